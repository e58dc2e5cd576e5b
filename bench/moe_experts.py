"""A mixture-of-experts layer's experts, torch's grouped GEMM (``model.moe_experts=grouped``,
the local spec's default) against megatron's ``SequentialMLP`` (``sequential``): forward +
backward time on the Qwen3-30B-A3B layer shape, the same weights and tokens for both.

    python bench/moe_experts.py                       # CPU: an EP8 rank of 30B-A3B, fp32
    python bench/moe_experts.py --experts 128 --tokens 512   # all 128 experts, few rows each
    python bench/moe_experts.py --tokens 16384        # a GPU: bf16 by default there

The experts are those the trainer builds (``build_model`` of a one-layer Qwen3-MoE with the
30B-A3B layer: hidden 2048, 128 experts of 768, top-8), fed what megatron's token dispatcher
hands them: ``tokens x top-k`` rows sorted by expert, with the counts of a random top-k
routing (``--skew`` > 0 makes some experts popular, as trained routers do). ``--experts``
cuts the expert count (an EP rank's share of 128). Prints one table: per path the median
seconds per forward + backward over ``--repeats``, and the largest differences of the outputs
and of the gradients between the two paths (float32: a few ulps).
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def layer_config(args) -> dict:
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                hidden_size=args.hidden, num_hidden_layers=1, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                moe_intermediate_size=args.ffn, num_experts=args.experts,
                num_experts_per_tok=args.topk, norm_topk_prob=True, decoder_sparse_step=1,
                mlp_only_layers=[], vocab_size=1024, tie_word_embeddings=False,
                attention_bias=False, rms_norm_eps=1e-6, rope_theta=1e6,
                max_position_embeddings=4096)


def routed_counts(args, torch):
    """Rows per expert of a random top-k routing of ``--tokens`` tokens."""
    gen = torch.Generator().manual_seed(0)
    popularity = torch.randn(args.experts, generator=gen) * args.skew
    scores = torch.randn(args.tokens, args.experts, generator=gen) + popularity
    chosen = scores.topk(args.topk, dim=1).indices.reshape(-1)
    return torch.bincount(chosen, minlength=args.experts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16,
                        help="local experts (default 16: an EP8 rank's share of 128)")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=768, help="moe_intermediate_size")
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch

    from bench.step_floors import cpu_name
    from rlep_megatron import distributed
    from rlep_megatron.config import ParallelConfig
    from rlep_megatron.models.megatron import build_model, resolve_dtype

    ctx = distributed.init_model_parallel(ParallelConfig(), seed=0)
    dtype = resolve_dtype(args.dtype)
    hf = layer_config(args)
    experts = {}
    for path in ("grouped", "sequential"):
        chunks, _ = build_model(hf, dtype, transformer_engine="off", moe_experts=path)
        experts[path] = chunks[0].decoder.layers[0].mlp.experts
    experts["sequential"].load_state_dict(experts["grouped"].state_dict())
    device = ctx.device
    counts = routed_counts(args, torch)
    rows = int(counts.sum())
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    probs = torch.rand(rows, generator=gen).to(device, torch.float32)
    grad_out = torch.randn(rows, args.hidden, generator=gen).to(device, dtype)
    tokens_per_expert = counts  # megatron's dispatcher gives the counts on the host

    def step(module):
        x = hidden.clone().requires_grad_(True)
        out, _ = module(x, tokens_per_expert, probs)
        out.backward(grad_out)
        return out.detach(), x.grad

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, results = {}, {}
    for path, module in experts.items():
        for param in module.parameters():
            param.grad = None
        results[path] = step(module)  # warm-up, and the compared result
        results[path] += ([p.grad.clone() for p in module.parameters()],)
        samples = []
        for _ in range(args.repeats):
            for param in module.parameters():
                param.grad = None
            sync()
            start = time.perf_counter()
            step(module)
            sync()
            samples.append(time.perf_counter() - start)
        times[path] = statistics.median(samples)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    g, s = results["grouped"], results["sequential"]
    out_diff, input_grad_diff = rel(g[0], s[0]), rel(g[1], s[1])
    weight_grad_diff = max(rel(a, b) for a, b in zip(g[2], s[2]))
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else cpu_name()
    print(f"MoE experts, forward + backward: {args.tokens} tokens x top-{args.topk} "
          f"({rows} rows) over {args.experts} experts, hidden {args.hidden}, ffn {args.ffn}, "
          f"{str(dtype).replace('torch.', '')}, {device_name}, median of {args.repeats}")
    print("| path | s / step | vs sequential |")
    print("|---|---|---|")
    for path in ("sequential", "grouped"):
        print(f"| {path} | {times[path]:.4f} | {times['sequential'] / times[path]:.2f}x |")
    print(f"max relative difference, grouped vs sequential: output {out_diff:.1e}, "
          f"input gradient {input_grad_diff:.1e}, weight gradients {weight_grad_diff:.1e}")
    distributed.destroy()


if __name__ == "__main__":
    main()
