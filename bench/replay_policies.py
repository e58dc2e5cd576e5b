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

5. The diagnostics of why (per arm, each run's mean over its steps, then mean over seeds with a
   95% interval, and the paired difference to the baseline or, for replay-only figures, to
   ``rlep``): the share of trained sequences that are replays, the mean advantage replays and
   fresh responses carry, the fresh rollouts' accuracy on the training questions (those the
   pool answers), the policy's entropy, how unlikely the replayed tokens are to the policy
   before the update (their mean negative log-prob), and the clip fractions of replayed and
   fresh tokens.

``--hard``: the hard miniature (``rlep_megatron.demo.HARD_TASK``: the warm start's sampled
answers are right about a fifth of the time; its pool from a baseline run twice as long as the
arms, seed 1000; every arm trains on every question), in its own ``--out``, with finer bins ([0, .05), [.05, .1), [.1, .25),
[.25, 1]) and the step-0 pass rates measured twice (two eval seeds: the bins come from the
first, the second shows how much of a question's bin is sampling noise).
``--warm-start-seed``: the demo's (another model, another directory). ``--arms``: more demo arms
beside the four, each compared with the baseline and with uniform replay (``rlep_equal``: the
replays in mini-batches of G + M sequences, as many optimizer steps as the baseline: whether a
gain comes from the replays or from the paper's extra optimizer steps; ``unlikely``: replay
the pool answers the current policy finds least likely, ``replay.policy=unlikely``).

A finished step is not redone (the demo's runs, and every eval whose report exists).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARMS = ("baseline", "rlep", "low_pass", "rescue")
EDGES = (0.25, 0.5, 0.75)          # the tiny default's bins: quarters
HARD_EDGES = (0.05, 0.1, 0.25)     # the hard miniature's


def bin_names(edges) -> list[str]:
    points = ["0", *(f"{e:g}".lstrip("0") for e in edges), "1"]
    return [f"[{a}, {b})" for a, b in zip(points[:-2], points[1:-1])] + [
        f"[{points[-2]}, 1]"]


BINS = tuple(bin_names(EDGES))


def pass_rates(samples: list[dict]) -> list[float]:
    return [sum(q["acc"]) / len(q["acc"]) for q in samples]


def difficulty_bins(samples: list[dict], edges=EDGES) -> list[int]:
    """Per question of an eval report's ``samples``: the bin of its pass rate (bin ``b`` holds
    the rates in ``[edges[b-1], edges[b])``; the last bin includes 1)."""
    return [sum(rate >= e for e in edges) for rate in pass_rates(samples)]


def accuracy_by_bin(samples: list[dict], bins: list[int], count: int = 4) -> list:
    """Per bin: the mean accuracy over its questions' samples (None: an empty bin)."""
    if len(samples) != len(bins):
        raise ValueError(f"{len(samples)} questions evaluated, {len(bins)} binned")
    out = []
    for b in range(count):
        accs = [sum(q["acc"]) / len(q["acc"]) for q, qb in zip(samples, bins) if qb == b]
        out.append(sum(accs) / len(accs) if accs else None)
    return out


def bin_table(by_arm: dict[str, list[list]], counts: list[int], names=BINS) -> str:
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
    for b, name in enumerate(names):
        if not counts[b]:
            continue
        lines.append(f"| {name} | {counts[b]} | "
                     + " | ".join(cell(arm, b) for arm in arms) + " |")
    return "\n".join(lines)


def evaluate(out: str, checkpoint: str, report: str, k: int, seed: int = 1) -> list[dict]:
    """``rlep eval`` of ``checkpoint`` on the demo's validation split (sampling seed
    ``seed``); its samples."""
    from rlep_megatron.demo import _run, examples_dir

    if not os.path.isfile(report):
        _run(["eval", "--config", os.path.join(examples_dir(), "tiny_cpu_baseline.yaml"),
              f"model.hf_dir={os.path.join(out, 'model')}",
              f"data.val_files=[{os.path.join(out, 'task', 'val.parquet')}]",
              f"eval.checkpoint={checkpoint}", f"eval.num_samples_per_prompt={k}",
              f"eval.output_file={report}", f"trainer.output_dir={out}",
              f"trainer.seed={seed}"], 1, report + ".log")
    with open(report) as f:
        return json.load(f)["samples"]


# (label, how a run's steps give it, the arm its paired difference is taken against)
DIAGNOSTICS = (
    ("replay share of trained sequences",
     lambda e: e["replay/num_sequences"] / (e["replay/num_sequences"]
                                            + e["rollout/num_groups"] * e["group_fresh"]),
     "rlep"),
    ("mean advantage of replays", lambda e: e.get("advantage/mean/replay"), "rlep"),
    ("mean advantage of fresh responses", lambda e: e.get("advantage/mean/fresh"), "baseline"),
    # the questions the pool answers: where replay acts first, before any transfer to the
    # validation questions
    ("accuracy of fresh rollouts on the training questions",
     lambda e: e.get("rollout/acc_mean"), "baseline"),
    ("entropy (nats per token)", lambda e: e.get("train/entropy"), "baseline"),
    # how unlikely the replayed answers are to the policy that trains on them
    ("replayed tokens' NLL before the update (nats per token)",
     lambda e: e.get("train/old_nll_mean/replay") if e.get("replay/num_sequences") else None,
     "rlep"),
    ("clip fraction, replayed tokens", lambda e: e.get("train/pg_clipfrac/replay"), "rlep"),
    ("clip fraction, fresh tokens", lambda e: e.get("train/pg_clipfrac/fresh",
                                                     e.get("train/pg_clipfrac")), "baseline"),
)


def run_diagnostics(metrics_path: str, fresh_per_group: int) -> dict[str, float]:
    """Each diagnostic's mean over the run's training steps (absent: a run without it)."""
    from rlep_megatron.metrics import read_metrics

    steps = [dict(e, group_fresh=fresh_per_group) for e in read_metrics(metrics_path)
             if "train/entropy" in e]
    out = {}
    for label, value, _ in DIAGNOSTICS:
        values = []
        for entry in steps:
            try:
                v = value(entry)
            except (KeyError, ZeroDivisionError):
                v = None
            if v is not None:
                values.append(v)
        if values:
            out[label] = sum(values) / len(values)
    return out


def diagnostics_table(by_arm: dict[str, list[dict]]) -> str:
    """Per diagnostic and arm: the mean over seeds [95% interval], and the paired difference
    to the reference arm [95% interval]."""
    from rlep_megatron.demo import paired_difference

    def interval(values: list[float]) -> str:
        d = paired_difference(values)
        return (f"{d['mean']:.4g}" if d["low"] is None
                else f"{d['mean']:.4g} [{d['low']:.4g}, {d['high']:.4g}]")

    arms = list(by_arm)
    lines = ["| diagnostic | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for label, _, reference in DIAGNOSTICS:
        cells = []
        for arm in arms:
            values = [run.get(label) for run in by_arm[arm]]
            if any(v is None for v in values):
                cells.append("-")
                continue
            cell = interval(values)
            ref = by_arm.get(reference)
            if arm != reference and ref and all(r.get(label) is not None for r in ref):
                cell += " (vs " + reference + ": " + interval(
                    [v - r[label] for v, r in zip(values, ref)]) + ")"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--out", default="outputs/replay_policies")
    parser.add_argument("--k", type=int, default=16, help="eval samples per question")
    parser.add_argument("--hard", action="store_true", help="the hard miniature")
    parser.add_argument("--warm-start-seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS),
                        help="comma-separated demo arms; baseline, rlep, low_pass and rescue "
                             "always run (e.g. add rlep_equal: the replays with as many "
                             "optimizer steps as the baseline; unlikely: replay.policy="
                             "unlikely)")
    args = parser.parse_args()
    arms = list(ARMS) + [a for a in args.arms.split(",") if a and a not in ARMS]
    from rlep_megatron.config import load_config
    from rlep_megatron.demo import (QUICK, examples_dir, paired_comparison, paired_table,
                                    read_curves, run_demo, summarise_arm)

    out = os.path.abspath(args.out)
    started = time.perf_counter()
    summary = run_demo(out, seeds=args.seeds, arms=arms, hard=args.hard,
                       warm_start_seed=args.warm_start_seed)
    edges = HARD_EDGES if args.hard else EDGES
    names = bin_names(edges)
    steps, seeds = QUICK["steps"], list(range(1, args.seeds + 1))
    k = summary["k"]
    curves = {arm: [read_curves(os.path.join(out, arm, f"seed_{s}", "metrics.jsonl"))
                    for s in seeds] for arm in arms}
    uniform_best = summarise_arm(curves["rlep"], None)["best_mean_val"]
    for arm in arms[2:]:
        paired = paired_comparison(curves["rlep"], curves[arm], uniform_best)
        print(f"\n{arm} against uniform replay (rlep), paired by seed:")
        print(paired_table(paired, k, label=f"RLEP {arm}", reference="RLEP uniform"))

    step0 = evaluate(out, os.path.join(out, "model"), os.path.join(out, "eval_step0.json"),
                     args.k)
    bins = difficulty_bins(step0, edges)
    counts = [bins.count(b) for b in range(len(names))]
    again = difficulty_bins(evaluate(out, os.path.join(out, "model"),
                                     os.path.join(out, "eval_step0_seed2.json"), args.k, seed=2),
                            edges)
    rates = sorted(pass_rates(step0))
    print(f"\nstep-0 pass rates of the {len(rates)} validation questions (mean@{args.k}, eval "
          f"seed 1): {', '.join(f'{n} {c}' for n, c in zip(names, counts))}; median "
          f"{rates[len(rates) // 2]:.3f}, mean {sum(rates) / len(rates):.3f}; measured again "
          f"(eval seed 2): {', '.join(f'{n} {again.count(b)}' for b, n in enumerate(names))}, "
          f"{sum(a == b for a, b in zip(bins, again))} of {len(bins)} in the same bin")
    by_arm = {arm: [accuracy_by_bin(evaluate(
        out, os.path.join(out, arm, f"seed_{s}", "checkpoints", f"step_{steps:08d}"),
        os.path.join(out, arm, f"seed_{s}", "eval_final.json"), args.k), bins, len(names))
        for s in seeds] for arm in arms}
    print(f"\nvalidation accuracy at step {steps} by the question's pass rate at step 0 "
          f"(mean@{args.k}, points; in brackets: paired difference to the baseline, 95% "
          "interval):")
    print(bin_table(by_arm, counts, names))
    fresh = load_config(os.path.join(examples_dir(), "tiny_cpu_rlep.yaml"),
                        []).rollout.num_samples_per_prompt
    diagnostics = {arm: [run_diagnostics(os.path.join(out, arm, f"seed_{s}", "metrics.jsonl"),
                                         fresh) for s in seeds] for arm in arms}
    print("\nwhy: per-run means over the training steps, mean over seeds [95% interval] (paired "
          "difference to the reference arm [95% interval]):")
    print(diagnostics_table(diagnostics))
    print(f"\n{summary['machine']}; {(time.perf_counter() - started) / 60:.0f} minutes")


if __name__ == "__main__":
    main()
