"""``rlep demo``: the paper in miniature on the tiny default (CPU, a few minutes).

1. build the tiny task and the warm-started tiny model if missing;
2. train the baseline (``examples/tiny_cpu_baseline.yaml``), checkpointing at every validation;
3. collect an experience pool from the baseline's best validation checkpoint;
4. train RLEP (``examples/tiny_cpu_rlep.yaml``) from the same warm-started model with that pool;
5. evaluate both runs' final checkpoints, print a comparison table and plot both validation
   curves (``comparison.png``); everything is also written to ``summary.json``.

Each phase runs as its own process (under torchrun with ``--nproc`` > 1), exactly as a user
would run ``rlep train`` / ``rlep collect`` / ``rlep eval``; a finished phase is not redone
when the demo is started again on the same directory.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from typing import Optional

logger = logging.getLogger(__name__)

QUICK = {"steps": 20, "pretrain_steps": 300}
LONG = {"steps": 60, "pretrain_steps": 300}
VALIDATION_EVERY = 4


def examples_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "examples")
    if not os.path.isfile(os.path.join(path, "tiny_cpu_baseline.yaml")):
        raise FileNotFoundError(f"the demo recipes are not at {path}; run the demo from a "
                                "checkout of the repository (pip install -e .)")
    return path


def _run(args: list[str], nproc: int, log_path: str) -> float:
    """Run ``rlep <args>`` as a subprocess (torchrun when nproc > 1); returns wall seconds."""
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "-m", "rlep_megatron.cli", *args]
    else:
        command = [sys.executable, "-m", "rlep_megatron.cli", *args]
    start = time.perf_counter()
    logger.info("running: %s (log: %s)", " ".join(command[1:]), log_path)
    with open(log_path, "w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"`rlep {args[0]}` failed (exit {proc.returncode}); the end of "
                           f"{log_path}:\n{tail}")
    return time.perf_counter() - start


def _val_curve(metrics_path: str) -> dict[int, float]:
    from rlep_megatron.metrics import read_metrics

    curve = {}
    for entry in read_metrics(metrics_path):
        values = [v for key, v in entry.items() if key.startswith("val/") and "/mean@" in key]
        if values:  # mean over data sources
            curve[int(entry["step"])] = sum(values) / len(values)
    return curve


def _step_times(metrics_path: str) -> list[float]:
    from rlep_megatron.metrics import read_metrics

    return [e["timing/step_s"] for e in read_metrics(metrics_path) if "timing/step_s" in e]


def _best(curve: dict[int, float]) -> tuple[int, float]:
    best_value = max(curve.values())
    return min(s for s, v in curve.items() if v == best_value), best_value


def plot_curves(curves: dict[str, dict[int, float]], path: str, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        steps = sorted(curve)
        ax.plot(steps, [100 * curve[s] for s in steps], marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel(f"validation mean@{k} (%)")
    ax.set_title("tiny default: baseline vs RLEP")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def comparison_table(summary: dict) -> str:
    rows = [("", "baseline", "RLEP")]
    b, r = summary["baseline"], summary["rlep"]
    target = b["best_val"]
    rows.append((f"best validation mean@{summary['k']}", f"{100 * b['best_val']:.1f}% "
                 f"(step {b['best_step']})", f"{100 * r['best_val']:.1f}% (step {r['best_step']})"))
    reach = r["steps_to_baseline_best"]
    rows.append((f"steps to reach the baseline's best ({100 * target:.1f}%)",
                 str(b["best_step"]), "not reached" if reach is None else str(reach)))
    rows.append((f"final eval mean@{summary['k']}", f"{100 * b['final_eval']:.1f}%",
                 f"{100 * r['final_eval']:.1f}%"))
    rows.append(("wall time per step (s)", f"{b['step_s']:.1f}", f"{r['step_s']:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def run_demo(out_dir: str = "outputs/tiny", long: bool = False, nproc: int = 1,
             overrides: Optional[list[str]] = None) -> dict:
    from rlep_megatron.tiny_model import make_tiny_model
    from rlep_megatron.tiny_task import make_tiny_task, warm_start

    budget = LONG if long else QUICK
    overrides = list(overrides or [])
    started = time.perf_counter()
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    recipes = examples_dir()
    task_dir, model_dir = os.path.join(out_dir, "task"), os.path.join(out_dir, "model")
    summary_path = os.path.join(out_dir, "summary.json")
    summary: dict = {"budget": budget, "nproc": nproc}

    if not os.path.isfile(os.path.join(task_dir, "val.parquet")):
        make_tiny_task(task_dir, seed=0)
    start_info = os.path.join(model_dir, "warm_start.json")
    if not os.path.isfile(start_info):
        make_tiny_model(model_dir, seed=0, arch="qwen2")
        result = warm_start(model_dir, os.path.join(task_dir, "train_solutions.jsonl"),
                            budget["pretrain_steps"], seed=0,
                            eval_parquet=os.path.join(task_dir, "val.parquet"))
        with open(start_info, "w") as f:
            json.dump({"pretrain_steps": budget["pretrain_steps"], **result}, f)
    with open(start_info) as f:
        summary["warm_start"] = json.load(f)
    print(f"warm-started tiny model: greedy accuracy on the validation split "
          f"{100 * summary['warm_start']['accuracy']:.1f}% after "
          f"{summary['warm_start']['pretrain_steps']} supervised steps", flush=True)

    common = [f"model.hf_dir={model_dir}",
              f"data.train_files=[{os.path.join(task_dir, 'train.parquet')}]",
              f"data.val_files=[{os.path.join(task_dir, 'val.parquet')}]",
              f"trainer.total_steps={budget['steps']}",
              f"trainer.validation_interval_steps={VALIDATION_EVERY}",
              f"checkpoint.save_interval_steps={VALIDATION_EVERY}",
              "checkpoint.keep_last=1000"] + overrides
    runs = {name: os.path.join(out_dir, name) for name in ("baseline", "rlep")}

    def train(name: str, recipe: str, extra: list[str]) -> None:
        done = os.path.join(runs[name], "checkpoints", f"step_{budget['steps']:08d}")
        if os.path.isdir(done):
            print(f"{name}: already trained ({done})", flush=True)
            return
        print(f"{name}: training {budget['steps']} steps ...", flush=True)
        seconds = _run(["train", "--config", os.path.join(recipes, recipe), *common,
                        f"trainer.output_dir={runs[name]}", *extra], nproc,
                       os.path.join(out_dir, f"{name}.log"))
        print(f"{name}: done in {seconds:.0f} s", flush=True)

    train("baseline", "tiny_cpu_baseline.yaml", [])
    base_curve = _val_curve(os.path.join(runs["baseline"], "metrics.jsonl"))
    best_step, best_value = _best(base_curve)
    source = (model_dir if best_step == 0 else
              os.path.join(runs["baseline"], "checkpoints", f"step_{best_step:08d}"))
    pool = os.path.join(out_dir, "pool.parquet")
    if not os.path.isfile(pool):
        print(f"collecting the experience pool from {source} (baseline best, step "
              f"{best_step}) ...", flush=True)
        seconds = _run(["collect", "--config", os.path.join(recipes, "tiny_cpu_rlep.yaml"),
                        *common, f"collect.checkpoint={source}", f"collect.output_file={pool}",
                        f"trainer.output_dir={out_dir}"], nproc,
                       os.path.join(out_dir, "collect.log"))
        print(f"collect: done in {seconds:.0f} s", flush=True)
    with open(os.path.splitext(pool)[0] + ".stats.json") as f:
        summary["pool"] = json.load(f)
    train("rlep", "tiny_cpu_rlep.yaml", [f"replay.pool_files=[{pool}]"])

    k = None
    for name in ("baseline", "rlep"):
        eval_path = os.path.join(runs[name], "eval.json")
        if not os.path.isfile(eval_path):
            final = os.path.join(runs[name], "checkpoints", f"step_{budget['steps']:08d}")
            _run(["eval", "--config", os.path.join(recipes, f"tiny_cpu_{name}.yaml"), *common,
                  f"eval.checkpoint={final}", f"eval.output_file={eval_path}",
                  f"trainer.output_dir={runs[name]}"], nproc,
                 os.path.join(out_dir, f"eval_{name}.log"))
        with open(eval_path) as f:
            report = json.load(f)
        k = report["k"]
        curve = _val_curve(os.path.join(runs[name], "metrics.jsonl"))
        step, value = _best(curve)
        reach = next((s for s in sorted(curve) if curve[s] >= best_value), None)
        times = _step_times(os.path.join(runs[name], "metrics.jsonl"))
        summary[name] = {
            "val_curve": {str(s): v for s, v in sorted(curve.items())},
            "best_step": step, "best_val": value,
            "steps_to_baseline_best": reach,
            "final_eval": sum(t[f"mean@{k}"] for t in report["report"].values())
            / max(1, len(report["report"])),
            "step_s": sum(times) / max(1, len(times)),
        }
    summary["k"] = k
    plot = os.path.join(out_dir, "comparison.png")
    plot_curves({"baseline": _val_curve(os.path.join(runs["baseline"], "metrics.jsonl")),
                 "RLEP": _val_curve(os.path.join(runs["rlep"], "metrics.jsonl"))}, plot, k)
    summary["wall_s"] = time.perf_counter() - started
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=1)
    print(comparison_table(summary))
    print(f"plot: {plot}\nsummary: {summary_path}\ntotal wall time: "
          f"{summary['wall_s'] / 60:.1f} min", flush=True)
    return summary
