"""The suite's learning tests over several warm starts: one of tests/e2e/test_learning.py's
runs for each warm-start seed given, one row per seed with the test's two criteria.

    python bench/learning_seeds.py --run dense --seeds 0 1 2 3 4 --out outputs/learning_seeds
    python bench/learning_seeds.py --run moe --seeds 0 1 2

Runs (each the test of that name; the tests themselves run warm-start seed 0):
- ``dense``: test_training_reward_rises_on_a_learnable_task (the tiny Qwen2, packed);
- ``lora``: test_training_reward_rises_with_lora (rank-8 adapters on every projection, each
  update merged into the engine's weights; the rows in bench/RESULTS.md before that change
  sampled through vLLM's LoRA);
- ``one_step_off``: test_training_reward_rises_one_step_off (``trainer.max_staleness=1``,
  ``algo.rollout_correction=truncate``);
- ``moe``: test_training_reward_rises_on_a_mixture_of_experts (the tiny Qwen3-MoE, 8 experts,
  top-2, ``algo.routing_replay=rollout``).

Per seed S: the test's task, the tiny model initialised with seed S and warm-started in batch
order S (1200 steps, 2 threads; seed 0 is the shipped copy when its digest matches), then the
test's ``rlep train`` run (32 prompts x 8 samples, 4 optimizer steps of 64 sequences at lr 2e-4,
16 steps). The rise is the mean fresh-rollout accuracy of the last 4 steps minus step 1's; the
noise the last 4 steps' spread (at least one step's binomial sampling error); the test asks for
rise >= 0.12 and rise >= 3 x noise.
"""
import argparse
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_overrides(run: str) -> tuple[str, tuple[str, ...]]:
    from tests.e2e.test_learning import LORA_RUN, MOE_RUN, PACKED

    return {"dense": ("qwen2", PACKED), "lora": ("qwen2", PACKED + LORA_RUN),
            "one_step_off": ("qwen2", PACKED + ("trainer.max_staleness=1",
                                                "algo.rollout_correction=truncate")),
            "moe": ("qwen3_moe", MOE_RUN)}[run]


def one_seed(run: str, seed: int, out: pathlib.Path) -> dict:
    from tests.e2e.test_learning import learnable_task, rise_and_noise, train, warm_started

    arch, overrides = run_overrides(run)
    task = learnable_task(str(out / "task"))
    started = time.perf_counter()
    model = warm_started(task, out / f"{arch}_seed_{seed}", arch, seed=seed)
    warm_s = time.perf_counter() - started
    started = time.perf_counter()
    metrics = train(task, model, out / f"{run}_seed_{seed}", *overrides)
    rise, noise = rise_and_noise(metrics)
    step1 = metrics[0]["rollout/acc_mean"]
    mismatch = [m["rollout/routing_mismatch_frac"] for m in metrics
                if "rollout/routing_mismatch_frac" in m]
    return {"seed": seed, "step1": step1, "last": step1 + rise, "rise": rise, "noise": noise,
            "mismatch": max(mismatch) if mismatch else None,
            "warm_s": warm_s, "rl_s": time.perf_counter() - started}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", choices=["dense", "lora", "one_step_off", "moe"],
                        default="dense")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="outputs/learning_seeds")
    args = parser.parse_args()
    from tests.e2e.test_learning import MIN_RISE

    out = pathlib.Path(args.out).resolve()
    rows = []
    for seed in args.seeds:
        rows.append(one_seed(args.run, seed, out))
        r = rows[-1]
        print(f"seed {seed}: rise {r['rise']:.3f}, {r['rise'] / r['noise']:.1f} x noise "
              f"({r['warm_s']:.0f} + {r['rl_s']:.0f} s)", flush=True)
    print(f"\n{args.run}, {cpu_name()}, {os.cpu_count()} cores\n")
    print("| seed | step 1 | last 4 | rise | rise / noise | passes | max routing mismatch | "
          "warm start s | RL s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        passes = r["rise"] >= MIN_RISE and r["rise"] >= 3 * r["noise"]
        mismatch = "-" if r["mismatch"] is None else f"{r['mismatch']:.4f}"
        print(f"| {r['seed']} | {r['step1']:.2f} | {r['last']:.2f} | {r['rise']:.2f} | "
              f"{r['rise'] / r['noise']:.1f} | {'yes' if passes else 'no'} | {mismatch} | "
              f"{r['warm_s']:.0f} | {r['rl_s']:.0f} |")
    if len(rows) > 1:
        rises = [r["rise"] for r in rows]
        ratios = [r["rise"] / r["noise"] for r in rows]
        passing = sum(r["rise"] >= MIN_RISE and r["rise"] >= 3 * r["noise"] for r in rows)
        print(f"\nrise: mean {statistics.fmean(rises):.2f}, min {min(rises):.2f}, "
              f"max {max(rises):.2f}; rise / noise: min {min(ratios):.1f}, "
              f"max {max(ratios):.1f}; {passing} of {len(rows)} pass")


if __name__ == "__main__":
    main()
