"""The servers' request driver: this trainer's fresh requests in flight, each its own HTTP
request, across steps and weight updates (``rollout.carry_over``)."""
from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from rlep_megatron.rollout.requests import Pending, continuation_seed, take_finished
from rlep_megatron.rollout.response import Response
from rlep_megatron.rollout.servers.client import HEALTH_INTERVAL_S, RolloutServerError

logger = logging.getLogger(__name__)

FINISH_REPORT_S = 300.0  # carry_over=finish: how often a long pause is logged


class ServerRequests:
    """The colocated :class:`~rlep_megatron.rollout.colocated.requests.EngineRequests`'
    interface for servers: this trainer's fresh requests in flight, each its own HTTP request;
    their results arrive on a queue that :meth:`run_until` drains."""

    def __init__(self, engine, cfg):  # engine: the ServerEngine that sends the requests
        self.engine, self.cfg = engine, cfg
        self.pending: dict[tuple[int, int, int], Pending] = {}
        self.in_flight: dict[str, tuple[Pending, int]] = {}  # request id -> (item, server)
        self.results: "queue.Queue" = queue.Queue()
        self.version = 0
        self.paused = False
        self._frozen = False

    # the engine's pieces shared with blocking generation
    def _add(self, item: Pending, server: int) -> None:
        left = self.cfg.max_response_tokens - len(item.token_ids)
        seed = item.seed if not item.token_ids else continuation_seed(item.seed,
                                                                      len(item.token_ids))
        item.request_id = self.engine.request_id()
        self.in_flight[item.request_id] = (item, server)
        self.engine.post_generate(server, item.request_id, item.prompt + item.token_ids, left,
                                  seed, self.version, self.results)

    def submit(self, key: tuple[int, int, int], prompt: list[int], seed: int) -> None:
        item = Pending(key, list(prompt), seed)
        self.pending[key] = item
        if not self.paused:
            self._add(item, self.engine.server_of(key[1]))

    def _apply(self, result) -> None:
        request_id, outcome = result
        entry = self.in_flight.pop(request_id, None)
        if isinstance(outcome, BaseException):
            raise outcome
        if entry is None:
            return
        item, _ = entry
        token_ids, logprobs, spans, finish_reason = outcome
        for version, start, end in spans:
            item.add_tokens(token_ids[start:end], logprobs[start:end], version)
        item.request_id = None
        if finish_reason != "abort":
            item.finish_reason = finish_reason or "length"

    def run_until(self, done: Callable[[], bool]) -> None:
        """Apply results as they arrive until ``done()``; a server that stops answering ends
        the wait with an error (:meth:`ServerEngine.check_alive`)."""
        while not done():
            if not self.in_flight:
                raise RuntimeError("no request is in flight on the rollout servers, yet a "
                                   "batch waits for responses")
            try:
                result = self.results.get(timeout=HEALTH_INTERVAL_S)
            except queue.Empty:
                self.engine.check_alive()
                continue
            self._apply(result)

    def _drain(self, abort: bool) -> None:
        """Until every request in flight has come back. ``abort``: a request that reached a
        paused server after its abort waits in its queue; it is aborted again at each wait
        (an abort of all: vLLM names the generate route's requests itself), and one not back
        within ``max(rollout.server_timeout_s, 60)`` seconds ends the job naming its server.
        Without ``abort`` (``carry_over: finish``) the requests generate to their end, for as
        long as a response takes, while the servers answer their health checks."""
        wait = max(self.engine.timeout_s, 60.0)
        start = time.monotonic()
        deadline, report = start + wait, start + FINISH_REPORT_S
        while self.in_flight:
            try:
                self._apply(self.results.get(timeout=HEALTH_INTERVAL_S))
            except queue.Empty:
                self.engine.check_alive()
                if not abort:
                    now = time.monotonic()
                    if now > report:  # a stall shows in the log
                        report = now + FINISH_REPORT_S
                        logger.warning("carry_over=finish: %d request(s) still generating on "
                                       "%s, %.0f s into the weight update's pause",
                                       len(self.in_flight), ", ".join(self._servers()),
                                       now - start)
                    continue
                self.engine.clients.abort_all()
                if time.monotonic() > deadline:
                    raise RolloutServerError(
                        f"{len(self.in_flight)} request(s) did not come back from "
                        f"{', '.join(self._servers())} within {wait:.0f} s of the weight update's "
                        "pause")

    def _servers(self) -> list[str]:
        """The servers of the requests in flight."""
        return sorted({self.engine.urls[server] for _, server in self.in_flight.values()})

    def pause(self, carry_over: str) -> None:
        """Before a weight update. ``resume`` / ``restart``: the servers abort the requests in
        flight; their tokens so far arrive and are kept (``resume``) or dropped, and the
        requests are submitted again at :meth:`resume`. ``keep``: the requests stay on the
        servers, frozen until :meth:`resume`. ``finish``: the requests in flight finish under
        the old weights first (nothing is cut by the update: reproducible, the update waits)."""
        self.paused = True
        self.engine.epoch += 1  # requests not sent yet stay here (the loop's gate)
        if not self.engine.driver:
            return
        if carry_over == "finish":
            self._drain(abort=False)
        elif carry_over == "keep":
            self.engine.clients.pause("keep")
            self._frozen = True
        else:
            # every request on the servers is aborted; their tokens so far come back, and the
            # servers go on at once (validation may generate before the resume)
            self.engine.clients.pause("abort")
            self._drain(abort=True)
            self.engine.clients.resume()
            if carry_over == "restart":
                for item in self.pending.values():
                    if item.finish_reason is None:
                        item.token_ids, item.logprobs, item.versions = [], [], []

    def resume(self, version: int) -> None:
        """After the weights became ``version``: the servers resume; requests that left come
        back, in the order they were submitted."""
        self.version, self.paused = version, False
        if self._frozen and self.engine.driver:
            self.engine.clients.resume()
            self._frozen = False
        for item in self.pending.values():
            if item.finish_reason is None and item.request_id is None:
                self._add(item, self.engine.server_of(item.key[1]))

    def finished(self, step: int) -> bool:
        return all(item.finish_reason is not None for key, item in self.pending.items()
                   if key[0] == step)

    def rollout_metrics(self) -> dict[str, float]:
        """``timing/server_idle_frac``: the share of the time since the last call in which
        no request of this trainer was running on the servers."""
        return {"timing/server_idle_frac": self.engine.idle.fraction()}

    def take(self, step: int, tokenizer) -> list[list[Response]]:
        return take_finished(self.pending, step, tokenizer)


# ---------------------------------------------------------------------- the engine
