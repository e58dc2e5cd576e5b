"""The tiny tasks: short integer questions in the DAPO schema, scored by the DAPO rule (the last
``Answer:`` line is compared with the ground truth; ``data_source = tiny_<kind>``), and a
supervised warm start of the tiny model on a corpus of worked solutions.

Kinds (``make_tiny_task(kind=...)``):

* ``arith`` (the earlier default): ``Compute 12 + 7.`` -> ``12 + 7 = 19\nAnswer: 19``; operands
  0..``max_operand``, ``+`` or ``-``. Hard questions carry (``+``) or borrow (``-``) a ten.
* ``column`` (the tiny default, ``demo.TASK``): the same questions, subtraction never below 0, and a second way to
  solve them, column by column: ``Compute 38 + 45.`` -> ``units 8+5=13, tens 3+4+1=8, so 83``
  / ``Answer: 83``. With ``stepwise_fraction`` > 0 that share of the corpus questions is
  solved column by column, always correctly; the rest directly, with the slips. The
  warm-started model then answers directly most of the time and slips often, and works column
  by column now and then, which it does more reliably: a reasoning mode the base model has but
  seldom uses, as RL on real base models finds (longer worked solutions get rewarded and
  spread to questions never trained on). RL can improve on unseen questions by choosing that
  mode more often, not only by memorising the trained questions' answers.
* ``max``: ``Largest of 41 17 45 8.`` -> ``Answer: 45``; four numbers 0..99. Hard questions
  have two numbers in the top decade.

The warm-start corpus (``train_solutions.jsonl``) imitates a partially competent model: every
corpus question has its correct worked solution plus ``num_slips_easy`` (easy questions) or
``num_slips_hard`` (hard ones) *slipped* solutions, each written out the same way but with a
wrong result of the kind a model gets wrong (``arith``: a ten dropped or added, as when a carry
or borrow is mishandled, then the units digit off by one or two; ``max``: the runners-up). A
model warm-started on it computes the answer, and samples a slip about as often as the corpus
shows one (hard questions more than easy ones): the state RL with verifiable rewards starts
from on real models, and one RL can improve by rewarding the correct result over the slips.
With ``num_slips_* = 0`` the corpus is the reference solutions only. ``column`` questions
solved column by column (``stepwise_fraction``) have no slips.

Files written by :func:`make_tiny_task` in its output directory:

* ``train.parquet`` / ``val.parquet``: DAPO schema (``prompt`` chat messages,
  ``reward_model.ground_truth``, ``extra_info.index``); the RL training questions are the
  corpus' questions, or with ``num_rl_train`` questions of their own that the corpus does not
  hold; validation questions are disjoint from both modulo the task's symmetry (commutativity
  of ``+``, the order of ``max``'s numbers);
* ``train_solutions.jsonl``: ``{"question", "solution"}`` per line, the warm-start corpus above.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rlep_megatron.staging import write_file_atomic
from rlep_megatron.data.schema import PromptRows, rows_to_table, write_table_atomic

logger = logging.getLogger(__name__)

WARM_START_RECORD = "warm_start.json"


@dataclass(frozen=True)
class TaskKind:
    """How one kind of tiny question is drawn, asked, solved and slipped."""

    draw: Callable[[random.Random, int], tuple]
    question: Callable[[tuple], str]
    answer: Callable[[tuple], int]
    worked: Callable[[tuple, int], str]
    """the solution text for a question and a result (correct or slipped)"""
    is_hard: Callable[[tuple], bool]
    slips: Callable[[tuple], list[int]]
    """wrong results a model plausibly writes, most plausible first"""
    num_questions: Callable[[int], int]
    canonical: Callable[[tuple], tuple]
    """one representative of the question's symmetry class (``3 + 5`` and ``5 + 3`` are one
    question to a model that has learnt either; so are the orders of ``max``'s numbers)"""
    stepwise: Optional[Callable[[tuple, int], str]] = None
    """the solution written step by step, where the kind has such a form (``column``)"""


def _arith_canonical(key: tuple) -> tuple:
    a, op, b = key
    return (min(a, b), op, max(a, b)) if op == "+" else key


def _arith_value(key: tuple) -> int:
    a, op, b = key
    return a + b if op == "+" else a - b


def _arith_hard(key: tuple) -> bool:
    a, op, b = key
    return a % 10 + b % 10 >= 10 if op == "+" else a % 10 < b % 10


def _arith_slips(key: tuple) -> list[int]:
    value = _arith_value(key)
    # a carry / borrow handled the wrong way, then a units digit off by one
    tens = [value - 10, value + 10] if _arith_hard(key) else [value + 10, value - 10]
    return tens + [value + 1, value - 1, value + 2, value - 2]


def _max_slips(key: tuple) -> list[int]:
    value = max(key)
    runners = sorted({v for v in key if v != value}, reverse=True)
    return runners + [value + 1, value - 1, value + 10, value - 10]


def _column_draw(rng: random.Random, top: int) -> tuple:
    a, op, b = rng.randint(0, top), rng.choice("+-"), rng.randint(0, top)
    return (a, op, b) if op == "+" or a >= b else (b, op, a)


def _column_steps(key: tuple, value: int) -> str:
    """``38 + 45`` -> ``units 8+5=13, tens 3+4+1=8, so 83``: the units column, the tens column
    with the carry (borrow), then the result."""
    a, op, b = key
    (a1, a0), (b1, b0) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        units = a0 + b0
        carry = units // 10
        tens = a1 + b1 + carry
        head = f"units {a0}+{b0}={units}, tens {a1}+{b1}" + ("+1" if carry else "")
    else:
        borrow = int(a0 < b0)
        units = a0 + 10 * borrow - b0
        tens = a1 - b1 - borrow
        head = f"units {a0 + 10 * borrow}-{b0}={units}, tens {a1}-{b1}" + ("-1" if borrow else "")
    return f"{head}={tens}, so {value}\nAnswer: {value}"


TASK_KINDS: dict[str, TaskKind] = {
    "arith": TaskKind(
        draw=lambda rng, top: (rng.randint(0, top), rng.choice("+-"), rng.randint(0, top)),
        question=lambda k: f"Compute {k[0]} {k[1]} {k[2]}.",
        answer=_arith_value,
        worked=lambda k, v: f"{k[0]} {k[1]} {k[2]} = {v}\nAnswer: {v}",
        is_hard=_arith_hard,
        slips=_arith_slips,
        num_questions=lambda top: (top + 1) ** 2 * 2,
        canonical=_arith_canonical,
    ),
    "column": TaskKind(
        draw=_column_draw,
        question=lambda k: f"Compute {k[0]} {k[1]} {k[2]}.",
        answer=_arith_value,
        worked=lambda k, v: f"{k[0]} {k[1]} {k[2]} = {v}\nAnswer: {v}",
        is_hard=_arith_hard,
        slips=_arith_slips,
        num_questions=lambda top: (top + 1) ** 2 + (top + 1) * (top + 2) // 2,
        canonical=_arith_canonical,
        stepwise=_column_steps,
    ),
    "max": TaskKind(
        draw=lambda rng, top: tuple(rng.randint(0, 99) for _ in range(4)),
        question=lambda k: "Largest of " + " ".join(map(str, k)) + ".",
        answer=max,
        worked=lambda k, v: f"Answer: {v}",
        is_hard=lambda k: sorted(k)[-2] // 10 == max(k) // 10,
        slips=_max_slips,
        num_questions=lambda top: 100 ** 4,
        canonical=lambda k: tuple(sorted(k)),
    ),
}


def data_source(kind: str) -> str:
    return f"tiny_{kind}"


def make_tiny_task(out_dir: str, seed: int = 0, num_train: int = 800, num_val: int = 64,
                   max_operand: int = 20, kind: str = "arith", num_slips_easy: int = 0,
                   num_slips_hard: int = 0, num_rl_train: Optional[int] = None,
                   stepwise_fraction: float = 0.0) -> dict[str, str]:
    """Write the task files to ``out_dir``; returns their paths. Same arguments -> same files.

    ``num_train`` questions make the warm-start corpus. ``num_rl_train`` (optional) questions
    make the RL training split instead, drawn apart from the corpus' questions, so that RL
    trains on questions the warm start never saw; without it the RL training split is the
    corpus' questions. Validation questions are disjoint from both modulo the task's symmetry
    (``TaskKind.canonical``: no ``5 + 3`` when ``3 + 5`` is trained), and so are the RL
    questions from the corpus'. ``max_operand`` bounds the ``arith`` operands;
    ``num_slips_easy`` / ``num_slips_hard`` are the slipped solutions per easy / hard corpus
    question."""
    if kind not in TASK_KINDS:
        raise ValueError(f"unknown tiny task kind {kind!r}; choose one of {sorted(TASK_KINDS)}")
    if num_train < 1 or num_val < 1 or (num_rl_train is not None and num_rl_train < 1):
        raise ValueError("num_train, num_val and num_rl_train must be >= 1")
    if num_slips_easy < 0 or num_slips_hard < 0:
        raise ValueError("num_slips_easy and num_slips_hard must be >= 0")
    task = TASK_KINDS[kind]
    if not 0.0 <= stepwise_fraction <= 1.0:
        raise ValueError(f"stepwise_fraction must be in [0, 1], got {stepwise_fraction}")
    if stepwise_fraction and task.stepwise is None:
        raise ValueError(f"the {kind} task has no step-by-step solutions; stepwise_fraction "
                         "needs kind='column'")
    space = task.num_questions(max_operand)
    wanted = num_train + num_val + (num_rl_train or 0)
    if wanted > space:
        raise ValueError(f"only {space} distinct {kind} questions with max_operand="
                         f"{max_operand}; asked for {wanted}")
    rng = random.Random(seed)
    seen: set[tuple] = set()
    corpus_keys: list[tuple] = []
    while len(corpus_keys) < num_train:  # the first num_train distinct questions drawn
        key = task.draw(rng, max_operand)
        if key not in seen:
            seen.add(key)
            corpus_keys.append(key)
    taken = {task.canonical(k) for k in corpus_keys}

    def draw_apart(count: int, split: str) -> list[tuple]:
        """``count`` questions of symmetry classes not taken yet (one per class)."""
        keys: list[tuple] = []
        misses = 0
        while len(keys) < count:
            key = task.draw(rng, max_operand)
            if task.canonical(key) in taken:
                misses += 1
                if misses > 10_000 + 100 * count:
                    raise ValueError(
                        f"cannot draw {count} {split} questions apart from the other splits "
                        f"modulo symmetry with max_operand={max_operand} (only {len(keys)} "
                        f"found): raise max_operand or ask for fewer questions")
                continue
            taken.add(task.canonical(key))
            keys.append(key)
        return keys

    rl_keys = corpus_keys if num_rl_train is None else draw_apart(num_rl_train, "RL training")
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.parquet"),
             "val": os.path.join(out_dir, "val.parquet"),
             "solutions": os.path.join(out_dir, "train_solutions.jsonl")}
    splits = {"train": rl_keys, "val": draw_apart(num_val, "validation")}
    for split, keys in splits.items():
        rows = PromptRows()
        for i, key in enumerate(keys):
            rows.data_source.append(data_source(kind))
            rows.messages.append([{"role": "user", "content": task.question(key)}])
            rows.ground_truth.append(str(task.answer(key)))
            rows.candidates.append(None)
            rows.index.append(f"{split}-{i}")
        write_table_atomic(rows_to_table(rows), paths[split])
    corpus = []
    style_rng = random.Random(seed + 2)  # its own stream: the questions do not depend on it
    for key in corpus_keys:
        value = task.answer(key)
        count = num_slips_hard if task.is_hard(key) else num_slips_easy
        wrong = [v for v in dict.fromkeys(task.slips(key)) if v != value][:count]
        if style_rng.random() < stepwise_fraction:  # worked column by column: no slips
            corpus.append({"question": task.question(key),
                           "solution": task.stepwise(key, value)})
            continue
        corpus += [{"question": task.question(key), "solution": task.worked(key, v)}
                   for v in [value] + wrong]
    random.Random(seed + 1).shuffle(corpus)
    write_file_atomic(paths["solutions"], "".join(json.dumps(line) + "\n" for line in corpus))
    return paths


def warm_start(model_dir: str, solutions_path: str, steps: int, lr: float = 1e-3,
               batch_size: int = 32, seed: int = 0, eval_parquet: Optional[str] = None,
               eval_questions: int = 64, warmup_steps: int = 50,
               show_progress: bool = True,
               extra_record: Optional[dict] = None, report_every: int = 0,
               report: Optional[Callable[[int, float, Any, Any], None]] = None
               ) -> dict[str, float]:
    """Supervised steps on reference solutions (loss on the response tokens, EOS included),
    written back to ``model_dir`` atomically with a ``warm_start.json`` record (settings,
    results, ``extra_record``). Returns ``{"loss", "accuracy"}`` where accuracy is
    greedy-decoding accuracy on ``eval_parquet`` (NaN without it).

    Schedule: linear warm-up over ``warmup_steps`` then cosine decay to 0 at ``steps``, AdamW
    betas (0.9, 0.98), grad-norm clip 1.0. A constant 3e-3 without warm-up or clipping left the
    tiny model unable to copy digits from its prompt (loss stalled near 0.5-0.6): the early
    large updates saturate it before attention learns to look back at the question. With
    warm-up and clipping, a peak of 3e-3 still held the two-digit ``column`` corpus on a plateau
    (loss about 0.2, almost no question answered right) until the cosine had brought the rate
    down, a point that moved with the seed and the CPU's floats (on one CPU the demo's warm
    start ended still on it: 11% greedy accuracy where another CPU reached 66%); at 1e-3 it
    leaves the plateau between steps 500 and 1000 (seeds 0 and 1; ``bench/warm_start_curve.py``
    prints the curves). The reported ``loss`` is the mean of the last 50 steps' batch losses.

    ``report(step, loss, model, tokenizer)`` is called every ``report_every`` steps and after
    the last, with the model in eval mode (back in train mode afterwards)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps < 1:
        raise ValueError(f"warm-start steps must be >= 1, got {steps}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    encoded = _encode_solutions(tokenizer, solutions_path)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, min(warmup_steps, steps))

    def lr_factor(i: int) -> float:
        return min(1.0, (i + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * i / steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    from rlep_megatron.metrics import progress

    model.train()
    recent: list[float] = []
    for step in progress(range(steps), desc="warm start", unit="step", enabled=show_progress):
        batch = rng.sample(encoded, min(batch_size, len(encoded)))
        length = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((len(batch), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        for row, (p, r) in enumerate(batch):
            ids[row, :len(p) + len(r)] = torch.tensor(p + r)
            labels[row, len(p):len(p) + len(r)] = torch.tensor(r)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        recent = recent[-49:] + [float(loss.detach())]
        done = step + 1
        if report is not None and ((report_every and done % report_every == 0)
                                   or done == steps):
            model.eval()
            report(done, sum(recent) / len(recent), model, tokenizer)
            model.train()
    loss_value = sum(recent) / len(recent)
    model.eval()
    accuracy = float("nan")
    # decode as far as the longest reference solution (and its EOS) plus a margin: a fixed
    # budget shorter than the task's solutions would score every answer as wrong
    budget = max(len(r) for _, r in encoded) + 8
    if eval_parquet:
        accuracy = greedy_accuracy(model, tokenizer, eval_parquet, eval_questions,
                                   max_new_tokens=budget)
    result = {"loss": loss_value, "accuracy": accuracy}
    record = {"pretrain_steps": steps, "lr": lr, "batch_size": batch_size, "seed": seed,
              "greedy_max_new_tokens": budget,
              "solutions": os.path.relpath(solutions_path, model_dir),  # from the model's dir
              **result, **(extra_record or {})}
    _write_warm_started(model, model_dir, record)
    return result


def _encode_solutions(tokenizer, solutions_path: str) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, solution ids + EOS)`` of every line of ``solutions_path``."""
    encoded = []
    for line in open(solutions_path):
        ex = json.loads(line)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ex["question"]}],
                                               tokenize=False, add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(ex["solution"], add_special_tokens=False)["input_ids"]
        encoded.append((p_ids, r_ids + [tokenizer.eos_token_id]))
    return encoded


def _write_warm_started(model, model_dir: str, record: dict) -> None:
    """The trained weights over ``model_dir``'s (its other files kept), with the record, in one
    atomic replacement."""
    from rlep_megatron.staging import staged_output

    with staged_output(model_dir, replace_existing=True) as staging:
        for name in os.listdir(model_dir):
            if not name.endswith(".safetensors") and name != WARM_START_RECORD:
                src = os.path.join(model_dir, name)
                if os.path.isfile(src):
                    with open(src, "rb") as fin, open(os.path.join(staging, name), "wb") as fout:
                        fout.write(fin.read())
        model.save_pretrained(staging, safe_serialization=True)
        with open(os.path.join(staging, WARM_START_RECORD), "w") as f:
            json.dump(record, f, indent=1)


def greedy_accuracy(model, tokenizer, parquet: str, limit: int = 64,
                    max_new_tokens: int = 24) -> float:
    """Fraction of the first ``limit`` questions answered correctly with greedy decoding of at
    most ``max_new_tokens`` (:func:`warm_start` passes its corpus' longest solution + 8)."""
    import torch

    from rlep_megatron.data.schema import read_prompt_file
    from rlep_megatron.reward import compute_score

    rows = read_prompt_file(parquet)
    correct = 0
    count = min(limit, len(rows))
    for row in range(count):
        prompt = tokenizer.apply_chat_template(rows.messages[row], tokenize=False,
                                               add_generation_prompt=True)
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        correct += bool(compute_score(rows.data_source[row], text, rows.ground_truth[row])["acc"])
    return correct / max(count, 1)
