"""Evaluation metrics over k sampled answers per question, grouped per ``data_source``
(docs/ALGORITHM.md section 5): ``mean@k``, ``maj@k``, ``best@k`` (bootstrap) and unbiased ``pass@k``.

A question's samples are given as parallel lists of correctness flags and extracted answers.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from math import comb
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class QuestionSamples:
    data_source: str
    correct: Sequence[bool]
    """``[n]`` correctness of each sampled answer."""
    preds: Sequence[str]
    """``[n]`` extracted (normalised) answer of each sample, for majority voting."""


def mean_at_k(correct: Sequence[bool]) -> float:
    """Average accuracy of the samples."""
    return float(np.mean(np.asarray(correct, dtype=np.float64))) if len(correct) else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: ``1 - C(n-c, k) / C(n, k)``."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def maj_at_k(correct: Sequence[bool], preds: Sequence[str]) -> float:
    """1 if the most frequent extracted answer is correct (ties: the earliest to appear)."""
    if not preds:
        return 0.0
    counts = Counter(preds)
    top = max(counts.values())
    winner = next(p for p in preds if counts[p] == top)
    return float(any(ok for ok, p in zip(correct, preds) if p == winner))


def best_at_k(correct: Sequence[bool], k: int, num_bootstrap: int = 1000, seed: int = 0) -> float:
    """Expected best accuracy of k answers drawn with replacement from the n samples,
    estimated with ``num_bootstrap`` resamples."""
    values = np.asarray(correct, dtype=np.float64)
    if values.size == 0:
        return 0.0
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, values.size, size=(num_bootstrap, k))
    return float(values[picks].max(axis=1).mean())


def evaluate_samples(questions: Sequence[QuestionSamples], k: int, num_bootstrap: int = 1000,
                     seed: int = 0) -> dict[str, dict[str, float]]:
    """``{data_source: {"mean@k", "maj@k", "best@k", "pass@k", "num_questions"}}``, each the
    average over that source's questions."""
    per_source: dict[str, list[dict[str, float]]] = defaultdict(list)
    for q in questions:
        if len(q.correct) != len(q.preds):
            raise ValueError("correct and preds must have the same length")
        n, c = len(q.correct), int(sum(bool(x) for x in q.correct))
        per_source[q.data_source].append({
            f"mean@{k}": mean_at_k(q.correct),
            f"maj@{k}": maj_at_k(q.correct, q.preds),
            f"best@{k}": best_at_k(q.correct, k, num_bootstrap, seed),
            f"pass@{k}": pass_at_k(n, c, k),
        })
    report = {}
    for source, rows in sorted(per_source.items()):
        report[source] = {key: float(np.mean([r[key] for r in rows])) for key in rows[0]}
        report[source]["num_questions"] = len(rows)
    return report


def format_table(report: dict[str, dict[str, float]]) -> str:
    """A fixed-width table of an ``evaluate_samples`` report."""
    if not report:
        return "(no questions)"
    metrics = [key for key in next(iter(report.values())) if key != "num_questions"]
    header = ["data_source", "questions"] + metrics
    lines = [header] + [[source, str(int(values["num_questions"]))]
                        + [f"{100 * values[m]:.2f}" for m in metrics]
                        for source, values in report.items()]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in lines)


def evaluate_policy(engine, scorer, rows, k: int, temperature: float, top_p: float,
                    max_tokens: int, max_prompt_tokens: int, seed: int,
                    samples: list | None = None) -> dict[str, dict[str, float]]:
    """Sample ``k`` answers per question of ``rows`` with the rollout engine, score them
    (split over ranks, hard timeouts) and report per ``data_source``. Collective.

    ``samples``, when given, receives one record per question: ``data_source``,
    ``ground_truth``, the ``responses`` texts and their ``acc`` and ``pred``."""
    from rlep_megatron.data.prompts import tokenize_prompt
    from rlep_megatron.distributed import map_across_ranks
    from rlep_megatron.reward.pool import ScoreRequest

    tokenizer = engine.get_tokenizer()
    prompts = [tokenize_prompt(tokenizer, rows.messages[r], max_prompt_tokens).token_ids
               for r in range(len(rows))]
    groups = engine.generate(prompts, n=k, temperature=temperature, top_p=top_p, top_k=-1,
                             max_tokens=max_tokens, seed=seed, routing=False)
    requests = [ScoreRequest(rows.data_source[row], response.text, rows.ground_truth[row])
                for row, responses in enumerate(groups) for response in responses]
    results = iter(map_across_ranks(scorer.score, requests))
    questions = []
    for row, responses in enumerate(groups):
        scored = [next(results) for _ in responses]
        questions.append(QuestionSamples(rows.data_source[row], [bool(s["acc"]) for s in scored],
                                         [str(s["pred"]) for s in scored]))
        if samples is not None:
            samples.append({"data_source": rows.data_source[row],
                            "ground_truth": rows.ground_truth[row],
                            "responses": [r.text for r in responses],
                            "acc": list(questions[-1].correct), "pred": list(questions[-1].preds)})
    return evaluate_samples(questions, k)


def run_eval(cfg, process_ending: bool = False) -> dict[str, dict[str, float]]:
    """``rlep eval``: a checkpoint on the eval files; writes the JSON report with every sample
    (texts, correctness, extracted answers) (rank 0) and prints the table. Returns the
    report. ``process_ending``: as for :func:`rlep_megatron.rollout.loading.engine_and_scorer`."""
    import json
    import os

    from rlep_megatron import distributed
    from rlep_megatron.data.schema import read_prompt_files
    from rlep_megatron.rollout.loading import (checkpoint_kind, engine_and_scorer,
                                                resolve_checkpoint)

    from rlep_megatron.checks import check_run_config

    check_run_config(cfg, "eval")  # model, files, checkpoint: before any model work
    files = cfg.eval.files or cfg.data.val_files
    rows = read_prompt_files(files, deduplicate=True)  # checks the schema before any model work
    from rlep_megatron.reward import check_rewards

    check_rewards({"the eval files": rows}, cfg.reward.function)
    checkpoint = resolve_checkpoint(cfg.eval.checkpoint or cfg.model.hf_dir)
    checkpoint_kind(checkpoint)
    out = cfg.eval.output_file or os.path.join(cfg.trainer.output_dir, "eval.json")
    samples: list[dict] = []
    with engine_and_scorer(cfg, checkpoint, cfg.trainer.seed, process_ending) as (engine,
                                                                             scorer):
        report = evaluate_policy(engine, scorer, rows, cfg.eval.num_samples_per_prompt,
                                 cfg.eval.temperature, cfg.eval.top_p,
                                 cfg.rollout.max_response_tokens, cfg.data.max_prompt_tokens,
                                 cfg.trainer.seed + 7_777_777, samples=samples)
        if distributed.is_rank0():
            from rlep_megatron.staging import write_file_atomic

            # a checkpoint inside the report's directory (a run's own) is recorded relative to it
            here = os.path.dirname(os.path.abspath(out))
            inside = os.path.commonpath([here, os.path.abspath(checkpoint)]) == here
            record = os.path.relpath(checkpoint, here) if inside else checkpoint
            write_file_atomic(out, json.dumps({"checkpoint": record, "files": list(files),
                                               "k": cfg.eval.num_samples_per_prompt,
                                               "report": report, "samples": samples},
                                              indent=1))
            print(format_table(report))
            print(f"wrote {out}")
    return report
