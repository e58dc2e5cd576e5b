"""How a step's prompts reach the rollout engine, and when.

:class:`SynchronousScheduler` (``trainer.max_staleness: 0``): a step's prompts are drawn and
generated in one blocking call under the weights that will then train on them; every token is
0 versions stale.

:class:`AheadScheduler` (``trainer.max_staleness: k >= 1``): when step ``t`` starts, the
batches of steps ``t .. t + k`` are on the engine (each drawn from the prompt sampler in order,
as the synchronous loop would draw it). The engine steps until every response of batch ``t`` has
finished; batch ``t + 1 .. t + k``'s requests run alongside, so the engine keeps a full batch
while batch ``t``'s longest responses finish. At the weight update their unfinished requests
leave the engine and come back after it (``rollout.carry_over``). The gate is "wait": a step
trains only its own batch, complete, so a token sampled by version ``v`` is trained at the
latest at step ``v + k``: never more than k versions stale.

Checkpoints are drain points: no batch is started beyond a step that ends at a checkpoint, so
nothing is in flight when one is written, and a resumed run starts from the same (empty) engine
state as the straight run did. The price is that the step before a checkpoint runs synchronously.
"""
from __future__ import annotations

import contextlib

from rlep_megatron.rollout.requests import request_seed

from rlep_megatron.rollout.response import Response


class _WeightUpdates:
    """When requests in flight step aside for the update (both schedulers): an engine that
    hands its devices to the update pauses before the actor trains; one that overlaps training
    (``engine.overlaps_training``, the servers) goes on generating and pauses only for the
    weight update itself, resuming under the new version right after it."""

    def before_update(self) -> None:
        """The actor is about to train."""
        if not self.engine.overlaps_training:
            self.pause()

    @contextlib.contextmanager
    def weight_update(self, version: int):
        """Around the delivery of the weights of policy ``version``."""
        if self.engine.overlaps_training:
            self.pause()  # the weights change: requests in flight leave or wait
        yield
        if self.engine.overlaps_training:
            self.resume(version)


class SynchronousScheduler(_WeightUpdates):
    """Draw a batch of prompts and generate all of it now, under the current version."""

    def __init__(self, engine):
        self.engine = engine

    def next_round(self, side, step: int, round_index: int
                   ) -> tuple[list[int], list[list[Response]]]:
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
        """After the weights became ``version``."""

    def tail_metrics(self) -> dict[str, float]:
        return {}


class AheadScheduler(_WeightUpdates):
    """Keep the next ``max_staleness`` steps' prompts generating (see the module docstring)."""

    def __init__(self, engine, cfg, ends_at_checkpoint, max_staleness=None):
        self.engine, self.cfg = engine, cfg
        self.max_staleness = (cfg.trainer.max_staleness if max_staleness is None
                              else max_staleness)
        self.ends_at_checkpoint = ends_at_checkpoint
        self.requests = engine.requests(cfg.rollout)
        self.batches: dict[int, list[int]] = {}  # step -> rows of its batch, submitted
        self.paused = False

    def _submit(self, side, step: int) -> None:
        """Draw batch ``step`` and start this replica's share of its responses."""
        rows = side.sampler.next_global_batch()
        prompts = [side.prompt_ids(side.train_rows, r) for r in rows]
        cfg = self.cfg.rollout
        n = cfg.num_samples_per_prompt
        base = side.seed(step, 0)
        for index in self.engine.share(prompts, n, cfg.max_response_tokens):
            for sample in range(n):
                self.requests.submit((step, index, sample), prompts[index],
                                     request_seed(base, index, n) + sample)
        self.batches[step] = rows

    def next_round(self, side, step: int, round_index: int
                   ) -> tuple[list[int], list[list[Response]]]:
        """``(rows, responses per row)`` of step ``step``'s batch, once all of it finished."""
        if round_index:
            raise RuntimeError("trainer.max_staleness >= 1 takes one generation round per "
                               "step (algo.dynamic_sampling is refused up front)")
        self.engine.check_ready()  # on a GPU: the KV cache back before any request is added
        if self.paused:
            self.requests.resume(step)
            self.paused = False
        else:
            self.requests.version = step
        last = step
        while last < step + self.max_staleness and not self.ends_at_checkpoint(last):
            last += 1
        for ahead in range(step, last + 1):
            if ahead not in self.batches:
                self._submit(side, ahead)
        self.requests.run_until(lambda: self.requests.finished(step))
        rows = self.batches.pop(step)
        local = self.requests.take(step, self.engine.get_tokenizer())
        return rows, self.engine.all_gather(local, len(rows))

    def pause(self) -> None:
        """Before the weights change: requests in flight leave the engine."""
        self.requests.pause(self.cfg.rollout.carry_over)
        self.paused = True

    def resume(self, version: int) -> None:
        """Right after the weights became ``version`` (separate placement: the servers go on
        at once, also while the trainer validates or saves)."""
        if self.paused:
            self.requests.resume(version)
            self.paused = False

    def tail_metrics(self) -> dict[str, float]:
        """Since the last call: how busy the engine was (the request driver's metrics)."""
        return self.requests.rollout_metrics()
