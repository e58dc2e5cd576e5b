"""One-step-off rollout learns as the synchronous loop does, over several warm starts: the
suite's learning run (tests/e2e/test_learning.py, warm-start seed 0 there) for each seed
given, synchronous and one step off (``trainer.max_staleness=1``) from the same warm start.
Prints one row per seed, the paired difference and its interval.

    python bench/async_learning.py --seeds 0 1 2 3 --out outputs/async_learning

Per seed S: the test's task, the tiny Qwen2 initialised with seed S and warm-started in batch
order S, then the test's ``rlep train`` run twice (32 prompts x 8 samples, 4 optimizer steps of
64 sequences at lr 2e-4, 16 steps, packed, ``algo.rollout_correction=truncate`` in both arms,
so that they differ only in the schedule). The rise is the mean fresh-rollout accuracy of the
last 4 steps minus step 1's (the test's criterion); the paired difference is one step off's
rise minus the synchronous one's, with a t interval (95%) over seeds. Step 1 is the same in
both arms: its rollouts come from the warm start before any update.
"""
import argparse
import math
import os
import pathlib
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = {"sync": (), "one-step-off": ("trainer.max_staleness=1",)}
# two-sided 95% t quantiles by degrees of freedom
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def one_seed(seed: int, out: pathlib.Path) -> dict:
    from tests.e2e.test_learning import (PACKED, learnable_task, rise_and_noise, train,
                                         warm_started)

    task = learnable_task(str(out / "task"))
    model = warm_started(task, out / f"seed_{seed}", "qwen2", seed=seed)
    row = {"seed": seed}
    for arm, extra in ARMS.items():
        metrics = train(task, model, out / f"seed_{seed}" / arm, *PACKED,
                        "algo.rollout_correction=truncate", *extra)
        rise, noise = rise_and_noise(metrics)
        row[arm] = {"step1": metrics[0]["rollout/acc_mean"], "rise": rise, "noise": noise,
                    "stale": statistics.fmean(m["rollout/staleness_mean"] for m in metrics)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--out", default="outputs/async_learning")
    args = parser.parse_args()
    from bench.step_floors import cpu_name

    rows = []
    for seed in args.seeds:
        rows.append(one_seed(seed, pathlib.Path(args.out).resolve()))
        print(rows[-1], flush=True)
    print(f"\n{cpu_name()}")
    print("| seed | step 1 | sync rise | one-step-off rise | difference | "
          "one-step-off mean staleness |")
    print("|---|---|---|---|---|---|")
    differences = []
    for r in rows:
        difference = r["one-step-off"]["rise"] - r["sync"]["rise"]
        differences.append(difference)
        print(f"| {r['seed']} | {r['sync']['step1']:.2f} | {r['sync']['rise']:.3f} | "
              f"{r['one-step-off']['rise']:.3f} | {difference:+.3f} | "
              f"{r['one-step-off']['stale']:.2f} |")
    mean = statistics.fmean(differences)
    if len(differences) > 1:
        half = T95[min(len(differences) - 1, 9)] * statistics.stdev(differences) / math.sqrt(
            len(differences))
        print(f"\npaired difference (one step off - sync): {mean:+.3f}, 95% interval "
              f"[{mean - half:+.3f}, {mean + half:+.3f}] over {len(differences)} seeds; "
              f"sync rises span {min(r['sync']['rise'] for r in rows):.3f}-"
              f"{max(r['sync']['rise'] for r in rows):.3f}")


if __name__ == "__main__":
    main()
