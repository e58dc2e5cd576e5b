"""The policy losses (and LoRA) against the default (DAPO's clip, full fine-tuning) over
warm-start seeds: best and final validation accuracy of each, with paired differences and their
95% intervals.

    python bench/losses.py --warm-start-seeds 3 --out outputs/losses
    python bench/losses.py --warm-start-seeds 3 --arms lora --out outputs/lora

For each warm-start seed S (0, 1, ...): ``rlep demo --arms baseline,gspo,cispo,dr_grpo --seeds 1
--warm-start-seed S`` in ``--out/ws_S`` (the demo's task, a warm start of its own, 30 steps of
each arm at training seed 1; the loss arms are the baseline recipe with ``algo.loss=gspo``,
``algo.loss=cispo``, or ``algo.advantage=dr_grpo`` + ``algo.loss_agg_mode=constant_length``;
the ``lora`` arm trains rank-8 adapters at 10x the lr; everything else unchanged). Then one
table over the warm-start seeds: each arm's best and final validation mean@k, and its paired difference to the baseline (the same warm start). A finished
run is not redone.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ("baseline", "gspo", "cispo", "dr_grpo")


def per_seed_table(rows: dict[str, list[dict]], k: int) -> str:
    """``rows[arm]``: per warm-start seed ``{"best", "final"}``; a markdown table."""
    from rlep_megatron.demo import ARM_LABELS, paired_difference

    def spread(values):
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{100 * statistics.fmean(values):.1f}% (sd {100 * sd:.1f})"

    def paired(arm, key):
        if arm == "baseline":
            return "-"
        d = paired_difference([a[key] - b[key] for a, b in zip(rows[arm], rows["baseline"])])
        if d["low"] is None:
            return f"{100 * d['mean']:+.1f}"
        return f"{100 * d['mean']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"

    lines = ["| arm | best mean@%d | final mean@%d | best - baseline | final - baseline |"
             % (k, k), "|---|---|---|---|---|"]
    for arm in rows:
        lines.append(f"| {ARM_LABELS.get(arm, arm)} | "
                     f"{spread([r['best'] for r in rows[arm]])} | "
                     f"{spread([r['final'] for r in rows[arm]])} | {paired(arm, 'best')} | "
                     f"{paired(arm, 'final')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-start-seeds", type=int, default=3)
    parser.add_argument("--out", default="outputs/losses")
    parser.add_argument("--arms", default=",".join(ARMS[1:]),
                        help="the loss arms beside the baseline")
    args = parser.parse_args()
    from rlep_megatron.demo import read_curves, run_demo

    arms = ["baseline"] + [a for a in args.arms.split(",") if a and a != "baseline"]
    out = os.path.abspath(args.out)
    started = time.perf_counter()
    rows: dict[str, list[dict]] = {arm: [] for arm in arms}
    k, machine = None, None
    for seed in range(args.warm_start_seeds):
        directory = os.path.join(out, f"ws_{seed}")
        summary = run_demo(directory, seeds=1, arms=arms, warm_start_seed=seed)
        k, machine = summary["k"], summary["machine"]
        print(f"warm-start seed {seed}: greedy validation accuracy "
              f"{100 * summary['warm_start']['accuracy']:.1f}% before RL", flush=True)
        for arm in arms:
            val = read_curves(os.path.join(directory, arm, "seed_1", "metrics.jsonl"))["val"]
            rows[arm].append({"best": max(val.values()), "final": val[max(val)]})
    print(f"\nover {args.warm_start_seeds} warm-start seeds (training seed 1 each); paired "
          "differences in points, 95% interval:")
    print(per_seed_table(rows, k))
    for arm in arms:
        print(f"{arm}: " + ", ".join(f"ws {s}: best {100 * r['best']:.1f} final "
                                     f"{100 * r['final']:.1f}" for s, r in enumerate(rows[arm])))
    print(f"\n{machine}; {(time.perf_counter() - started) / 60:.0f} minutes")


if __name__ == "__main__":
    main()
