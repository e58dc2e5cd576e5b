"""Scores a batch of responses in parallel worker processes with a hard per-answer timeout.

Rule rewards can hang: sympy inside math-verify can spend minutes on a power tower, and
math-verify's own timeout relies on ``signal.alarm``, which does not protect threads. So the
limit is enforced from outside: each worker process publishes, in shared memory, which answer
it is scoring and since when; the parent kills a worker whose current answer has run past
``timeout_s``, records that answer as ``score -1, timed_out``, re-queues the rest of the
worker's chunk and starts a replacement. No hang can stall a step and no process is leaked
(workers are daemonic and ``close()`` joins them). A worker's start and its rules' set-up
(imports) are off an answer's clock but have a limit of their own, :data:`SETUP_LIMIT_S`: one
that hangs past it ends the scoring with an error naming it.

Backends: ``local`` (this class, the default) and ``ray`` (:class:`RayScorerPool`, for spreading
scoring over many CPUs/nodes).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_connections
from typing import Optional, Sequence

from rlep_megatron.reward.rules import (compute_score, load_registry, prepare,
                                        registry_snapshot, scorable)

logger = logging.getLogger(__name__)

TIMED_OUT = {"score": -1.0, "acc": False, "pred": "", "timed_out": True}
# how long a scorer process may take to start and set up the rules it is handed (imports of
# math-verify and sympy, reward.function's module) before scoring ends with an error: a hung
# import is a broken environment, not a bad answer
SETUP_LIMIT_S = 300.0


def _setup_error(who: str, sources, hint: str = "") -> RuntimeError:
    return RuntimeError(
        f"{who} spent over {SETUP_LIMIT_S:.0f} s starting or setting up the reward rules of "
        f"{sorted(set(sources))} (importing math-verify and sympy, or reward.function's "
        f"module){hint}; check that `python -c 'import rlep_megatron.reward, math_verify'` and "
        "your reward module import quickly on this host")


@dataclass(frozen=True)
class ScoreRequest:
    data_source: str
    solution_str: str
    ground_truth: str


def _worker_main(conn, progress) -> None:
    """Worker loop: receive chunks ``(chunk_id, [(index, request), ...])``, reply with results.
    ``progress[0]`` = index being scored, ``progress[1]`` = its start time (0 when idle),
    ``progress[2]`` = since when the worker has been starting or setting up (0 when not)."""
    while True:
        progress[2] = 0.0
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        progress[2] = time.monotonic()
        chunk_id, items, registry = message
        load_registry(registry)  # rules registered in the parent after the worker started
        try:  # imports before the clock (progress[1] is 0: idle); a failure shows in scoring
            prepare(request.data_source for _, request in items)
        except Exception:
            pass
        progress[2] = 0.0
        results = []
        for index, request in items:
            progress[0] = index
            progress[1] = time.monotonic()
            result = compute_score(request.data_source, request.solution_str,
                                   request.ground_truth)
            result["timed_out"] = False
            results.append((index, result))
        progress[1] = 0.0
        conn.send((chunk_id, results))


class _Worker:
    def __init__(self, ctx):
        self.conn, child_conn = ctx.Pipe()
        # the start counts as set-up until the worker first waits for a chunk
        self.progress = ctx.Array("d", [-1.0, 0.0, time.monotonic()], lock=False)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, self.progress),
                                   daemon=True)
        self.process.start()
        child_conn.close()
        self.chunk: Optional[tuple[int, list]] = None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


class ScorerPool:
    """Local worker processes scoring ``ScoreRequest``s with a hard per-answer timeout.

    Usage::

        with ScorerPool(num_workers=2, timeout_s=10) as pool:
            results = pool.score(requests)   # list of {"score", "acc", "pred", "timed_out"}
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, max_chunk: int = 256):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_chunk = max_chunk
        # spawn: the parent holds torch/OpenMP threads, which fork would copy in a bad state.
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx) for _ in range(num_workers)]
        self.num_timeouts = 0
        self._startup_failures = 0

    def score(self, requests: Sequence[ScoreRequest]) -> list[dict]:
        scorable({r.data_source for r in requests})  # fails here, listing the known sources
        results: list[Optional[dict]] = [None] * len(requests)
        chunk = max(1, min(self.max_chunk, -(-len(requests) // (4 * len(self._workers)))))
        pending = [list(enumerate(requests))[i:i + chunk] for i in range(0, len(requests), chunk)]
        pending.reverse()
        registry = registry_snapshot()
        next_chunk_id = 0
        remaining = len(requests)
        while remaining:
            for slot, worker in enumerate(self._workers):
                if worker.chunk is None and pending:
                    items = pending.pop()
                    worker.chunk = (next_chunk_id, items)
                    next_chunk_id += 1
                    worker.conn.send((next_chunk_id - 1, items, registry))
            busy = [w for w in self._workers if w.chunk is not None]
            ready = wait_for_connections([w.conn for w in busy], timeout=0.05)
            for worker in busy:
                if worker.conn in ready:
                    try:
                        _, chunk_results = worker.conn.recv()
                    except (EOFError, OSError):
                        chunk_results = None
                    if chunk_results is not None:
                        for index, result in chunk_results:
                            results[index] = result
                        remaining -= len(chunk_results)
                        worker.chunk = None
                        self._startup_failures = 0
                        continue
                    remaining -= self._replace_crashed(worker, results, pending)
                    continue
                started = worker.progress[1]
                if started and time.monotonic() - started > self.timeout_s:
                    remaining -= self._handle_timeout(worker, results, pending)
                    continue
                setting_up = worker.progress[2]
                if setting_up and time.monotonic() - setting_up > SETUP_LIMIT_S:
                    sources = [request.data_source for _, request in worker.chunk[1]]
                    worker.kill()
                    self.close()
                    raise _setup_error("a reward scorer worker has", sources)
        return results  # type: ignore[return-value]

    def _handle_timeout(self, worker: _Worker, results: list, pending: list) -> int:
        stuck_index = int(worker.progress[0])
        _, items = worker.chunk
        results[stuck_index] = dict(TIMED_OUT)
        self.num_timeouts += 1
        logger.warning("reward: answer %d exceeded %.1fs; scored -1 (timed out), worker "
                       "restarted", stuck_index, self.timeout_s)
        rest = [item for item in items if item[0] != stuck_index]
        if rest:
            pending.append(rest)
        self._restart(worker)
        return 1

    def _replace_crashed(self, worker: _Worker, results: list, pending: list) -> int:
        """A worker died (segfault, OOM kill). The answer it was scoring is scored -1 so a
        crashing input cannot loop forever; the rest of its chunk is re-queued."""
        _, items = worker.chunk
        started = worker.progress[1] > 0 and int(worker.progress[0]) in {i for i, _ in items}
        exitcode = worker.process.exitcode
        if not started:
            # died before scoring anything: a broken worker environment, not a bad input
            self._startup_failures += 1
            if self._startup_failures > 3:
                self.close()
                raise RuntimeError(
                    f"reward scorer workers keep dying at start (exit code {exitcode}); run "
                    "`python -c 'import rlep_megatron.reward'` to see the import error")
            pending.append(items)
            self._restart(worker)
            return 0
        crashed_index = int(worker.progress[0])
        logger.warning("reward: scorer worker died (exit code %s) on answer %d; scored -1",
                       exitcode, crashed_index)
        results[crashed_index] = {"score": -1.0, "acc": False, "pred": "", "timed_out": False,
                                  "crashed": True}
        rest = [item for item in items if item[0] != crashed_index]
        if rest:
            pending.append(rest)
        self._restart(worker)
        return 1

    def _restart(self, worker: _Worker) -> None:
        worker.kill()
        replacement = _Worker(self._ctx)
        index = self._workers.index(worker)
        self._workers[index] = replacement

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
        self._workers = []

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()
        return False


class _RayScorer:
    """One scoring process of the Ray backend (a Ray actor): one answer per call."""

    def ready(self, data_sources=(), registry=None) -> bool:
        """The process is up, this module (the rules) imported, and the set-up of the rules
        of ``data_sources`` done: an answer's clock starts after this returns."""
        if registry is not None:
            load_registry(registry)
            try:  # a failure shows in scoring
                prepare(data_sources)
            except Exception:
                pass
        return True

    def score(self, request: ScoreRequest, registry) -> dict:
        load_registry(registry)  # rules and reward.function of the driver
        result = compute_score(request.data_source, request.solution_str, request.ground_truth)
        result["timed_out"] = False
        return result


class RayScorerPool:
    """Scoring on Ray actors (many CPUs / nodes), one answer at a time each. An answer's clock
    starts when it is handed to an actor that is up, idle and set up for the batch's rules, so
    time spent queued, starting a process or importing a rule's modules never counts; one past
    ``timeout_s`` is scored -1 with ``timed_out``, its actor is killed and a new one
    started."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0, ray_address: str = ""):
        import ray

        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=ray_address or None, num_cpus=None if ray_address else num_workers,
                     include_dashboard=False, log_to_driver=False)
        self._ray = ray
        self._actor_class = ray.remote(num_cpus=1, max_restarts=0)(_RayScorer)
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._idle: list = []
        # the ready() call of an actor not up yet -> (the actor, since when it is starting)
        self._starting: dict = {}
        # every actor has been sent ready() with these data sources (all seen so far) and the
        # registry; new sources send it again to all, before their answers are handed over
        self._batch: tuple = ((), None)
        for _ in range(num_workers):
            self._start_actor()

    def _start_actor(self, actor=None, since: Optional[float] = None) -> None:
        """A new actor, or an idle one given the set-up of the current batch's rules (both
        off the answers' clocks)."""
        if actor is None:
            actor = self._actor_class.remote()
        since = time.monotonic() if since is None else since
        self._starting[actor.ready.remote(*self._batch)] = (actor, since)

    def _collect(self, ref, running: dict, results: list) -> None:
        """A finished call: a started actor joins the idle ones, or an answer's result."""
        if ref in self._starting:
            actor, _ = self._starting.pop(ref)
            try:
                self._ray.get(ref)
            except Exception as err:
                raise RuntimeError(f"a Ray scorer process failed to start or to set up its "
                                   f"rules (reward.function, math-verify): {err}") from err
            self._idle.append(actor)
            return
        index, actor, _ = running.pop(ref)
        try:
            results[index] = self._ray.get(ref)
        except Exception:  # the rule raised: scored as wrong, like the local pool's workers
            results[index] = {"score": -1.0, "acc": False, "pred": "", "timed_out": False}
        self._idle.append(actor)

    def score(self, requests: Sequence[ScoreRequest]) -> list[dict]:
        sources = {r.data_source for r in requests}
        scorable(sources)
        registry = registry_snapshot()
        if not sources <= set(self._batch[0]):
            self._batch = (sorted(sources | set(self._batch[0])), registry)
            # the actors still starting were sent the old set: their calls run in order, so a
            # second ready() returns after both
            for ref, (actor, since) in list(self._starting.items()):
                del self._starting[ref]
                self._start_actor(actor, since)
            while self._idle:
                self._start_actor(self._idle.pop())
        ray = self._ray
        results: list[Optional[dict]] = [None] * len(requests)
        queue = list(range(len(requests)))
        queue.reverse()
        running: dict = {}  # call -> (index, actor, when it was handed over)
        while queue or running:
            while queue and self._idle:
                index, actor = queue.pop(), self._idle.pop()
                call = actor.score.remote(requests[index], registry)
                running[call] = (index, actor, time.monotonic())
            calls = [*running, *self._starting]
            ready, rest = ray.wait(calls, num_returns=1, timeout=0.05)
            if ready and rest:
                more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
                ready += more
            for ref in ready:
                self._collect(ref, running, results)
            now = time.monotonic()
            for ref, (index, actor, started) in list(running.items()):
                if now - started > self.timeout_s:
                    ray.kill(actor, no_restart=True)
                    running.pop(ref)
                    results[index] = dict(TIMED_OUT)
                    self.num_timeouts += 1
                    self._start_actor()
            # nothing can score and every process not yet ready is past the set-up's limit
            if queue and not running and not self._idle and self._starting and \
                    now - max(since for _, since in self._starting.values()) > SETUP_LIMIT_S:
                raise _setup_error(
                    "every Ray scorer process has", self._batch[0],
                    "; or the cluster has no free CPU for reward.num_workers actors of 1 CPU")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        if not self._ray.is_initialized():
            return
        if self._owns_ray:
            self._ray.shutdown()
            return
        for actor in [*self._idle, *(actor for actor, _ in self._starting.values())]:
            self._ray.kill(actor, no_restart=True)
        self._idle, self._starting = [], {}

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()
        return False


def make_scorer_pool(backend: str, num_workers: int, timeout_s: float):
    """The scorer for ``reward.backend``: ``local`` (default) or ``ray``."""
    if backend == "local":
        return ScorerPool(num_workers=num_workers, timeout_s=timeout_s)
    if backend == "ray":
        return RayScorerPool(num_workers=num_workers, timeout_s=timeout_s)
    raise ValueError(f"reward.backend must be 'local' or 'ray', got {backend!r}")
