"""The HTTP side of the rollout servers: one blocking client per server's routes, a fan-out
over all of them, the asyncio loop that carries the generate requests while the trainer trains,
and the parsing of a generate response."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from typing import Callable, Optional


logger = logging.getLogger(__name__)


HEALTH_INTERVAL_S = 2.0


class RolloutServerError(RuntimeError):
    """A rollout server failed, refused a request or stopped answering."""


class ServerClient:
    """Blocking calls to one server's routes (vLLM's ``VLLMWeightSyncClient`` protocol among
    them); every failure names the server."""

    def __init__(self, url: str, timeout_s: float = 300.0):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method: str, path: str, **kwargs):
        import requests

        try:
            response = requests.request(method, f"{self.url}{path}",
                                        timeout=kwargs.pop("timeout", self.timeout_s), **kwargs)
        except requests.RequestException as err:
            raise RolloutServerError(f"rollout server {self.url} did not answer {path}: "
                                     f"{err}") from err
        if response.status_code != 200:
            raise RolloutServerError(f"rollout server {self.url} answered {path} with "
                                     f"{response.status_code}: {response.text[:500]}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:  # a route answering in plain text (vLLM's adapter routes)
            return response.text

    def healthy(self, timeout_s: float = 5.0) -> bool:
        import requests

        try:
            return requests.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def world_size(self) -> int:
        return int(self.call("GET", "/get_world_size")["world_size"])

    def pause(self, mode: str) -> None:
        self.call("POST", "/pause", params={"mode": mode})

    def abort_all(self) -> None:
        """Abort every request the server holds, queued ones included."""
        self.call("POST", "/abort_requests", json={})

    def resume(self) -> None:
        self.call("POST", "/resume")

    def reset_prefix_cache(self) -> None:
        self.call("POST", "/reset_prefix_cache")

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info) -> None:
        self.call("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.call("POST", "/finish_weight_update",
                   json=None if weight_version is None else {"weight_version": weight_version})


class FanOutClient:
    """Several servers driven as one for the weight lifecycle (each call reaches every server
    at once); the servers' workers get consecutive ranks of the transfer group after the
    trainer's."""

    def __init__(self, clients: list[ServerClient]):
        self.clients = clients
        self.workers = [c.world_size() for c in clients]

    def each(self, call: Callable[[ServerClient, int], None]) -> None:
        errors: list[BaseException] = []

        def run(index):
            try:
                call(self.clients[index], index)
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=run, args=(i,), daemon=True)
                   for i in range(len(self.clients))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = list(itertools.accumulate([1] + self.workers[:-1]))
        self.each(lambda c, i: c.init_weight_transfer_engine(
            {**init_info, "rank_offset": offsets[i]}))

    def start_weight_update(self) -> None:
        self.each(lambda c, i: c.start_weight_update())

    def update_weights(self, update_info) -> None:
        self.each(lambda c, i: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self.each(lambda c, i: c.finish_weight_update(weight_version))

    def pause(self, mode: str) -> None:
        self.each(lambda c, i: c.pause(mode))

    def abort_all(self) -> None:
        self.each(lambda c, i: c.abort_all())

    def resume(self) -> None:
        self.each(lambda c, i: c.resume())

    def reset_prefix_cache(self) -> None:
        self.each(lambda c, i: c.reset_prefix_cache())

    def update_weight_version(self, version: str) -> None:
        self.each(lambda c, i: c.call("POST", "/update_weight_version",
                                        json={"new_version": version}))


class HttpLoop:
    """An asyncio loop on a thread of its own: the HTTP requests in flight while the trainer
    trains."""

    def __init__(self, max_connections: int):
        self.max_connections = max_connections
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="rlep-rollout-http")
        self.thread.start()
        self.session = self.run(self._session())

    async def _session(self):
        import aiohttp

        # a connection per request: a pooled one the server closed while the trainer trained
        # (its keep-alive timeout is seconds) fails the next request sent on it; at most
        # max_connections at once (the rest wait here, not in the servers' queues)
        self.slots = asyncio.Semaphore(self.max_connections)
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(
                                         limit=self.max_connections, force_close=True))

    def run(self, coroutine, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def submit(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.session.close(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def parse_choice(choice: dict, submitted_version: int):
    """``(token_ids, logprobs, spans, finish_reason)`` of a generate response's choice; spans
    ``(version, start, end)`` from the server's weight versions (labels set by
    :meth:`ServerEngine.load_weights`), else the version the request was submitted under."""
    token_ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(entry["logprob"]) for entry in content]
    if len(logprobs) != len(token_ids) or any(
            entry["token_id"] != token for entry, token in zip(content, token_ids)):
        raise RolloutServerError("the rollout server's log-prob entries are not those of the "
                                 "sampled tokens")
    spans = []
    for span in choice.get("weight_versions") or []:
        label = str(span["version"])
        version = int(label) if label.lstrip("-").isdigit() else submitted_version
        spans.append((version, int(span["start"]), int(span["end"])))
    if not spans or spans[-1][2] != len(token_ids) or spans[0][1] != 0:
        spans = [(submitted_version, 0, len(token_ids))]
    return token_ids, logprobs, spans, choice.get("finish_reason")
