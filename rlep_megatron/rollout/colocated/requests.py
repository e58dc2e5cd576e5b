"""The rollout engine driven request by request (add / step / abort), for one replica.

Each fresh response is its own vLLM request (``n = 1``, seeded ``request_seed(...) + j`` as
vLLM seeds the j-th sample of an ``n``-sample request, so with unchanged weights the tokens are
those of :meth:`RolloutEngine.generate`). Its tokens, their log-probs and the policy version
that sampled each are accumulated here from vLLM's per-step deltas, so a request can leave the
engine before a weight update and come back after it:

- ``resume``: the request is aborted and re-added with its prompt plus the tokens it has so far
  as the new prompt (the KV cache is recomputed under the new weights; no stale cache is ever
  attended), asking for the tokens it has left; the tokens it had keep their version and
  log-prob.
- ``restart``: the request is aborted and its tokens dropped; it starts over under the new
  weights with its original seed.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

from rlep_megatron import faults
from rlep_megatron.rollout.requests import Pending, continuation_seed, take_finished
from rlep_megatron.rollout.response import Response


class EngineRequests:
    """This replica's fresh requests in flight on ``engine`` (a
    :class:`~rlep_megatron.rollout.colocated.engine.RolloutEngine`)."""

    _ids = itertools.count()

    def __init__(self, engine, cfg):
        self.engine, self.cfg = engine, cfg
        self.rank = engine.rank
        self.pending: dict[tuple[int, int, int], Pending] = {}
        self.in_engine: dict[str, Pending] = {}
        self.version = 0
        self.paused = False
        self.step_log: list[tuple[int, float]] = []  # (requests running, seconds) per step

    def _params(self, max_tokens: int, seed: int):
        from vllm.sampling_params import RequestOutputKind

        cfg = self.cfg
        params = self.engine.sampling_params(1, cfg.temperature, cfg.top_p, cfg.top_k,
                                             max_tokens, seed)
        params.output_kind = RequestOutputKind.DELTA  # each step's new tokens only
        return params

    def _add(self, item: Pending) -> None:
        left = self.cfg.max_response_tokens - len(item.token_ids)
        seed = item.seed if not item.token_ids else continuation_seed(item.seed,
                                                                      len(item.token_ids))
        item.request_id = f"rlep-{next(self._ids)}"
        self.engine.llm.llm_engine.add_request(
            item.request_id, {"prompt_token_ids": item.prompt + item.token_ids},
            self._params(left, seed), lora_request=self.engine.lora_request)
        self.in_engine[item.request_id] = item

    def submit(self, key: tuple[int, int, int], prompt: list[int], seed: int) -> None:
        """Start one fresh response under the current version."""
        item = Pending(key, list(prompt), seed)
        self.pending[key] = item
        if not self.paused:
            self._add(item)

    def step(self) -> None:
        """One engine step; its new tokens go to their requests."""
        faults.check("engine_step", self.rank)
        running = len(self.in_engine)
        started = time.perf_counter()
        for output in self.engine.llm.llm_engine.step():
            item = self.in_engine.get(output.request_id)
            if item is None:
                continue
            completion = output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = list(completion.logprobs.logprobs) if completion.logprobs else []
            if len(logprobs) != len(token_ids):
                raise RuntimeError("vLLM's log-prob entries are not those of the sampled tokens")
            item.add_tokens(token_ids, logprobs, self.version)
            if output.finished:
                item.finish_reason = completion.finish_reason or "length"
                item.request_id = None
                del self.in_engine[output.request_id]
        self.step_log.append((running, time.perf_counter() - started))

    def rollout_metrics(self) -> dict[str, float]:
        """Since the last call: the share of engine time spent with at most a quarter of the
        largest number of requests running (the long tail), and the engine steps taken."""
        log, self.step_log = self.step_log, []
        if not log:
            return {}
        peak = max(running for running, _ in log)
        total = sum(seconds for _, seconds in log)
        tail = sum(seconds for running, seconds in log if running <= peak / 4)
        return {"rollout/long_tail_time_frac": tail / total if total > 0 else 0.0,
                "rollout/engine_steps": float(len(log))}

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step the engine until ``done()``; a request the engine dropped is an error, not a
        hang."""
        self.engine.check_ready()
        while not done():
            if not self.in_engine:
                raise RuntimeError("the rollout engine has no request left running, yet a "
                                   "batch waits for responses")
            self.step()

    def pause(self, carry_over: str) -> None:
        """Before a weight update: every running request leaves the engine, its tokens kept
        (``resume``) or dropped (``restart``)."""
        if self.in_engine:
            self.engine.llm.llm_engine.abort_request(list(self.in_engine))
        for item in self.in_engine.values():
            item.request_id = None
            if carry_over == "restart":
                item.token_ids, item.logprobs, item.versions = [], [], []
        self.in_engine = {}
        self.paused = True

    def resume(self, version: int) -> None:
        """After the weights became ``version``: the unfinished requests come back, in the
        order they were submitted."""
        self.version, self.paused = version, False
        for item in self.pending.values():
            if item.finish_reason is None and item.request_id is None:
                self._add(item)

    def finished(self, step: int) -> bool:
        return all(item.finish_reason is not None for key, item in self.pending.items()
                   if key[0] == step)

    def take(self, step: int, tokenizer) -> list[list[Response]]:
        return take_finished(self.pending, step, tokenizer)
