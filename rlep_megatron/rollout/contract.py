"""The rollout-engine contract: what the training loop, the scheduler and the learner call on a
rollout engine and on its request driver. Three backends implement it:

- :class:`~rlep_megatron.rollout.colocated.engine.RolloutEngine`, vLLM in this process on every rank
  (colocated placement), driven by
  :class:`~rlep_megatron.rollout.colocated.requests.EngineRequests`;
- :class:`~rlep_megatron.rollout.servers.engine.ServerEngine`, vLLM servers of the job's own
  (separate placement), driven by :class:`~rlep_megatron.rollout.servers.requests.ServerRequests`;
- :class:`~rlep_megatron.rollout.megatron.engine.MegatronEngine`, the actor's own megatron-core
  model (``rollout.backend: megatron``), driven by
  :class:`~rlep_megatron.rollout.megatron.requests.MegatronRequests`.

Callers use these members only, never a probe (``hasattr``) for one backend's extras: where a
backend has nothing to do (the servers keep their devices, so ``released`` is a no-op there;
the colocated engine needs no weight plan), it implements the member as a no-op; what differs
in behaviour is a declared capability (``overlaps_training``, ``capturing_routing``,
``routing_unavailable``). Engines are built by :mod:`rlep_megatron.rollout.factory` only. A
test checks that both backends implement every member, and another drives the loop, the
schedulers and the weight lifecycle with an engine written against this file alone
(``tests/unit/test_engine_contract_loop.py``).
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable


class IncompleteWeightsError(RuntimeError):
    """The engine's weights are not a complete copy of any policy (a sync failed midway)."""


@runtime_checkable
class RequestDriver(Protocol):
    """One replica's fresh requests in flight, keyed ``(step, prompt index, sample)``, that
    continue across steps (``trainer.max_staleness`` >= 1) and across weight updates."""

    version: int
    """The weight version the engine generates with (labels each token)."""

    def submit(self, key: tuple[int, int, int], prompt: list[int], seed: int) -> None: ...

    def run_until(self, done: Callable[[], bool]) -> None:
        """Generate until ``done()``; an engine failure raises."""

    def pause(self, carry_over: str) -> None:
        """Before the weights change: requests in flight leave the engine
        (``rollout.carry_over``: keep, resume or restart them after)."""

    def resume(self, version: int) -> None:
        """After the weights became ``version``: paused requests go on."""

    def finished(self, step: int) -> bool: ...

    def take(self, step: int, tokenizer) -> list: ...

    def rollout_metrics(self) -> dict[str, float]:
        """Since the last call: how busy the engine was (docs/metrics.md)."""


@runtime_checkable
class InferenceEngine(Protocol):
    """A rollout engine: generation, the weight stream's destination and, where it shares the
    devices with training, the memory hand-off."""

    eos_token_id: int
    """The tokenizer's end-of-sequence id (ends every replayed answer; pads rows without a pad
    token)."""

    routing_unavailable: Optional[str]
    """Why the engine cannot give MoE routing (``None``: it can)."""

    capturing_routing: bool
    """Whether the engine reports each fresh token's experts (MoE routing capture)."""

    receives_weights: bool
    """True: the engine holds a copy of the weights that each update streams into it (vLLM);
    false: it generates with the actor's own model (``rollout.backend=megatron``), so an update
    streams nothing and only labels the version."""

    overlaps_training: bool
    """True: the engine has devices of its own and generates while the actor trains (the
    servers), paused only for the weight update; false: it hands its devices to the update
    (colocated), so nothing is in flight while the actor trains."""

    # ---------------------------------------------------------------- generation
    def get_tokenizer(self): ...

    def share(self, prompts: list[list[int]], n: int = 1, max_tokens: int = 0) -> range:
        """The prompt indices this replica generates."""

    def check_ready(self) -> None:
        """Raise if the engine cannot generate now (weights incomplete, memory released)."""

    def generate(self, prompts: list[list[int]], n: Optional[int] = None, **kwargs) -> list:
        """Every prompt's ``n`` responses, gathered on every rank."""

    def requests(self, cfg) -> RequestDriver:
        """A driver of requests that continue across steps (``cfg``: ``RolloutConfig``)."""

    def all_gather(self, local: list, num_prompts: int) -> list:
        """Every replica's responses (``local``: this replica's), in prompt order."""

    # ---------------------------------------------------------------- weights
    @property
    def weights_incomplete(self) -> bool:
        """True while a weight update has begun and not completed."""

    def plan_weights(self, plan: list) -> None:
        """Before the first update: ``(hf_name, dtype, shape)`` of every tensor the weight
        stream will carry, in order (``WeightStreamer.plan()``)."""

    # the weight-update lifecycle (rlep_megatron.weight_sync.lifecycle.WeightTarget)
    def start_weight_update(self) -> None: ...

    def send_weights(self, weights) -> None:
        """The update's ``(hf_name, tensor)`` pairs, bucket by bucket (collective)."""

    def finish_weight_update(self, version: Optional[int] = None) -> None:
        """Complete; the servers label their tokens with ``version`` from here."""

    def abort_weight_update(self, error: BaseException, tensors_sent: int) -> None: ...

    # ---------------------------------------------------------------- memory
    def released(self):
        """A context in which the engine's device memory is released to training (the
        colocated engine sleeps for the block, with ``rollout.enable_sleep_mode``)."""

    def abandon(self) -> None:
        """After a failure, best effort and without a collective: leave what outlives the job
        usable (the servers: requests aborted, generation resumed)."""

    def shutdown(self, process_ending: bool = False) -> None:
        """End of the job (collective). ``process_ending``: the process exits right after, so
        what it would free goes with it (the colocated engine skips vLLM's slow teardown)."""
