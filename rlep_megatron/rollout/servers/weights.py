"""The trainer end of a weight update of the rollout servers (``rollout.placement:
separate``): vLLM's weight-transfer lifecycle (``/start_weight_update``, ``/update_weights`` per
bucket, ``/finish_weight_update`` with the policy version) over vLLM's ``nccl`` engine on GPU
(never run yet) or ``rlep_gloo`` (:mod:`rlep_megatron.rollout.servers.gloo_transfer`) on the host.

The tensors are the HF-named ones of :class:`~rlep_megatron.weight_sync.WeightStreamer`, in its
order, one bucket at a time; global rank 0 sends them.
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterable, Iterator, Optional

import torch


def _synchronize_device(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def produced(weights: Iterable[tuple[str, torch.Tensor]], synchronize=_synchronize_device
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, each device tensor handed on only once the stream that produced it (the
    current stream: the weight stream's gathers and HF conversions run there) has finished.
    vLLM's NCCL trainer engine packs the tensors it is given on side streams of its own, which
    wait for nothing queued on the current stream: a tensor handed on earlier could be read
    before it is written. Waiting per tensor costs little, as a bucket's tensors are done
    together (the first wait of a bucket is its gather)."""
    for name, tensor in weights:
        if tensor.is_cuda:
            synchronize(tensor.device)
        yield name, tensor


class TransferStalled(TimeoutError):
    """A weight transfer to the rollout servers did not complete within its deadline."""


def within_deadline(action, timeout_s: float, what: str):
    """``action()`` on a helper thread, its result or error returned or raised here; a
    ``TransferStalled`` naming ``what`` if it has not finished within ``timeout_s`` (the
    helper, stuck in a collective that cannot be cancelled, is left behind: the job ends)."""
    import threading

    outcome: dict = {}
    # the current CUDA device and stream are per thread: the helper takes the caller's
    device = stream = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        stream = torch.cuda.current_stream(device)

    def run():
        try:
            if device is not None:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    outcome["result"] = action()
                return
            outcome["result"] = action()
        except BaseException as err:  # re-raised on the caller's thread
            outcome["error"] = err

    helper = threading.Thread(target=run, daemon=True, name="rlep-weight-transfer")
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        raise TransferStalled(f"{what} did not complete within {timeout_s:.0f} s: the server "
                              "stopped taking the weights (it hangs, or its GPU link does); "
                              "the job ends (rollout.server_timeout_s sets the deadline, "
                              "at least 300 s)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


class ServerWeights:
    """The transfer engine of this trainer (global rank 0) to every server behind ``clients``
    (a :class:`~rlep_megatron.rollout.servers.client.FanOutClient`); they join the transfer group at
    this host's ``port``."""

    def __init__(self, clients, url: str, *, port: int, bucket_bytes: int, timeout_s: float):
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from rlep_megatron import platform
        from rlep_megatron.rollout.servers import gloo_transfer

        gloo_transfer.register()
        self.clients = clients
        self.timeout_s = max(300.0, timeout_s)
        self.servers = ", ".join(client.url for client in clients.clients)
        address = advertised_address(url)
        workers = sum(clients.workers)
        if platform.cuda_available():
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(master_address=address, master_port=port,
                                       world_size=1 + workers, rank=0)
            self.source = stream_source()
            self.transfer = WeightTransferTrainerFactory.trainer_init(info, client=clients,
                                                                      source=self.source)
        else:
            self.source = None
            info = gloo_transfer.GlooTrainerInitInfo(
                master_address=address, master_port=port,
                num_workers=workers, timeout_s=self.timeout_s, servers=self.servers,
                bucket_bytes=bucket_bytes, rank=0)
            self.transfer = WeightTransferTrainerFactory.trainer_init(info, client=clients)

    def plan(self, plan: list) -> None:
        """The names, dtypes and shapes of the weight stream, which vLLM's NCCL engine sends
        ahead of the tensors."""
        if self.source is not None:
            plan_source(self.source, plan)

    # one update of every server (the lifecycle of rlep_megatron.weight_sync.lifecycle)
    def start(self) -> None:
        if self.source is None:  # vLLM's NCCL engine starts the update inside its send
            self.transfer.start_update()

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.source is not None:  # vLLM's NCCL engine reads a source
            # one bucket at a time, each tensor complete before vLLM's side streams read it;
            # NCCL sends device memory (a checkpoint read from disk is on the host)
            self.source.pairs = produced((name, tensor if tensor.is_cuda else tensor.cuda())
                                         for name, tensor in weights)
            # PyNccl has no watchdog: a server that stalls inside the broadcast (while its
            # /health still answers) would block this rank for ever
            within_deadline(self.transfer.send_weights, self.timeout_s,
                            f"the weight transfer to the rollout server(s) {self.servers}")
            self.source.pairs = iter(())
        else:
            self.transfer.send_stream(weights)

    def finish(self, label: Optional[str]) -> None:
        """``label`` becomes the servers' weight version; their prefix caches are reset."""
        if self.source is not None:
            if label is not None:
                self.clients.update_weight_version(label)
        else:
            self.transfer.finish_update(label)
        self.clients.reset_prefix_cache()

    def close(self) -> None:
        """Both ends drop the transfer group: this trainer's engine, and the servers, which
        may outlive the job (best effort)."""
        with contextlib.suppress(Exception):
            self.transfer.shutdown()
        for client in self.clients.clients:
            with contextlib.suppress(Exception):
                client.call("POST", "/shutdown_weight_transfer_engine", timeout=10)


def plan_source(source, plan: list) -> None:
    """Give ``source`` (:func:`stream_source`) the ``(name, dtype, shape)`` of every tensor of
    the stream, in order."""
    source.plan = [(name, dtype, tuple(shape)) for name, dtype, shape in plan]


def stream_source():
    """A ``WeightSource`` for vLLM's NCCL trainer engine over the pairs of one sync (the
    weight stream's tensors of this update, set as ``pairs`` before each send)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class _StreamSource(WeightSource):
        pairs = iter(())
        plan: list = []  # (name, dtype, shape) of every tensor, in stream order

        def metadata(self):
            if not self.plan:
                raise RuntimeError("the weight stream's plan was not given "
                                   "(ServerWeights.plan)")
            return [ParamMeta(name, dtype, shape) for name, dtype, shape in self.plan]

        def __iter__(self):
            return self.pairs

    return _StreamSource()


def advertised_address(url: str) -> str:
    """This host's address as the server at ``url`` reaches it: ``RLEP_ADVERTISE_ADDR``, else
    the address of the interface that routes to the server, else loopback."""
    from urllib.parse import urlparse

    explicit = os.environ.get("RLEP_ADVERTISE_ADDR")
    if explicit:
        return explicit
    host = urlparse(url).hostname or "127.0.0.1"
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]
    return "127.0.0.1"
