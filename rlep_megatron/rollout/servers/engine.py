"""The servers' engine (:class:`ServerEngine`, the engine contract over vLLM servers), the
watchdog of their health and the clock of their idle time."""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import queue
import threading
import time
from typing import Optional

import torch

from rlep_megatron.rollout.requests import merge_gathered, request_seed
from rlep_megatron.rollout.response import Response, decode_response
from rlep_megatron.rollout.servers.client import (HEALTH_INTERVAL_S, FanOutClient, HttpLoop,
                                                  RolloutServerError, ServerClient,
                                                  parse_choice)
from rlep_megatron.rollout.servers.launch import free_port
from rlep_megatron.rollout.servers.requests import ServerRequests
from rlep_megatron.rollout.servers.weights import ServerWeights

logger = logging.getLogger(__name__)


MAX_CONNECTIONS_PER_SERVER = 512  # generate requests open at once (one connection each)
_REQUEST_IDS = itertools.count()


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
    """The rollout engine interface (the colocated
    :class:`~rlep_megatron.rollout.colocated.engine.RolloutEngine`'s) over vLLM servers at ``urls``. Global rank 0 talks to the servers; every rank of the
    trainer gets the responses."""

    routing_unavailable = ("the rollout runs on separate vLLM servers, which return no "
                           "per-token routing to replay here")
    capturing_routing = False
    overlaps_training = True  # the servers keep their devices and generate meanwhile
    receives_weights = True
    routing_source = None
    sleep_enabled = False
    extra_sampling: dict = {}  # more vLLM sampling parameters of every request (tests)

    def __init__(self, urls: list[str], model_dir: str, cfg, *, timeout_s: float = 60.0,
                 watchdog: bool = True, owns_rollout_ranks: bool = False, lora=None):
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
        # lora (rollout.lora_sync=adapter): the servers load the base themselves and each
        # update brings the policy's adapter, which the generate requests name
        self.lora = lora
        self._incomplete_reason: Optional[str] = (
            "the servers start with dummy weights and no weight sync has completed yet"
            if lora is None else "the servers have the base only: no adapter has arrived yet")
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
            self._loop = HttpLoop(MAX_CONNECTIONS_PER_SERVER * len(servers))
            if lora is not None:
                from rlep_megatron.rollout.servers.adapters import ServerAdapters

                self.weights = ServerAdapters(self.clients, lora, model_dir, timeout_s=timeout_s)
            else:
                self.weights = ServerWeights(self.clients, self.urls[0],
                                             port=free_port("0.0.0.0"), timeout_s=timeout_s,
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
        return f"rlep-r{self.rank}-{os.getpid()}-{next(_REQUEST_IDS)}"

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
        from rlep_megatron.rollout.contract import IncompleteWeightsError

        if self._incomplete_reason is not None:
            raise IncompleteWeightsError(
                f"refusing to generate: the rollout servers' weights are incomplete because "
                f"{self._incomplete_reason}. Run a complete weight sync first.")

    def post_generate(self, server: int, request_id: str, token_ids: list[int], max_tokens: int,
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
        if self.lora is not None and self.weights.current is not None:
            body["model"] = self.weights.current  # the policy's adapter
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
                outcome = parse_choice(json.loads(text)["choices"][0], version)
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
                    self.post_generate(self.server_of(index), request_id,
                                       list(prompts[index]), max_tokens, base + j, version,
                                       results, temperature=temperature, top_p=top_p,
                                       top_k=top_k)
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
        if self.lora is not None:
            self.weights.abandon()  # this job's adapters off the servers' hosts
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
