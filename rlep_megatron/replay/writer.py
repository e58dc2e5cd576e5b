"""Writes an experience pool in the RLEP training-file schema and summarises it.

The output is the training rows themselves with ``reward_model.candidates`` filled in (one row
per question), so RLEP's released files and ours are interchangeable. Writes are atomic.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

from rlep_megatron.staging import write_file_atomic
from rlep_megatron.data.schema import PromptRows, rows_to_table, write_table_atomic


def pool_rows(questions: PromptRows, candidates: Sequence[Sequence[str]],
              min_correct: int = 1,
              correct_counts: Optional[Sequence[int]] = None,
              behaviour: Optional[Sequence[Sequence[Optional[dict]]]] = None) -> PromptRows:
    """Rows of ``questions`` with their candidates; questions with fewer than ``min_correct``
    correct answers are dropped (docs/ALGORITHM.md section 1: at least 2). ``correct_counts`` gives
    each question's number of correct samples (duplicate texts included) when ``candidates``
    holds distinct texts; without it every non-empty candidate counts once. ``behaviour``: per
    question, per candidate, ``{"token_ids", "logprobs", "version"}`` of the policy that
    sampled it (written to the pool's optional behaviour columns)."""
    keep = []
    for row, answers in enumerate(candidates):
        entries = behaviour[row] if behaviour is not None else [None] * len(answers)
        pairs = [(a, e) for a, e in zip(answers, entries) if a and a.strip()]
        count = len(pairs) if correct_counts is None else correct_counts[row]
        if pairs and count >= min_correct:
            keep.append((row, pairs))
    out = questions.select([row for row, _ in keep])
    out.candidates = [[a for a, _ in pairs] for _, pairs in keep]
    out.behaviour = [[e for _, e in pairs] for _, pairs in keep]
    return out


def pool_stats(rows: PromptRows, tokenizer=None) -> dict:
    counts = [len(c or []) for c in rows.candidates]
    texts = [t for c in rows.candidates for t in (c or [])]
    stats = {
        "questions": len(rows),
        "answers": sum(counts),
        "answers_per_question_mean": sum(counts) / max(1, len(counts)),
        "answers_per_question_min": min(counts, default=0),
        "answers_per_question_max": max(counts, default=0),
        "answer_chars_mean": sum(len(t) for t in texts) / max(1, len(texts)),
    }
    if tokenizer is not None and texts:
        lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        stats["answer_tokens_mean"] = sum(lengths) / len(lengths)
    return stats


def write_pool(rows: PromptRows, path: str, stats_path: Optional[str] = None,
               tokenizer=None, extra: Optional[dict] = None) -> dict:
    """Write the pool parquet (and a JSON stats summary next to it, with ``extra`` merged in)
    atomically."""
    write_table_atomic(rows_to_table(rows, with_candidates=True), path)
    stats = pool_stats(rows, tokenizer)
    stats.update(extra or {})
    stats_path = stats_path or os.path.splitext(path)[0] + ".stats.json"
    write_file_atomic(stats_path, json.dumps(stats, indent=2, sort_keys=True))
    return stats
