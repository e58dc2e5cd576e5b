"""Where ``replay.policy=unlikely`` has a choice: the hard miniature's pool plus one verified
solution per pooled question in a form the policy seldom writes (column by column, slip-free:
``rlep_megatron.tiny_task``'s ``stepwise`` form, 5% of the warm-start corpus). Uniform replay
draws it about once in a dozen replays; ``unlikely`` replays it whenever the policy finds it
less likely than its own form.

    python bench/stepwise_pool.py --from D --out D2 [--seeds 8]

``--from``: a finished ``bench/replay_policies.py --hard`` directory (its warm start, pool
source, baseline runs and their final evals are reused, by symbolic links, and its pool
copied). In ``--out``: the pool with the added solutions, then ``rlep demo --hard --arms
rlep,unlikely`` on it (the demo's tables against the baseline); then ``unlikely`` against
uniform replay on the same pool (paired by seed); per arm the replays' mean length (a
column-by-column solution is about twice as long as the usual form), the replayed tokens' mean
negative log-prob before the update and their clip fraction (means over steps and seeds); and
``rlep eval`` of every final checkpoint on the validation questions (16 samples each, as
``bench/replay_policies.py``): accuracy and the share of answers written column by column,
each arm's paired difference to the baseline, and how many of the column-by-column answers
are right. A finished run or eval is not redone.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUESTION = re.compile(r"Compute (\d+) ([+-]) (\d+)\.")
COLUMN_FORM = "units "  # how a column-by-column solution starts (tiny_task._column_steps)


def column_solution(question: str) -> str:
    from rlep_megatron.tiny_task import TASK_KINDS

    a, op, b = QUESTION.fullmatch(question.strip()).groups()
    key = (int(a), op, int(b))
    kind = TASK_KINDS["column"]
    return kind.stepwise(key, kind.answer(key))


def build_pool(source_dir: str, out_dir: str) -> dict:
    """``out_dir``: links to the source's warm start, task, pool source and baseline runs, its
    settings, and its pool with one column-by-column solution added to each question (checked
    by the task's reward first)."""
    from rlep_megatron.data.schema import read_prompt_file, rows_to_table, write_table_atomic
    from rlep_megatron.reward import compute_score

    os.makedirs(out_dir, exist_ok=True)
    for name in ("model", "task", "pool_source", "baseline"):
        link = os.path.join(out_dir, name)
        if not os.path.exists(link):
            os.symlink(os.path.join(os.path.abspath(source_dir), name), link)
    shutil.copy(os.path.join(source_dir, "demo_settings.json"), out_dir)
    pool = os.path.join(out_dir, "pool.parquet")
    stats_path = os.path.join(out_dir, "pool.stats.json")
    if os.path.isfile(pool):
        with open(stats_path) as f:
            return json.load(f)
    rows = read_prompt_file(os.path.join(source_dir, "pool.parquet"))
    for i, (messages, truth, source) in enumerate(zip(rows.messages, rows.ground_truth,
                                                      rows.data_source)):
        solution = column_solution(messages[-1]["content"])
        if not compute_score(source, solution, truth)["acc"]:
            raise RuntimeError(f"the column-by-column solution {solution!r} fails its reward")
        rows.candidates[i] = list(rows.candidates[i]) + [solution]
    with open(os.path.join(source_dir, "pool.stats.json")) as f:
        stats = json.load(f)
    stats["answers"] = sum(len(c) for c in rows.candidates)
    stats["added_column_solutions"] = len(rows)
    write_table_atomic(rows_to_table(rows), pool)
    with open(stats_path, "w") as f:
        json.dump(stats, f, indent=1)
    return stats


def replay_facts(run_dir: str) -> dict[str, float]:
    """A run's replays, means over its steps: length, NLL before the update, clip fraction."""
    from rlep_megatron.metrics import read_metrics

    entries = [e for e in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
               if e.get("replay/num_sequences")]
    return {"replay length (tokens)": statistics.mean(e["replay/response_len_mean"]
                                                      for e in entries),
            "replayed tokens' NLL": statistics.mean(e["train/old_nll_mean/replay"]
                                                   for e in entries),
            "replay clip fraction": statistics.mean(e["train/pg_clipfrac/replay"]
                                                    for e in entries)}


def final_answers(out: str, arm: str, seed: int, steps: int, k: int) -> dict[str, float]:
    """Validation accuracy of the run's final checkpoint, and its answers' share written
    column by column."""
    from bench.replay_policies import evaluate

    run = os.path.join(out, arm, f"seed_{seed}")
    samples = evaluate(out, os.path.join(run, "checkpoints", f"step_{steps:08d}"),
                       os.path.join(run, "eval_final.json"), k)
    answers = [(r, a) for q in samples for r, a in zip(q["responses"], q["acc"])]
    column = [a for r, a in answers if r.startswith(COLUMN_FORM)]
    return {"accuracy": statistics.mean(a for _, a in answers),
            "column-by-column share": len(column) / len(answers),
            "column_right": sum(column), "column_count": len(column)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    from rlep_megatron.demo import (paired_comparison, paired_table, read_curves, run_demo,
                                    summarise_arm)

    stats = build_pool(args.source, args.out)
    print(f"pool: {stats['answers']} answers over {stats['questions']} questions, "
          f"{stats['added_column_solutions']} of them column by column", flush=True)
    summary = run_demo(args.out, seeds=args.seeds, arms=["baseline", "rlep", "unlikely"],
                       hard=True, warm_start_seed=json.load(open(os.path.join(
                           args.out, "demo_settings.json")))["warm_start_seed"])
    seeds = summary["seeds"]
    curves = {arm: [read_curves(os.path.join(args.out, arm, f"seed_{s}", "metrics.jsonl"))
                    for s in seeds] for arm in ("rlep", "unlikely")}
    best = summarise_arm(curves["rlep"], None)["best_mean_val"]
    print("\nunlikely against uniform replay on this pool, paired by seed:")
    print(paired_table(paired_comparison(curves["rlep"], curves["unlikely"], best),
                       summary["k"], label="RLEP unlikely", reference="RLEP uniform"))
    for arm in ("rlep", "unlikely"):
        facts = [replay_facts(os.path.join(args.out, arm, f"seed_{s}")) for s in seeds]
        print(f"{arm}: " + ", ".join(f"{k} {statistics.mean(f[k] for f in facts):.4g}"
                                     for k in facts[0]))
    from rlep_megatron.demo import QUICK, paired_difference

    finals = {arm: [final_answers(args.out, arm, s, QUICK["steps"], 16) for s in seeds]
              for arm in ("baseline", "rlep", "unlikely")}
    print("\nfinal checkpoints on the validation questions (16 samples each), mean over seeds; "
          "paired difference to the baseline [95% interval]:")
    for key in ("accuracy", "column-by-column share"):
        cells = []
        for arm, runs in finals.items():
            cell = f"{arm} {100 * statistics.mean(r[key] for r in runs):.1f}%"
            if arm != "baseline":
                d = paired_difference([100 * (r[key] - b[key])
                                       for r, b in zip(runs, finals["baseline"])])
                cell += f" ({d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}])"
            cells.append(cell)
        print(f"{key}: " + "; ".join(cells))
    # how well the policy carries the form out once it writes it
    print("accuracy of the answers written column by column (all seeds): " + "; ".join(
        f"{arm} {sum(r['column_right'] for r in runs)} of "
        f"{sum(r['column_count'] for r in runs)}" for arm, runs in finals.items()))

if __name__ == "__main__":
    main()
