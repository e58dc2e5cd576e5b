"""The tiny default task: integer addition/subtraction questions in the DAPO schema, scored by
the DAPO rule (``data_source = tiny_arith``: the last ``Answer:`` line is compared with the
ground truth), and a warm start of the tiny model on the task's reference solutions so that RL
starts from a low but non-zero accuracy.

Files written by :func:`make_tiny_task` in its output directory:

* ``train.parquet`` / ``val.parquet``: DAPO schema (``prompt`` chat messages,
  ``reward_model.ground_truth``, ``extra_info.index``); validation questions never appear in
  the training split;
* ``train_solutions.jsonl``: ``{"question", "solution"}`` per training row, the reference
  solution ``"a + b = c\\nAnswer: c"`` used by the warm start.
"""
from __future__ import annotations

import json
import logging
import os
import random
from typing import Optional

from rlep_megatron.data.schema import PromptRows, rows_to_table, write_table_atomic

logger = logging.getLogger(__name__)

DATA_SOURCE = "tiny_arith"


def _question(a: int, op: str, b: int) -> str:
    return f"Compute {a} {op} {b}. End with the line Answer: <number>."


def _solution(a: int, op: str, b: int) -> tuple[str, str]:
    value = a + b if op == "+" else a - b
    return f"{a} {op} {b} = {value}\nAnswer: {value}", str(value)


def make_tiny_task(out_dir: str, seed: int = 0, num_train: int = 800, num_val: int = 64,
                   max_operand: int = 20) -> dict[str, str]:
    """Write the task files to ``out_dir``; returns their paths. Same seed -> same files."""
    if num_train < 1 or num_val < 1:
        raise ValueError("num_train and num_val must be >= 1")
    space = (max_operand + 1) ** 2 * 2
    if num_train + num_val > space:
        raise ValueError(f"only {space} distinct questions with max_operand={max_operand}; "
                         f"asked for {num_train + num_val}")
    rng = random.Random(seed)
    seen: set[tuple[int, str, int]] = set()
    items = []
    while len(items) < num_train + num_val:
        key = (rng.randint(0, max_operand), rng.choice("+-"), rng.randint(0, max_operand))
        if key not in seen:
            seen.add(key)
            items.append(key)
    os.makedirs(out_dir, exist_ok=True)
    paths = {"train": os.path.join(out_dir, "train.parquet"),
             "val": os.path.join(out_dir, "val.parquet"),
             "solutions": os.path.join(out_dir, "train_solutions.jsonl")}
    splits = {"train": items[:num_train], "val": items[num_train:]}
    for split, keys in splits.items():
        rows = PromptRows()
        for i, (a, op, b) in enumerate(keys):
            rows.data_source.append(DATA_SOURCE)
            rows.messages.append([{"role": "user", "content": _question(a, op, b)}])
            rows.ground_truth.append(_solution(a, op, b)[1])
            rows.candidates.append(None)
            rows.index.append(f"{split}-{i}")
        write_table_atomic(rows_to_table(rows), paths[split])
    tmp = paths["solutions"] + ".tmp"
    with open(tmp, "w") as f:
        for a, op, b in splits["train"]:
            f.write(json.dumps({"question": _question(a, op, b),
                                "solution": _solution(a, op, b)[0]}) + "\n")
    os.replace(tmp, paths["solutions"])
    return paths


def warm_start(model_dir: str, solutions_path: str, steps: int, lr: float = 3e-3,
               batch_size: int = 32, seed: int = 0, eval_parquet: Optional[str] = None,
               eval_questions: int = 64) -> dict[str, float]:
    """Supervised steps on reference solutions (loss on the response tokens, EOS included),
    written back to ``model_dir`` atomically. Returns ``{"loss", "accuracy"}`` where accuracy is
    greedy-decoding accuracy on ``eval_parquet`` (NaN without it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlep_megatron.checkpoint.staging import staged_output

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = [json.loads(line) for line in open(solutions_path)]
    encoded = []
    for ex in examples:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": ex["question"]}],
                                               tokenize=False, add_generation_prompt=True)
        p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(ex["solution"], add_special_tokens=False)["input_ids"]
        encoded.append((p_ids, r_ids + [tokenizer.eos_token_id]))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_value = float("nan")
    for _ in range(steps):
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
        optimizer.step()
        loss_value = float(loss.detach())
    model.eval()
    accuracy = float("nan")
    if eval_parquet:
        accuracy = greedy_accuracy(model, tokenizer, eval_parquet, eval_questions)
    with staged_output(model_dir, replace_existing=True) as staging:
        for name in os.listdir(model_dir):
            if not name.endswith(".safetensors"):
                src = os.path.join(model_dir, name)
                if os.path.isfile(src):
                    with open(src, "rb") as fin, open(os.path.join(staging, name), "wb") as fout:
                        fout.write(fin.read())
        model.save_pretrained(staging, safe_serialization=True)
    return {"loss": loss_value, "accuracy": accuracy}


def greedy_accuracy(model, tokenizer, parquet: str, limit: int = 64,
                    max_new_tokens: int = 24) -> float:
    """Fraction of the first ``limit`` questions answered correctly with greedy decoding."""
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
