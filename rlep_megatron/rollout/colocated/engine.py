"""The rollout engine: vLLM in-process on every rank (``external_launcher``).

The world is cut into rollout groups of ``rollout.tensor_model_parallel_size`` consecutive
ranks; each group is one vLLM tensor-parallel engine replica. The replicas are independent:
vLLM's own data parallelism is not used (``data_parallel_size=1``; the world's leading dimension
is what vLLM calls external data parallelism), so no collective couples the replicas' engine
steps, a replica never pads to another's batch or runs dummy batches, and a replica that ends
early is done. :meth:`RolloutEngine.generate` takes the same global prompt list on every rank,
each replica samples a contiguous share balanced by token budget
(:func:`~rlep_megatron.rollout.requests.split_by_budget`;
any share may be empty), and every rank gets every response back in one gather.

Weights: the engine starts from an HF directory (or with dummy weights when the first weight
sync is what fills it) and is updated in place through vLLM's worker ``reload_weights`` (called
by :class:`~rlep_megatron.rollout.colocated.worker_ext.RolloutWorkerExtension`), which runs the
model's
own ``load_weights`` (each rank keeps its tensor-parallel slice) and re-applies the kernels'
weight processing (e.g. the CPU backend's GEMM packing) layer by layer. A sync that fails midway marks the engine
stale: :meth:`generate` refuses to run until a later sync completes.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import time
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from rlep_megatron import platform
from rlep_megatron.config import RolloutConfig
from rlep_megatron.rollout.contract import IncompleteWeightsError
from rlep_megatron.rollout.requests import (merge_gathered, replica_share, request_seed,
                                            sampling_settings)
from rlep_megatron.rollout.response import Response, decode_response

logger = logging.getLogger(__name__)


class _ExpectedReloadWarnings(logging.Filter):
    """vLLM's in-place reload warns "<Layer>: Failed to load weights" for every layer that got
    no tensor. Two such layers are expected at every weight sync: the rotary embedding (a
    cos/sin cache, in no checkpoint) and, with tied embeddings, the LM head (it shares the
    embedding's weight, which is synced). Only those are dropped; any other layer is still
    reported. ``RLEP_SHOW_ALL_WARNINGS=1`` keeps every warning."""

    MESSAGE = "%s: Failed to load weights"

    def __init__(self, layers: set[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.MESSAGE and record.args
                    and record.args[0] in self.layers)


class _WarnOnce(logging.Filter):
    """A vLLM warning is printed the first time its text appears only (the CPU backend, for
    one, repeats its thread-binding notice at every weight sync), and a vLLM info line the
    first time its format appears only (every weight sync logs "Reloading and processing
    weights took %.2f seconds" and "Successfully reset prefix cache": 61 of a 30-step tiny
    run's 139 log lines)."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            key = (record.name, record.getMessage())
        elif record.levelno == logging.INFO:
            key = (record.name, str(record.msg))
        else:
            return True
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


_WARN_ONCE = _WarnOnce()


def _quiet_expected_reload_warnings(tied_embeddings: bool) -> None:
    """Install :class:`_ExpectedReloadWarnings` and, on every vLLM module's logger that
    exists once the engine is built, :class:`_WarnOnce`, unless ``RLEP_SHOW_ALL_WARNINGS=1``
    (vLLM reconfigures its handlers when an engine starts, so the filters sit on the
    loggers)."""
    if os.environ.get("RLEP_SHOW_ALL_WARNINGS") == "1":
        return
    target = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    for existing in [f for f in target.filters if isinstance(f, _ExpectedReloadWarnings)]:
        target.removeFilter(existing)
    # first, so that a dropped record never counts as seen by _WarnOnce
    target.filters.insert(0, _ExpectedReloadWarnings(
        {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_embeddings else set())))
    # created here if not imported yet: repeats its thread-binding notice while it starts
    logging.getLogger("vllm.v1.worker.cpu_worker")
    for name, candidate in list(logging.Logger.manager.loggerDict.items()):
        if (name.startswith("vllm.") and isinstance(candidate, logging.Logger)
                and _WARN_ONCE not in candidate.filters):
            candidate.addFilter(_WARN_ONCE)


@contextlib.contextmanager
def _environment(variables: dict[str, str]):
    """Set ``variables`` in ``os.environ`` inside the block and put back what each was before
    (unset included); every other variable, including those the block sets, is left alone."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class MemoryHandOff:
    """The colocated engine's hand-off of its devices to the update (GPU; no-ops on CPU):
    weights and KV cache released while the actor trains, back for the weight sync."""

    def sleep(self) -> None:
        """Release weights and KV cache while the actor trains (GPU; no-op on CPU). The weights
        are discarded, so the next :meth:`wake_up` must be followed by a weight sync; with
        ``rollout.lora_sync=adapter`` the base is offloaded to CPU memory instead and comes
        back as it was (vLLM's sleep level 1)."""
        if not self.sleep_enabled or self._asleep:
            return
        self._asleep = True
        if self.adapters is not None:  # the base is never sent again: offloaded, kept
            self.llm.sleep(level=1)
            return
        self.llm.sleep(level=2)
        self._incomplete_reason = "it slept (weights released) and has not been synced since"

    def wake_up(self) -> None:
        """Staged: the weights' memory comes back now, for the weight sync; the KV cache only
        when generation next needs it (:meth:`_wake_kv_cache`), so the sync's buckets never
        share the GPU with a full KV cache. vLLM resumes scheduling once both are back."""
        if not self._asleep:
            return
        self.llm.wake_up(tags=["weights"])
        self._asleep = False
        self._kv_cache_asleep = True

    def _wake_kv_cache(self) -> None:
        if self._kv_cache_asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._kv_cache_asleep = False

    def memory_state(self) -> str:
        """``awake``, ``asleep`` or ``weights only`` (for logs and tests)."""
        if self._asleep:
            return "asleep"
        return "weights only" if self._kv_cache_asleep else "awake"

    @contextlib.contextmanager
    def released(self):
        """``with engine.released(): train...`` sleeps for the block and wakes after it."""
        self.sleep()
        try:
            yield
        finally:
            self.wake_up()


def _routing_settings(cfg: RolloutConfig, capture_routing: bool, eager_for_routing: bool
                      ) -> tuple[dict, dict[str, str], Optional[str]]:
    """``(engine settings, environment, routing source)`` for MoE routing capture."""
    if not capture_routing:
        return {}, {}, None
    if not eager_for_routing:
        return {}, {}, "capture"
    from rlep_megatron.rollout.routing_capture import engine_routing_settings

    extra, variables, source = engine_routing_settings(
        cfg.engine_routing, platform.cuda_available(), os.environ, cfg.tensor_model_parallel_size)
    if extra.get("enforce_eager"):
        logger.info("rollout engine: vLLM's V1 model runner without CUDA graphs, so that the "
                    "experts it routes each token to can be replayed (algo.routing_replay="
                    "rollout, rollout.engine_routing=capture); generation is slower than with "
                    "graphs")
    elif source == "output":
        logger.info("rollout engine: vLLM returns the experts it routes each token to "
                    "(rollout.engine_routing=output; its V2 runner, CUDA graphs kept)")
    return extra, variables, source


class RolloutEngine(MemoryHandOff):
    """One vLLM engine replica per rollout group; collective over the whole world.

    ``capture_routing``: record the experts a mixture-of-experts engine routes each token to,
    where the engine allows it (else ``routing_unavailable`` says why); ``eager_for_routing``:
    on a GPU, build the engine so that it allows it (vLLM's V1 runner without CUDA graphs,
    slower; :func:`~rlep_megatron.rollout.routing_capture.eager_v1_engine_settings`)."""

    capturing_routing = False
    overlaps_training = False  # the engine hands its devices to the update
    receives_weights = True
    routing_source: Optional[str] = None
    """``output`` (vLLM's own routed experts) or ``capture`` (the V1 hook), when routing is
    asked for (:func:`~rlep_megatron.rollout.routing_capture.engine_routing_settings`)."""
    routing_unavailable: Optional[str] = None
    """Why the engine's routing is not captured although asked for, or ``None``."""
    adapters: Optional["AdapterSlot"] = None
    """``rollout.lora_sync=adapter``: the policy's LoRA adapter on the engine's base."""

    def __init__(self, model_dir: str, cfg: RolloutConfig, *, dtype: str = "auto",
                 seed: int = 0, max_model_len: int = 4096, load_weights: bool = True,
                 capture_routing: bool = False, eager_for_routing: bool = False,
                 lora=None):
        if not torch.distributed.is_initialized():
            raise RuntimeError("RolloutEngine needs torch.distributed initialised first "
                               "(rlep_megatron.distributed.init_process_group)")
        world = torch.distributed.get_world_size()
        tp = cfg.tensor_model_parallel_size
        if world % tp:
            raise ValueError(f"rollout.tensor_model_parallel_size={tp} does not divide the "
                             f"world size {world}; pick a divisor of {world}")
        hf_config_path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(hf_config_path):
            raise FileNotFoundError(f"rollout model directory {model_dir!r} has no config.json")
        with open(hf_config_path) as f:
            hf_config = json.load(f)
        heads = hf_config.get("num_attention_heads")
        if heads and heads % tp:
            raise ValueError(f"rollout.tensor_model_parallel_size={tp} does not divide the "
                             f"model's {heads} attention heads")
        self.cfg = cfg
        self.rank = torch.distributed.get_rank()
        self.tp_size = tp
        self.dp_size = world // tp        # independent replicas
        self.dp_rank = self.rank // tp    # this rank's replica
        from rlep_megatron import distributed

        self.gather_group = distributed.rollout_group(cfg.gather_timeout_minutes)
        self.sleep_enabled = cfg.enable_sleep_mode and platform.cuda_available()
        self._incomplete_reason: Optional[str] = None if load_weights else (
            "it was started with dummy weights and no weight sync has completed yet")
        self._asleep = False
        self._kv_cache_asleep = False
        if lora is not None:  # the base stays, each update brings the policy's adapter
            self.adapters = AdapterSlot(lora)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm import LLM

        tied = bool(hf_config.get("tie_word_embeddings", False))
        _quiet_expected_reload_warnings(tied)

        # vLLM collects garbage several times while it builds the engine: walk only what the
        # engine creates (the import-time heap frozen once, after one collection)
        platform.freeze_startup_heap()
        started = time.perf_counter()
        settings = dict(gpu_memory_utilization=cfg.gpu_memory_utilization)
        settings.update(platform.vllm_cpu_engine_settings(max_model_len, hf_config, tp))
        if self.adapters is not None:
            settings.update(self.adapters.engine_settings())
        extra, variables, self.routing_source = _routing_settings(cfg, capture_routing,
                                                                  eager_for_routing)
        settings.update(extra)
        with _environment(variables):  # read while the engine's worker is built
            self.llm = LLM(
                model=model_dir, dtype=dtype, seed=seed,
                tensor_parallel_size=tp, data_parallel_size=1,
                distributed_executor_backend="external_launcher",
                max_model_len=max_model_len,
                enable_sleep_mode=self.sleep_enabled,
                **settings,
                load_format="auto" if load_weights else "dummy",
                logprobs_mode="processed_logprobs",
                worker_extension_cls=("rlep_megatron.rollout.colocated.worker_ext."
                                      "RolloutWorkerExtension"),
            )
        self.eos_token_id = self.llm.get_tokenizer().eos_token_id
        if self.routing_source == "output":
            self.capturing_routing = True
        elif capture_routing:
            self._start_routing_capture(hf_config)
        # again for the vLLM modules the engine imported
        _quiet_expected_reload_warnings(tied)
        logger.info("rollout engine ready in %.1fs (rollout TP=%d, replicas=%d)",
                    time.perf_counter() - started, tp, self.dp_size)

    def _start_routing_capture(self, hf_config: dict) -> None:
        from rlep_megatron.models import num_experts

        if not num_experts(hf_config):
            raise ValueError("engine routing capture needs a mixture-of-experts model; "
                             f"{hf_config.get('architectures')} is dense")
        [why] = self.llm.collective_rpc(
            "rlep_capture_routing",
            args=(int(hf_config["num_hidden_layers"]), int(hf_config["num_experts_per_tok"])))
        self.capturing_routing = why is None
        self.routing_unavailable = why

    # ------------------------------------------------------------------ generation

    def share(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 0) -> range:
        """The prompt indices this rank's replica samples (:func:`replica_share`)."""
        return replica_share(prompts, n, max_tokens, self.dp_size, self.dp_rank)

    def requests(self, cfg):
        """A driver of requests that continue across steps
        (:class:`~rlep_megatron.rollout.colocated.requests.EngineRequests`)."""
        from rlep_megatron.rollout.colocated.requests import EngineRequests

        return EngineRequests(self, cfg)

    def sampling_params(self, n: int, temperature: float, top_p: float, top_k: int,
                        max_tokens: int, seed: int):
        from vllm import SamplingParams

        # the sampled token's log-prob only, in vLLM's flat form (a few lists per response, not
        # a dict per token), and no text: vLLM would decode every token twice (the response's
        # text and each log-prob's token), where one decode per response is all the trainer
        # needs (:func:`_response`)
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                              max_tokens=max_tokens, seed=seed, logprobs=0, flat_logprobs=True,
                              detokenize=False)

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def check_ready(self) -> None:
        """Refuse to generate from stale or released weights; bring the KV cache back."""
        if self._incomplete_reason is not None:
            raise IncompleteWeightsError(
                f"refusing to generate: the engine's weights are incomplete because "
                f"{self._incomplete_reason}. Run a complete weight sync first.")
        if self._asleep:
            raise RuntimeError("refusing to generate: the engine is asleep (call wake_up)")
        self._wake_kv_cache()

    def generate(self, prompts: list[list[int]], n: Optional[int] = None, *,
                 temperature: Optional[float] = None, top_p: Optional[float] = None,
                 top_k: Optional[int] = None, max_tokens: Optional[int] = None,
                 seed: int = 0, routing: bool = True) -> list[list[Response]]:
        """Sample ``n`` responses for every prompt (token ids; the same list on every rank).
        Defaults come from the rollout config. Returns, on every rank, one list of ``n``
        responses per prompt, in prompt order. ``routing=False``: no routing tables, also where
        the engine captures them (evaluation trains nothing)."""
        self.check_ready()
        n, temperature, top_p, top_k, max_tokens = sampling_settings(
            self.cfg, n, temperature, top_p, top_k, max_tokens)
        mine = self.share(prompts, n, max_tokens)
        requests = [{"prompt_token_ids": list(prompts[i])} for i in mine]
        params = [self.sampling_params(n, temperature, top_p, top_k, max_tokens,
                                       request_seed(seed, i, n)) for i in mine]
        local: list[list[Response]] = []
        if requests:  # an empty share skips the engine: no other replica waits on it
            # (the hook captures also when the tables are not wanted: the prompt positions it
            # records are those later requests take from vLLM's prefix cache)
            wanted = routing and self.capturing_routing
            hooked = self.capturing_routing and self.routing_source == "capture"
            if hooked:
                self.llm.collective_rpc("rlep_routing_arm")
            outputs = self.llm.generate(requests, params, use_tqdm=False,
                                        lora_request=self.lora_request)
            routes = self.llm.collective_rpc("rlep_routing_take")[0] if hooked else {}
            tokenizer = self.llm.get_tokenizer()
            for index, output, request in zip(mine, outputs, params):
                local.append([_response(index, completion, tokenizer,
                                        None if not wanted
                                        else completion.routed_experts
                                        if self.routing_source == "output"
                                        else routes.get(request.seed + completion.index),
                                        prompts[index])
                              for completion in output.outputs])
        return self.all_gather(local, len(prompts))

    def all_gather(self, local: list[list[Response]], num_prompts: int
                    ) -> list[list[Response]]:
        """Every replica's responses on every rank (one copy per replica is taken), over the
        rollout's gloo group. Routing tables stay with the replica that made them
        (:func:`~rlep_megatron.actor.routing_store.hold_for_gather`)."""
        if self.dp_size == 1:
            return local
        from rlep_megatron import distributed
        from rlep_megatron.actor.routing_store import hold_for_gather

        sender = self.rank % self.tp_size == 0
        if sender:
            hold_for_gather(local, self.rank)
        return merge_gathered(distributed.all_gather_object(local if sender else None,
                                                            group=self.gather_group),
                              num_prompts)

    # ------------------------------------------------------------------ weights

    @property
    def weights_incomplete(self) -> bool:
        return self._incomplete_reason is not None

    def plan_weights(self, plan: list) -> None:
        """Nothing to plan: each update reloads the tensors that arrive."""

    # the weight-update lifecycle (rlep_megatron.weight_sync.lifecycle) over the worker's RPC:
    # every rank passes the same stream and keeps its tensor-parallel slice (collective)
    def start_weight_update(self) -> None:
        self._incomplete_reason = "a weight sync was started and has not completed"
        if self.adapters is not None:
            self.adapters.start()
            return
        self.llm.collective_rpc("rlep_start_weight_update")

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.adapters is not None:
            self.adapters.receive(weights)
            return
        self.llm.collective_rpc("rlep_load_weights", args=(weights,))

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """The colocated engine labels no tokens with ``version``: the loop knows it."""
        if self.adapters is not None:
            self.adapters.finish(version)  # a new LoRA request: no cached prefix reused
        else:
            self.llm.collective_rpc("rlep_finish_weight_update")
            # cached prefixes were computed with the old weights
            self.llm.reset_prefix_cache()
        self._incomplete_reason = None

    @property
    def lora_request(self):
        """The policy's adapter as vLLM's LoRA request (``rollout.lora_sync=adapter``), else
        None: every generate request carries it."""
        return self.adapters.request if self.adapters is not None else None

    def abort_weight_update(self, error: BaseException, tensors_sent: int) -> None:
        self._incomplete_reason = (f"the last weight sync failed after {tensors_sent} "
                                   f"tensors with {type(error).__name__}: {error}")

    def abandon(self) -> None:
        """After a failure: nothing outlives the process."""

    def shutdown(self, process_ending: bool = False) -> None:
        """Tear the engine down. vLLM's teardown also destroys torch.distributed's default
        process group (with the groups built on it), so call this last, before
        :func:`rlep_megatron.distributed.destroy`. Collective; safe to call twice.
        ``process_ending``: left to the end of the process (vLLM's shutdown walks the whole
        heap three times, about 3 s on a 2-core machine)."""
        if self.adapters is not None:
            self.adapters.close()
        if process_ending:
            return
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()


def _response(index: int, completion, tokenizer, routing=None,
              prompt: Sequence[int] = ()) -> Response:
    token_ids = list(completion.token_ids)
    # vLLM's flat log-probs (:meth:`RolloutEngine.sampling_params`): with logprobs=0 one entry
    # per position, the sampled token's
    entries = completion.logprobs
    if entries is None or list(entries.token_ids) != token_ids:
        raise RuntimeError("vLLM's log-prob entries are not those of the sampled tokens")
    logprobs = list(entries.logprobs)
    finish_reason = completion.finish_reason or "length"
    # the token that stopped the response (EOS or a stop token id, included in token_ids) is
    # not part of vLLM's text, special or not
    text = decode_response(tokenizer, list(prompt),
                            token_ids[:-1] if finish_reason == "stop" else token_ids)
    if routing is not None:
        # one row per position of prompt + response: an engine that schedules one more
        # forward after a stop (async scheduling) captured a row past the end. vLLM's own
        # output is unsigned: signed, so that -1 can mark the rows nothing was routed for
        length = len(prompt) + len(token_ids)
        routing = np.asarray(routing)[:length].astype(np.int16, copy=False)
        if len(routing) < length:
            routing = np.concatenate([routing, np.full((length - len(routing),
                                                        *routing.shape[1:]), -1, routing.dtype)])
    return Response(index, token_ids, logprobs, text, finish_reason, routing)


class AdapterSlot:
    """The policy's LoRA adapter in the engine (``rollout.lora_sync=adapter``): the frozen base
    is the engine's own weights (loaded once, never streamed), and each weight update carries
    only the adapter's tensors (PEFT names, full on every rank), written to a directory of this
    process and served as a new vLLM LoRA request (a new id per update, so neither vLLM's
    adapter cache nor its prefix cache reuses the previous policy's)."""

    def __init__(self, lora):
        import tempfile

        from rlep_megatron.lora.serving import lora_slot_rank

        lora_slot_rank(lora.rank)  # refused above vLLM's largest slot
        self.lora = lora
        self.directory = tempfile.mkdtemp(prefix="rlep-rollout-adapter-")
        self.request = None
        self.updates = 0
        self.received: dict[str, torch.Tensor] = {}

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)

    def engine_settings(self) -> dict:
        from rlep_megatron.lora.serving import engine_settings

        return engine_settings(self.lora.rank)

    def start(self) -> None:
        self.received = {}

    def receive(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.received[name] = tensor.detach().to("cpu", copy=True)

    def finish(self, version: Optional[int]) -> None:
        import shutil

        from vllm.lora.request import LoRARequest

        from rlep_megatron.lora import peft_io

        self.updates += 1
        path = os.path.join(self.directory, f"update_{self.updates}")
        peft_io.save(path, self.received, self.lora)
        previous, self.received = self.request, {}
        self.request = LoRARequest(f"policy-v{version if version is not None else 'x'}"
                                   f"-{self.updates}", self.updates, path)
        if previous is not None:  # vLLM has read it; only the current one is needed
            shutil.rmtree(previous.lora_path, ignore_errors=True)
