"""``rollout.lora_sync=adapter`` on the rollout servers: each server loads the frozen base from
``model.hf_dir`` itself and serves the policy as a vLLM LoRA adapter; each weight update moves
the adapter's tensors alone.

Trainer end (:class:`ServerAdapters`, global rank 0): the update's tensors (PEFT names, from
:class:`~rlep_megatron.weight_sync.adapters.AdapterStreamer`) become one safetensors file, sent
in parts over the servers' ``/collective_rpc`` route to :class:`AdapterWorkerExtension`, which
writes it as a PEFT directory on the server's host (one per server: servers may share a
host); ``/v1/load_lora_adapter`` then loads it under a new name (a new LoRA id per update:
neither vLLM's adapter cache nor its prefix cache reuses the previous policy's), the generate
requests name it, and the previous adapter is unloaded and its directory removed. The same
path on GPU and CPU servers: the bytes are few.

Server end: ``vllm serve`` with :func:`serve_flags` (vLLM's LoRA with one slot of the run's
rank, this module's worker extension) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``
(:func:`~rlep_megatron.rollout.servers.launch.serve_environment`).
"""
from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import uuid
from typing import Iterable, Optional

import torch

from rlep_megatron.rollout.servers.client import RolloutServerError

logger = logging.getLogger(__name__)

WORKER_EXTENSION = f"{__name__}.AdapterWorkerExtension"
PART_BYTES = 32 * 1024 ** 2  # raw bytes per /collective_rpc call (base64 adds a third)
# an adapter's directory on a server's host: rlep-<job>-s<server>-<update> (servers of one
# job may share a host: each writes its own)
_DIRECTORY = re.compile(r"^rlep-[0-9a-f]+-s\d+-\d+$")


def serve_flags(rank: int) -> list[str]:
    """The ``vllm serve`` flags of a server that takes the policy as adapters of ``rank``."""
    from rlep_megatron.lora.serving import serve_flags as lora_flags

    return [*lora_flags(rank), "--worker-extension-cls", WORKER_EXTENSION]


class ServerAdapters:
    """The delivery of adapter-mode weight updates to every server behind ``clients`` (a
    :class:`~rlep_megatron.rollout.servers.client.FanOutClient`); the interface of
    :class:`~rlep_megatron.rollout.servers.weights.ServerWeights`. ``lora``: the run's
    ``lora`` section; ``base_model``: the base's directory, as the adapters' config names it.
    Checks at once that every server serves LoRA adapters of this rank."""

    def __init__(self, clients, lora, base_model: str, *, timeout_s: float):
        self.clients, self.lora, self.base_model = clients, lora, base_model
        self.timeout_s = max(300.0, timeout_s)
        self.job = uuid.uuid4().hex[:12]  # names this job's adapters on the servers
        self.updates = 0
        self.current: Optional[str] = None  # the adapter the generate requests name
        self.received: dict[str, torch.Tensor] = {}
        self.check()

    def _rpc(self, client, method: str, *args: str, timeout_s: Optional[float] = None):
        return client.call("POST", "/collective_rpc", timeout=timeout_s or self.timeout_s,
                           json={"method": method, "args": list(args)})["results"]

    def check(self) -> None:
        from rlep_megatron.lora.serving import lora_slot_rank

        needed = lora_slot_rank(self.lora.rank)
        start = (f"start it with {' '.join(serve_flags(needed))} and "
                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment (rlep init "
                 "--rollout-servers prints the command), or use rollout.lora_sync=merged")
        for client in self.clients.clients:
            try:
                workers = self._rpc(client, "rlep_adapter_info")
                ranks = [int(w["max_lora_rank"]) for w in workers]
                updating = all(w["runtime_updating"] for w in workers)
            except (RolloutServerError, KeyError, TypeError, ValueError) as err:
                raise RolloutServerError(
                    f"rollout server {client.url} does not take LoRA adapters "
                    f"(rollout.lora_sync=adapter): {start} ({err})") from err
            if min(ranks) == 0 or not updating:
                lacking = ("--enable-lora" if min(ranks) == 0
                           else "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
                raise RolloutServerError(f"rollout server {client.url} runs without {lacking} "
                                         f"(rollout.lora_sync=adapter): {start}")
            if min(ranks) < self.lora.rank:
                raise RolloutServerError(
                    f"rollout server {client.url} serves LoRA adapters up to rank {min(ranks)}, "
                    f"below lora.rank={self.lora.rank}: start it with --max-lora-rank {needed}")

    def plan(self, plan: list) -> None:
        """Nothing to announce: the adapter goes as one file."""

    def start(self) -> None:
        self.received = {}

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.received[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def finish(self, label: Optional[str]) -> None:
        """Every server loads the update's adapter under a new name, which the generate
        requests name from here; ``label`` becomes the servers' weight version."""
        from safetensors.torch import save

        from rlep_megatron.lora import peft_io

        self.updates += 1
        name = f"rlep-{self.job}-{self.updates}"
        payload = save(self.received, metadata={"format": "pt"})
        config = json.dumps(peft_io.peft_config(self.lora, self.base_model,
                                                peft_io.targets_of(self.received)))
        parts = [base64.b64encode(payload[i:i + PART_BYTES]).decode("ascii")
                 for i in range(0, len(payload), PART_BYTES)] or [""]
        self.received = {}

        def load(client, server):
            directory = self._directory(server, self.updates)
            for index, part in enumerate(parts):
                self._rpc(client, "rlep_adapter_part", directory, str(index), part)
            path = self._rpc(client, "rlep_adapter_commit", directory, config)[0]
            client.call("POST", "/v1/load_lora_adapter", timeout=self.timeout_s,
                        json={"lora_name": name, "lora_path": path})

        self.clients.each(load)
        previous, self.current = self.current, name
        if label is not None:
            self.clients.update_weight_version(label)
        if previous is not None:
            for server, client in enumerate(self.clients.clients):
                self._drop(client, previous, self._directory(server, self.updates - 1))

    def _directory(self, server: int, update: int) -> str:
        return f"rlep-{self.job}-s{server}-{update}"

    def _drop(self, client, name: str, directory: str, timeout_s: float = 60.0) -> None:
        """The adapter ``name`` unloaded from ``client``'s server and its ``directory``
        removed; best effort (a server that fails here fails the next request or update)."""
        try:
            client.call("POST", "/v1/unload_lora_adapter", timeout=timeout_s,
                        json={"lora_name": name})
            self._rpc(client, "rlep_adapter_remove", directory, timeout_s=timeout_s)
        except RolloutServerError as err:
            logger.warning("could not remove the previous LoRA adapter %s from %s: %s", name,
                           client.url, err)

    def close(self) -> None:
        """This job's adapters gone from the servers, which may outlive it (best effort, also
        after a failure: nothing here waits on the trainer's other ranks)."""
        for server, client in enumerate(self.clients.clients):
            with contextlib.suppress(Exception):
                if self.current is not None:
                    client.call("POST", "/v1/unload_lora_adapter", timeout=10,
                                json={"lora_name": self.current})
            with contextlib.suppress(Exception):
                self._rpc(client, "rlep_adapter_remove", self._directory(server, 0), "job",
                          timeout_s=10)

    abandon = close


def _adapter_root() -> str:
    """Where a server's host keeps the adapters it was sent (one directory per adapter)."""
    import tempfile

    return os.path.join(tempfile.gettempdir(), "rlep-server-adapters")


def _checked(directory: str) -> str:
    if not _DIRECTORY.match(directory):
        raise ValueError(f"not an adapter directory of rlep: {directory!r}")
    return directory


class AdapterWorkerExtension:
    """Mixed into each vLLM worker of a server (``--worker-extension-cls``): the server end of
    :class:`ServerAdapters`. The first worker of each host writes; every worker answers (vLLM
    loads an adapter in each worker from the path)."""

    def rlep_adapter_info(self) -> dict:
        import vllm.envs as envs

        lora = self.vllm_config.lora_config
        return {"max_lora_rank": lora.max_lora_rank if lora is not None else 0,
                "runtime_updating": bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)}

    def _rlep_writes(self) -> bool:
        return self.local_rank == 0

    def rlep_adapter_part(self, directory: str, index: str, part: str) -> None:
        if not self._rlep_writes():
            return
        staging = os.path.join(_adapter_root(), f".{_checked(directory)}.partial")
        if index == "0":
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        with open(os.path.join(staging, "adapter_model.safetensors"), "ab") as f:
            f.write(base64.b64decode(part))

    def rlep_adapter_commit(self, directory: str, config: str) -> str:
        """The adapter's directory: its config written beside its weights, then moved into
        place whole."""
        final = os.path.join(_adapter_root(), _checked(directory))
        if self._rlep_writes():
            staging = os.path.join(_adapter_root(), f".{directory}.partial")
            with open(os.path.join(staging, "adapter_config.json"), "w") as f:
                f.write(config)
            os.replace(staging, final)
        return final

    def rlep_adapter_remove(self, directory: str, scope: str = "adapter") -> None:
        """Remove the adapter ``directory``, or (``scope`` ``job``) every one of the job and
        server that ``directory`` belongs to (its last ``-<update>`` dropped)."""
        import shutil

        if not self._rlep_writes():
            return
        root = _adapter_root()
        name = _checked(directory)
        prefix = name.rsplit("-", 1)[0] + "-" if scope == "job" else None
        for entry in (os.listdir(root) if os.path.isdir(root) else []):
            plain = entry.lstrip(".").removesuffix(".partial")
            if plain == name or (prefix is not None and plain.startswith(prefix)):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
