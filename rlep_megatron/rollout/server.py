"""Rollout on vLLM servers (``rollout.placement: separate``): stock ``vllm serve`` processes,
started by the job's rollout ranks or by the user (``rollout.server_urls``), driven over HTTP.

- Generation is token in / token out (vLLM's ``/inference/v1/generate``): the prompt goes as
  token ids and the response comes back as token ids with each token's log-prob, so no
  detokenise / re-tokenise round trip changes a sample. Each response is one request with
  its own seed (``request_seed(...) + j``, as the colocated engine seeds the j-th sample), so
  with the same weights a server samples what the colocated engine samples.
- Weights go through vLLM's weight-transfer lifecycle (``/start_weight_update``,
  ``/update_weights`` per bucket, ``/finish_weight_update`` with the policy version as the
  server's weight version): the HF tensors of :class:`~rlep_megatron.weight_sync.WeightStreamer`
  over vLLM's ``nccl`` engine on GPU, or ``rlep_gloo`` (:mod:`rlep_megatron.rollout.gloo_transfer`)
  on the host.
- Around each update, ``/pause`` and ``/resume``: ``rollout.carry_over`` ``resume`` or
  ``restart`` abort the requests in flight (their tokens so far come back and are kept, or
  dropped) and submit them again after the update; ``keep`` freezes them on the server, and
  they continue under the new weights with the KV cache they had. Every token is tagged with
  the version that sampled it: from the server's weight-version spans where it gives them,
  else from the version the request was submitted under.
- Failure: a server that stops answering for ``rollout.server_timeout_s`` ends the trainer
  with an error naming it (a watchdog checks ``/health`` also while the trainer trains); a
  failed request fails the step that waits for it.

One trainer rank (global rank 0) drives the servers and sends the weights; the responses reach
the other trainer ranks through the same gather as the colocated engine's replicas use.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import torch

from rlep_megatron.rollout.engine import merge_gathered, request_seed
from rlep_megatron.rollout.requests import Pending, continuation_seed, take_finished
from rlep_megatron.rollout.response import Response, decode_response
from rlep_megatron.rollout.server_weights import ServerWeights, advertised_address

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
MAX_CONNECTIONS_PER_SERVER = 512  # generate requests open at once (one connection each)


class RolloutServerError(RuntimeError):
    """A rollout server failed, refused a request or stopped answering."""


# ---------------------------------------------------------------------- launching a server


def serve_arguments(model_dir: str, cfg, *, port: int, host: str = "127.0.0.1",
                    dtype: str = "auto", seed: int = 0, max_model_len: int = 4096,
                    cuda: Optional[bool] = None, owns_gpu: bool = False) -> list[str]:
    """The ``vllm serve`` arguments a rollout server needs (``rollout`` config ``cfg``): the
    token-in/out route (``--enable-scale-out``), the weight-transfer backend, the processed
    log-probs the actor compares with, and on the CPU build the settings of the colocated
    engine (:func:`~rlep_megatron.platform.vllm_cpu_engine_settings`). Also needs
    ``VLLM_SERVER_DEV_MODE=1`` in its environment (:func:`serve_environment`)."""
    from rlep_megatron import platform

    cuda = platform.cuda_available() if cuda is None else cuda
    backend = "nccl" if cuda else "rlep_gloo"
    args = ["--model", model_dir, "--host", host, "--port", str(port), "--dtype", dtype,
            "--seed", str(seed), "--max-model-len", str(max_model_len),
            "--tensor-parallel-size", str(cfg.tensor_model_parallel_size),
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--weight-transfer-config", json.dumps({"backend": backend}),
            "--load-format", "dummy", "--disable-uvicorn-access-log"]
    if cfg.server_log_requests:
        args.append("--enable-log-requests")  # INFO lines: serve_environment(log_requests)
    if cuda:  # a rollout rank's server owns its GPU (no actor beside it)
        fraction = cfg.server_gpu_memory_utilization if owns_gpu else cfg.gpu_memory_utilization
        args += ["--gpu-memory-utilization", str(fraction)]
    else:
        args += ["--enforce-eager", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(max(max_model_len, 8192))]
    return args


def serve_environment(threads: Optional[int] = None, log_requests: bool = False
                      ) -> dict[str, str]:
    """The environment of a rollout server: its weight-update and pause routes on
    (``VLLM_SERVER_DEV_MODE``), no hub, the CPU build's KV cache size, ``threads`` CPU
    threads. Without a GPU, a one-rank server runs its model in the engine-core process, as
    vLLM does on a GPU (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the CPU build otherwise adds a
    worker process, which starts in about 10 s more)."""
    from rlep_megatron import platform

    env = dict(os.environ)
    env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not platform.cuda_available():
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if log_requests:  # vLLM logs each request at INFO (the job's default level is WARNING)
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)  # the server is no member of the job's process group
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the server's process before it starts: end it when the process that started it
    ends, even by SIGKILL (Linux's parent-death signal)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setsid()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalServer:
    """A ``vllm serve`` process started here (a rollout rank's, or a test's), which ends with
    this process."""

    def __init__(self, model_dir: str, cfg, *, host: str = "127.0.0.1",
                 advertise: Optional[str] = None, port: Optional[int] = None,
                 log_path: Optional[str] = None, threads: Optional[int] = None, **kwargs):
        self.port = port or free_port(host if host != "0.0.0.0" else "127.0.0.1")
        self.url = f"http://{advertise or host}:{self.port}"
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   *serve_arguments(model_dir, cfg, port=self.port, host=host, **kwargs)]
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(command, env=serve_environment(
                                            threads, cfg.server_log_requests),
                                        stdout=self._log, stderr=subprocess.STDOUT,
                                        preexec_fn=_die_with_parent)

    def log_tail(self, lines: int = 15) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_ready(self, timeout_s: float = 600.0) -> str:
        """Block until the server answers ``/health``; an error with its log's tail if it
        exits first or takes longer than ``timeout_s``."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RolloutServerError(f"the rollout server {self.url} exited with code {code} "
                                         f"while starting:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            time.sleep(0.5)
        raise RolloutServerError(f"the rollout server {self.url} did not start within "
                                 f"{timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


# ---------------------------------------------------------------------- the control plane


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
        return response.json() if response.content else None

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

    def _each(self, call: Callable[[ServerClient, int], None]) -> None:
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
        self._each(lambda c, i: c.init_weight_transfer_engine(
            {**init_info, "rank_offset": offsets[i]}))

    def start_weight_update(self) -> None:
        self._each(lambda c, i: c.start_weight_update())

    def update_weights(self, update_info) -> None:
        self._each(lambda c, i: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: Optional[str] = None) -> None:
        self._each(lambda c, i: c.finish_weight_update(weight_version))

    def pause(self, mode: str) -> None:
        self._each(lambda c, i: c.pause(mode))

    def abort_all(self) -> None:
        self._each(lambda c, i: c.abort_all())

    def resume(self) -> None:
        self._each(lambda c, i: c.resume())

    def reset_prefix_cache(self) -> None:
        self._each(lambda c, i: c.reset_prefix_cache())

    def update_weight_version(self, version: str) -> None:
        self._each(lambda c, i: c.call("POST", "/update_weight_version",
                                        json={"new_version": version}))


# ---------------------------------------------------------------------- generation requests


class _Loop:
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


class ServerRequests:
    """:class:`~rlep_megatron.rollout.requests.EngineRequests`' interface for servers: this
    trainer's fresh requests in flight, each its own HTTP request; their results arrive on a
    queue that :meth:`run_until` drains."""

    _ids = itertools.count()

    def __init__(self, engine: "ServerEngine", cfg):
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
        self.engine._post(server, item.request_id, item.prompt + item.token_ids, left, seed,
                          self.version, self.results)

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
        (an abort of all: vLLM names the generate route's requests itself)."""
        wait = max(self.engine.timeout_s, 60.0)
        deadline = time.monotonic() + wait
        while self.in_flight:
            try:
                self._apply(self.results.get(timeout=HEALTH_INTERVAL_S))
            except queue.Empty:
                self.engine.check_alive()
                if abort:
                    self.engine.clients.abort_all()
                if time.monotonic() > deadline:
                    servers = sorted({self.engine.urls[s] for _, s in self.in_flight.values()})
                    raise RolloutServerError(
                        f"{len(self.in_flight)} request(s) did not come back from "
                        f"{', '.join(servers)} within {wait:.0f} s of the weight update's "
                        "pause")

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


def _parse_choice(choice: dict, submitted_version: int):
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


class ServerHealth:
    """``/health`` of every server: one that has not answered for ``timeout_s`` is an error
    naming it, raised by :meth:`check` (also from a watchdog thread while the trainer
    trains)."""

    def __init__(self, clients: list[ServerClient], timeout_s: float):
        self.clients, self.timeout_s = clients, timeout_s
        self.failure: Optional[str] = None
        self._unhealthy_since: dict[str, float] = {}
        self.closed = threading.Event()

    def check(self) -> None:
        if self.failure:
            raise RolloutServerError(self.failure)
        now = time.monotonic()
        for client in self.clients:
            if client.healthy(min(5.0, self.timeout_s)):
                self._unhealthy_since.pop(client.url, None)
                continue
            since = self._unhealthy_since.setdefault(client.url, now)
            if now - since >= self.timeout_s:
                self.failure = (f"rollout server {client.url} has not answered for "
                                f"{now - since:.0f} s (rollout.server_timeout_s="
                                f"{self.timeout_s:g}): it died or hangs")
                raise RolloutServerError(self.failure)

    def start_watchdog(self) -> None:
        """Until :attr:`closed`: a failed check ends this process with the error."""
        from rlep_megatron import distributed

        def watch():
            while not self.closed.wait(HEALTH_INTERVAL_S):
                try:
                    self.check()
                except RolloutServerError as err:
                    if self.closed.is_set():
                        return
                    logger.error("%s; ending the job", err)
                    distributed.end_process(1)

        threading.Thread(target=watch, daemon=True, name="rlep-rollout-watchdog").start()


class IdleClock:
    """``timing/server_idle_frac``: the share of the time with no generate request of this
    trainer running on the servers (requests counted on the HTTP loop's thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active = 0
        now = time.perf_counter()  # one reading: the idle time cannot exceed the window
        self._idle_s, self._idle_since, self._window_start = 0.0, now, now

    def busy(self, change: int) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._active == 0 and change > 0:
                self._idle_s += now - self._idle_since
            self._active += change
            if self._active == 0:
                self._idle_since = now

    def fraction(self) -> float:
        """The idle share since the last call."""
        with self._lock:
            now = time.perf_counter()
            idle = self._idle_s + (now - self._idle_since if self._active == 0 else 0.0)
            window = now - self._window_start
            self._idle_s, self._window_start = 0.0, now
            if self._active == 0:
                self._idle_since = now
        return idle / window if window > 0 else 0.0


class ServerEngine:
    """The rollout engine interface (:class:`~rlep_megatron.rollout.engine.RolloutEngine`'s)
    over vLLM servers at ``urls``. Global rank 0 talks to the servers; every rank of the
    trainer gets the responses."""

    routing_unavailable = ("the rollout runs on separate vLLM servers, which return no "
                           "per-token routing to replay here")
    capturing_routing = False
    overlaps_training = True  # the servers keep their devices and generate meanwhile
    routing_source = None
    sleep_enabled = False
    extra_sampling: dict = {}  # more vLLM sampling parameters of every request (tests)

    def __init__(self, urls: list[str], model_dir: str, cfg, *, timeout_s: float = 60.0,
                 watchdog: bool = True, owns_rollout_ranks: bool = False):
        from vllm.tokenizers import get_tokenizer

        from rlep_megatron import distributed

        if not urls:
            raise ValueError("rollout.placement=separate needs rollout servers: "
                             "rollout.num_ranks > 0 or rollout.server_urls")
        self.cfg, self.urls = cfg, [u.rstrip("/") for u in urls]
        # the job's own rollout ranks serve until the trainer's shutdown tells them to end
        self.owns_rollout_ranks = owns_rollout_ranks
        self.timeout_s = timeout_s
        self.rank = distributed.get_rank()
        self.driver = self.rank == 0
        multi = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        self.gather_group = distributed.rollout_group(cfg.gather_timeout_minutes) if multi else None
        self.tokenizer = get_tokenizer(model_dir)  # the tokenizer vLLM's engines use
        self.eos_token_id = self.tokenizer.eos_token_id
        self._incomplete_reason: Optional[str] = (
            "the servers start with dummy weights and no weight sync has completed yet")
        self.clients = self.health = self.weights = self._loop = None
        self.epoch = 0  # weight updates begun: a request not sent before one is not sent
        self.idle = IdleClock()
        if self.driver:
            servers = [ServerClient(u, timeout_s=max(300.0, timeout_s)) for u in self.urls]
            for client in servers:
                if not client.healthy(timeout_s):
                    raise RolloutServerError(f"rollout server {client.url} does not answer "
                                             f"/health")
            self.clients = FanOutClient(servers)
            self.health = ServerHealth(servers, timeout_s)
            # a job killed during an update may have left a server paused, or busy
            self.clients.abort_all()
            self.clients.resume()
            self._loop = _Loop(MAX_CONNECTIONS_PER_SERVER * len(servers))
            self.weights = ServerWeights(self.clients, self.urls[0], port=free_port("0.0.0.0"),
                                         timeout_s=timeout_s,
                                         bucket_bytes=cfg.weight_sync_bucket_bytes)
            if watchdog:
                self.health.start_watchdog()
        logger.info("rollout: %d vLLM server(s) at %s", len(self.urls), ", ".join(self.urls))

    def check_alive(self) -> None:
        """Raise if a server has not answered ``/health`` for ``timeout_s``."""
        if self.health is not None:
            self.health.check()

    # ------------------------------------------------------------------ generation

    def get_tokenizer(self):
        return self.tokenizer

    def request_id(self) -> str:
        """A new generate request's id: ``rlep-r<global rank>-<pid>-<n>``, unique within the
        job, and naming the sender in the servers' logs."""
        return f"rlep-r{self.rank}-{os.getpid()}-{next(ServerRequests._ids)}"

    def server_of(self, prompt_index: int) -> int:
        """The server that samples a prompt (all its samples: they share its prefix)."""
        return prompt_index % len(self.urls)

    def share(self, prompts, n: int = 1, max_tokens: int = 0) -> range:
        """Global rank 0 sends every request; the other trainer ranks receive the
        responses."""
        return range(len(prompts)) if self.driver else range(0)

    def requests(self, cfg) -> ServerRequests:
        return ServerRequests(self, cfg)

    def check_ready(self) -> None:
        from rlep_megatron.rollout.engine import IncompleteWeightsError

        if self._incomplete_reason is not None:
            raise IncompleteWeightsError(
                f"refusing to generate: the rollout servers' weights are incomplete because "
                f"{self._incomplete_reason}. Run a complete weight sync first.")

    def _post(self, server: int, request_id: str, token_ids: list[int], max_tokens: int,
              seed: int, version: int, results: "queue.Queue", *, temperature=None,
              top_p=None, top_k=None) -> None:
        cfg = self.cfg
        body = {"request_id": request_id, "token_ids": token_ids,
                "sampling_params": {
                    "max_tokens": max_tokens, "seed": seed, "logprobs": 0,
                    "temperature": cfg.temperature if temperature is None else temperature,
                    "top_p": cfg.top_p if top_p is None else top_p,
                    "top_k": cfg.top_k if top_k is None else top_k,
                    "detokenize": False, **self.extra_sampling},
                # the prefix cache of one version serves that version only: blocks the old
                # weights computed are never reused after an update (also where a reset is
                # refused while frozen requests hold blocks)
                "cache_salt": f"rlep-v{version}"}
        url = f"{self.urls[server]}/inference/v1/generate"

        epoch = self.epoch

        async def call():
            async with self._loop.slots:
                if self.epoch != epoch:  # an update began before this request left: unsent
                    results.put((request_id, ([], [], [], "abort")))
                    return
                await post()

        async def post():
            self.idle.busy(+1)
            try:
                async with self._loop.session.post(url, json=body) as response:
                    text = await response.text()
                    if response.status != 200:
                        raise RolloutServerError(
                            f"rollout server {self.urls[server]} refused a generate request "
                            f"({response.status}): {text[:500]}")
                outcome = _parse_choice(json.loads(text)["choices"][0], version)
            except RolloutServerError as err:
                outcome = err
            except Exception as err:  # connection lost, malformed answer
                outcome = RolloutServerError(f"rollout server {self.urls[server]} failed a "
                                             f"generate request: {type(err).__name__}: {err}")
            self.idle.busy(-1)
            results.put((request_id, outcome))

        self._loop.submit(call())

    def generate(self, prompts: list[list[int]], n: Optional[int] = None, *,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, max_tokens: Optional[int] = None,
                 seed: int = 0, routing: bool = True, version: int = 0
                 ) -> list[list[Response]]:
        """Blocking: ``n`` responses per prompt, on every trainer rank (see
        :meth:`RolloutEngine.generate`); tokens tagged with ``version``."""
        self.check_ready()
        cfg = self.cfg
        n = cfg.num_samples_per_prompt if n is None else n
        max_tokens = cfg.max_response_tokens if max_tokens is None else max_tokens
        local: list[list[Response]] = []
        if self.driver and prompts:
            results: "queue.Queue" = queue.Queue()
            keys = {}
            for index in range(len(prompts)):
                base = request_seed(seed, index, n)
                for j in range(n):
                    request_id = self.request_id()
                    keys[request_id] = (index, j)
                    self._post(self.server_of(index), request_id, list(prompts[index]),
                               max_tokens, base + j, version, results,
                               temperature=temperature, top_p=top_p, top_k=top_k)
            outputs: dict[tuple[int, int], tuple] = {}
            while len(outputs) < len(keys):
                try:
                    request_id, outcome = results.get(timeout=HEALTH_INTERVAL_S)
                except queue.Empty:
                    self.check_alive()
                    continue
                if isinstance(outcome, BaseException):
                    raise outcome
                if outcome[3] == "abort":
                    raise RolloutServerError(
                        "the rollout server aborted a request of a blocking generate call "
                        "(another client paused or aborted it: a server serves one job)")
                outputs[keys[request_id]] = outcome
            for index in range(len(prompts)):
                group = []
                for j in range(n):
                    token_ids, logprobs, spans, finish = outputs[(index, j)]
                    finish = finish or "length"
                    text = decode_response(self.tokenizer, list(prompts[index]),
                                            token_ids[:-1] if finish == "stop" else token_ids)
                    group.append(Response(index, token_ids, logprobs, text, finish,
                                          versions=[(v, e - s) for v, s, e in spans if e > s]))
                local.append(group)
        return self.all_gather(local, len(prompts))

    def all_gather(self, local: list[list[Response]], num_prompts: int
                    ) -> list[list[Response]]:
        if self.gather_group is None:
            return local
        from rlep_megatron import distributed

        return merge_gathered(distributed.all_gather_object(
            local if self.driver else None, group=self.gather_group), num_prompts)

    # ------------------------------------------------------------------ weights

    @property
    def weights_incomplete(self) -> bool:
        return self._incomplete_reason is not None

    def plan_weights(self, plan: list) -> None:
        if self.weights is not None:
            self.weights.plan(plan)

    # the weight-update lifecycle (rlep_megatron.weight_sync.lifecycle): every trainer rank
    # walks the same stream (its gathers are collectives); global rank 0 sends
    def start_weight_update(self) -> None:
        self._incomplete_reason = "a weight sync was started and has not completed"
        if self.weights is not None:
            self.weights.start()

    def send_weights(self, weights) -> None:
        if self.weights is not None:
            self.weights.send(weights)
        else:
            for _ in weights:
                pass

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """The servers' weight version becomes ``version``; their prefix caches are reset."""
        if self.weights is not None:
            self.weights.finish(None if version is None else str(version))
        self._incomplete_reason = None

    def abort_weight_update(self, error: BaseException, tensors_sent: int) -> None:
        self._incomplete_reason = (f"the last weight sync failed after {tensors_sent} "
                                   f"tensors with {type(error).__name__}: {error}")

    # ------------------------------------------------------------------ memory

    @contextlib.contextmanager
    def released(self):
        """Nothing to hand over: the servers keep their devices."""
        yield

    def abandon(self) -> None:
        """After a trainer failure, best effort: requests in flight are aborted and the
        servers resumed, so that a server outliving the job is left usable."""
        if self.clients is None:
            return
        self.health.closed.set()
        for client in self.clients.clients:
            with contextlib.suppress(Exception):
                client.call("POST", "/abort_requests", json={}, timeout=5)
                client.call("POST", "/resume", timeout=5)

    def shutdown(self, process_ending: bool = False) -> None:
        """The transfer group closed on both ends; the job's own rollout ranks told to end.
        Always done, whether the process ends next or not: the servers outlive it."""
        from rlep_megatron import distributed

        if self.clients is not None:
            self.health.closed.set()
            self.weights.close()
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self.owns_rollout_ranks and self.driver:
            distributed.job_store().set(distributed.ROLLOUT_DONE_KEY, "1")


def serve_rollout_rank(cfg, index: int) -> None:
    """A rollout rank of ``rollout.placement: separate`` (``rollout.num_ranks``): start a
    vLLM server on this node, publish its URL to the job, and watch it until the trainers are
    done. A server that exits early ends this rank with its exit code and log, which ends the
    job (torchrun stops the other ranks)."""
    from rlep_megatron import distributed
    from rlep_megatron.models.megatron import resolve_dtype

    rcfg = cfg.rollout
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    log_path = os.path.join(cfg.trainer.output_dir, f"rollout_server_{index}.log")
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    advertise = os.environ.get("RLEP_ADVERTISE_ADDR") or advertised_address(f"http://{master}")
    threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS") else None
    from rlep_megatron import platform

    if platform.cuda_available():  # the GPU of this rank's slot on its node
        local = int(os.environ.get("LOCAL_RANK", "0"))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in
                                                       range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[local]
    server = LocalServer(cfg.model.hf_dir, rcfg, host="0.0.0.0", advertise=advertise,
                         log_path=log_path, threads=threads,
                         dtype=str(resolve_dtype(cfg.model.params_dtype)).split(".")[-1],
                         seed=cfg.trainer.seed, owns_gpu=True,
                         max_model_len=cfg.data.max_prompt_tokens + rcfg.max_response_tokens)
    try:
        url = server.wait_ready()
        logger.info("rollout rank %d: vLLM server %s ready (log: %s)", index, url, log_path)
        distributed.publish_rollout_url(index, url)
        store = distributed.job_store()
        while not store.check([distributed.ROLLOUT_DONE_KEY]):
            code = server.process.poll()
            if code is not None:
                raise RolloutServerError(f"rollout rank {index}: the vLLM server {url} exited "
                                         f"with code {code}:\n{server.log_tail()}")
            time.sleep(1.0)
        logger.info("rollout rank %d: the trainers are done; stopping the server", index)
    finally:
        server.stop()
