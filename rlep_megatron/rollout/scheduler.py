"""How a step's prompts reach the rollout engine, and when.

:class:`SynchronousScheduler` (``trainer.max_staleness: 0``): a step's prompts are drawn and
generated in one blocking call under the weights that will then train on them; every token is
0 versions stale.
"""
from __future__ import annotations

from rlep_megatron.rollout.engine import Response


class SynchronousScheduler:
    """Draw a batch of prompts and generate all of it now, under the current version."""

    def __init__(self, engine):
        self.engine = engine

    def take(self, side, step: int, round_index: int) -> tuple[list[int], list[list[Response]]]:
        """``(rows, responses per row)`` of one generation round of step ``step``."""
        rows = side.sampler.next_global_batch()
        prompts = [side.prompt_ids(side.train_rows, r) for r in rows]
        groups = self.engine.generate(prompts, seed=side.seed(step, round_index))
        for responses in groups:
            for response in responses:
                response.versions = [(step, len(response.token_ids))]
        return rows, groups

    def pause(self) -> None:
        """Before the weights change: nothing is in flight between steps."""

    def resume(self, version: int) -> None:
        """After the weights changed to ``version``."""

    def drain_before(self, step: int) -> None:
        """Step ``step`` ends at a checkpoint: nothing may be in flight after it."""

    def state_dict(self) -> dict:
        return {}
