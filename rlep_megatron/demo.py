"""``rlep demo``: the paper's comparison in miniature on the tiny default (CPU, minutes).

1. build the tiny task and the warm-started tiny model if missing (:data:`TASK`,
   :data:`WARM_START`): RL training questions the warm start never saw, validation questions
   disjoint from both modulo the task's symmetry;
2. train the baseline (``examples/tiny_cpu_baseline.yaml``) once per seed;
3. collect one experience pool from the first seed's baseline at its final checkpoint (the
   paper: one baseline run, its last checkpoint, one pool), keeping every correct sample;
4. train each other arm from the same warm-started model with the same seeds (no seed is
   picked or dropped): ``rlep`` (``examples/tiny_cpu_rlep.yaml``: M = 1 replay per group, on
   the questions with a pool, mini-batches counted in prompts x G as the paper, so (G + M) / G
   times the baseline's optimizer steps: 9 vs 8), optionally ``rlep_equal`` (the same with as
   many optimizer steps as the baseline), ``online`` (online experience replay from an
   empty pool), ``one_step_off`` (the baseline with ``trainer.max_staleness=1``: one step
   off against synchronous, docs/ASYNC.md), ``separate`` (the same with generation on a
   vLLM server of its own, one more process: ``rollout.placement=separate``), ``low_pass``,
   ``rescue`` and ``unlikely`` (``rlep`` with that replay policy, docs/ALGORITHM.md section
   11);
5. report every arm across seeds: validation mean@k and training accuracy curves as mean and
   spread (min..max over seeds), best and final validation accuracy with their spread, the
   optimizer steps per training step, the steps each arm needs to reach the baseline's best
   mean, and per arm the paired differences to the baseline (same seed) with 95% intervals and
   a verdict sentence. Printed as tables, plotted to ``comparison.png`` and written to
   ``summary.json``.

Each phase runs as its own process (under torchrun with ``--nproc`` > 1), exactly as a user
would run ``rlep train`` / ``rlep collect``; a finished phase is not redone when the demo is
started again on the same directory. Everything is deterministic for a given machine and
thread count.
"""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

from rlep_megatron.staging import write_file_atomic

logger = logging.getLogger(__name__)

# The tiny default task: two-digit addition and subtraction, operands 0..99, answered directly
# or column by column (``column`` in rlep_megatron/tiny_task.py). The warm-start corpus covers
# 3000 questions: a quarter of them solved column by column (always right), the rest directly
# with one slipped solution per easy question and two per hard one. RL trains on 128 other
# questions (each used about 4 times in 30 steps of 16 prompts) and validation asks 64 more,
# disjoint from both modulo commutativity. Measured on 2 cores (warm-start seed 0, 4 training
# seeds, bench/RESULTS.md "The tiny demo"): the baseline's validation mean@8 rises from 49% to a
# best of 71% in 30 steps, choosing the column form more often. The earlier task (direct
# answers only, operands 0..49) gained 1.6-3.5 points at best, inside the validation noise:
# RL sharpened the trained questions' answers and little carried over. bench/RESULTS.md has the
# figures over warm-start seeds and thread counts (docs/demo.md: what the demo shows).
TASK = {"kind": "column", "num_train": 3000, "num_rl_train": 128, "num_val": 64,
        "max_operand": 99, "num_slips_easy": 1, "num_slips_hard": 2, "stepwise_fraction": 0.25}
# The hard miniature (bench/replay_policies.py --hard, docs/ALGORITHM.md section 12): the same
# questions, a warm-start corpus with six slipped solutions per question (every slip
# tiny_task has: tens +-10, units +-1 and +-2) and only 5% solved column by column, so that the
# warm start's sampled answers are right about a fifth of the time (validation mean@16 20.7% at
# warm-start seed 0, 37 of 64 questions below 0.25; with 4 / 6 slips and 10% column solutions
# it was 23.9%, 30 of 64). Its pool comes from a baseline run twice as long as the arms
# (HARD_POOL_SOURCE), so that it holds answers the fresh policy seldom finds.
HARD_TASK = {**TASK, "num_slips_easy": 6, "num_slips_hard": 6, "stepwise_fraction": 0.05}
HARD_POOL_SOURCE = {"seed": 1000, "steps_factor": 2}
# 2500 supervised steps at a peak lr of 1e-3 (why not 3e-3: tiny_task.warm_start's docstring).
# 1500 steps at 1e-3 left the model short of the corpus' mix (validation mean@8 29% at step
# 0, and RL then lowered it).
WARM_START = {"steps": 2500, "lr": 1e-3, "batch_size": 32}
QUICK = {"seeds": 4, "steps": 30}
LONG = {"seeds": 8, "steps": 60}
VALIDATION_EVERY = 2
DEFAULT_ARMS = ("baseline", "rlep")
# the arms that replay the pool
POOLED_ARMS = ("rlep", "rlep_equal", "low_pass", "rescue", "unlikely")


def examples_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(here, "examples")
    if not os.path.isfile(os.path.join(path, "tiny_cpu_baseline.yaml")):
        raise FileNotFoundError(f"the demo recipes are not at {path}; run the demo from a "
                                "checkout of the repository (pip install -e .)")
    return path


_LIVE: set = set()  # the phase processes running now (several with --jobs > 1)
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set (under _LIVE_LOCK) once a phase has failed


def _run(args: list[str], nproc: int, log_path: str, threads: Optional[int] = None) -> float:
    """Run ``rlep <args>`` as a subprocess (torchrun when nproc > 1), with ``threads`` torch
    threads per rank when given; returns wall seconds."""
    if nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "-m", "rlep_megatron.cli", *args]
    else:
        command = [sys.executable, "-m", "rlep_megatron.cli", *args]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    logger.info("running: %s (log: %s)", " ".join(command[1:]), log_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        with _LIVE_LOCK:
            _LIVE.add(proc)
            if _STOPPING.is_set():  # a sibling phase failed while this one was starting
                proc.terminate()
        try:
            returncode = proc.wait()
        except BaseException:  # Ctrl-C (or any exit) reaching the demo: no run left behind
            proc.terminate()
            proc.wait()
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    if returncode:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"`rlep {args[0]}` failed (exit {returncode}); the end of "
                           f"{log_path}:\n{tail}")
    return time.perf_counter() - start


def _run_all(calls: list, jobs: int) -> None:
    """Run the zero-argument ``calls`` (phases of the demo), ``jobs`` at a time. The first
    failure stops the phases still running (their processes are terminated) and is raised."""
    _STOPPING.clear()
    if jobs <= 1 or len(calls) <= 1:
        for call in calls:
            call()
        return
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    def stop_all(pool) -> None:
        with _LIVE_LOCK:
            _STOPPING.set()
            for proc in _LIVE:
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(call) for call in calls]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # Ctrl-C: no queued phase starts, the running ones are ended
        stop_all(pool)
        raise
    failed = [f for f in done if f.exception() is not None]
    if failed:
        stop_all(pool)
        raise failed[0].exception()
    pool.shutdown(wait=True)


def default_jobs(nproc: int) -> int:
    """Phases run at once by default: one per core-sized share of the machine (each phase with
    ``nproc`` ranks of one torch thread), at most 4. On the tiny model a second torch thread
    hardly helps: on 2 cores two single-thread runs together took 103 s, as long as one run
    with 2 threads (95-119 s)."""
    return max(1, min(4, (os.cpu_count() or 1) // max(1, nproc)))


def read_curves(metrics_path: str) -> dict[str, dict[int, float]]:
    """``val``: validation mean@k per validated step (mean over data sources); ``train``:
    ``rollout/acc_mean`` per training step; ``step_s``: ``timing/step_s`` per step (the
    training step alone); ``all_s``: the step with its validation and checkpoint (step 0: the
    first validation)."""
    from rlep_megatron.metrics import read_metrics

    curves: dict[str, dict[int, float]] = {"val": {}, "train": {}, "step_s": {}, "all_s": {},
                                           "opt_steps": {}}
    for entry in read_metrics(metrics_path):
        step = int(entry["step"])
        values = [v for key, v in entry.items() if key.startswith("val/") and "/mean@" in key]
        if values:
            curves["val"][step] = sum(values) / len(values)
        if "rollout/acc_mean" in entry:
            curves["train"][step] = entry["rollout/acc_mean"]
        if "timing/step_s" in entry:
            curves["step_s"][step] = entry["timing/step_s"]
        if "train/num_optimizer_steps" in entry:
            curves["opt_steps"][step] = entry["train/num_optimizer_steps"]
        curves["all_s"][step] = sum(entry.get(f"timing/{name}_s", 0.0)
                                    for name in ("step", "validate", "checkpoint"))
    return curves


def band(curves: list[dict[int, float]]) -> dict[int, tuple[float, float, float]]:
    """Per step present in every curve: (mean, min, max) across curves (seeds)."""
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return {s: (statistics.fmean(c[s] for c in curves), min(c[s] for c in curves),
                max(c[s] for c in curves)) for s in steps}


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values}


def summarise_arm(runs: list[dict[str, dict[int, float]]], target: Optional[float]) -> dict:
    """One arm over its seeds. ``target``: the peak of the baseline's mean validation curve (None
    for the baseline itself, which uses its own)."""
    val = band([r["val"] for r in runs])
    mean_curve = {s: v[0] for s, v in val.items()}
    best_value = max(mean_curve.values())
    target = best_value if target is None else target
    first = min(mean_curve)
    return {
        "val_band": {str(s): v for s, v in val.items()},
        "train_band": {str(s): v for s, v in band([r["train"] for r in runs]).items()},
        "start_val": _spread([r["val"][first] for r in runs]),
        "best_val": _spread([max(r["val"].values()) for r in runs]),
        "final_val": _spread([r["val"][max(r["val"])] for r in runs]),
        "best_mean_step": min(s for s, v in mean_curve.items() if v == best_value),
        "best_mean_val": best_value,
        "steps_to_target": next((s for s in sorted(mean_curve) if mean_curve[s] >= target),
                                None),
        "step_s": _spread([statistics.fmean(r["step_s"].values()) for r in runs]),
        # optimizer steps per training step (RLEP's G + M sequences per group take more)
        "opt_steps": (_spread([statistics.fmean(r["opt_steps"].values()) for r in runs])
                      if all(r.get("opt_steps") for r in runs) else {"mean": float("nan")}),
        # everything the run's steps took (validations, checkpoints, step 0's validation) per
        # training step; engine start-up and model building are not in metrics.jsonl
        "all_s": _spread([sum(r["all_s"].values()) / len(r["step_s"]) for r in runs]),
    }


# Paired statistics (RLEP minus baseline, the same training seed in both arms): per seed the
# best and final validation accuracy, the area under the validation curve (its mean over the
# validated steps, trapezoids) and the steps to two thresholds: the peak of the baseline's mean
# curve (over seeds), and a fixed level, the step-0 accuracy + FIXED_GAIN. (It was 10 points with
# the first task, whose validation questions had their commutative twins in training; on the
# direct-answers-only task with disjoint validation the baseline's best was about 3 points above
# step 0, hence 2 points, set from the baseline's runs. On the current column task the
# baseline's best is 9-16 points above step 0 and every run passes 2 points within a few steps:
# the row separates little there, the peak row more.)
FIXED_GAIN = 0.02


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (two-sided intervals: p = 0.975), by bisection on the distribution
    function, itself integrated from the density (Simpson's rule). No scipy needed."""
    if df < 1 or not 0.5 <= p < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0.5 <= p < 1, got {df}, {p}")
    log_norm = (math.lgamma((df + 1) / 2) - math.lgamma(df / 2)
                - 0.5 * math.log(df * math.pi))

    def density(x: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    def cdf(x: float, pieces: int = 4000) -> float:  # x >= 0
        h = x / pieces
        total = density(0.0) + density(x) + sum(
            (4 if i % 2 else 2) * density(i * h) for i in range(1, pieces))
        return 0.5 + total * h / 3

    low, high = 0.0, 1.0
    while cdf(high) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def area_under_curve(curve: dict[int, float]) -> float:
    """Mean of a validation curve over its steps (trapezoids between validated steps)."""
    steps = sorted(curve)
    if len(steps) < 2:
        return curve[steps[0]]
    area = sum((curve[a] + curve[b]) / 2 * (b - a) for a, b in zip(steps, steps[1:]))
    return area / (steps[-1] - steps[0])


def first_step_at(curve: dict[int, float], level: float) -> Optional[int]:
    return next((s for s in sorted(curve) if curve[s] >= level), None)


def paired_difference(values: list[float]) -> dict:
    """Mean of per-seed differences with its 95% t-interval (None below 2 pairs)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": n, "values": values}
    half = t_quantile(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "values": values}


def paired_comparison(base_runs: list[dict], rlep_runs: list[dict],
                      baseline_best_mean: float) -> dict:
    """Per seed (same seed in both arms) and paired: best, final, area under the validation
    curve, steps to the peak of the baseline's mean curve (``baseline_best_mean``) and to the
    fixed level, and the fresh rollouts' accuracy on the training questions (mean over the
    training steps: the questions the pool answers). A seed where an arm
    never reaches a level counts as the run's length + its validation interval for that arm
    (a lower bound on how long it would take), and is flagged."""
    per_seed = []
    for base, rlep in zip(base_runs, rlep_runs):
        start = base["val"][min(base["val"])]
        row = {}
        for name, run in (("baseline", base), ("rlep", rlep)):
            val = run["val"]
            steps = sorted(val)
            censor = steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)
            reach = {}
            for label, level in (("to_best", baseline_best_mean),
                                 ("to_fixed", start + FIXED_GAIN)):
                step = first_step_at(val, level)
                reach[label] = step if step is not None else censor
                reach[f"{label}_reached"] = step is not None
            row[name] = {"best": max(val.values()), "final": val[steps[-1]],
                         "auc": area_under_curve(val), **reach}
            if run.get("train"):  # the fresh rollouts' accuracy, mean over training steps
                row[name]["train"] = statistics.fmean(run["train"].values())
        per_seed.append(row)
    keys = ["best", "final", "auc", "to_best", "to_fixed"]
    if all("train" in r[arm] for r in per_seed for arm in ("baseline", "rlep")):
        keys.append("train")
    differences = {key: paired_difference([r["rlep"][key] - r["baseline"][key]
                                           for r in per_seed]) for key in keys}
    return {"per_seed": per_seed, "differences": differences, "fixed_gain": FIXED_GAIN}


def verdict(paired: dict, label: str = "RLEP") -> str:
    """One sentence on the best-accuracy difference and whether its interval excludes 0."""
    diff = paired["differences"]["best"]
    points = 100 * diff["mean"]
    side = "above" if points >= 0 else "below"
    head = f"{label}'s best validation accuracy is {abs(points):.1f} points {side} the baseline's"
    if diff["low"] is None:
        return f"{head} on one seed: no interval, no conclusion."
    low, high = 100 * diff["low"], 100 * diff["high"]
    interval = f"(paired over {diff['n']} seeds, 95% interval {low:+.1f} to {high:+.1f})"
    if low > 0 or high < 0:
        return f"{head} {interval}: the interval excludes 0."
    return f"{head} {interval}: the interval includes 0, so this run shows no difference."


def paired_table(paired: dict, k: int, label: str = "RLEP", reference: str = "baseline") -> str:
    def interval(d: dict, scale: float, unit: str) -> str:
        if d["low"] is None:
            return f"{scale * d['mean']:+.1f}{unit}"
        return (f"{scale * d['mean']:+.1f}{unit} "
                f"[{scale * d['low']:+.1f}, {scale * d['high']:+.1f}]")

    def steps(label: str) -> str:
        reached = [r[arm][f"{label}_reached"] for r in paired["per_seed"]
                   for arm in ("baseline", "rlep")]
        return interval(d[label], 1, "") if any(reached) else "reached by no run"

    d = paired["differences"]
    rows = [(f"{label} - {reference}, paired by seed", "mean [95% interval]"),
            (f"best validation mean@{k} (points)", interval(d["best"], 100, "")),
            (f"final validation mean@{k} (points)", interval(d["final"], 100, "")),
            ("area under the validation curve (points)", interval(d["auc"], 100, "")),
            (f"steps to the peak of the {reference}'s mean curve", steps("to_best")),
            (f"steps to step 0 + {100 * paired['fixed_gain']:.0f} points", steps("to_fixed"))]
    if "train" in d:
        rows.append(("fresh accuracy on the training questions, mean over steps (points)",
                     interval(d["train"], 100, "")))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    unreached = sum(not r[arm][f"{label}_reached"] for r in paired["per_seed"]
                    for arm in ("baseline", "rlep") for label in ("to_best", "to_fixed"))
    if unreached:
        lines.append(f"({unreached} arm-seed pairs never reached a level: counted at the run's "
                     "end + one validation interval)")
    return "\n".join(lines)


ARM_LABELS = {"baseline": "baseline", "rlep": "RLEP", "rlep_equal": "RLEP equal-updates",
              "online": "online replay", "one_step_off": "baseline one step off",
              "separate": "baseline one step off, separate rollout",
              "low_pass": "RLEP low_pass", "rescue": "RLEP rescue",
              "unlikely": "RLEP unlikely",
              "gspo": "baseline with GSPO", "cispo": "baseline with CISPO",
              "dr_grpo": "baseline with Dr. GRPO", "lora": "baseline with LoRA"}
# the variant arms: the baseline with another algo.loss / algo.advantage (docs/ALGORITHM.md
# 4), or trained through rank-8 LoRA adapters at 10x the baseline's lr (docs/lora.md)
VARIANT_ARMS = {"gspo": ["algo.loss=gspo"], "cispo": ["algo.loss=cispo"],
                "dr_grpo": ["algo.advantage=dr_grpo", "algo.loss_agg_mode=constant_length"],
                "lora": ["lora.rank=8", "lora.alpha=16", "lora.lr=1e-3"]}


def arm_order(summary: dict) -> list[str]:
    """The arms of a summary, baseline first."""
    return list(summary.get("arm_names") or [a for a in ("baseline", "rlep") if a in summary])


def comparison_table(summary: dict) -> str:
    arms, k = arm_order(summary), summary["k"]
    b = summary["baseline"]

    def pct(spread: dict) -> str:
        return (f"{100 * spread['mean']:.1f}% (sd {100 * spread['sd']:.1f}, "
                f"{100 * spread['min']:.1f}-{100 * spread['max']:.1f})")

    def reach(arm: dict) -> str:
        return "not reached" if arm["steps_to_target"] is None else str(arm["steps_to_target"])

    def steps(arm: dict) -> str:
        value = arm.get("opt_steps", {}).get("mean", float("nan"))
        return "-" if math.isnan(value) else f"{value:.2f}"

    seeds = len(b["best_val"]["values"])
    rows = [(f"over {seeds} seeds: mean (sd, min-max)", *(ARM_LABELS.get(a, a) for a in arms))]
    table = [(f"validation mean@{k} at step 0", lambda a: pct(a["start_val"])),
             (f"best validation mean@{k}", lambda a: pct(a["best_val"])),
             (f"final validation mean@{k}", lambda a: pct(a["final_val"])),
             (f"steps for the mean curve to reach the baseline's peak "
              f"({100 * b['best_mean_val']:.1f}%)", reach),
             ("optimizer steps per training step", steps),
             ("training step alone (s)", lambda a: f"{a['step_s']['mean']:.2f}"),
             ("per step with validation and checkpoints (s)",
              lambda a: f"{a['all_s']['mean']:.2f}")]
    rows += [(name, *(cell(summary[a]) for a in arms)) for name, cell in table]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def plot_comparison(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = [("val_band", f"validation mean@{summary['k']} (%)"),
              ("train_band", "training accuracy: fresh rollouts correct (%)\n"
                             "(offline RLEP arms: on the questions with a pool)")]
    for ax, (key, label) in zip(axes, panels):
        for arm in arm_order(summary):
            name = ARM_LABELS.get(arm, arm)
            points = sorted((int(s), v) for s, v in summary[arm][key].items())
            steps = [s for s, _ in points]
            ax.plot(steps, [100 * v[0] for _, v in points], marker="o" if key == "val_band"
                    else None, ms=3, label=f"{name} (mean)")
            ax.fill_between(steps, [100 * v[1] for _, v in points],
                            [100 * v[2] for _, v in points], alpha=0.15,
                            label=f"{name} (min-max over seeds)")
        if key == "val_band":  # the levels of the paired "steps to" rows
            start = summary["baseline"]["start_val"]["mean"]
            ax.axhline(100 * summary["baseline"]["best_mean_val"], color="gray", ls="--",
                       lw=0.8, label="peak of the baseline's mean curve")
            ax.axhline(100 * (start + FIXED_GAIN), color="gray", ls=":", lw=0.8,
                       label=f"step 0 + {100 * FIXED_GAIN:.0f} points")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"tiny default: {' vs '.join(ARM_LABELS.get(a, a) for a in arm_order(summary))}"
                 f" over {len(summary['baseline']['best_val']['values'])} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prepare_model(out_dir: str, warm_start_seed: int = 0, task: Optional[dict] = None) -> dict:
    """The tiny task and the warm-started model (built once; ``warm_start.json`` records it).
    ``warm_start_seed`` seeds the model's initial weights and the warm start's batch order (the
    task itself is always the same). ``task``: :data:`TASK` (default) or :data:`HARD_TASK`."""
    task = TASK if task is None else task
    from rlep_megatron.tiny_model import make_tiny_model
    from rlep_megatron.tiny_task import WARM_START_RECORD, make_tiny_task, warm_start

    task_dir, model_dir = os.path.join(out_dir, "task"), os.path.join(out_dir, "model")
    _check_settings(out_dir, warm_start_seed, task)
    if not os.path.isfile(os.path.join(task_dir, "val.parquet")):
        make_tiny_task(task_dir, seed=0, **task)
    start_info = os.path.join(model_dir, WARM_START_RECORD)
    if not os.path.isfile(start_info):
        print(f"warm-starting the tiny model: {WARM_START['steps']} supervised steps ...",
              flush=True)
        make_tiny_model(model_dir, seed=warm_start_seed, arch="qwen2")
        warm_start(model_dir, os.path.join(task_dir, "train_solutions.jsonl"),
                   WARM_START["steps"], lr=WARM_START["lr"], batch_size=WARM_START["batch_size"],
                   seed=warm_start_seed, eval_parquet=os.path.join(task_dir, "val.parquet"),
                   extra_record={"task": task})
    with open(start_info) as f:
        return json.load(f)


SETTINGS_FILE = "demo_settings.json"


def _check_settings(out_dir: str, warm_start_seed: int, task: Optional[dict] = None) -> None:
    """A demo directory is continued only with the task and warm start it was built with: a
    directory from another version (or other settings) is refused, never overwritten."""
    settings = json.dumps({"task": TASK if task is None else task, "warm_start": WARM_START,
                           "warm_start_seed": warm_start_seed}, sort_keys=True)
    path = os.path.join(out_dir, SETTINGS_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            if json.dumps(json.load(f), sort_keys=True) == settings:
                return
    elif not os.listdir(out_dir):
        write_file_atomic(path, settings)
        return
    raise FileExistsError(f"{out_dir} holds a tiny default built with other settings (another "
                          f"--warm-start-seed, or an older version of rlep demo); remove it or "
                          f"give another --out-dir")


def _collect_pool(recipes: str, common: list[str], source: str, pool: str, out_dir: str,
                  nproc: int, seed: int, steps: int) -> None:
    print(f"collecting the experience pool from baseline seed {seed} at its final "
          f"step {steps} ...", flush=True)
    seconds = _run(["collect", "--config", os.path.join(recipes, "tiny_cpu_rlep.yaml"),
                    *common, f"collect.checkpoint={source}", f"collect.output_file={pool}",
                    f"trainer.output_dir={out_dir}"], nproc,
                   os.path.join(out_dir, "collect.log"))
    print(f"collect: done in {seconds:.0f} s", flush=True)


def _pool_stats(pool: str, source: str, out_dir: str, steps: int, seed: int) -> dict:
    """The pool's statistics, checked to come from this demo's final baseline checkpoint."""
    with open(os.path.splitext(pool)[0] + ".stats.json") as f:
        stats = json.load(f)
    # a pool left by a demo of another length (say a quick one before --long) came from
    # another checkpoint: refused rather than reported as this run's
    if stats.get("checkpoint") != os.path.relpath(source, out_dir):
        raise FileExistsError(f"{pool} was collected from {stats.get('checkpoint')}"
                              f", not from this demo's final baseline checkpoint "
                              f"{os.path.relpath(source, out_dir)}; remove it (and its "
                              "rlep runs) or give another --out-dir")
    stats["source_step"] = steps
    print(f"pool: {stats['questions']} of {stats['training_questions']}"
          f" training questions, {stats['answers']} answers, from baseline seed "
          f"{seed}'s step {steps} (its final checkpoint)", flush=True)
    return stats


def _common_overrides(model_dir: str, task_dir: str, steps: int, overrides: list[str],
                      hard: bool) -> list[str]:
    """The overrides every run of a demo shares (the user's last)."""
    common = [f"model.hf_dir={model_dir}",
              f"data.train_files=[{os.path.join(task_dir, 'train.parquet')}]",
              f"data.val_files=[{os.path.join(task_dir, 'val.parquet')}]",
              f"trainer.total_steps={steps}",
              f"trainer.validation_interval_steps={VALIDATION_EVERY}",
              f"checkpoint.save_interval_steps={steps}",
              "checkpoint.keep_last=1000"] + overrides
    if hard:
        # every arm trains on the same questions: the pool covers only those its source solved,
        # an easier subset on this split (the paper's protocol keeps them alone)
        common.append("replay.pooled_questions_only=false")
    return common


def _hard_pool_source(recipes: str, common: list[str], out_dir: str, nproc: int,
                      steps: int) -> tuple[str, int, int]:
    """The hard miniature's pool source (:data:`HARD_POOL_SOURCE`): a baseline run longer than
    the arms, with a seed none of them has, trained once. Returns its final checkpoint, its
    seed and its steps."""
    seed = HARD_POOL_SOURCE["seed"]
    source_steps = steps * HARD_POOL_SOURCE["steps_factor"]
    directory = os.path.join(out_dir, "pool_source", f"seed_{seed}")
    checkpoint = os.path.join(directory, "checkpoints", f"step_{source_steps:08d}")
    if not os.path.isdir(checkpoint):
        print(f"pool source: baseline seed {seed}, {source_steps} steps ...", flush=True)
        seconds = _run(["train", "--config", os.path.join(recipes, "tiny_cpu_baseline.yaml"),
                        *common, f"trainer.total_steps={source_steps}",
                        f"checkpoint.save_interval_steps={source_steps}",
                        f"trainer.seed={seed}", f"trainer.output_dir={directory}"],
                       nproc, os.path.join(out_dir, "pool_source.log"))
        print(f"pool source: done in {seconds:.0f} s", flush=True)
    return checkpoint, seed, source_steps


def run_demo(out_dir: str = "outputs/tiny", long: bool = False, nproc: int = 1,
             seeds: Optional[int] = None, overrides: Optional[list[str]] = None,
             warm_start_seed: int = 0, prepare_only: bool = False,
             arms: Optional[list[str]] = None, jobs: Optional[int] = None,
             hard: bool = False) -> dict:
    """``rlep demo``; ``hard``: the hard miniature (:data:`HARD_TASK`, :data:`HARD_POOL_SOURCE`)."""
    budget = dict(LONG if long else QUICK)
    jobs = default_jobs(nproc) if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    # each of the runs going at once gets its share of the cores (one job: torch's default)
    threads = max(1, (os.cpu_count() or 1) // (jobs * nproc)) if jobs > 1 else None
    if seeds is not None:
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        budget["seeds"] = seeds
    arms = check_arms(arms)
    seed_list = list(range(1, budget["seeds"] + 1))
    steps = budget["steps"]
    overrides = list(overrides or [])
    started = time.perf_counter()
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    recipes = examples_dir()
    task_dir, model_dir = os.path.join(out_dir, "task"), os.path.join(out_dir, "model")
    summary: dict = {"budget": budget, "nproc": nproc, "warm_start_seed": warm_start_seed,
                     "jobs": jobs, "torch_threads": threads or _torch_threads(),
                     "arm_names": arms, "hard": hard}
    summary["warm_start"] = prepare_model(out_dir, warm_start_seed,
                                          HARD_TASK if hard else TASK)
    print(f"warm-started tiny model: greedy accuracy on the validation split "
          f"{100 * summary['warm_start']['accuracy']:.1f}% after "
          f"{summary['warm_start']['pretrain_steps']} supervised steps", flush=True)
    if prepare_only:
        print(f"task: {task_dir}\nmodel: {model_dir}", flush=True)
        return summary

    common = _common_overrides(model_dir, task_dir, steps, overrides, hard)
    pool = os.path.join(out_dir, "pool.parquet")

    def run_dir(arm: str, seed: int) -> str:
        return os.path.join(out_dir, arm, f"seed_{seed}")

    def train(arm: str, seed: int) -> None:
        directory = run_dir(arm, seed)
        done = os.path.join(directory, "checkpoints", f"step_{steps:08d}")
        if os.path.isdir(done):
            print(f"{arm} seed {seed}: already trained ({done})", flush=True)
            return
        recipe, extra = arm_settings(arm, recipes, pool, overrides)
        print(f"{arm} seed {seed}: training {steps} steps ...", flush=True)
        # the separate arm's rollout rank comes on top of the training ranks
        seconds = _run(["train", "--config", recipe, *common, *extra, f"trainer.seed={seed}",
                        f"trainer.output_dir={directory}"],
                       nproc + (arm == "separate"),
                       os.path.join(out_dir, f"{arm}_seed_{seed}.log"), threads)
        print(f"{arm} seed {seed}: done in {seconds:.0f} s", flush=True)

    def each(arm_list: list[str]) -> list:
        return [lambda a=a, s=s: train(a, s) for a in arm_list for s in seed_list]

    _run_all(each(["baseline"]), jobs)
    # the paper collects the pool from the baseline's final checkpoint (one baseline run, one
    # pool): here the first seed's, at its last step; the hard miniature's from a baseline run
    # of its own, longer than the arms, with a seed none of them has
    source, source_seed, source_steps = (
        _hard_pool_source(recipes, common, out_dir, nproc, steps) if hard else
        (os.path.join(run_dir("baseline", seed_list[0]), "checkpoints", f"step_{steps:08d}"),
         seed_list[0], steps))
    if any(arm in POOLED_ARMS for arm in arms) and not os.path.isfile(pool):
        _collect_pool(recipes, common, source, pool, out_dir, nproc, source_seed, source_steps)
    if os.path.isfile(pool):
        summary["pool"] = _pool_stats(pool, source, out_dir, source_steps, source_seed)
    _run_all(each(arms[1:]), jobs)

    curves = {arm: [read_curves(os.path.join(run_dir(arm, s), "metrics.jsonl"))
                    for s in seed_list] for arm in arms}
    summary["seeds"] = seed_list
    summary["baseline"] = summarise_arm(curves["baseline"], None)
    target = summary["baseline"]["best_mean_val"]
    summary["paired"], summary["verdicts"] = {}, {}
    for arm in arms[1:]:
        summary[arm] = summarise_arm(curves[arm], target)
        summary["paired"][arm] = paired_comparison(curves["baseline"], curves[arm], target)
        summary["verdicts"][arm] = verdict(summary["paired"][arm], ARM_LABELS.get(arm, arm))
    summary["k"] = _validation_k(os.path.join(run_dir("baseline", seed_list[0]), "metrics.jsonl"))
    plot = os.path.join(out_dir, "comparison.png")
    plot_comparison(summary, plot)
    summary["wall_s"] = time.perf_counter() - started
    summary["machine"] = machine_description(summary["torch_threads"], jobs)
    summary_path = os.path.join(out_dir, "summary.json")
    write_file_atomic(summary_path, json.dumps(summary, indent=1))
    print(comparison_table(summary))
    for arm in arms[1:]:
        print(paired_table(summary["paired"][arm], summary["k"], ARM_LABELS.get(arm, arm)))
    for arm in arms[1:]:
        print(summary["verdicts"][arm])
    print(f"plot: {plot}\nsummary: {summary_path}\ntotal wall time: "
          f"{summary['wall_s'] / 60:.1f} min on {summary['machine']}", flush=True)
    return summary


def check_arms(arms: Optional[list[str]]) -> list[str]:
    """The demo's arms, baseline first (it is every comparison's reference)."""
    arms = list(arms or DEFAULT_ARMS)
    unknown = [a for a in arms if a not in ARM_LABELS]
    if unknown:
        raise ValueError(f"unknown demo arm(s) {unknown}; choose from {list(ARM_LABELS)}")
    if len(set(arms)) != len(arms):
        raise ValueError(f"--arms names an arm twice: {arms}")
    return ["baseline"] + [a for a in arms if a != "baseline"]


def arm_settings(arm: str, recipes: str, pool: str,
                 overrides: Optional[list[str]] = None) -> tuple[str, list[str]]:
    """The recipe and overrides of one arm. ``rlep``: the paper's protocol, where the mini-batch
    counts prompts x G sequences, so the G + M sequences of a group take (G + M) / G times the
    baseline's optimizer steps (the paper's 9 vs 8); ``rlep_equal``: the same replays in
    mini-batches of prompts x (G + M) sequences, as many optimizer steps as the baseline;
    ``online``: online experience replay (``replay.mode=online``) from an empty pool;
    ``one_step_off``: the baseline with the next step's prompts generating ahead
    (``trainer.max_staleness=1``, with the rollout correction it is meant to run with), so its
    paired differences to the baseline are one step off against synchronous; ``separate``:
    the same with generation on a vLLM server of its own (``rollout.placement=separate``, one
    more process), overlapping training; ``low_pass``, ``rescue`` and ``unlikely``:
    ``rlep`` with that ``replay.policy``; ``gspo``, ``cispo``, ``dr_grpo``: the baseline with that loss, ``lora``
    with LoRA adapters (:data:`VARIANT_ARMS`)."""
    if arm == "baseline":
        return os.path.join(recipes, "tiny_cpu_baseline.yaml"), []
    if arm in VARIANT_ARMS:
        return os.path.join(recipes, "tiny_cpu_baseline.yaml"), list(VARIANT_ARMS[arm])
    if arm in ("one_step_off", "separate"):
        return os.path.join(recipes, "tiny_cpu_baseline.yaml"), [
            "trainer.max_staleness=1", "algo.rollout_correction=truncate",
            *(["rollout.placement=separate", "rollout.num_ranks=1"] if arm == "separate"
              else [])]
    recipe = os.path.join(recipes, "tiny_cpu_rlep.yaml")
    if arm == "online":  # no offline pool: the run's own verified answers, as they appear
        return recipe, ["replay.pool_files=[]", "replay.mode=online"]
    extra = [f"replay.pool_files=[{pool}]"]
    if arm in ("low_pass", "rescue", "unlikely"):
        extra.append(f"replay.policy={arm}")
    if arm == "rlep_equal":
        from rlep_megatron.config import load_config

        cfg = load_config(recipe, list(overrides or []))  # the user's G, M and mini-batch
        if cfg.trainer.mini_batch_unit != "prompts":
            raise ValueError(f"{recipe}: the equal-updates arm needs mini_batch_unit=prompts")
        group = cfg.rollout.num_samples_per_prompt + cfg.replay.num_replays_per_prompt
        extra += ["trainer.mini_batch_unit=sequences",
                  f"trainer.mini_batch_size={cfg.trainer.mini_batch_size * group}"]
    return recipe, extra


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def machine_description(threads: Optional[int] = None, jobs: int = 1) -> str:
    """The CPU model, its cores, the runs at a time and torch's thread count in each: what the
    demo's figures depend on."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    threads = threads or _torch_threads()
    runs = f"{jobs} runs at a time, " if jobs > 1 else ""
    return (f"{model}, {os.cpu_count()} cores, {runs}{threads} torch "
            f"thread{'s' if threads > 1 else ''}{' each' if jobs > 1 else ''}")


def _validation_k(metrics_path: str) -> int:
    from rlep_megatron.metrics import read_metrics

    for entry in read_metrics(metrics_path):
        for key in entry:
            if key.startswith("val/") and "/mean@" in key:
                return int(key.rsplit("@", 1)[1])
    raise ValueError(f"{metrics_path} has no validation entries")
