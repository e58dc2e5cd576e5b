"""``rlep collect``: build the experience pool (docs/ALGORITHM.md section 1), which the reference code
never released.

Load a checkpoint (HF directory or training checkpoint), deduplicate the training questions,
sample ``collect.num_samples_per_prompt`` answers per question (T, top-p from the config; the
response budget of the training recipe, ``rollout.max_response_tokens``), score them, keep the
verified-correct ones (every correct sample in sampling order, as the paper keeps them, so a
common answer is replayed as often as the model wrote it; ``collect.distinct_texts`` keeps one
copy of each text instead) and keep questions with at least ``collect.min_correct`` correct
samples (duplicate texts count: the spec counts correct answers).
Output: the training parquet with ``reward_model.candidates`` (only the kept questions) and
``<output>.stats.json``.

The questions are cut into ``collect.num_shards`` shards; each finished shard is written (by
rank 0, atomically) to ``<output>.shards/shard_XXXXX.json`` and skipped after a restart. The
pool file appears only when every shard is done.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Optional

from rlep_megatron import distributed, faults
from rlep_megatron.staging import write_file_atomic

logger = logging.getLogger(__name__)

SHARD_FORMAT = 4


def correct_indices(texts: list[str], correct: list[bool], distinct: bool) -> list[int]:
    """The samples of one question that go into the pool, by index: the correct ones in
    sampling order, duplicates kept unless ``distinct`` (then the first of equal texts); the
    question's count of correct samples counts every duplicate."""
    kept, seen = [], set()
    for index, (text, ok) in enumerate(zip(texts, correct)):
        if ok and not (distinct and text in seen):
            kept.append(index)
            seen.add(text)
    return kept


def checkpoint_version(checkpoint: str) -> Optional[int]:
    """The training step of a training checkpoint (its policy version); ``None`` for an HF
    directory."""
    meta = os.path.join(checkpoint, "meta.json")
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        return int(json.load(f)["step"])


def _shard_ranges(num_questions: int, num_shards: int) -> list[range]:
    shards = min(num_shards, num_questions)
    return [range(i * num_questions // shards, (i + 1) * num_questions // shards)
            for i in range(shards)]


def _job_signature(cfg, checkpoint: str, rows) -> str:
    """Identity of a collection job: a restart may only reuse shards of the same job."""
    digest = hashlib.sha256()
    c = cfg.collect
    # SHARD_FORMAT: shards of an older format (distinct texts only) are another job
    digest.update(json.dumps([os.path.abspath(checkpoint), c.num_samples_per_prompt,
                              c.temperature, c.top_p, cfg.rollout.max_response_tokens,
                              c.num_shards, cfg.trainer.seed, len(rows), c.distinct_texts,
                              c.save_behaviour, SHARD_FORMAT]).encode())
    for row in range(len(rows)):
        digest.update(rows.prompt_key(row).encode())
    return digest.hexdigest()[:16]


def _sample_shard(cfg, engine, scorer, tokenizer, rows, indices, number: int,
                  version: Optional[int]) -> tuple[list, list, list]:
    """One shard's questions sampled and scored: per question its correct texts (sampling
    order), how many of its samples were correct, and the kept answers' behaviour records."""
    from rlep_megatron.data.prompts import tokenize_prompt
    from rlep_megatron.distributed import map_across_ranks
    from rlep_megatron.reward.pool import ScoreRequest

    c = cfg.collect
    prompts = [tokenize_prompt(tokenizer, rows.messages[r],
                               cfg.data.max_prompt_tokens).token_ids for r in indices]
    groups = engine.generate(prompts, n=c.num_samples_per_prompt,
                             temperature=c.temperature, top_p=c.top_p, top_k=-1,
                             max_tokens=cfg.rollout.max_response_tokens,
                             seed=cfg.trainer.seed * 1_000_003 + number)
    requests = [ScoreRequest(rows.data_source[r], resp.text, rows.ground_truth[r])
                for r, responses in zip(indices, groups) for resp in responses]
    results = iter(map_across_ranks(scorer.score, requests))
    # per question: its correct texts (sampling order) and how many of its samples
    # were correct; min_correct counts the latter (docs/ALGORITHM.md section 1)
    correct, counts, behaviour = [], [], []
    for responses in groups:
        texts = [resp.text for resp in responses]
        flags = [bool(next(results)["acc"]) for _ in responses]
        kept = correct_indices(texts, flags, c.distinct_texts)
        correct.append([texts[i] for i in kept])
        counts.append(sum(flags))
        # what the sampling policy gave each kept answer: replay.correction's input
        behaviour.append([{"token_ids": responses[i].token_ids,
                           "logprobs": responses[i].logprobs, "version": version}
                          if c.save_behaviour else None for i in kept])
    return correct, counts, behaviour


def _write_pool(cfg, rows, shard_dir: str, num_shards: int, out: str, checkpoint: str,
                tokenizer) -> None:
    """The finished shards merged into the pool at ``out`` (rank 0), the shards removed."""
    from rlep_megatron.replay.writer import pool_rows, write_pool

    c = cfg.collect
    candidates: list[list[str]] = [[] for _ in range(len(rows))]
    behaviour: list[list] = [[] for _ in range(len(rows))]
    correct_counts = [0] * len(rows)
    for number in range(num_shards):
        with open(os.path.join(shard_dir, f"shard_{number:05d}.json")) as f:
            shard = json.load(f)
        for row, texts, count, entries in zip(shard["rows"], shard["correct"],
                                              shard["correct_counts"],
                                              shard["behaviour"]):
            candidates[row], correct_counts[row], behaviour[row] = texts, count, entries
    num_correct = sum(correct_counts)
    pool = pool_rows(rows, candidates, min_correct=c.min_correct,
                     correct_counts=correct_counts, behaviour=behaviour)
    stats = write_pool(pool, out, tokenizer=tokenizer, extra={
        "training_questions": len(rows), "samples_per_question": c.num_samples_per_prompt,
        "min_correct": c.min_correct, "temperature": c.temperature, "top_p": c.top_p,
        # relative to the pool's directory (the run's, by default)
        "checkpoint": os.path.relpath(checkpoint, os.path.dirname(os.path.abspath(out))),
        "sample_accuracy": num_correct / max(1, len(rows) * c.num_samples_per_prompt)})
    shutil.rmtree(shard_dir, ignore_errors=True)
    logger.info("wrote pool %s: %s", out, stats)


def run_collect(cfg, stop_after_shards: Optional[int] = None,
                process_ending: bool = False) -> str:
    """Returns the pool path. ``stop_after_shards`` ends the job early (tests of restarts);
    ``process_ending``: as for :func:`rlep_megatron.rollout.loading.engine_and_scorer`."""
    from rlep_megatron.data.schema import read_prompt_files
    from rlep_megatron.rollout.loading import (checkpoint_kind, engine_and_scorer,
                                                resolve_checkpoint)

    from rlep_megatron.checks import check_run_config

    check_run_config(cfg, "collect")  # model, files, checkpoint: before any model work
    faults.target()  # a malformed RLEP_FAULT_INJECT fails here, not mid-run
    c = cfg.collect
    rows = read_prompt_files(cfg.data.train_files, deduplicate=True)
    from rlep_megatron.reward import check_rewards

    check_rewards({"data.train_files": rows}, cfg.reward.function)
    checkpoint = resolve_checkpoint(c.checkpoint or cfg.model.hf_dir)
    checkpoint_kind(checkpoint)
    version = checkpoint_version(checkpoint)
    out = c.output_file or os.path.join(cfg.trainer.output_dir, "pool.parquet")
    if os.path.exists(out):
        raise FileExistsError(f"pool {out} already exists; remove it or set collect.output_file")
    shard_dir = out + ".shards"
    signature = _job_signature(cfg, checkpoint, rows)
    shards = _shard_ranges(len(rows), c.num_shards)
    with engine_and_scorer(cfg, checkpoint, cfg.trainer.seed, process_ending) as (engine,
                                                                             scorer):
        rank0 = distributed.is_rank0()
        if rank0:
            os.makedirs(shard_dir, exist_ok=True)
            job_file = os.path.join(shard_dir, "job.json")
            if os.path.exists(job_file):
                with open(job_file) as f:
                    if json.load(f).get("signature") != signature:
                        raise ValueError(f"{shard_dir} holds shards of a different collection "
                                         "job (checkpoint, data or sampling settings changed); "
                                         "remove it to start over")
            else:
                write_file_atomic(job_file, json.dumps({"signature": signature,
                                                        "shards": len(shards)}))
        distributed.barrier()
        tokenizer = engine.get_tokenizer()
        done = 0
        for number, indices in enumerate(shards):
            path = os.path.join(shard_dir, f"shard_{number:05d}.json")
            if os.path.exists(path):
                done += 1
                logger.info("shard %d/%d already finished, skipped", number + 1, len(shards))
                continue
            faults.check("shard", distributed.get_rank(), number)
            correct, counts, behaviour = _sample_shard(cfg, engine, scorer, tokenizer, rows,
                                                       indices, number, version)
            if rank0:
                write_file_atomic(path, json.dumps({"rows": list(indices), "correct": correct,
                                                    "correct_counts": counts,
                                                    "behaviour": behaviour}))
            distributed.barrier()
            done += 1
            logger.info("shard %d/%d: %d questions, %d with >= %d correct answers", number + 1,
                        len(shards), len(indices),
                        sum(n >= c.min_correct for n in counts), c.min_correct)
            if stop_after_shards is not None and done >= stop_after_shards:
                logger.warning("stopping after %d shards as asked", done)
                return out
        if rank0:
            _write_pool(cfg, rows, shard_dir, len(shards), out, checkpoint, tokenizer)
        distributed.barrier()
    return out
