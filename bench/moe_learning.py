"""RL on a mixture-of-experts actor learns, over several warm starts: the suite's
mixture-of-experts learning test (tests/e2e/test_learning.py::
test_training_reward_rises_on_a_mixture_of_experts, which runs warm-start seed 0) for each
seed given. Prints one row per warm-start seed and the test's two criteria.

    python bench/moe_learning.py --seeds 0 1 2 --out outputs/moe_learning

Per seed S: the test's task, the tiny Qwen3-MoE (8 experts, top-2) initialised with seed S and
warm-started in batch order S, then the test's ``rlep train`` run (32 prompts x 8 samples, 4
optimizer steps of 64 sequences at lr 2e-4, 16 steps, packed, ``algo.routing_replay=rollout``).
The rise is the mean fresh-rollout accuracy of the last 4 steps minus step 1's; the noise the
last 4 steps' spread (at least one step's binomial sampling error); the test asks for
rise >= 0.12 and rise >= 3 x noise.
"""
import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_seed(seed: int, out: pathlib.Path) -> dict:
    from tests.e2e.test_learning import (MOE_RUN, learnable_task, rise_and_noise, train,
                                         warm_started)

    task = learnable_task(str(out / "task"))
    started = time.perf_counter()
    model = warm_started(task, out / f"seed_{seed}", "qwen3_moe", seed=seed)
    warm_s = time.perf_counter() - started
    started = time.perf_counter()
    metrics = train(task, model, out / f"seed_{seed}" / "run", *MOE_RUN)
    rise, noise = rise_and_noise(metrics)
    step1 = metrics[0]["rollout/acc_mean"]
    return {"seed": seed, "step1": step1, "last": step1 + rise, "rise": rise, "noise": noise,
            "mismatch": max(m["rollout/routing_mismatch_frac"] for m in metrics),
            "warm_s": warm_s, "rl_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="outputs/moe_learning")
    args = parser.parse_args()
    from tests.e2e.test_learning import MIN_RISE

    rows = [one_seed(seed, pathlib.Path(args.out).resolve()) for seed in args.seeds]
    print("| seed | step 1 | last 4 | rise | rise / noise | passes | max routing mismatch | "
          "warm start s | RL s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        passes = r["rise"] >= MIN_RISE and r["rise"] >= 3 * r["noise"]
        print(f"| {r['seed']} | {r['step1']:.2f} | {r['last']:.2f} | {r['rise']:.2f} | "
              f"{r['rise'] / r['noise']:.1f} | {'yes' if passes else 'no'} | "
              f"{r['mismatch']:.4f} | {r['warm_s']:.0f} | {r['rl_s']:.0f} |")


if __name__ == "__main__":
    main()
