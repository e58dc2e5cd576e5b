"""Throughput of the actor's forward + backward (the train phase's unavoidable work) on a
realistic shape with random weights: tokens/s, model FLOPs utilisation and peak memory.

    python bench/actor_throughput.py                    # Qwen2.5-1.5B-like, bf16, one GPU
    python bench/actor_throughput.py --shape tiny       # a few layers: checks the bench on CPU
    python bench/actor_throughput.py --logprob-chunk-tokens 0 --recompute

The model is megatron-core's GPTModel built by the trainer's own code (``build_model``: the
TransformerEngine spec when usable), the loss the trainer's vocab-parallel log-probs of the
next tokens, computed as the trainer computes them (``--logprob-chunk-tokens``, default the
trainer's, 0 for the full logits; ``--recompute`` for full activation recompute). MFU counts
FLOPs as ``rlep plan`` does: 6 x tokens x (the parameters a token passes through outside the
embeddings, of a MoE layer's experts its top-k, plus the output layer) plus causal attention
(6 x layers x sequence x heads x head_dim per token), against ``--peak-tflops`` (default: 989,
an H100 SXM's dense bf16).

The model is wrapped in megatron's DDP as the trainer wraps it (a float32 gradient buffer
allocated up front; no distributed optimizer, one GPU). On a GPU the bench also checks
``rlep plan``'s memory model: what is allocated before a step (the weights and the gradient
buffer) against the planner's count of the model's parameters from its HF config x (dtype + 4
bytes), and the step's peak above that (the activations saved for the backward and the log-prob
step's logits) against the planner's activations + log-prob step for the same shape, tokens,
layer spec and recompute setting. What the planner adds for a real run is not measured here:
the optimizer state, the CUDA context, the reference policy and the rollout engine.
"""
import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    # the published Qwen2.5-1.5B configuration (tied embeddings, QKV bias, GQA 12/2)
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True),
    # the published Qwen2.5-7B configuration (untied embeddings, QKV bias, GQA 28/4)
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False),
    # Qwen3-30B-A3B's published layer (128 experts, top-8, q/k norms, head_dim 128) with 12 of
    # its 48 layers, so that the weights, gradients and one micro-batch fit one GPU
    "qwen3-30b-a3b-12l": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=12,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              intermediate_size=6144, moe_intermediate_size=768,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                              tie_word_embeddings=False, attention_bias=False),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=352, moe_intermediate_size=64, num_experts=8,
                     num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], vocab_size=320, tie_word_embeddings=False,
                     attention_bias=False),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352, vocab_size=320,
                 tie_word_embeddings=True),
}


def hf_config(shape: str, seq_len: int) -> dict:
    return {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "hidden_act": "silu", "max_position_embeddings": max(4096, seq_len),
            **SHAPES[shape]}


def planner_view(config: dict, tokens: int, dtype, chunk: int, recompute: bool, spec: str,
                 padded_vocab: int) -> dict[str, float]:
    """``rlep plan``'s figures for one GPU (TP1, PP1), from the HF config alone: ``static``
    (bytes of the weights and a float32 gradient buffer), ``step`` (one micro-batch's
    activations saved for the backward + the log-prob step's logits) and ``flops_per_token``
    (forward + backward)."""
    from rlep_megatron import plan
    from rlep_megatron.config import ModelConfig, RunConfig
    from rlep_megatron.models import llama_family

    cfg = RunConfig(model=ModelConfig(logprob_chunk_tokens=chunk))
    dtype_bytes = dtype.itemsize
    counts = plan._total_params(config, [], cfg)  # closed form from the HF config
    activations = plan.activation_bytes(config, cfg, tokens, 0, dtype_bytes, spec)
    step = (activations["with_recompute" if recompute else "without_recompute"]
            + plan.logits_bytes(config, cfg, tokens, padded_vocab, dtype_bytes))
    dims = llama_family.dims_from_config(config)
    per_token = counts["active_params"] + dims.vocab_size * dims.hidden_size  # + output layer
    return {"static": counts["total_params"] * (dtype_bytes + 4), "step": step,
            "active_params": per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--logprob-chunk-tokens", type=int, default=None,
                        help="default: the trainer's model.logprob_chunk_tokens; 0: full logits")
    parser.add_argument("--recompute", action="store_true",
                        help="full activation recompute (model.recompute_activations)")
    args = parser.parse_args()

    import torch

    from megatron.core import parallel_state as ps

    from rlep_megatron import distributed, platform
    from rlep_megatron.actor.logprob import next_token_logprobs
    from rlep_megatron.actor.optimizer import wrap_ddp
    from rlep_megatron.actor.packing import run_model
    from rlep_megatron.config import ModelConfig, ParallelConfig
    from rlep_megatron.models.megatron import build_model

    on_gpu = platform.cuda_available()
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    config = hf_config(args.shape, args.seq_len)
    distributed.init_model_parallel(ParallelConfig(), seed=0,
                                    num_attention_heads=config["num_attention_heads"],
                                    num_query_groups=config["num_key_value_heads"],
                                    num_layers=config["num_hidden_layers"])
    chunk = (ModelConfig().logprob_chunk_tokens if args.logprob_chunk_tokens is None
             else args.logprob_chunk_tokens)
    (model,), info = build_model(config, dtype, recompute_activations=args.recompute)
    info = dataclasses.replace(info, logprob_chunk_tokens=chunk)
    (model,) = wrap_ddp([model], use_distributed_optimizer=False)
    tp_group = ps.get_tensor_model_parallel_group()
    device = next(model.parameters()).device
    params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (args.micro_batch, args.seq_len),
                        generator=generator).to(device)
    positions = torch.arange(args.seq_len, device=device).unsqueeze(0).expand_as(ids)

    def step():
        output = run_model(model, ids, positions, hidden_states=bool(chunk))
        logp, _ = next_token_logprobs(model, info, output, ids, 0, tp_group, 1.0,
                                      with_entropy=False)
        (-logp.mean()).backward()
        model.zero_grad_buffer()

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if on_gpu:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.micro_batch * args.seq_len
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    planner = planner_view(config, tokens, dtype, chunk, args.recompute,
                           "te" if info.use_te else "local", info.padded_vocab_size)
    active = planner["active_params"]
    width = config["num_attention_heads"] * config.get(
        "head_dim", hidden // config["num_attention_heads"])
    flops_per_token = 6 * active + 6 * layers * args.seq_len * width  # causal attention
    achieved = flops_per_token * tokens / seconds / 1e12
    device_name = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device_name}; layer spec: {'TransformerEngine' if info.use_te else 'local'}; "
          f"{args.shape}: {params / 1e6:,.1f} M parameters ({active / 1e6:,.1f} M per token "
          f"with the output layer), "
          f"{str(dtype).split('.')[-1]}; "
          f"log-prob chunk {chunk or 'off (full logits)'}; recompute {args.recompute}")
    print("micro-batch x seq | step (s) | tokens/s | TFLOP/s | MFU | peak memory (GiB) | "
          "before the step (GiB): measured / planner | step above it (GiB): measured / planner")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    planned_static, planned_step = planner["static"] / 2**30, planner["step"] / 2**30
    if on_gpu:
        peak = torch.cuda.max_memory_allocated()
        memory = f"{peak / 2**30:.1f}"
        static = f"{before / 2**30:.1f} / {planned_static:.1f}"
        step_memory = f"{(peak - before) / 2**30:.1f} / {planned_step:.1f}"
    else:
        memory = "n/a (CPU)"
        static = f"n/a / {planned_static:.2f}"
        step_memory = f"n/a / {planned_step:.2f}"
    mfu = f"{100 * achieved / args.peak_tflops:.1f}%" if on_gpu else "n/a (CPU)"
    print(f"{args.micro_batch} x {args.seq_len} | {seconds:.3f} | {tokens / seconds:,.0f} | "
          f"{achieved:.1f} | {mfu} | {memory} | {static} | {step_memory}")
    distributed.destroy()


if __name__ == "__main__":
    main()
