"""The pause before a weight update on rollout servers: with ``carry_over: finish`` the requests
in flight generate to their end under the old weights, however long that takes while the servers
answer their health checks (a long response on a real model takes minutes); with ``resume`` the
aborted requests must come back within ``max(rollout.server_timeout_s, 60)`` seconds. Driven
with a stand-in engine and a clock that jumps 100 s at each look."""
import itertools
import logging
import types

import pytest

from rlep_megatron.config import RolloutConfig
from rlep_megatron.rollout.servers import requests as server_requests
from rlep_megatron.rollout.servers.client import RolloutServerError

pytestmark = pytest.mark.unit


class _Engine:
    """Answers its health checks; the request in flight comes back at the ``back_at``-th."""

    def __init__(self, back_at):
        self.timeout_s, self.urls, self.driver, self.epoch = 60.0, ["http://r0:8000"], True, 0
        self.back_at, self.checks, self.aborts, self.requests = back_at, 0, 0, None
        self.clients = types.SimpleNamespace(abort_all=self._abort, pause=lambda how: None,
                                             resume=lambda: None)

    def _abort(self):
        self.aborts += 1

    def check_alive(self):
        self.checks += 1
        if self.checks == self.back_at:
            (request_id, _), = self.requests.in_flight.items()
            self.requests.results.put((request_id, ([5, 6], [-0.5, -0.25], [(3, 0, 2)],
                                                    "stop")))


def _one_in_flight(monkeypatch, back_at):
    clock = itertools.count(0, 100)
    monkeypatch.setattr(server_requests, "time",
                        types.SimpleNamespace(monotonic=lambda: float(next(clock))))
    monkeypatch.setattr(server_requests, "HEALTH_INTERVAL_S", 0.001)
    engine = _Engine(back_at)
    requests = server_requests.ServerRequests(engine, RolloutConfig(max_response_tokens=8))
    engine.requests = requests
    item = server_requests.Pending((0, 0, 0), [1, 2], seed=7, request_id="r-1")
    requests.pending[item.key] = item
    requests.in_flight["r-1"] = (item, 0)
    requests.version = 3
    return engine, requests, item


def test_finish_waits_for_a_long_response_past_the_abort_deadline(monkeypatch, caplog):
    engine, requests, item = _one_in_flight(monkeypatch, back_at=20)  # 2,000 s on the clock
    with caplog.at_level(logging.WARNING, logger=server_requests.__name__):
        requests.pause("finish")
    assert engine.checks == 20 and engine.aborts == 0 and not requests.in_flight
    assert item.token_ids == [5, 6] and item.versions == [(3, 2)] and item.finish_reason == "stop"
    # the wait shows in the log every FINISH_REPORT_S (300 s), naming the server
    reports = [r.getMessage() for r in caplog.records if "still generating" in r.getMessage()]
    assert len(reports) >= 3 and all("1 request(s) still generating on http://r0:8000" in m
                                     for m in reports), reports


def test_an_aborted_request_not_back_in_time_ends_the_job_naming_its_server(monkeypatch):
    engine, requests, _ = _one_in_flight(monkeypatch, back_at=0)  # never back
    with pytest.raises(RolloutServerError, match=r"1 request\(s\) did not come back from "
                                                 r"http://r0:8000 within 60 s"):
        requests.pause("resume")
    assert engine.aborts >= 1
