"""Replay policies against the baseline and against the paper's uniform replay, over seeds, and
by question difficulty. Prints one table per comparison and one of accuracy by difficulty bin.

    python bench/replay_policies.py --seeds 8 --out outputs/replay_policies

1. ``rlep demo --arms baseline,rlep,low_pass,rescue --seeds N`` in ``--out`` (the demo's task,
   warm start, pool and 30-step runs; the arms ``low_pass`` and ``rescue`` are ``rlep`` with
   that ``replay.policy``). The demo prints each arm's paired table against the baseline.
2. Each arm's paired table against ``rlep`` (uniform replay, the same training seed).
3. The validation questions' difficulty: ``rlep eval`` of the warm-started model with ``--k``
   samples per question; a question's pass rate at step 0 puts it in one of 4 bins
   ([0, .25), [.25, .5), [.5, .75), [.75, 1]).
4. ``rlep eval`` of every run's final checkpoint alike (the same eval seed): per arm and bin,
   the mean accuracy over the bin's questions, mean over seeds, and its paired difference to
   the baseline with a 95% interval.

A finished step is not redone (the demo's runs, and every eval whose report exists).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ("baseline", "rlep", "low_pass", "rescue")
BINS = ("[0, .25)", "[.25, .5)", "[.5, .75)", "[.75, 1]")


def difficulty_bins(samples: list[dict]) -> list[int]:
    """Per question of an eval report's ``samples``: the bin of its pass rate."""
    return [min(3, int(4 * sum(q["acc"]) / len(q["acc"]))) for q in samples]


def accuracy_by_bin(samples: list[dict], bins: list[int]) -> list:
    """Per bin: the mean accuracy over its questions' samples (None: an empty bin)."""
    if len(samples) != len(bins):
        raise ValueError(f"{len(samples)} questions evaluated, {len(bins)} binned")
    out = []
    for b in range(4):
        accs = [sum(q["acc"]) / len(q["acc"]) for q, qb in zip(samples, bins) if qb == b]
        out.append(sum(accs) / len(accs) if accs else None)
    return out


def bin_table(by_arm: dict[str, list[list]], counts: list[int]) -> str:
    """``by_arm[arm][seed][bin]`` accuracies: per bin, each arm's mean over seeds and its
    paired difference to the baseline (points, 95% interval)."""
    from rlep_megatron.demo import paired_difference

    def cell(arm: str, b: int) -> str:
        values = [seed[b] for seed in by_arm[arm]]
        mean = 100 * sum(values) / len(values)
        if arm == "baseline":
            return f"{mean:.1f}"
        d = paired_difference([x[b] - y[b] for x, y in zip(by_arm[arm], by_arm["baseline"])])
        if d["low"] is None:
            return f"{mean:.1f} ({100 * d['mean']:+.1f})"
        return (f"{mean:.1f} ({100 * d['mean']:+.1f} "
                f"[{100 * d['low']:+.1f}, {100 * d['high']:+.1f}])")

    arms = list(by_arm)
    lines = ["| step-0 pass rate | questions | " + " | ".join(arms) + " |",
             "|---" * (len(arms) + 2) + "|"]
    for b, name in enumerate(BINS):
        if not counts[b]:
            continue
        lines.append(f"| {name} | {counts[b]} | "
                     + " | ".join(cell(arm, b) for arm in arms) + " |")
    return "\n".join(lines)


def evaluate(out: str, checkpoint: str, report: str, k: int) -> list[dict]:
    """``rlep eval`` of ``checkpoint`` on the demo's validation split; its samples."""
    from rlep_megatron.demo import _run, examples_dir

    if not os.path.isfile(report):
        _run(["eval", "--config", os.path.join(examples_dir(), "tiny_cpu_baseline.yaml"),
              f"model.hf_dir={os.path.join(out, 'model')}",
              f"data.val_files=[{os.path.join(out, 'task', 'val.parquet')}]",
              f"eval.checkpoint={checkpoint}", f"eval.num_samples_per_prompt={k}",
              f"eval.output_file={report}", f"trainer.output_dir={out}"], 1,
             report + ".log")
    with open(report) as f:
        return json.load(f)["samples"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--out", default="outputs/replay_policies")
    parser.add_argument("--k", type=int, default=16, help="eval samples per question")
    args = parser.parse_args()
    from rlep_megatron.demo import (QUICK, paired_comparison, paired_table, read_curves,
                                    run_demo, summarise_arm)

    out = os.path.abspath(args.out)
    started = time.perf_counter()
    summary = run_demo(out, seeds=args.seeds, arms=list(ARMS))
    steps, seeds = QUICK["steps"], list(range(1, args.seeds + 1))
    k = summary["k"]
    curves = {arm: [read_curves(os.path.join(out, arm, f"seed_{s}", "metrics.jsonl"))
                    for s in seeds] for arm in ARMS}
    uniform_best = summarise_arm(curves["rlep"], None)["best_mean_val"]
    for arm in ("low_pass", "rescue"):
        paired = paired_comparison(curves["rlep"], curves[arm], uniform_best)
        print(f"\n{arm} against uniform replay (rlep), paired by seed:")
        print(paired_table(paired, k, label=f"RLEP {arm}", reference="RLEP uniform"))

    step0 = evaluate(out, os.path.join(out, "model"), os.path.join(out, "eval_step0.json"),
                     args.k)
    bins = difficulty_bins(step0)
    by_arm = {arm: [accuracy_by_bin(evaluate(
        out, os.path.join(out, arm, f"seed_{s}", "checkpoints", f"step_{steps:08d}"),
        os.path.join(out, arm, f"seed_{s}", "eval_final.json"), args.k), bins)
        for s in seeds] for arm in ARMS}
    counts = [bins.count(b) for b in range(4)]
    print(f"\nvalidation accuracy at step {steps} by the question's pass rate at step 0 "
          f"(mean@{args.k}, points; in brackets: paired difference to the baseline, 95% "
          "interval):")
    print(bin_table(by_arm, counts))
    print(f"\n{summary['machine']}; {(time.perf_counter() - started) / 60:.0f} minutes")


if __name__ == "__main__":
    main()
