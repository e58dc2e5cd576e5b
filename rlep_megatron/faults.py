"""Test-only fault injection through ``RLEP_FAULT_INJECT``, unset in normal runs (where
:func:`check` is one dictionary lookup):

- ``<phase>:<rank>`` makes the trainer raise :class:`InjectedFault` when global rank ``<rank>``
  enters ``<phase>`` (the phase names of the ``timing/<phase>_s`` metrics, and ``engine_step``:
  every step of the request-level rollout engine of ``trainer.max_staleness >= 1``, in the
  middle of a rollout). Used by the tests that check a failure on one rank ends the whole job
  promptly.
- ``kill@<phase>:<step>`` kills the whole job with SIGKILL, as ``kill -9`` of every process
  would, when the first rank enters ``<phase>`` of training step ``<step>`` (the step number of
  ``metrics.jsonl``; ``validate`` and ``checkpoint`` of a step come after its ``train``). Under
  torchrun it kills the launcher, every process it started (with their children: engines,
  rollout servers) and itself; alone, itself and its children. Used by the resume tests, which
  so kill at a chosen point rather than at whatever a poll of the metrics file sees.
  ``kill@shard:<n>`` kills ``rlep collect`` as it starts shard ``<n>``: shards ``0..n-1``
  are finished, none after.
- ``kill@<phase>:<step>:<rank>`` kills only the process of torchrun's global rank ``<rank>``
  (before rollout ranks are split off) at that point, killed by training rank 0 (so once); the
  rest of the job must then end by itself. The killing rank first
  prints ``RLEP_FAULT_INJECT: killed rank <rank> at <unix time>`` to stderr.
- ``hang@<phase>:<step>`` makes every rank that reaches that point wait for ever (how a test
  suite's per-test deadline is shown to work).
"""
from __future__ import annotations

import os
import signal
from typing import Optional

ENV = "RLEP_FAULT_INJECT"
PHASES = ("rollout", "replay", "reward", "advantage", "old_logprob", "train", "weight_sync",
          "validate", "checkpoint", "engine_step", "shard")
KILL, HANG = "kill@", "hang@"
STEP_PHASES = tuple(p for p in PHASES if p != "engine_step")  # those that know their step


class InjectedFault(RuntimeError):
    """The failure asked for by ``RLEP_FAULT_INJECT``."""


def target() -> tuple | None:
    """``("raise", phase, rank)`` or ``("kill", phase, step, rank or None)`` from the
    environment, or None; a malformed value is an error."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    action = next((a for a in (KILL, HANG) if value.startswith(a)), None)
    phase, sep, numbers = value.removeprefix(action or "").partition(":")
    numbers = numbers.split(":")
    phases = STEP_PHASES if action else PHASES
    if (not sep or phase not in phases or len(numbers) > (2 if action == KILL else 1)
            or not all(n.strip().isdigit() for n in numbers)):
        raise ValueError(f"{ENV}={value!r}: expected <phase>:<rank> (raise on that global "
                         f"rank, e.g. train:1), kill@<phase>:<step> (SIGKILL the job at that "
                         f"training step, e.g. kill@train:4), kill@<phase>:<step>:<rank> "
                         f"(SIGKILL that rank alone) or hang@<phase>:<step>, with a phase "
                         f"among {', '.join(phases)}")
    if action is None:
        return "raise", phase, int(numbers[0])
    if action == HANG:
        return "hang", phase, int(numbers[0])
    return "kill", phase, int(numbers[0]), (int(numbers[1]) if len(numbers) > 1 else None)


def check(phase: str, rank: int, step: Optional[int] = None) -> None:
    """Raise :class:`InjectedFault`, or kill the job, if the environment asks for it here."""
    if ENV not in os.environ:
        return
    wanted = target()
    if wanted is None:
        return
    action, wanted_phase, number = wanted[:3]
    if wanted_phase != phase:
        return
    if action == "raise" and number == rank:
        import sys
        import time

        # when it struck, for a test that measures how soon the job ends after it
        print(f"{ENV}: raising in phase {phase} on rank {rank} at {time.time():.3f}",
              file=sys.stderr, flush=True)
        raise InjectedFault(f"{ENV}: injected failure in phase {phase!r} on rank {rank}")
    if action == "hang" and step == number:
        import threading

        threading.Event().wait()
    if action == "kill" and step == number:
        if wanted[3] is None:
            kill_job()
        else:
            kill_rank(wanted[3])


def kill_order(me, under_torchrun: bool) -> list:
    """The processes :func:`kill_job` kills, in order, ``me`` last: under torchrun the launcher
    first, then every process below it that is not a rank (engines, servers, workers), then the
    other ranks. Every rank that reaches the point kills: the ranks may kill each other, and
    only a killing that is first in line reaches everyone else before that can happen (had a
    rank killed its peer before the launcher, and its peer it, the launcher would see its ranks
    die and end with an error report, not be killed)."""
    root = me.parent() if under_torchrun else me
    ranks = [p for p in root.children() if p.pid != me.pid] if under_torchrun else []
    below = [p for p in root.children(recursive=True)
             if p.pid != me.pid and p.pid not in {r.pid for r in ranks}]
    return [*([root] if under_torchrun else []), *below, *ranks, me]


def kill_job() -> None:
    """SIGKILL every process of this job (module doc), this one last."""
    import psutil

    me = psutil.Process()
    *others, _ = kill_order(me, "TORCHELASTIC_RUN_ID" in os.environ)
    for process in others:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def kill_rank(rank: int) -> None:
    """SIGKILL the process of global rank ``rank`` of this torchrun job (this one, or a
    sibling found by its ``RANK``); nothing else."""
    import sys
    import time

    import psutil

    if os.environ.get("RANK", "0") != "0":
        return  # training rank 0 kills (each rank reaching the point would kill once more)
    me = psutil.Process()
    victim = None
    if os.environ.get("RLEP_GLOBAL_RANK", os.environ.get("RANK", "0")) == str(rank):
        victim = me
    else:
        for process in me.parent().children():
            try:
                # a process's start-up environment: torchrun's global rank
                if process.environ().get("RANK") == str(rank):
                    victim = process
            except psutil.Error:
                continue
    if victim is None:
        raise InjectedFault(f"{ENV}: no process of rank {rank} to kill")
    print(f"{ENV}: killed rank {rank} at {time.time():.3f}", file=sys.stderr, flush=True)
    victim.send_signal(signal.SIGKILL)
