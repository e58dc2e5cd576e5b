"""Test-only fault injection: ``RLEP_FAULT_INJECT=<phase>:<rank>`` makes the trainer raise
:class:`InjectedFault` when global rank ``<rank>`` enters ``<phase>`` (the phase names of the
``timing/<phase>_s`` metrics, and ``engine_step``: every step of the request-level rollout
engine of ``trainer.max_staleness >= 1``, in the middle of a rollout). Used by the tests that check a failure on one rank ends the
whole job promptly; unset in normal runs, where :func:`check` is one dictionary lookup.
"""
from __future__ import annotations

import os

ENV = "RLEP_FAULT_INJECT"
PHASES = ("rollout", "replay", "reward", "advantage", "old_logprob", "train", "weight_sync",
          "validate", "checkpoint", "engine_step")


class InjectedFault(RuntimeError):
    """The failure asked for by ``RLEP_FAULT_INJECT``."""


def target() -> tuple[str, int] | None:
    """``(phase, rank)`` from the environment, or None; a malformed value is an error."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    phase, sep, rank = value.partition(":")
    if not sep or phase not in PHASES or not rank.strip().isdigit():
        raise ValueError(f"{ENV}={value!r}: expected <phase>:<rank> with a phase among "
                         f"{', '.join(PHASES)} and a global rank, e.g. train:1")
    return phase, int(rank)


def check(phase: str, rank: int) -> None:
    """Raise :class:`InjectedFault` if the environment asks for a failure here."""
    if ENV not in os.environ:
        return
    wanted = target()
    if wanted == (phase, rank):
        raise InjectedFault(f"{ENV}: injected failure in phase {phase!r} on rank {rank}")
