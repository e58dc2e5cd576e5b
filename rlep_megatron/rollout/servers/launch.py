"""Starting ``vllm serve`` processes: the arguments and environment a rollout server needs, a
server started here (:class:`LocalServer`), and the rollout ranks of separate placement
(:func:`serve_rollout_rank`)."""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from rlep_megatron.rollout.servers.client import RolloutServerError
from rlep_megatron.rollout.servers.weights import advertised_address

logger = logging.getLogger(__name__)


def serve_arguments(model_dir: str, cfg, *, port: int, host: str = "127.0.0.1",
                    dtype: str = "auto", seed: int = 0, max_model_len: int = 4096,
                    cuda: Optional[bool] = None, owns_gpu: bool = False,
                    lora_rank: int = 0) -> list[str]:
    """The ``vllm serve`` arguments a rollout server needs (``rollout`` config ``cfg``): the
    token-in/out route (``--enable-scale-out``), the weight-transfer backend, the processed
    log-probs the actor compares with, and on the CPU build the settings of the colocated
    engine (:func:`~rlep_megatron.platform.vllm_cpu_engine_settings`), its KV cache sized to
    the model in ``model_dir``. ``lora_rank``
    (``rollout.lora_sync=adapter``): the server loads the base from ``model_dir`` itself and
    takes the policy as LoRA adapters of that rank
    (:mod:`~rlep_megatron.rollout.servers.adapters`); otherwise it starts with dummy weights,
    which the first weight update fills. Also needs ``VLLM_SERVER_DEV_MODE=1`` in its
    environment (:func:`serve_environment`)."""
    from rlep_megatron import platform

    cuda = platform.cuda_available() if cuda is None else cuda
    backend = "nccl" if cuda else "rlep_gloo"
    args = ["--model", model_dir, "--host", host, "--port", str(port), "--dtype", dtype,
            "--seed", str(seed), "--max-model-len", str(max_model_len),
            "--tensor-parallel-size", str(cfg.tensor_model_parallel_size),
            "--logprobs-mode", "processed_logprobs", "--enable-scale-out",
            "--weight-transfer-config", json.dumps({"backend": backend}),
            "--disable-uvicorn-access-log"]
    if lora_rank:
        from rlep_megatron.rollout.servers.adapters import serve_flags

        args += serve_flags(lora_rank)
    else:
        args += ["--load-format", "dummy"]
    if cfg.server_log_requests:
        args.append("--enable-log-requests")  # INFO lines: serve_environment(log_requests)
    if cuda:  # a rollout rank's server owns its GPU (no actor beside it)
        fraction = cfg.server_gpu_memory_utilization if owns_gpu else cfg.gpu_memory_utilization
        args += ["--gpu-memory-utilization", str(fraction)]
    else:
        from rlep_megatron.platform.vllm_cpu import cpu_kv_cache_bytes

        with open(os.path.join(model_dir, "config.json")) as f:
            kv_bytes = cpu_kv_cache_bytes(json.load(f), max_model_len,
                                          cfg.tensor_model_parallel_size)
        args += ["--enforce-eager", "--no-enable-chunked-prefill",
                 "--max-num-batched-tokens", str(max(max_model_len, 8192)),
                 "--kv-cache-memory-bytes", str(kv_bytes)]
    return args


def serve_environment(threads: Optional[int] = None, log_requests: bool = False,
                      lora: bool = False) -> dict[str, str]:
    """The environment of a rollout server: its weight-update and pause routes on
    (``VLLM_SERVER_DEV_MODE``; ``lora``: and its adapter routes,
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), no hub, ``threads`` CPU threads (the CPU build's KV
    cache size is an argument: :func:`serve_arguments`). Without a GPU, a one-rank server runs
    its model in the engine-core process, as vLLM does on a GPU
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the CPU build otherwise adds a worker process, which
    starts in about 10 s more)."""
    from rlep_megatron import platform

    env = dict(os.environ)
    env.update(VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1")
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if not platform.cuda_available():
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if log_requests:  # vLLM logs each request at INFO (the job's default level is WARNING)
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)  # the server is no member of the job's process group
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """In the server's process before it starts: end it when the process that started it
    ends, even by SIGKILL (Linux's parent-death signal)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    os.setsid()


# a rollout rank's server binds the free port it was given seconds later, after its imports:
# another process may take the port in between, and the server then starts again on another
PORT_ATTEMPTS = 3
PORT_TAKEN = "Address already in use"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalServer:
    """A ``vllm serve`` process started here (a rollout rank's, or a test's), which ends with
    this process."""

    def __init__(self, model_dir: str, cfg, *, host: str = "127.0.0.1",
                 advertise: Optional[str] = None, port: Optional[int] = None,
                 log_path: Optional[str] = None, threads: Optional[int] = None, **kwargs):
        self.port = port or free_port(host if host != "0.0.0.0" else "127.0.0.1")
        self.url = f"http://{advertise or host}:{self.port}"
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                   *serve_arguments(model_dir, cfg, port=self.port, host=host, **kwargs)]
        self.log_path = log_path
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        env = serve_environment(threads, cfg.server_log_requests,
                                lora=bool(kwargs.get("lora_rank")))
        # vLLM's front end and its engine core meet on ZeroMQ sockets in VLLM_RPC_BASE_PATH
        # (the temporary directory itself by default), which a server that does not shut down
        # cleanly leaves behind: a directory of this server's own, removed when it stops
        self._rpc_dir = None
        if "VLLM_RPC_BASE_PATH" not in env:
            self._rpc_dir = env["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="rlep-vllm-rpc-")
        self.process = subprocess.Popen(command, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def log_tail(self, lines: int = 15) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def wait_ready(self, timeout_s: float = 600.0) -> str:
        """Block until the server answers ``/health``; an error with its log's tail if it
        exits first or takes longer than ``timeout_s``."""
        import requests

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise RolloutServerError(f"the rollout server {self.url} exited with code {code} "
                                         f"while starting:\n{self.log_tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            time.sleep(0.5)
        raise RolloutServerError(f"the rollout server {self.url} did not start within "
                                 f"{timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        if self._rpc_dir:
            shutil.rmtree(self._rpc_dir, ignore_errors=True)


def adapter_rank(cfg) -> int:
    """The LoRA rank the run's servers take adapters of (``rollout.lora_sync=adapter``), else
    0 (they take full weights)."""
    return cfg.lora.rank if cfg.syncs_adapters else 0


def serve_rollout_rank(cfg, index: int) -> None:
    """A rollout rank of ``rollout.placement: separate`` (``rollout.num_ranks``): start a
    vLLM server on this node, publish its URL to the job, and watch it until the trainers are
    done. A server that exits early ends this rank with its exit code and log, which ends the
    job (torchrun stops the other ranks)."""
    from rlep_megatron import distributed
    from rlep_megatron.models.megatron import resolve_dtype

    rcfg = cfg.rollout
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    log_path = os.path.join(cfg.trainer.output_dir, f"rollout_server_{index}.log")
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    advertise = os.environ.get("RLEP_ADVERTISE_ADDR") or advertised_address(f"http://{master}")
    threads = int(os.environ["OMP_NUM_THREADS"]) if os.environ.get("OMP_NUM_THREADS") else None
    from rlep_megatron import platform

    if platform.cuda_available():  # the GPU of this rank's slot on its node
        local = int(os.environ.get("LOCAL_RANK", "0"))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in
                                                       range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[local]
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server = LocalServer(cfg.model.hf_dir, rcfg, host="0.0.0.0", advertise=advertise,
                             log_path=log_path, threads=threads,
                             dtype=str(resolve_dtype(cfg.model.params_dtype)).split(".")[-1],
                             seed=cfg.trainer.seed, owns_gpu=True,
                             max_model_len=cfg.data.max_prompt_tokens + rcfg.max_response_tokens,
                             lora_rank=adapter_rank(cfg))
        try:
            url = server.wait_ready()
            break
        except BaseException as err:
            server.stop()
            # the free port was taken by another process before the server bound it
            taken = isinstance(err, RolloutServerError) and PORT_TAKEN in str(err)
            if not taken or attempt == PORT_ATTEMPTS:
                raise
            logger.warning("rollout rank %d: the vLLM server's port %d was taken before it "
                           "bound it; starting it on another port (attempt %d of %d)", index,
                           server.port, attempt + 1, PORT_ATTEMPTS)
    try:
        logger.info("rollout rank %d: vLLM server %s ready (log: %s)", index, url, log_path)
        distributed.publish_rollout_url(index, url)
        store = distributed.job_store()
        while not store.check([distributed.ROLLOUT_DONE_KEY]):
            code = server.process.poll()
            if code is not None:
                raise RolloutServerError(f"rollout rank {index}: the vLLM server {url} exited "
                                         f"with code {code}:\n{server.log_tail()}")
            time.sleep(1.0)
        logger.info("rollout rank %d: the trainers are done; stopping the server", index)
    finally:
        server.stop()
