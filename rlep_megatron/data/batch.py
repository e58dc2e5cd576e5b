"""What the rollout side hands the learning side: the scored groups of one training step.

A :class:`StepBatch` holds the step's prompts and, per prompt, its G fresh responses followed by
its M replays (a group of G' = G + M, docs/ALGORITHM.md section 3). Every fresh response carries
the policy versions that sampled its tokens (:attr:`Sample.versions`); version ``v`` is the
weights after ``v`` training steps, so a token sampled by version ``v`` and trained at step
``s`` is ``s - v`` versions stale (0 in the synchronous loop).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

FRESH, REPLAY = "fresh", "replay"


@dataclass
class Sample:
    """One response of a group, fresh or replayed."""

    group: int                   # index of its prompt in the step's batch
    token_ids: list[int]
    text: str
    source: str                  # fresh | replay
    engine_logprobs: Optional[list[float]] = None
    """Fresh: the engine's log-prob of each token under the version that sampled it. Replay:
    the pool's behaviour log-probs, where the pool has them and they align with the replay's
    tokens (``replay.correction``), else ``None``."""
    finish_reason: str = "stop"
    pool_index: Optional[int] = None     # a replay: which answer of its question's pool
    age: Optional[int] = None            # an online replay: steps since it was sampled
    score: float = 0.0
    acc: bool = False
    reward: float = 0.0
    advantage: float = 0.0
    routing: Optional[np.ndarray] = None  # a fresh MoE response: the engine's experts
    routing_key: Optional[tuple[int, int]] = None
    """Where ``routing`` waits until the step that trains it: ``(rank, key)``
    (:mod:`rlep_megatron.actor.routing_store`)."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """Fresh: ``(policy version, number of tokens)`` spans over the response, in order (one
    span unless the response was carried over a weight update)."""

    def token_versions(self) -> list[int]:
        """The policy version of each response token (``[len(token_ids)]``)."""
        return [version for version, count in self.versions for _ in range(count)]


@dataclass
class StepBatch:
    rows: list[int]                          # training-file rows of the groups
    prompts: list[list[int]]                 # prompt token ids per group
    sequences: list[Sample] = field(default_factory=list)
    generation_rounds: int = 1
    generated_tokens: int = 0                # every round's responses, kept or not

    def length(self, seq: Sample) -> int:
        """Tokens of a sequence: its prompt and its response."""
        return len(self.prompts[seq.group]) + len(seq.token_ids)

    def groups(self) -> dict[int, list[Sample]]:
        """The sequences of each group, in batch order."""
        by_group: dict[int, list[Sample]] = {}
        for seq in self.sequences:
            by_group.setdefault(seq.group, []).append(seq)
        return by_group
