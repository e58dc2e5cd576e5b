"""The megatron backend's requests across steps (``trainer.max_staleness`` >= 1).

The engine has no request-level scheduler of its own: :meth:`MegatronRequests.run_until`
decodes every request submitted and not finished yet to its end, in one batch call, under the
current weights (each request drawn from its own seed, so the tokens are those
:meth:`~rlep_megatron.rollout.megatron.engine.MegatronEngine.generate` gives for the same
seeds). Requests of later steps submitted before that call are finished with it too, labelled
with the version that sampled them; nothing is ever in flight across a weight update, so
``pause`` and ``resume`` have nothing to carry over."""
from __future__ import annotations

from typing import Callable

from rlep_megatron import faults
from rlep_megatron.rollout.requests import Pending, take_finished


class MegatronRequests:
    def __init__(self, engine, cfg):
        self.engine, self.cfg = engine, cfg
        self.pending: dict[tuple[int, int, int], Pending] = {}
        self.version = 0

    def submit(self, key: tuple[int, int, int], prompt: list[int], seed: int) -> None:
        self.pending[key] = Pending(key, list(prompt), seed)

    def run_until(self, done: Callable[[], bool]) -> None:
        """Decode every unfinished request to its end (once), then check ``done()``."""
        if done():
            return
        faults.check("engine_step", self.engine.rank)
        todo = [item for item in self.pending.values() if item.finish_reason is None]
        if not todo:
            raise RuntimeError("the rollout engine has no request left running, yet a batch "
                               "waits for responses")
        cfg = self.cfg
        results = self.engine.sample_rows([(item.prompt, item.seed) for item in todo],
                                          cfg.max_response_tokens, cfg.temperature, cfg.top_p,
                                          cfg.top_k)
        for item, (tokens, logprobs, reason) in zip(todo, results):
            item.add_tokens(tokens, logprobs, self.version)
            item.finish_reason = reason
        if not done():
            raise RuntimeError("every submitted request finished, yet the batch is not done")

    def pause(self, carry_over: str) -> None:
        """Nothing is in flight between calls."""

    def resume(self, version: int) -> None:
        self.version = version

    def finished(self, step: int) -> bool:
        return all(item.finish_reason is not None for key, item in self.pending.items()
                   if key[0] == step)

    def take(self, step: int, tokenizer):
        return take_finished(self.pending, step, tokenizer)

    def rollout_metrics(self) -> dict[str, float]:
        return self.engine.rollout_metrics()
