"""The weight-delivery lifecycle: how the actor's weights reach a rollout engine, the same for
every backend.

    start_weight_update()            the engine's weights are incomplete from here
    send_weights(stream)             the stream of (hf_name, tensor) pairs, bucket by bucket
    finish_weight_update(version)    complete again, labelled with the policy version

The colocated engine implements it over its vLLM worker's RPC
(:class:`~rlep_megatron.rollout.colocated.worker_ext.RolloutWorkerExtension`), the servers of separate
placement over vLLM's weight-transfer API (start / update per bucket / finish,
:mod:`rlep_megatron.rollout.servers.weights`); the vLLM-side steps of both are
:mod:`rlep_megatron.rollout.vllm_reload`. A failure anywhere calls
``abort_weight_update`` and propagates: the engine stays marked incomplete and refuses to
generate. The loop (``trainer.py``) calls :func:`sync_weights`; nothing else updates an
engine's weights.
"""
from __future__ import annotations

import time
from typing import Iterable, Iterator, Optional, Protocol

import torch


class WeightTarget(Protocol):
    """What receives a weight update: every rollout engine (the engine contract,
    :mod:`rlep_megatron.rollout.contract`, includes it)."""

    receives_weights: bool
    """False where the engine generates with the actor's own weights (nothing is streamed)."""

    def start_weight_update(self) -> None: ...

    def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The update's tensors, in the stream's order (collective over the trainer's ranks,
        every rank walking the same stream)."""

    def finish_weight_update(self, version: Optional[int]) -> None:
        """Every tensor arrived: the weights are complete, of policy ``version`` (``None``: the
        engine's label does not change)."""

    def abort_weight_update(self, error: BaseException, tensors_sent: int) -> None:
        """The update failed after ``tensors_sent`` tensors (no collective here)."""


def count_tensors(weights: Iterable[tuple[str, torch.Tensor]], count: dict
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, counting the tensors and bytes that pass into ``count``."""
    for name, tensor in weights:
        count["tensors"] += 1
        count["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def deliver(target: WeightTarget, weights: Iterable[tuple[str, torch.Tensor]],
            version: Optional[int] = None, expected: Optional[int] = None) -> dict[str, float]:
    """One weight update of ``target`` from ``(hf_name, tensor)`` pairs; returns its
    ``tensors``, ``bytes`` and ``seconds``. ``expected``: the tensors the update must have (a
    stream that ends short fails before the weights are declared complete)."""
    count = {"tensors": 0, "bytes": 0}
    started = time.perf_counter()
    target.start_weight_update()
    try:
        target.send_weights(count_tensors(weights, count))
        if expected is not None and count["tensors"] != expected:
            raise RuntimeError(f"weight sync delivered {count['tensors']} of {expected} "
                               "tensors")
        target.finish_weight_update(version)
    except BaseException as err:
        target.abort_weight_update(err, count["tensors"])
        raise
    return {**count, "seconds": time.perf_counter() - started}


def sync_weights(target: WeightTarget, streamer, version: Optional[int] = None
                 ) -> dict[str, float]:
    """Stream the actor's current weights (``streamer``, a
    :class:`~rlep_megatron.weight_sync.WeightStreamer`) into the rollout engine, whose weight
    version becomes ``version``. Collective over the trainer's ranks. Checks that every planned
    tensor arrived. An engine that generates with the actor's own weights
    (``receives_weights`` false: ``rollout.backend=megatron``) gets an update of no tensors,
    which only labels its version."""
    if not target.receives_weights:
        return deliver(target, (), version, expected=0)
    return deliver(target, streamer.iter_tensors(), version, expected=len(streamer.names))
