"""RL on a mixture-of-experts actor learns: the suite's learning test (tests/e2e/test_learning.py)
with the tiny Qwen3-MoE (8 experts, top-2) in place of the tiny Qwen2, every update routed
through the experts the rollout engine chose (``algo.routing_replay=rollout``), over several
warm starts. Prints one row per warm-start seed and the test's two criteria.

    python bench/moe_learning.py --seeds 0 1 2 --out outputs/moe_learning

Per seed S: the learning test's task (one-digit operands, 160 training questions, a slipped
solution next to every correct one), a tiny Qwen3-MoE initialised with seed S, warm-started
for ``--warm-start-steps`` supervised steps in batch order S, then ``rlep train`` with the
test's overrides (32 prompts x 8 samples, 4 optimizer steps of 64 sequences at lr 2e-4, 16
steps). The rise is the mean fresh-rollout accuracy of the last 4 steps minus step 1's; the
noise the last 4 steps' spread (at least one step's binomial sampling error); the dense test
asks for rise >= 0.12 and rise >= 3 x noise. The suite runs warm-start seed 0
(tests/e2e/test_learning.py::test_training_reward_rises_on_a_mixture_of_experts); this bench
runs the same over several warm starts.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WINDOW, MIN_RISE = 16, 4, 0.12


def one_seed(seed: int, out: str, warm_start_steps: int) -> dict:
    sys.path.insert(0, REPO)
    from rlep_megatron.tiny_model import make_tiny_model
    from rlep_megatron.tiny_task import make_tiny_task, warm_start

    task = make_tiny_task(os.path.join(out, "task"), seed=0, num_train=160, num_val=16,
                          max_operand=9, num_slips_easy=1, num_slips_hard=1)
    started = time.perf_counter()
    model = make_tiny_model(os.path.join(out, f"model_{seed}"), seed=seed, arch="qwen3_moe")
    warm_start(model, task["solutions"], steps=warm_start_steps, lr=3e-3, seed=seed,
               show_progress=False)
    warm_s = time.perf_counter() - started
    run = os.path.join(out, f"run_{seed}")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlep_megatron.cli", "train", "--config",
                    os.path.join(REPO, "examples", "tiny_cpu_baseline.yaml"),
                    f"model.hf_dir={model}", f"data.train_files=[{task['train']}]",
                    "data.val_files=[]", "data.train_batch_size=32", "trainer.mini_batch_size=8",
                    "optim.lr=2e-4", f"trainer.total_steps={STEPS}",
                    "trainer.validation_interval_steps=0", "checkpoint.save_interval_steps=0",
                    f"trainer.output_dir={run}", "algo.routing_replay=rollout"],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    accuracy = [m["rollout/acc_mean"] for m in metrics]
    before, last = accuracy[0], accuracy[-WINDOW:]
    rise = statistics.fmean(last) - before
    noise = max(statistics.pstdev(last), (before * (1 - before) / 256) ** 0.5)
    return {"seed": seed, "step1": before, "last": statistics.fmean(last), "rise": rise,
            "noise": noise, "mismatch": max(m["rollout/routing_mismatch_frac"] for m in metrics),
            "warm_s": warm_s, "rl_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warm-start-steps", type=int, default=1200)
    parser.add_argument("--out", default="outputs/moe_learning")
    args = parser.parse_args()
    rows = [one_seed(seed, args.out, args.warm_start_steps) for seed in args.seeds]
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
