"""Process-group initialisation, megatron-core parallel state, rank helpers and rank-aware logging.

Runs under ``torchrun`` (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or alone
as a single rank. The layout (TP, PP, virtual PP, CP; DP is what remains) is validated against
the world size and the model's shape before megatron-core sees it, so a bad layout fails with a
message naming the numbers instead of deep inside megatron.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from rlep_megatron import platform
from rlep_megatron.config import ParallelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in the layout; passed to the components that need it."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel_rank: int
    pipeline_model_parallel_rank: int
    data_parallel_rank: int

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def validate_parallel_layout(world_size: int, parallel: ParallelConfig,
                             num_attention_heads: Optional[int] = None,
                             num_query_groups: Optional[int] = None,
                             num_layers: Optional[int] = None,
                             num_experts: Optional[int] = None) -> int:
    """Check a layout; returns the data-parallel size. Raises ValueError naming the numbers.
    ``num_experts``: the model's routed experts (0 or None for a dense model)."""
    tp = parallel.tensor_model_parallel_size
    pp = parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) x "
            f"pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}) = "
            f"{model_parallel}; launch a multiple of {model_parallel} processes")
    if num_attention_heads is not None and num_attention_heads % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} does not divide the number of attention heads "
            f"({num_attention_heads}); choose a divisor of {num_attention_heads}")
    if num_query_groups is not None and num_query_groups % tp:
        raise ValueError(
            f"tensor_model_parallel_size={tp} does not divide the number of query groups "
            f"(key/value heads, {num_query_groups}); choose a divisor of {num_query_groups}")
    if num_layers is not None:
        chunks = pp * (parallel.virtual_pipeline_model_parallel_size or 1)
        if num_layers % chunks:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pipeline_model_parallel_size "
                f"({pp}) x virtual_pipeline_model_parallel_size "
                f"({parallel.virtual_pipeline_model_parallel_size or 1}) = {chunks}")
    ep = parallel.expert_model_parallel_size
    if ep > 1 and num_experts is not None and not num_experts:
        raise ValueError(f"expert_model_parallel_size={ep} needs a mixture-of-experts model; "
                         "this one is dense: use 1")
    if num_experts and tp > 1 and not parallel.sequence_parallel:
        raise ValueError(f"a mixture-of-experts model at tensor_model_parallel_size={tp} needs "
                         "parallel.sequence_parallel=true (megatron-core's MoE layer trains "
                         "only with it at TP > 1)")
    if num_experts and num_experts % ep:
        raise ValueError(f"expert_model_parallel_size={ep} does not divide the model's "
                         f"{num_experts} experts; choose a divisor of {num_experts}")
    # experts are split over EP x (expert) TP within a pipeline stage (megatron: the
    # expert-tensor-parallel size is the TP size)
    if world_size % (ep * tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by "
                         f"expert_model_parallel_size ({ep}) x tensor_model_parallel_size "
                         f"({tp}) x pipeline_model_parallel_size ({pp}) = {ep * tp * pp}")
    return world_size // model_parallel


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_process_group(timeout_minutes: int = 30) -> platform.Platform:
    """Initialise torch.distributed from torchrun's environment, or as a single rank."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    plat = platform.select_platform(local_rank)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=plat.backend, timeout=datetime.timedelta(minutes=timeout_minutes),
            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    platform.install_megatron_cpu_shim()
    return plat


# per launch attempt (torchrun --max-restarts): a new attempt never reads the last one's keys
_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
_ROLLOUT_URL_KEY = f"rlep/{_ATTEMPT}/rollout_url/"
ROLLOUT_DONE_KEY = f"rlep/{_ATTEMPT}/rollout_done"


def job_store(timeout_minutes: float = 15.0):
    """A client of the torchrun job's rendezvous store (``MASTER_ADDR:MASTER_PORT``): how the
    rollout ranks of ``rollout.placement: separate`` and the trainers find each other."""
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(minutes=timeout_minutes))


ROLE_ENV = "RLEP_NODE_ROLE"
_ROLE_KEY = f"rlep/{_ATTEMPT}/role/"


def _node_role() -> Optional[str]:
    role = os.environ.get(ROLE_ENV, "").strip().lower()
    if role not in ("", "train", "rollout"):
        raise ValueError(f"{ROLE_ENV}={os.environ[ROLE_ENV]!r}: a node's role is train or "
                         "rollout (NODE_ROLE of scripts/train_multinode.sh)")
    return role or None


def assign_roles(roles: list[Optional[str]], num_ranks: int) -> list[tuple[str, int]]:
    """Each global rank's part, ``("train", new rank)`` or ``("rollout", server index)``,
    from the ranks' node roles (``None``: not set). With no role set anywhere, the last
    ``num_ranks`` ranks serve; with roles, the ranks of rollout nodes serve, whatever their
    global ranks (torchrun's c10d rendezvous numbers nodes in its own order, not by
    ``--node-rank``). Training ranks keep their order."""
    world = len(roles)
    if num_ranks >= world:
        raise ValueError(f"rollout.num_ranks={num_ranks} leaves no training rank in a job of "
                         f"{world}; launch more processes (torchrun --nproc-per-node) or "
                         f"lower it")
    if all(role is None for role in roles):
        roles = ["train"] * (world - num_ranks) + ["rollout"] * num_ranks
    elif any(role is None for role in roles):
        unset = [rank for rank, role in enumerate(roles) if role is None]
        raise ValueError(f"{ROLE_ENV} is set on some nodes and not on others (not on global "
                         f"ranks {unset}): set NODE_ROLE=train or rollout on every node")
    serving = roles.count("rollout")
    if serving != num_ranks:
        raise ValueError(f"rollout.num_ranks={num_ranks}, but {serving} rank(s) run on nodes "
                         f"whose {ROLE_ENV} is rollout: make them agree (num_ranks = rollout "
                         "nodes x GPUs per node)")
    counters = {"train": 0, "rollout": 0}
    parts = []
    for role in roles:
        parts.append((role, counters[role]))
        counters[role] += 1
    return parts


def split_rollout_ranks(num_ranks: int) -> Optional[int]:
    """``rollout.num_ranks``: that many ranks of the torchrun job run the vLLM servers and the
    others train (which ones: :func:`assign_roles`, from each node's ``RLEP_NODE_ROLE``).
    Returns this rank's server index, or ``None`` on a training rank, whose ``RANK`` and
    ``WORLD_SIZE`` then count the training ranks only (they form the process group; the
    servers are no members). Call before :func:`init_process_group`."""
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ValueError("rollout.num_ranks needs a torchrun launch (its last ranks start the "
                         "vLLM servers); with no launcher, start a server yourself and give "
                         "rollout.server_urls")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    own = _node_role()
    if num_ranks >= world:
        assign_roles([own] * world, num_ranks)  # the error, before any store is reached
    # the roles travel through torchrun's agent store, which exists before any process group
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if own is not None and not agent_store:
        raise ValueError(f"{ROLE_ENV} needs a torchrun launch (its agent store carries the "
                         "nodes' roles); with another launcher leave it unset: the last "
                         "rollout.num_ranks ranks then serve")
    os.environ.setdefault("RLEP_GLOBAL_RANK", str(rank))  # before any renumbering
    if not agent_store:
        roles = [None] * world  # no roles: the last ranks serve
    else:
        store = job_store()
        store.set(f"{_ROLE_KEY}{rank}", own or "")
        roles = [store.get(f"{_ROLE_KEY}{r}").decode() or None for r in range(world)]
    part, number = assign_roles(roles, num_ranks)[rank]
    if part == "rollout":
        return number
    os.environ["RANK"] = str(number)
    os.environ["WORLD_SIZE"] = str(world - num_ranks)
    return None


def publish_rollout_url(index: int, url: str) -> None:
    job_store().set(f"{_ROLLOUT_URL_KEY}{index}", url)


def rollout_urls(num_ranks: int, timeout_minutes: float = 15.0) -> list[str]:
    """The servers' URLs the rollout ranks published (waits for them to start)."""
    store = job_store(timeout_minutes)
    return [store.get(f"{_ROLLOUT_URL_KEY}{i}").decode() for i in range(num_ranks)]


_SEQUENCE_PARALLEL = False


def sequence_parallel() -> bool:
    """Whether the model-parallel layout of :func:`init_model_parallel` splits sequences
    across the tensor-parallel ranks (``parallel.sequence_parallel``); models built afterwards
    follow it."""
    return _SEQUENCE_PARALLEL


def set_sequence_parallel(value: bool) -> None:
    """Set what :func:`sequence_parallel` answers (``rlep plan`` restores it after building
    each pipeline stage's skeleton)."""
    global _SEQUENCE_PARALLEL
    _SEQUENCE_PARALLEL = value


def init_model_parallel(parallel: ParallelConfig, seed: int,
                        num_attention_heads: Optional[int] = None,
                        num_query_groups: Optional[int] = None,
                        num_layers: Optional[int] = None,
                        num_experts: Optional[int] = None) -> ParallelContext:
    """Process group + megatron-core model-parallel groups + model-parallel RNG seeds."""
    plat = init_process_group()
    world_size = torch.distributed.get_world_size()
    validate_parallel_layout(world_size, parallel, num_attention_heads, num_query_groups,
                             num_layers, num_experts)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_megatron_groups(parallel)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return current_context(plat.device)


def initialize_megatron_groups(parallel: ParallelConfig, gloo_groups: bool = True) -> None:
    """megatron-core's model-parallel groups of the layout (on an initialised process group),
    and the sequence-parallel flag that models built afterwards follow. ``gloo_groups=False``
    skips megatron's extra gloo groups (a simulated process group has no gloo)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        create_gloo_process_groups=gloo_groups,
    )
    global _SEQUENCE_PARALLEL
    _SEQUENCE_PARALLEL = parallel.sequence_parallel


def current_context(device: Optional[torch.device] = None) -> ParallelContext:
    from megatron.core import parallel_state as ps

    if device is None:
        device = platform.select_platform(int(os.environ.get("LOCAL_RANK", "0"))).device
    return ParallelContext(
        rank=torch.distributed.get_rank(),
        world_size=torch.distributed.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        device=device,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        tensor_model_parallel_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_model_parallel_rank=ps.get_pipeline_model_parallel_rank(),
        data_parallel_rank=ps.get_data_parallel_rank(),
    )


_ROLLOUT_GROUP = None


def rollout_group(timeout_minutes: float = 180.0):
    """A gloo group over the whole world for the rollout's object collectives (the gather of
    responses, the delivery of routing tables): host memory, and its own timeout
    (``rollout.gather_timeout_minutes``), so that a replica that finishes early waits for the
    slowest one there and not inside a GPU collective's watchdog. Created by the first call
    (collective: every rank makes it at the same point, when the rollout engine is built)."""
    global _ROLLOUT_GROUP
    if _ROLLOUT_GROUP is None:
        _ROLLOUT_GROUP = torch.distributed.new_group(
            backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
    return _ROLLOUT_GROUP


def destroy() -> None:
    """Tear down megatron parallel state and the process group (safe to call twice)."""
    global _ROLLOUT_GROUP
    _ROLLOUT_GROUP = None
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def get_rank() -> int:
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def in_multi_rank_job() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def exit_now_if_multi_rank(code: int) -> None:
    """After a failure in a job of several ranks: flush the logs and end this process with
    ``code`` at once. Python's normal exit would run clean-ups that wait on the other ranks
    (the process group's destructor, vLLM's shutdown), which may be blocked in a collective
    that this rank will never join; a single-rank run returns normally."""
    if not in_multi_rank_job():
        return
    end_process(code)


def end_process(code: int) -> None:
    """Flush the logs and end this process with ``code`` at once, without the interpreter's
    own teardown (atexit hooks, module and object finalisers)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_rank0() -> bool:
    return get_rank() == 0


class _RankFilter(logging.Filter):
    def __init__(self, log_all_ranks: bool):
        super().__init__()
        self.log_all_ranks = log_all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = get_rank()
        record.rank = rank
        return self.log_all_ranks or rank == 0 or record.levelno >= logging.ERROR


def setup_logging(log_all_ranks: bool = False, level: int = logging.INFO) -> None:
    """Rank 0 prints INFO and above; other ranks print only errors unless ``log_all_ranks``."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_rlep_handler", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._rlep_handler = True
    handler.addFilter(_RankFilter(log_all_ranks))
    handler.setFormatter(logging.Formatter(
        "[%(asctime)s rank%(rank)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)


def map_across_ranks(function, items: list) -> list:
    """``function(share)`` on each rank's contiguous share of ``items`` (it must return one
    result per item); every rank gets all results back, in item order. Collective."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return list(function(list(items)))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    n = len(items)
    local = list(function(list(items[rank * n // world:(rank + 1) * n // world])))
    return [result for part in all_gather_object(local) for result in part]


def communication_device(group=None) -> torch.device:
    """Where tensors of a collective on ``group`` must live: the current CUDA device for NCCL
    (which handles CUDA tensors only), the CPU for gloo."""
    backend = torch.distributed.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# collectives: package code calls these, never torch.distributed's directly (a unit test checks
# it), so a tensor built on the CPU never reaches NCCL, which takes CUDA tensors only
# ---------------------------------------------------------------------------------------------

_OPS = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}


def _on_comm_device(tensor: torch.Tensor, group) -> torch.Tensor:
    device = communication_device(group)
    return tensor if tensor.device == device else tensor.to(device)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place all-reduce (``sum`` or ``max``) of ``tensor`` wherever it lives; returns it.
    Collective."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    work = _on_comm_device(tensor, group)
    torch.distributed.all_reduce(work, op=_OPS[op], group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """In-place broadcast of ``tensor`` from global rank ``src``; returns it. Collective."""
    work = _on_comm_device(tensor, group)
    torch.distributed.broadcast(work, src=src, group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def all_gather(outputs: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` into ``outputs`` (one per rank of ``group``). Collective."""
    device = communication_device(group)
    if tensor.device == device and all(o.device == device for o in outputs):
        torch.distributed.all_gather(outputs, tensor, group=group)
        return
    work = [torch.empty_like(o, device=device) for o in outputs]
    torch.distributed.all_gather(work, tensor.to(device), group=group)
    for out, got in zip(outputs, work):
        out.copy_(got)


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj``, in rank order. Collective."""
    gathered: list = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, obj, group=group)
    return gathered


def barrier(group=None) -> None:
    """Wait for every rank of ``group``. Collective."""
    torch.distributed.barrier(group=group)


def reduce_values(values: dict[str, float], op: str = "sum", group=None) -> dict[str, float]:
    """Named floats reduced over ``group`` (``sum`` or ``max``) in float64, one collective;
    every rank gets the result. Collective."""
    keys = sorted(values)
    if not torch.distributed.is_initialized() or not keys:
        return dict(values)
    buffer = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    return dict(zip(keys, all_reduce(buffer, op, group).tolist()))


def broadcast_values(values: dict[str, float], src: int, group=None) -> dict[str, float]:
    """Named floats of global rank ``src`` on every rank of ``group`` (float64, one
    collective). Collective."""
    keys = sorted(values)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return dict(values)
    buffer = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    return dict(zip(keys, broadcast(buffer, src, group).tolist()))
