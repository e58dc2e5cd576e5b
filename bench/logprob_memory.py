"""Peak memory of per-token log-probs (forward + backward) for one tensor-parallel rank:
vocab-parallel (this project: logits of vocab/TP columns, cross-rank max/sum reductions)
versus a naive full-vocabulary log-softmax.

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


def run_variant(kind: str, tokens: int, vocab: int, tp: int) -> dict:
    import torch

    torch.manual_seed(0)
    before = rss_mb()
    shard = vocab // tp
    logits = torch.randn(tokens, shard, requires_grad=True)
    targets = torch.randint(0, shard, (tokens,))
    if kind == "naive":
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
    else:
        from rlep_megatron.actor.logprob import vocab_parallel_logprobs

        logp, _ = vocab_parallel_logprobs(logits, targets, real_vocab_size=shard)
    logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - before, "logits_mb": logits.numel() * 4 / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        kind, tp = args.variant.split(":")
        print(json.dumps(run_variant(kind, args.tokens, args.vocab, int(tp))))
        return

    def measure(kind, tp):
        out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--variant", f"{kind}:{tp}"],
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


if __name__ == "__main__":
    main()
