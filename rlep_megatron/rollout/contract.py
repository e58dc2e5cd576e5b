"""The rollout-engine contract: what the training loop, the scheduler and the learner call on a
rollout engine and on its request driver. Two backends implement it:

- :class:`~rlep_megatron.rollout.engine.RolloutEngine`, vLLM in this process on every rank
  (colocated placement), driven by :class:`~rlep_megatron.rollout.requests.EngineRequests`;
- :class:`~rlep_megatron.rollout.server.ServerEngine`, vLLM servers of the job's own (separate
  placement), driven by :class:`~rlep_megatron.rollout.server.ServerRequests`.

Callers use these members only, never a probe (``hasattr``) for one backend's extras: where a
backend has nothing to do (the servers keep their devices, so ``released`` is a no-op there;
the colocated engine needs no weight plan), it implements the member as a no-op. A test checks
that both backends implement every member.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable


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

    routing_unavailable: Optional[str]
    """Why the engine cannot give MoE routing (``None``: it can)."""

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

    def plan_weights(self, streamer) -> None:
        """Before the first update: what the weight stream will carry."""

    def load_weights(self, weights, version: Optional[int] = None) -> dict[str, float]:
        """One weight update from ``(hf_name, tensor)`` pairs; ``tensors``/``bytes``/
        ``seconds`` of it."""

    # ---------------------------------------------------------------- memory
    def released(self):
        """A context in which the engine's device memory is released to training (the
        colocated engine sleeps for the block, with ``rollout.enable_sleep_mode``)."""

    def shutdown(self) -> None: ...
