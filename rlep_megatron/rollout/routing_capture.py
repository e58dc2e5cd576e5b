"""The experts the rollout engine routed each token to (mixture-of-experts models), per request.

vLLM 0.32 returns routed experts (``enable_return_routed_experts``) only from its V2 model runner,
which needs Triton (absent from the CPU build), and under the in-process ``external_launcher``
only the first tensor-parallel rank's scheduler receives them. This module captures them on the
V1 model runner itself, on every rank of the engine: each MoE router of the model calls
:meth:`RoutingCapture.capture` with its top-k expert ids (vLLM's own router hook, bound with
vLLM's own binder), and every engine step's row layout is read where the runner lays the step
out (``_prepare_inputs``: the requests in batch order, how many tokens each is scheduled, and
from which position). Rows are keyed by the request's sampling seed, which is unique per sample
in every ``generate`` call of the colocated
:class:`~rlep_megatron.rollout.colocated.engine.RolloutEngine` (vLLM gives
the ``j``-th sample of a request ``seed + j``).

Prefix caching: a prompt position served from the cache is not computed again, so its experts
come from the request that computed it, found by the hash of the tokens up to that position
(the computation of a position depends on those tokens only). The table is cleared when the
engine's prefix cache is (at every weight sync).

What a request gets (:meth:`RoutingCapture.take`): ``[positions, layers, top-k]`` int16 expert
ids, ``-1`` where nothing was routed (dense layers, and the last sampled token, which the engine
never feeds back). Row ``q`` is the routing of the token at position ``q`` (prompt then
response), the same place the actor's forward routes it.

Needs an engine whose forward runs in Python every step (no CUDA graphs) on the V1 runner: the
CPU backend always is one; a GPU engine is built as one when ``algo.routing_replay=rollout``
asks for the engine's routing with ``rollout.engine_routing=capture``
(:func:`eager_v1_engine_settings`), and otherwise runs as vLLM chooses, without capture.
:func:`capture_supported` says whether a runner can be read.

Where vLLM itself returns the routing (``rollout.engine_routing=output``, the default on a GPU:
:func:`engine_routing_settings`), the engine keeps its V2 runner and CUDA graphs and each
finished completion carries ``routed_experts`` (``[positions, layers, top-k]``, uint8 up to 256
experts, rows of the dense layers 0). vLLM 0.32 gives them to the first tensor-parallel rank
of an in-process engine only, and the other ranks' schedulers then fail: ``output`` is for
engines of one GPU (``rollout.tensor_model_parallel_size=1``), ``auto`` takes ``capture`` for
larger ones.
"""
from __future__ import annotations

from typing import Mapping, Optional

import numpy as np
import torch

CAPTURED_DTYPE = np.int16


V2_RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"


def eager_v1_engine_settings(cuda: bool, environ: Mapping[str, str]
                             ) -> tuple[dict, dict[str, str]]:
    """What a GPU engine needs for its routing to be captured: vLLM's V1 model runner (vLLM
    picks the V2 runner wherever Triton is installed; V2 returns routed experts itself, a path
    not wired here) and eager mode (a replayed CUDA graph does not call the routers' Python
    hook). Returns ``(LLM keyword arguments, environment variables to set while the engine is
    built)``; nothing on CPU, whose engine is both already. The cost is every decode step's
    kernel launches without graphs: slower generation, most for small batches.

    Raises ValueError when ``environ`` asks for the V2 runner (``VLLM_USE_V2_MODEL_RUNNER`` a
    non-zero integer, as vLLM reads it), on any device: the routing would go uncaptured."""
    asked = environ.get(V2_RUNNER_VARIABLE, "").strip()
    if asked and (not asked.lstrip("+-").isdigit() or int(asked) != 0):
        raise ValueError(f"algo.routing_replay=rollout captures the engine's routing on vLLM's "
                         f"V1 model runner, but {V2_RUNNER_VARIABLE}={asked} asks for V2: unset "
                         "it, or use algo.routing_replay=actor (replays the old-log-prob pass's "
                         "routing, with the engine as vLLM builds it)")
    if not cuda:
        return {}, {}
    return {"enforce_eager": True}, {V2_RUNNER_VARIABLE: "0"}


ENGINE_ROUTING = ("auto", "output", "capture")


def engine_routing_settings(mode: str, cuda: bool, environ: Mapping[str, str],
                            tensor_parallel_size: int = 1) -> tuple[dict, dict[str, str], str]:
    """How the engine's routing is obtained (``rollout.engine_routing``): ``(LLM keyword
    arguments, environment variables while the engine is built, source)`` with source
    ``output`` (vLLM's own ``routed_experts``: the V2 runner, CUDA graphs kept; GPU only, the
    default there for an engine of one GPU) or ``capture`` (this module's hook on the V1 runner: eager on a GPU, slower
    decoding; the CPU path). Raises ValueError for a mode the device or the environment rules
    out."""
    if mode not in ENGINE_ROUTING:
        raise ValueError(f"rollout.engine_routing must be one of {', '.join(ENGINE_ROUTING)}, "
                         f"got {mode!r}")
    if mode == "auto":
        mode = "output" if cuda and tensor_parallel_size == 1 else "capture"
    if mode == "capture":
        kwargs, variables = eager_v1_engine_settings(cuda, environ)
        return kwargs, variables, "capture"
    if not cuda:
        raise ValueError("rollout.engine_routing=output needs vLLM's V2 model runner, which "
                         "the CPU build lacks; use auto or capture on CPU")
    if tensor_parallel_size > 1:
        # under the in-process launcher every rank runs a scheduler, and vLLM 0.32's routing
        # connector sends the experts to the first tensor-parallel rank's only: the others'
        # schedulers assert on the missing output
        raise ValueError("rollout.engine_routing=output needs an engine of one GPU "
                         f"(rollout.tensor_model_parallel_size=1, not {tensor_parallel_size}): "
                         "vLLM 0.32 returns the routed experts to the first rank of an "
                         "in-process tensor-parallel engine only; use auto or capture")
    asked = environ.get(V2_RUNNER_VARIABLE, "").strip()
    if asked and asked.lstrip("+-").isdigit() and int(asked) == 0:
        raise ValueError(f"rollout.engine_routing=output reads the routed experts vLLM's V2 "
                         f"model runner returns, but {V2_RUNNER_VARIABLE}=0 asks for V1: unset "
                         "it, or set rollout.engine_routing=capture")
    return {"enable_return_routed_experts": True}, {}, "output"


def capture_supported(runner) -> Optional[str]:
    """``None`` when routing can be captured on this model runner, else why not."""
    prepare = getattr(type(runner), "_prepare_inputs", None)
    if prepare is None or not hasattr(runner, "input_batch"):
        return (f"vLLM's {type(runner).__name__} is not the V1 model runner (the V2 runner, "
                "used on GPUs with Triton, serves routed experts itself; not wired yet; "
                "algo.routing_replay=rollout builds the engine on the V1 runner)")
    mode = getattr(getattr(runner, "compilation_config", None), "cudagraph_mode", None)
    if runner.device.type != "cpu" and mode is not None and str(mode).split(".")[-1] != "NONE":
        return ("the engine replays CUDA graphs, where the routers' Python hook does not run "
                "(engine routing capture needs eager mode, as algo.routing_replay=rollout "
                "builds it)")
    return None


class RoutingCapture:
    """Captures the top-k experts of every MoE layer of a V1-runner vLLM engine (module doc)."""

    def __init__(self, runner, num_layers: int, topk: int):
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            bind_routed_experts_capturer)

        why = capture_supported(runner)
        if why is not None:
            raise RuntimeError(f"cannot capture the engine's expert routing: {why}")
        self.runner = runner
        self.num_layers, self.topk = num_layers, topk
        max_tokens = runner.scheduler_config.max_num_batched_tokens
        self.buffer = torch.full((max_tokens, num_layers, topk), -1, dtype=torch.int16,
                                 device=runner.device)
        self.armed = False
        self._layout: Optional[list[tuple[int, int, int, list[int]]]] = None
        self._rows: dict[int, dict[int, np.ndarray]] = {}   # seed -> position -> [layers, k]
        self._prompts: dict[int, list[int]] = {}             # seed -> prompt token ids
        self.prefixes: dict[int, np.ndarray] = {}            # prefix hash -> [layers, k]
        bind_routed_experts_capturer(runner.get_model(), self)
        original = runner._prepare_inputs

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            self._step(num_scheduled_tokens)
            return original(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        runner._prepare_inputs = prepare_inputs

    # ------------------------------------------------------------------ engine side

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        """vLLM's router hook: one MoE layer's ``[tokens, k]`` top-k ids of this step."""
        if self.armed and self._layout is not None:
            self.buffer[:topk_ids.shape[0], layer] = topk_ids

    def _step(self, num_scheduled_tokens) -> None:
        """A new engine step is laid out: keep the last one's rows, note this one's layout."""
        self._flush()
        if not self.armed:
            return
        batch = self.runner.input_batch
        requests = self.runner.requests
        layout = []
        for index, req_id in enumerate(batch.req_ids[:len(num_scheduled_tokens)]):
            state = requests[req_id]
            seed = state.sampling_params.seed if state.sampling_params is not None else None
            if seed is None:
                raise RuntimeError("engine routing capture needs a seeded request per sample")
            count = int(num_scheduled_tokens[index])
            start = int(batch.num_computed_tokens_cpu[index])
            layout.append((seed, start, count, state.prompt_token_ids))
        self._layout = layout
        self.buffer.fill_(-1)

    def _flush(self) -> None:
        layout, self._layout = self._layout, None
        if not layout:
            return
        rows = self.buffer[:sum(count for _, _, count, _ in layout)].cpu().numpy()
        offset = 0
        for seed, start, count, prompt in layout:
            if seed not in self._rows:
                self._rows[seed], self._prompts[seed] = {}, list(prompt)
            mine = self._rows[seed]
            hashes = _prefix_hashes(prompt) if start < len(prompt) else ()
            for q in range(count):
                row = rows[offset + q].astype(CAPTURED_DTYPE)
                mine[start + q] = row
                if start + q < len(prompt):
                    self.prefixes[hashes[start + q]] = row
            offset += count

    # ------------------------------------------------------------------ caller side

    def arm(self) -> None:
        """Capture the steps of the next ``generate`` call."""
        self._flush()
        self._rows, self._prompts = {}, {}
        self.armed = True

    def take(self) -> dict[int, np.ndarray]:
        """``{seed: [positions, layers, k]}`` of the requests since :meth:`arm` (module doc);
        disarms."""
        self._flush()
        self.armed = False
        out = {}
        for seed, rows in self._rows.items():
            prompt = self._prompts[seed]
            length = max(max(rows) + 2, len(prompt) + 1)  # + the last, never fed, token
            routing = np.full((length, self.num_layers, self.topk), -1, dtype=CAPTURED_DTYPE)
            for position, row in rows.items():
                routing[position] = row
            for position, key in enumerate(_prefix_hashes(prompt)):
                if position not in rows and key in self.prefixes:  # a prefix-cache hit
                    routing[position] = self.prefixes[key]
            out[seed] = routing
        self._rows, self._prompts = {}, {}
        return out

    def reset_prefixes(self) -> None:
        """The engine's prefix cache was cleared (new weights): forget the cached rows."""
        self.prefixes.clear()


def _prefix_hashes(tokens: list[int]) -> list[int]:
    """Hash of ``tokens[:q + 1]`` for every position ``q``, each from the previous one."""
    hashes, value = [], 0
    for token in tokens:
        value = hash((value, token))
        hashes.append(value)
    return hashes
