"""Peak memory of per-token log-probs (forward + backward) for one tensor-parallel rank:
vocab-parallel (this project: logits of vocab/TP columns, cross-rank max/sum reductions)
versus a naive full-vocabulary log-softmax; and, in fp32 and bf16, what the entropy costs with
autograd (an entropy bonus in the loss) and without (entropy only reported, the default);
and the forward-only pass (old log-probs, reference log-probs), which runs in chunks of tokens;
and the train step's log-probs from the last hidden states, the output layer included: the full
logits at once against ``model.logprob_chunk_tokens`` chunks recomputed in the backward.

    python bench/logprob_memory.py [--tokens 2048] [--vocab 152064] [--tp 1 2 4 8]
        [--hidden 3584 --hidden-tp 2 4 --chunk 2048]

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


def run_from_hidden(kind: str, tokens: int, vocab: int, tp: int, hidden_size: int,
                    chunk: int) -> dict:
    """One train-step log-prob pass from hidden states (``hidden @ weight.T`` then the
    log-probs, entropy reported, backward into both): the full logits, or chunked. Peak above
    the inputs (hidden states and this rank's output-layer weight, which the model holds
    anyway); the weight's gradient (one more copy of the weight) counts in both."""
    import torch

    import importlib

    importlib.import_module("megatron.core.tensor_parallel.mappings")  # the full path's import

    from rlep_megatron.actor.logprob import output_layer_logprobs, vocab_parallel_logprobs

    torch.manual_seed(0)
    shard = vocab // tp
    hidden = (torch.randn(tokens, hidden_size) * 0.1).requires_grad_()
    weight = (torch.randn(shard, hidden_size) * 0.02).requires_grad_()
    targets = torch.randint(0, shard, (tokens,))
    before = rss_mb()
    if kind == "hidden_full":
        logp, _ = vocab_parallel_logprobs(hidden @ weight.T, targets, real_vocab_size=shard,
                                          with_entropy=True, entropy_grad=False)
    else:
        logp, _ = output_layer_logprobs(hidden, weight, targets, real_vocab_size=shard,
                                        with_entropy=True, entropy_grad=False,
                                        chunk_tokens=chunk)
    logp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak_mb": peak - before, "logits_mb": tokens * shard * 4 / 2**20,
            "chunk_logits_mb": min(chunk, tokens) * shard * 4 / 2**20,
            "weight_grad_mb": shard * hidden_size * 4 / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--hidden", type=int, default=3584,
                        help="hidden size of the output-layer section (Qwen2.5-7B: 3584)")
    parser.add_argument("--hidden-tp", type=int, nargs="+", default=[2, 4],
                        help="TP sizes of the output-layer section")
    parser.add_argument("--chunk", type=int, default=2048,
                        help="model.logprob_chunk_tokens of the output-layer section")
    parser.add_argument("--only-hidden", action="store_true",
                        help="print only the output-layer section")
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        kind, tp, dtype, entropy = args.variant.split(":")
        if kind.startswith("hidden"):
            result = run_from_hidden(kind, args.tokens, args.vocab, int(tp), args.hidden,
                                     args.chunk)
        else:
            result = run_variant(kind, args.tokens, args.vocab, int(tp), dtype, entropy)
        print(json.dumps(result))
        return

    def measure(kind, tp, dtype="float32", entropy="none"):
        out = subprocess.run([sys.executable, __file__, "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--hidden", str(args.hidden), "--chunk",
                              str(args.chunk), "--variant", f"{kind}:{tp}:{dtype}:{entropy}"],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    if not args.only_hidden:
        report_logits(args, measure)
    print()
    print(f"train step from the last hidden states (hidden {args.hidden}, fp32, entropy "
          f"reported), {args.tokens} tokens x vocab {args.vocab}: peak per rank above the inputs")
    print("TP | logits (MB) | output-layer weight grad (MB) | full logits: peak (MB) | "
          f"chunks of {args.chunk}: peak (MB) | one chunk's logits (MB) | chunked / full")
    print("--- | --- | --- | --- | --- | --- | ---")
    for tp in args.hidden_tp:
        full = measure("hidden_full", tp)
        chunked = measure("hidden_chunked", tp)
        print(f"{tp} | {full['logits_mb']:.0f} | {full['weight_grad_mb']:.0f} | "
              f"{full['peak_mb']:.0f} | {chunked['peak_mb']:.0f} | "
              f"{chunked['chunk_logits_mb']:.0f} | {chunked['peak_mb'] / full['peak_mb']:.2f}")


def report_logits(args, measure) -> None:
    """The sections on given logits (vocab-parallel vs naive, entropy, forward-only)."""
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
