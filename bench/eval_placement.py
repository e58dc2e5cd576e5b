"""``rlep eval`` colocated against ``rlep eval`` on the job's own rollout server
(``rollout.placement=separate rollout.num_ranks=1``), on the demo's warm-started model and
validation split: greedy answers compared question by question, and mean@k at the demo's
temperature over eval seeds, each placement's spread beside the other's.

    python bench/eval_placement.py --demo-dir outputs/tiny --seeds 3

``--demo-dir`` holds a demo's ``model/`` and ``task/`` (``rlep demo --prepare-only`` makes
them). Prints one table; nothing else should run meanwhile (not for timing: the scores do not
depend on load, the run time does).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO_ROOT)


def run_eval(demo: str, out: str, separate: bool, seed: int, greedy: bool) -> dict:
    args = ["eval", "--config", os.path.join(REPO_ROOT, "examples", "tiny_cpu_baseline.yaml"),
            f"model.hf_dir={os.path.join(demo, 'model')}",
            f"data.val_files=[{os.path.join(demo, 'task', 'val.parquet')}]",
            f"eval.output_file={out}", f"trainer.output_dir={os.path.dirname(out)}",
            f"trainer.seed={seed}"]
    if greedy:
        args += ["eval.temperature=0", "eval.num_samples_per_prompt=1"]
    if separate:
        args += ["rollout.placement=separate", "rollout.num_ranks=1"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", "-m", "rlep_megatron.cli", *args]
    else:
        command = [sys.executable, "-m", "rlep_megatron.cli", *args]
    proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"rlep eval failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo-dir", default="outputs/tiny")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    from rlep_megatron.demo import machine_description

    demo = os.path.abspath(args.demo_dir)
    work = tempfile.mkdtemp(prefix="eval_placement_")
    greedy = {p: run_eval(demo, os.path.join(work, f"greedy_{p}", "eval.json"), p == "separate",
                          0, True) for p in ("colocated", "separate")}
    same = sum(a["responses"] == b["responses"] for a, b in
               zip(greedy["colocated"]["samples"], greedy["separate"]["samples"]))
    scores = {p: [] for p in ("colocated", "separate")}
    key = None
    for seed in range(1, args.seeds + 1):
        for placement in scores:
            report = run_eval(demo, os.path.join(work, f"{placement}_{seed}", "eval.json"),
                              placement == "separate", seed, False)["report"]
            source = next(iter(report))
            key = key or next(k for k in report[source] if k.startswith("mean@"))
            scores[placement].append(report[source][key])
    questions = len(greedy["colocated"]["samples"])
    print(f"greedy: {same} of {questions} questions answered identically; greedy accuracy "
          f"colocated {100 * greedy['colocated']['report'][source]['mean@1']:.1f}%, separate "
          f"{100 * greedy['separate']['report'][source]['mean@1']:.1f}%")
    print(f"\n| placement | {key} per eval seed 1..{args.seeds} | mean | min-max |")
    print("|---|---|---|---|")
    for placement, values in scores.items():
        print(f"| {placement} | {', '.join(f'{100 * v:.1f}' for v in values)} | "
              f"{100 * statistics.fmean(values):.1f} | {100 * min(values):.1f}-"
              f"{100 * max(values):.1f} |")
    print(f"\n{machine_description()}")


if __name__ == "__main__":
    main()
