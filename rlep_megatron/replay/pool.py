"""The experience pool (docs/ALGORITHM.md sections 1, 3.4 and 8): per question, the verified correct
response texts; replay draws; tokenisation of replayed answers.

A pool is read from ``reward_model.candidates`` of DAPO-schema rows (RLEP's released training
file, or our ``collect`` output) and keyed by the prompt (chat messages), so a separate pool file
matches the training rows whatever their order or repetition.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from rlep_megatron.data.schema import PromptRows, prompt_key

logger = logging.getLogger(__name__)

REPLAY = "replay"
FRESH = "fresh"


class ExperiencePool:
    """Question (prompt key) -> list of correct response texts, in stored order."""

    def __init__(self, answers: dict[str, list[str]]):
        self.answers = answers

    @classmethod
    def from_rows(cls, rows: PromptRows) -> "ExperiencePool":
        """Collect ``candidates`` per question. Empty or whitespace-only texts are dropped: a
        replayed empty answer would become a lone EOS scored -1 (docs/ALGORITHM.md section 8)."""
        answers: dict[str, list[str]] = {}
        dropped = 0
        for messages, candidates in zip(rows.messages, rows.candidates):
            if not candidates:
                continue
            key = prompt_key(messages)
            if key in answers:
                continue  # repeated rows of one question carry the same pool
            kept = [text for text in candidates if text and text.strip()]
            dropped += len(candidates) - len(kept)
            if kept:
                answers[key] = kept
        if dropped:
            logger.warning("experience pool: dropped %d empty candidate texts", dropped)
        return cls(answers)

    def __len__(self) -> int:
        return len(self.answers)

    def get(self, messages: Sequence[dict]) -> list[str]:
        return self.answers.get(prompt_key(messages), [])

    def coverage(self, rows: PromptRows) -> float:
        """Fraction of distinct questions of ``rows`` that have a pool."""
        keys = {prompt_key(m) for m in rows.messages}
        return sum(k in self.answers for k in keys) / max(1, len(keys))

    def check_matches(self, rows: PromptRows, source: str) -> None:
        """Fail early when a pool shares no question with the training data."""
        if len(self) and self.coverage(rows) == 0.0:
            raise ValueError(
                f"the experience pool from {source} has {len(self)} questions but none of them "
                "is a question of the training files; was it collected on another dataset or "
                "with a different prompt format?")


class ReplaySampler:
    """Draws M pool answers per prompt occurrence, uniformly without replacement (all of them,
    in stored order, when the pool has <= M); a fresh draw every time a row is used.

    It also counts how many times each pool answer has been replayed (:meth:`record`, called
    for the replays that made it into a training batch). The RNG state and the counts are
    saved in checkpoints, so a resumed run draws the same replays and keeps counting."""

    def __init__(self, pool: ExperiencePool, num_replays_per_prompt: int, seed: int):
        if num_replays_per_prompt < 0:
            raise ValueError(f"num_replays_per_prompt must be >= 0, got {num_replays_per_prompt}")
        self.pool = pool
        self.num_replays_per_prompt = num_replays_per_prompt
        self._rng = np.random.default_rng([seed, 0x5E1A7])
        self._counts: dict[str, list[int]] = {}
        self._num_answers = sum(len(texts) for texts in pool.answers.values())

    def draw_indices(self, messages: Sequence[dict]) -> list[int]:
        """Indices into the question's pool answers (``pool.get(messages)``)."""
        n = len(self.pool.get(messages))
        m = self.num_replays_per_prompt
        if m == 0 or n == 0:
            return []
        if n <= m:
            return list(range(n))
        return [int(i) for i in self._rng.choice(n, size=m, replace=False)]

    def draw(self, messages: Sequence[dict]) -> list[str]:
        answers = self.pool.get(messages)
        return [answers[i] for i in self.draw_indices(messages)]

    def record(self, messages: Sequence[dict], index: int) -> None:
        """Count one replay of answer ``index`` of the question ``messages``."""
        key = prompt_key(messages)
        counts = self._counts.setdefault(key, [0] * len(self.pool.answers[key]))
        counts[index] += 1

    def replay_counts_summary(self) -> dict[str, float]:
        """How often pool answers have been replayed so far: ``times_replayed_mean`` (over every
        answer of the pool), ``times_replayed_max`` and ``answers_replayed_frac`` (answers
        replayed at least once)."""
        flat = [c for counts in self._counts.values() for c in counts]
        total = max(1, self._num_answers)
        return {"times_replayed_mean": sum(flat) / total,
                "times_replayed_max": float(max(flat, default=0)),
                "answers_replayed_frac": sum(c > 0 for c in flat) / total}

    def state_dict(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state,
                "counts": {key: list(c) for key, c in self._counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["bit_generator"]
        self._counts = {key: list(c) for key, c in state.get("counts", {}).items()}


@dataclass(frozen=True)
class ReplayResponse:
    text: str
    token_ids: list[int]
    """``[num_tokens]``: the text tokenised without special tokens, then EOS, truncated to the
    response budget."""
    source: str = REPLAY


def tokenize_replays(texts: Sequence[str], tokenizer, max_response_tokens: int,
                     eos_token_id: Optional[int] = None) -> list[ReplayResponse]:
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id explicitly")
    responses = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        if len(ids) > max_response_tokens:
            # the reward scores what is trained: the text of the kept tokens (no EOS left)
            ids = ids[:max_response_tokens]
            text = tokenizer.decode(ids, skip_special_tokens=False)
        responses.append(ReplayResponse(text=text, token_ids=ids))
    return responses
