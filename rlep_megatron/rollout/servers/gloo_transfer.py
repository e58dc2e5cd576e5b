"""``rlep_gloo``: a weight-transfer backend for vLLM's start / update / finish lifecycle over a
gloo group (host memory, TCP), for rollout engines without NCCL: vLLM's CPU build, or a server
on other hosts without a GPU interconnect.

vLLM (0.32) loads it through its plugin entry point (``vllm.general_plugins``: :func:`register`,
declared in setup.py), so a stock ``vllm serve ... --weight-transfer-config
'{"backend": "rlep_gloo"}'`` accepts it. The control plane is vLLM's own (the HTTP routes
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``); the data plane is one gloo broadcast per bucket from the sending
trainer rank (group rank 0) to every worker of the server (TP ranks each take the full tensors
and keep their slice, as in a colocated sync).

Worker side (:class:`GlooWeightTransferEngine`): ``start`` begins vLLM's layer-wise reload (the
CPU MoE experts re-processed as at load), each ``update`` receives one flat byte buffer and
loads its tensors, ``finish`` finalises the reload and repacks a tied CPU LM head: the steps of
:mod:`rlep_megatron.rollout.vllm_reload`, as in the colocated engine's worker extension.

Trainer side (:class:`GlooTrainerWeightTransferEngine`): opens the group's TCP store, has the
server join through the client while it joins itself, then streams ``(hf_name, tensor)`` pairs
in buckets of at most ``bucket_bytes``.
"""
from __future__ import annotations

import datetime
import math
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Optional

import torch

BACKEND = "rlep_gloo"
_PREFIX = "rlep-weights"


def register() -> None:
    """vLLM general plugin: register both sides of ``rlep_gloo`` with vLLM's factories (called
    in every vLLM process; a second call is a no-op)."""
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__,
                                                    "GlooWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__,
                                                     "GlooTrainerWeightTransferEngine")


def _gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float,
                is_master: bool):
    """A gloo process group of ``world_size`` members outside torch.distributed's default
    group (the trainer's world and the server's are separate)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(address, port, world_size=world_size, is_master=is_master,
                     timeout=timeout, wait_for_workers=False)
    return ProcessGroupGloo(PrefixStore(_PREFIX, store), rank, world_size, timeout), store


def _wait(done, errors: list, timeout_s: float, what: str) -> None:
    """Poll until ``done()``; the first error of a helper thread (the server's answer, which
    names it) ends the wait at once, and so does ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while not done():
        if errors:
            raise RuntimeError(f"{what} failed: {errors[0]}") from errors[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete within {timeout_s:.0f} s")
        time.sleep(0.005)
    if errors:
        raise RuntimeError(f"{what} failed: {errors[0]}") from errors[0]


def _byte_views(buffer: torch.Tensor, dtype_names, shapes) -> list[torch.Tensor]:
    views, offset = [], 0
    for dtype_name, shape in zip(dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        size = math.prod(shape) * dtype.itemsize
        views.append(buffer[offset:offset + size].view(dtype).view(tuple(shape)))
        offset += size
    if offset != buffer.numel():
        raise RuntimeError(f"weight bucket of {buffer.numel()} bytes, its tensors take {offset}")
    return views


_CLASSES: dict = {}
_NAMES = ("GlooInitInfo", "GlooUpdateInfo", "GlooWeightTransferEngine", "GlooTrainerInitInfo",
          "GlooTrainerWeightTransferEngine")


def __getattr__(name: str):
    """The classes subclass vLLM's, so they are built when first asked for (vLLM's factory
    asks by name): importing this module does not import vLLM."""
    if name not in _NAMES:
        raise AttributeError(name)
    if not _CLASSES:
        _CLASSES.update(_build())
    return _CLASSES[name]


def _rendezvous(init_info, client):
    """The trainer's end of the group: its TCP store and group rank 0, while the servers join
    through ``client`` (``/init_weight_transfer_engine``); ``(group, store)``."""
    world = 1 + init_info.num_workers
    errors: list[BaseException] = []

    def server_joins():
        try:
            client.init_weight_transfer_engine({
                "master_address": init_info.master_address,
                "master_port": init_info.master_port, "rank_offset": 1,
                "world_size": world, "timeout_s": init_info.timeout_s})
        except BaseException as err:  # reported below, after the join
            errors.append(err)

    # the store and group rendezvous block until the server's workers join: the
    # request that makes them join runs meanwhile; a refusal ends the wait at once
    joined: list = []

    def trainer_joins():
        try:
            joined.append(_gloo_group(init_info.master_address, init_info.master_port,
                                      0, world, init_info.timeout_s, is_master=True))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=f, daemon=True)
               for f in (server_joins, trainer_joins)]
    for thread in threads:
        thread.start()
    _wait(lambda: not any(t.is_alive() for t in threads), errors, init_info.timeout_s,
          "the rlep_gloo weight transfer's rendezvous with the rollout server(s) "
          f"{init_info.servers}")
    return joined[0]


def _build() -> dict:
    return {**_build_server_side(), **_build_trainer_side()}


def _build_server_side() -> dict:
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                       WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)

    @dataclass
    class GlooInitInfo(WeightTransferInitInfo):
        """Where the group meets: the trainer's TCP store, the ranks of this server's workers
        (``rank_offset`` + the worker's rank) and the group's size."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 300.0

    @dataclass
    class GlooUpdateInfo(WeightTransferUpdateInfo):
        """One bucket: its tensors' names, dtypes and shapes, in the order of its bytes."""

        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

        def __post_init__(self):
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError("names, dtype_names and shapes of a bucket differ in length")

    class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
        """The server side of ``rlep_gloo`` (see the module docstring)."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config, vllm_config, device, model):
            super().__init__(config, vllm_config, device, model)
            self.group = None
            self._store = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            pc = self.parallel_config
            rank = (init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank)
            self.group, self._store = _gloo_group(
                init_info.master_address, init_info.master_port, rank, init_info.world_size,
                init_info.timeout_s, is_master=False)

        def start_weight_update(self) -> None:
            from rlep_megatron.rollout import vllm_reload

            vllm_reload.begin(self.model)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # vLLM's default ends with torch.accelerator.synchronize(): nothing to wait for on
            # the host, and a GPU copy below is synchronised where it happens
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            from rlep_megatron.rollout import vllm_reload

            if self.group is None:
                raise RuntimeError("rlep_gloo weight transfer used before "
                                   "/init_weight_transfer_engine")
            nbytes = sum(math.prod(s) * getattr(torch, d).itemsize
                         for d, s in zip(update_info.dtype_names, update_info.shapes))
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            self.group.broadcast(buffer, 0).wait()
            if self.device.type != "cpu":
                buffer = buffer.to(self.device)
            tensors = _byte_views(buffer, update_info.dtype_names, update_info.shapes)
            vllm_reload.load(self.model, list(zip(update_info.names, tensors)))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

        def finish_weight_update(self) -> None:
            from rlep_megatron.rollout import vllm_reload

            vllm_reload.finish(self.model, self.model_config)

        def shutdown(self) -> None:
            self.group, self._store = None, None

    return {"GlooInitInfo": GlooInitInfo, "GlooUpdateInfo": GlooUpdateInfo,
            "GlooWeightTransferEngine": GlooWeightTransferEngine}


def _build_trainer_side() -> dict:
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo,
                                                       TrainerWeightTransferEngine)

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """The trainer's end: where its store listens and how many workers the server has."""

        backend: ClassVar[str] = BACKEND

        master_address: str = "127.0.0.1"
        master_port: int = 0
        num_workers: int = 1
        timeout_s: float = 300.0
        bucket_bytes: int = 512 * 1024 * 1024
        servers: str = "the rollout server"  # how errors name the servers (their URLs)

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """The trainer side of ``rlep_gloo``: the sending rank (group rank 0) streams; other
        trainer ranks only walk the source, whose gathers are their collectives."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client, source=None, is_sender=True, info=None):
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.info = info
            self.group = None
            self._store = None

        @classmethod
        def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
            self = cls(client=client, source=source, is_sender=init_info.is_sender,
                       info=init_info)
            if not self.is_sender:
                return self
            self.group, self._store = _rendezvous(init_info, client)
            return self

        def send_weights(self, weights: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
                         version: Optional[str] = None) -> None:
            """Stream ``weights`` (default: the source) through one start / update... / finish
            round; ``version`` labels the new weights on the server."""
            self.start_update()
            self.send_stream(self.source if weights is None else weights)
            self.finish_update(version)

        def start_update(self) -> None:
            if self.is_sender:
                self.client.start_weight_update()

        def send_stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
            """The update's tensors in buckets of at most ``bucket_bytes`` (a rank that does
            not send only walks the stream, whose gathers are its collectives)."""
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in weights:
                if not self.is_sender:
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                if bucket and size + nbytes > self.info.bucket_bytes:
                    self._send_bucket(bucket)
                    bucket, size = [], 0
                bucket.append((name, tensor))
                size += nbytes
            if self.is_sender and bucket:
                self._send_bucket(bucket)

        def finish_update(self, version: Optional[str] = None) -> None:
            if self.is_sender:
                self.client.finish_weight_update(version)

        def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
            flat = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
                              for _, t in bucket])
            meta = {"names": [n for n, _ in bucket],
                    "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket]}
            errors: list[BaseException] = []

            def server_receives():
                try:
                    self.client.update_weights(meta)
                except BaseException as err:
                    errors.append(err)

            # the server's workers enter the broadcast inside the request
            receiver = threading.Thread(target=server_receives, daemon=True)
            receiver.start()
            work = self.group.broadcast(flat, 0)
            _wait(lambda: work.is_completed() and not receiver.is_alive(), errors,
                  self.info.timeout_s,
                  f"a weight bucket's transfer to the rollout server(s) {self.info.servers}")

        def shutdown(self) -> None:
            self.group, self._store = None, None

    return {"GlooTrainerInitInfo": GlooTrainerInitInfo,
            "GlooTrainerWeightTransferEngine": GlooTrainerWeightTransferEngine}
