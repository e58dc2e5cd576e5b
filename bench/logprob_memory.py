"""Peak memory of per-token log-probs (forward + backward) for one tensor-parallel rank:
vocab-parallel (this project: logits of vocab/TP columns, cross-rank max/sum reductions)
versus a naive full-vocabulary log-softmax; and, in fp32 and bf16, what the entropy costs with
autograd (an entropy bonus in the loss) and without (entropy only reported, the default);
and the forward-only pass (old log-probs, reference log-probs), which runs in chunks of tokens.

    python bench/logprob_memory.py [--tokens 2048] [--vocab 152064] [--tp 1 2 4 8]

Each variant runs in a fresh process; memory is the peak resident set size above the process's
size before the logits were allocated (so it includes the logits themselves and autograd
buffers). The cross-rank reductions are of [tokens]-sized vectors, so one process holding one
rank's shard measures a rank's memory exactly; the reductions themselves are exercised by the
distributed tests.
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def run_variant(kind: str, tokens: int, vocab: int, tp: int, dtype: str = "float32",
                entropy: str = "none") -> dict:
    import torch

    torch.manual_seed(0)
    shard = vocab // tp
    fp32_logits_mb = tokens * shard * 4 / 2**20
    if kind == "forward":  # the old-log-prob / reference pass: no autograd
        logits = torch.randn(tokens, shard, dtype=getattr(torch, dtype))
        targets = torch.randint(0, shard, (tokens,))
        before = rss_mb()
        from rlep_megatron.actor.logprob import vocab_parallel_logprobs

        with torch.no_grad():
            vocab_parallel_logprobs(logits, targets, real_vocab_size=shard,
                                    with_entropy=entropy != "none")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        # the logits were allocated before the baseline: add them back
        logits_mb = logits.numel() * logits.element_size() / 2**20
        return {"peak_mb": peak - before + logits_mb, "logits_mb": logits_mb,
                "fp32_logits_mb": fp32_logits_mb}
    before = rss_mb()
    logits = torch.randn(tokens, shard, dtype=getattr(torch, dtype), requires_grad=True)
    targets = torch.randint(0, shard, (tokens,))
    if kind == "naive":
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
        loss = logp.sum()
    else:
        from rlep_megatron.actor.logprob import vocab_parallel_logprobs

        logp, ent = vocab_parallel_logprobs(logits, targets, real_vocab_size=shard,
                                            with_entropy=entropy != "none",
                                            entropy_grad=entropy == "grad")
        loss = logp.sum() + (ent.sum() if entropy == "grad" else 0.0)
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - before, "logits_mb": logits.numel() * logits.element_size() / 2**20,
            "fp32_logits_mb": fp32_logits_mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        kind, tp, dtype, entropy = args.variant.split(":")
        print(json.dumps(run_variant(kind, args.tokens, args.vocab, int(tp), dtype, entropy)))
        return

    def measure(kind, tp, dtype="float32", entropy="none"):
        out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--variant", f"{kind}:{tp}:{dtype}:{entropy}"],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    naive = measure("naive", 1)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch CPU, fp32; "
          f"{args.tokens} tokens x vocab {args.vocab}")
    print("variant | TP | logits per rank (MB) | peak per rank (MB) | vs naive full vocab")
    print("--- | --- | --- | --- | ---")
    print(f"naive log_softmax | 1 | {naive['logits_mb']:.0f} | {naive['peak_mb']:.0f} | 1.00")
    for tp in args.tp:
        result = measure("vocab_parallel", tp)
        print(f"vocab-parallel | {tp} | {result['logits_mb']:.0f} | {result['peak_mb']:.0f} | "
              f"{result['peak_mb'] / naive['peak_mb']:.2f}")
    print()
    print(f"entropy, TP={args.tp[0]}: peak per rank in units of one fp32 copy of the rank's "
          "logits (what the loss step adds on top of the logits themselves)")
    print("logits dtype | entropy | peak (MB) | peak / fp32 logits")
    print("--- | --- | --- | ---")
    for dtype in ("float32", "bfloat16"):
        for entropy in ("none", "nograd", "grad"):
            result = measure("vocab_parallel", args.tp[0], dtype, entropy)
            label = {"none": "not computed", "nograd": "reported (no autograd, the default)",
                     "grad": "in the loss (autograd)"}[entropy]
            print(f"{dtype} | {label} | {result['peak_mb']:.0f} | "
                  f"{result['peak_mb'] / result['fp32_logits_mb']:.1f}")
    print()
    print(f"old-log-prob / reference pass (no autograd), TP={args.tp[0]}: peak per rank, the "
          "logits included, in units of one fp32 copy of the rank's logits")
    print("logits dtype | entropy | peak (MB) | peak / fp32 logits")
    print("--- | --- | --- | ---")
    for dtype in ("float32", "bfloat16"):
        for entropy in ("none", "nograd"):
            result = measure("forward", args.tp[0], dtype, entropy)
            label = {"none": "not computed", "nograd": "computed"}[entropy]
            print(f"{dtype} | {label} | {result['peak_mb']:.0f} | "
                  f"{result['peak_mb'] / result['fp32_logits_mb']:.2f}")


if __name__ == "__main__":
    main()
