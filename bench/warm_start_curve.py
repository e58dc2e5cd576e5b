"""The demo's warm start step by step: supervised loss and greedy accuracy on the validation
questions every ``--every`` steps, per initial-weight / batch-order seed and peak learning rate,
next to the lowest loss any model can reach on the corpus.

    python bench/warm_start_curve.py --seeds 0 1 --lrs 1e-3 3e-3 --steps 2500 --every 250

Each run is ``rlep_megatron.tiny_task.warm_start`` as ``rlep demo`` calls it (the demo's task
and batch size, a tiny Qwen2 made with the seed), with a report hook that decodes the first 64
validation questions greedily (transformers' ``generate``, up to the corpus' longest solution +
8 tokens, as the warm start's own record does). The hook draws no random numbers, so the
trajectory is the demo's own for the same seed and thread count: the curve shows when, if at
all, the model leaves the plateau where it answers almost nothing right.

Two loss floors, per token of response (EOS included), for a batch that samples the corpus
lines uniformly: a question worked column by column has one line, a direct one its correct
line and its slips. *Memorising*: each question's own mix (the entropy of its lines), the least
any model can reach. *Generalising*: a model that knows the arithmetic and the corpus' mix but
not which form each question drew: a line costs -log of its form's share (questions with one
line vs several) plus, for a direct line, -log of one over the question's number of lines (a
coin toss between the right result and its slips; the slipped value itself counted as known).
"""
import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def loss_floors(solutions_path: str, tokenizer) -> tuple[float, float, int]:
    """(memorising floor, generalising floor, longest response in tokens with EOS)."""
    by_question: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    tokens, longest = 0, 0
    for line in open(solutions_path):
        item = json.loads(line)
        by_question[item["question"]][item["solution"]] += 1
        length = len(tokenizer(item["solution"], add_special_tokens=False)["input_ids"]) + 1
        tokens, longest = tokens + length, max(longest, length)
    single = sum(sum(c.values()) == 1 for c in by_question.values()) / len(by_question)
    memorising = generalising = 0.0
    for counts in by_question.values():
        n = sum(counts.values())
        memorising -= sum(c * math.log(c / n) for c in counts.values())
        form = single if n == 1 else 1.0 - single
        generalising += n * (-math.log(form) + math.log(n))
    return memorising / tokens, generalising / tokens, longest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--lrs", type=float, nargs="+", default=None,
                        help="peak learning rates (default: the demo's)")
    parser.add_argument("--steps", type=int, default=None, help="default: the demo's")
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--task-dir", default=None,
                        help="the demo's task directory (default: built here)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.every < 1:
        parser.error("--every must be >= 1")

    import torch
    from transformers import AutoTokenizer

    from rlep_megatron.demo import TASK, WARM_START, machine_description
    from rlep_megatron.tiny_model import make_tiny_model
    from rlep_megatron.tiny_task import greedy_accuracy, make_tiny_task, warm_start

    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or WARM_START["steps"]
    lrs = args.lrs or [WARM_START["lr"]]
    work = tempfile.mkdtemp(prefix="warm_start_curve_")
    task_dir = args.task_dir or os.path.join(work, "task")
    if not args.task_dir:
        make_tiny_task(task_dir, seed=0, **TASK)
    solutions = os.path.join(task_dir, "train_solutions.jsonl")
    val = os.path.join(task_dir, "val.parquet")
    for path in (solutions, val):
        if not os.path.isfile(path):
            sys.exit(f"{path} does not exist: --task-dir must be a demo task directory")

    print(f"{machine_description()}; {steps} steps, batch {WARM_START['batch_size']}, "
          f"linear warm-up then cosine decay to 0")
    floor = None
    curves = {}
    for seed in args.seeds:
        for lr in lrs:
            model_dir = os.path.join(work, f"model_{seed}_{lr:g}")
            make_tiny_model(model_dir, seed=seed, arch="qwen2")
            if floor is None:
                floor, general, longest = loss_floors(
                    solutions, AutoTokenizer.from_pretrained(model_dir))
                print(f"corpus loss floors per token: memorising {floor:.4f}, generalising "
                      f"{general:.4f}")
            rows = []
            started = time.perf_counter()

            def report(step, loss, model, tokenizer):
                accuracy = greedy_accuracy(model, tokenizer, val, 64, max_new_tokens=longest + 8)
                rows.append((step, loss, accuracy))
                print(f"  seed {seed} lr {lr:g} step {step}: loss {loss:.4f}, greedy "
                      f"{100 * accuracy:.1f}% ({time.perf_counter() - started:.0f} s)",
                      flush=True)

            warm_start(model_dir, solutions, steps, lr=lr, batch_size=WARM_START["batch_size"],
                       seed=seed, show_progress=False, report_every=args.every, report=report)
            curves[(seed, lr)] = rows

    print("\nloss (mean of the last 50 steps) / greedy accuracy on 64 validation questions")
    header = "".join(f"{f'seed {s}, lr {lr:g}':>22}" for s, lr in curves)
    print(f"{'step':>6}{header}")
    for index, (step, _, _) in enumerate(next(iter(curves.values()))):
        cells = "".join(f"{rows[index][1]:>13.4f} / {100 * rows[index][2]:>4.1f}%"
                        for rows in curves.values())
        print(f"{step:>6}{cells}")


if __name__ == "__main__":
    main()
