"""Throughput of the actor's forward + backward (the train phase's unavoidable work) on a
realistic shape with random weights: tokens/s, model FLOPs utilisation and peak memory.

    python bench/actor_throughput.py                    # Qwen2.5-1.5B-like, bf16, one GPU
    python bench/actor_throughput.py --shape tiny       # a few layers: checks the bench on CPU

The model is megatron-core's GPTModel built by the trainer's own code (``build_model``: the
TransformerEngine spec when usable), the loss the trainer's vocab-parallel log-probs of the
next tokens. MFU counts 6 x parameters x tokens plus attention (6 x layers x sequence x hidden
per token, causal) against ``--peak-tflops`` (default: 989, an H100 SXM's dense bf16).
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {
    # the published Qwen2.5-1.5B configuration (tied embeddings, QKV bias, GQA 12/2)
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                         tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=352, vocab_size=320,
                 tie_word_embeddings=True),
}


def hf_config(shape: str, seq_len: int) -> dict:
    return {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "hidden_act": "silu", "max_position_embeddings": max(4096, seq_len),
            **SHAPES[shape]}


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
    args = parser.parse_args()

    import torch

    from rlep_megatron import distributed, platform
    from rlep_megatron.actor.logprob import vocab_parallel_logprobs
    from rlep_megatron.models.megatron import build_model
    from rlep_megatron.config import ParallelConfig

    on_gpu = platform.cuda_available()
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    config = hf_config(args.shape, args.seq_len)
    distributed.init_model_parallel(ParallelConfig(), seed=0,
                                    num_attention_heads=config["num_attention_heads"],
                                    num_query_groups=config["num_key_value_heads"],
                                    num_layers=config["num_hidden_layers"])
    (model,), info = build_model(config, dtype)
    device = next(model.parameters()).device
    params = sum(p.numel() for p in model.parameters())
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (args.micro_batch, args.seq_len),
                        generator=generator).to(device)
    positions = torch.arange(args.seq_len, device=device).unsqueeze(0).expand_as(ids)

    def step():
        logits = model(ids, positions, attention_mask=None)
        logp, _ = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], info.dims.vocab_size)
        (-logp.mean()).backward()
        model.zero_grad(set_to_none=True)

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    sync()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = args.micro_batch * args.seq_len
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    flops_per_token = 6 * params + 6 * layers * args.seq_len * hidden  # causal attention
    achieved = flops_per_token * tokens / seconds / 1e12
    device_name = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device_name}; layer spec: {'TransformerEngine' if info.use_te else 'local'}; "
          f"{args.shape}: {params / 1e6:,.1f} M parameters, {str(dtype).split('.')[-1]}")
    print("micro-batch x seq | step (s) | tokens/s | TFLOP/s | MFU | peak memory (GiB)")
    print("--- | --- | --- | --- | --- | ---")
    memory = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")
    mfu = f"{100 * achieved / args.peak_tflops:.1f}%" if on_gpu else "n/a (CPU)"
    print(f"{args.micro_batch} x {args.seq_len} | {seconds:.3f} | {tokens / seconds:,.0f} | "
          f"{achieved:.1f} | {mfu} | {memory:.1f}")
    distributed.destroy()


if __name__ == "__main__":
    main()
