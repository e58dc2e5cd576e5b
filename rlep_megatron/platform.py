"""Device and backend choice, and the only place with CPU workarounds for megatron-core.

With CUDA: device ``cuda:<local_rank>`` and NCCL, megatron-core untouched.
Without CUDA: device ``cpu`` and gloo, and :func:`install_megatron_cpu_shim` makes megatron-core's
CUDA assumptions hold on CPU:

* megatron-core modules call ``torch.cuda.current_device()``, ``torch.cuda.synchronize()``,
  CUDA RNG functions and allocate with ``device="cuda"``. Rather than patching ``torch`` itself
  (which would change behaviour for vLLM and user code in the same process), each loaded
  ``megatron.core`` module gets a proxy in place of its ``torch`` global: the proxy forwards
  everything to torch except ``torch.cuda`` (answered by CPU equivalents) and the tensor factory
  functions (``device="cuda"`` becomes ``cpu``).
* a few megatron methods call ``tensor.cuda()`` (e.g. syncing tied embeddings between the first
  and last pipeline stage); :data:`_METHODS_USING_TENSOR_CUDA` run with ``Tensor.cuda`` as the
  identity for the duration of the call only.
* functions that assert CUDA tensor types (gradient clipping) are replaced, in the megatron
  modules that import them, by CPU versions with the same semantics (:data:`_CPU_FUNCTIONS`).
* gloo lacks the reduce-scatter and all-gather-into-tensor collectives that megatron's
  distributed optimizer uses, and the optimizer groups parameters by CUDA type names: the
  collectives are replaced by gloo equivalents in the modules that bind them, and
  :data:`_METHODS_CHECKING_CUDA_TYPES` run with ``Tensor.type()`` answering CUDA names.
* megatron's CUDA RNG tracker is replaced by :class:`CpuRNGStatesTracker`, which keeps its own
  ``torch.Generator`` states per name; mapping the tracker onto the global CPU generator makes
  megatron warn "CPU RNG state changed within GPU RNG context" and couples the streams.

The shim is active only when CUDA is absent (:func:`cuda_available` is false) and is idempotent.

vLLM's CPU backend needs a few settings and one fix-up, also kept here:
:func:`vllm_cpu_engine_settings` and :func:`refresh_vllm_cpu_embedding_kernels`.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import pkgutil
import sys
import types
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_SHIM_INSTALLED = False

# Megatron modules imported before the shim is installed; every one that references ``torch``
# gets the proxy. Listed explicitly so that modules which import optional GPU packages at import
# time (and fail on CPU) are not touched.
_MEGATRON_PACKAGES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel",
    "megatron.core.pipeline_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.models.common",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.fusions",
)


@dataclass(frozen=True)
class Platform:
    """What this process runs on."""

    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def cuda_available() -> bool:
    return torch.cuda.is_available()


DEVICE_MODES = ("auto", "cuda", "cpu")


class DeviceError(RuntimeError):
    """The device ``trainer.device`` asks for cannot be used here (reported without a
    traceback, before anything is built)."""


def nvidia_gpus() -> list[str]:
    """The NVIDIA GPUs the driver sees, one line each (``nvidia-smi -L``), whatever torch can
    use; empty without ``nvidia-smi`` or when it fails (no driver)."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listing.stdout.splitlines() if line.startswith("GPU ")]


def _nvidia_driver_version() -> str:
    import shutil
    import subprocess

    try:
        query = subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi",
                                "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        return query.stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _gpus_hidden_on_purpose() -> bool:
    """``CUDA_VISIBLE_DEVICES`` set to nothing, -1 or SLURM's ``NoDevFiles``: the GPUs are
    hidden from this process on purpose (the user's or the scheduler's choice)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip().lower() in ("", "-1", "nodevfiles")


def _vllm_is_cpu_build() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def choose_device(mode: str = "auto") -> str:
    """Decide, before any model or engine is built, what this process runs on
    (``trainer.device``) and return ``"cuda"`` or ``"cpu"``:

    * ``cuda``: torch must see a GPU, or an error says why it does not;
    * ``cpu``: hide the GPUs from this process (``CUDA_VISIBLE_DEVICES=""``, before CUDA is
      initialised), so torch, megatron-core and vLLM all run on the CPU;
    * ``auto``: CUDA when torch sees a GPU; the CPU when the machine has no NVIDIA GPU or they
      are hidden on purpose (``CUDA_VISIBLE_DEVICES=""``). A machine whose driver sees GPUs
      that torch cannot use (a driver older than torch's CUDA, a CPU build of torch) is an
      error naming the mismatch, not a silent fall-back that builds a large model on the CPU.
    """
    if mode not in DEVICE_MODES:
        raise ValueError(f"trainer.device must be one of {', '.join(DEVICE_MODES)}; "
                         f"got {mode!r}")
    if mode == "cpu":
        if torch.version.cuda is not None and not _vllm_is_cpu_build() and nvidia_gpus():
            # vLLM's CUDA build picks its platform through NVML, which ignores
            # CUDA_VISIBLE_DEVICES: its engine would look for a GPU and fail to start
            raise DeviceError("trainer.device=cpu on a GPU node needs the CPU stack (vLLM's "
                              "CPU build: scripts/setup.sh); this venv has vLLM's CUDA build")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():  # CUDA was initialised before the variable took effect
            raise DeviceError("trainer.device=cpu, but CUDA was initialised before the choice "
                               "could hide the GPUs; set CUDA_VISIBLE_DEVICES='' instead")
        return "cpu"
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()
    if usable:
        return "cuda"
    why = "; ".join(str(w.message).strip() for w in caught) or "torch.cuda.is_available() is False"
    gpus = [] if _gpus_hidden_on_purpose() else nvidia_gpus()
    if mode == "auto" and not gpus:
        return "cpu"
    where = (f"the NVIDIA driver {_nvidia_driver_version()} sees {len(gpus)} GPU(s) "
             f"({gpus[0]}{', ...' if len(gpus) > 1 else ''})" if gpus else
             "trainer.device=cuda")
    if torch.version.cuda is None:
        cause = (f"torch {torch.__version__} is a CPU build; install the CUDA build "
                 "(scripts/setup_gpu.sh)")
    else:
        cause = (f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use "
                 f"them ({why}); the driver is probably older than CUDA "
                 f"{torch.version.cuda} needs: update the driver, or install a torch built "
                 "for a CUDA the driver supports")
    raise DeviceError(f"{where}, but {cause}. To run on the CPU on purpose, set "
                       "trainer.device=cpu")


def select_platform(local_rank: int = 0) -> Platform:
    """CUDA + NCCL when a GPU is visible, CPU + gloo otherwise."""
    if cuda_available():
        torch.cuda.set_device(local_rank)
        return Platform(device=torch.device("cuda", local_rank), backend="nccl")
    return Platform(device=torch.device("cpu"), backend="gloo")


def fused_softmax_available() -> bool:
    """megatron's fused masked-softmax kernels (``scaled_upper_triang_masked_softmax_cuda``,
    ``scaled_masked_softmax_cuda``): built by apex / Megatron-LM, not by megatron-core's wheel.
    Without them ``masked_softmax_fusion`` would crash the local layer spec on a GPU as soon as
    a batch shape selects the fused path."""
    if not cuda_available():
        return False
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
    except Exception:
        return False
    return True


def megatron_config_overrides() -> dict:
    """TransformerConfig fields this platform needs. On gloo, pipeline stages must not batch
    their sends and receives: with PP=2 the previous and the next stage are the same rank, gloo
    matches messages to one peer in posting order, and megatron's batched op order then swaps
    activations and gradients of equal shape (silently wrong losses in the interleaved
    schedule). The unbatched path sends the two directions on two communicators."""
    return {} if cuda_available() else {"batch_p2p_comm": False}


@functools.lru_cache(maxsize=None)
def transformer_engine_status() -> tuple[bool, str]:
    """``(usable, why not)``: TransformerEngine needs CUDA and an importable
    ``transformer_engine.pytorch``; a broken install is reported with its import error."""
    if not cuda_available():
        return False, "no CUDA device (TransformerEngine and apex are GPU-only)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # a half-built install raises more than ImportError
        return False, f"importing transformer_engine.pytorch failed: {type(err).__name__}: {err}"
    return True, ""


TRANSFORMER_ENGINE_MODES = ("auto", "required", "off")


def use_transformer_engine(mode: str = "auto") -> bool:
    """Whether the actor takes TransformerEngine's layer spec (``model.transformer_engine``):
    ``auto`` when it is usable, ``off`` never, ``required`` always, or an error that says why
    it is not usable (a broken install shows its import error here rather than a silent switch
    to the slower local spec)."""
    if mode not in TRANSFORMER_ENGINE_MODES:
        raise ValueError(f"model.transformer_engine must be one of "
                         f"{', '.join(TRANSFORMER_ENGINE_MODES)}; got {mode!r}")
    if mode == "off":
        return False
    usable, reason = transformer_engine_status()
    if mode == "required" and not usable:
        raise RuntimeError(f"model.transformer_engine=required, but {reason}. Install it with "
                           "scripts/setup_gpu.sh, or set model.transformer_engine=auto to fall "
                           "back to megatron-core's local spec")
    return usable


@functools.lru_cache(maxsize=None)
def report_layer_spec(use_te: bool) -> None:
    """Say once per process which layer implementation the actor uses, and what it costs when
    an accelerator is missing where it would matter (on a GPU)."""
    if use_te:
        logger.info("actor layers: TransformerEngine spec (fused attention, norms, GEMMs)")
        return
    reason = transformer_engine_status()[1]
    if cuda_available():
        logger.warning("actor layers: megatron-core's local spec and torch's AdamW, because "
                       "%s. Training is correct but slower than with TransformerEngine's fused "
                       "kernels; see scripts/setup_gpu.sh.", reason)
    else:
        logger.info("actor layers: megatron-core's local spec and torch's AdamW (%s)", reason)


def quiet_megatron_accelerator_warnings() -> None:
    """megatron-core warns at import, once per module and process, that TransformerEngine and
    apex are missing (a dozen lines per run); :func:`report_layer_spec` says it once instead.
    Its gradient buffer lists every parameter of every bucket at INFO: kept to warnings unless
    ``RLEP_SHOW_ALL_WARNINGS=1``."""
    import warnings

    for pattern in (r"Transformer Engine and Apex are not installed",
                    r"Apex is not installed"):
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
    logging.getLogger("megatron.core.distributed.fsdp").setLevel(logging.WARNING)
    if os.environ.get("RLEP_SHOW_ALL_WARNINGS") != "1":
        # the gradient buffer's per-bucket parameter listing (dozens of lines per model build)
        logging.getLogger("megatron.core.distributed.param_and_grad_buffer").setLevel(
            logging.WARNING)


quiet_megatron_accelerator_warnings()


# ----------------------------------------------------------------------------------------------
# CPU shim
# ----------------------------------------------------------------------------------------------


class _NullStream:
    """Stands in for a CUDA stream/event: work on CPU is synchronous."""

    def synchronize(self):
        return None

    def wait_stream(self, _stream):
        return None

    def wait_event(self, _event):
        return None

    def record_event(self, *_args, **_kwargs):
        return _NullStream()

    def record(self, *_args, **_kwargs):
        return None

    def query(self):
        return True

    def elapsed_time(self, _other):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        return False


class _CpuCudaNamespace(types.SimpleNamespace):
    """Answers the ``torch.cuda`` calls megatron-core makes, with CPU equivalents."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def current_device():
        return torch.device("cpu")

    @staticmethod
    def device_count():
        return 0

    @staticmethod
    def synchronize(*_args, **_kwargs):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def current_stream(*_args, **_kwargs):
        return _NullStream()

    @staticmethod
    def default_stream(*_args, **_kwargs):
        return _NullStream()

    @staticmethod
    def Stream(*_args, **_kwargs):  # noqa: N802 (mirrors torch.cuda.Stream)
        return _NullStream()

    @staticmethod
    def Event(*_args, **_kwargs):  # noqa: N802 (mirrors torch.cuda.Event)
        return _NullStream()

    @staticmethod
    def stream(_stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def nvtx_range_push(*_args, **_kwargs):
        return None

    @staticmethod
    def nvtx_range_pop(*_args, **_kwargs):
        return None

    @staticmethod
    def memory_allocated(*_args, **_kwargs):
        return 0

    @staticmethod
    def max_memory_allocated(*_args, **_kwargs):
        return 0

    @staticmethod
    def get_rng_state(*_args, **_kwargs):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state, *_args, **_kwargs):
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed):
        return None

    @staticmethod
    def manual_seed_all(seed):
        return None


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _factory_on_cpu(factory):
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    wrapped.__name__ = getattr(factory, "__name__", "factory")
    return wrapped


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor", "linspace")


class _GlooDistributed(types.ModuleType):
    """``torch.distributed`` as seen by megatron-core modules on CPU: gloo's list all-gather
    needs equal sizes and gloo has no list reduce-scatter, while megatron's MoE token
    dispatcher gathers and reduce-scatters uneven per-rank token counts over the
    tensor-parallel group (sequence parallelism with experts)."""

    def __init__(self):
        super().__init__("torch.distributed")

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        dist = torch.distributed
        sizes = {t.shape[0] for t in tensor_list} | {tensor.shape[0]}
        if len(sizes) == 1:
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
        padded = [tensor.new_empty((longest,) + tuple(tensor.shape[1:])) for _ in tensor_list]
        dist.all_gather(padded, torch.cat([tensor, pad]).contiguous(), group=group)
        for out, full in zip(tensor_list, padded):
            out.copy_(full[: out.shape[0]])
        return _DoneWork() if async_op else None

    @staticmethod
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        dist = torch.distributed
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if op is None else op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start: start + input_list[rank].numel()].view_as(output))
        return _DoneWork() if async_op else None


class _TorchProxy(types.ModuleType):
    """``torch`` as seen by megatron-core modules on CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCudaNamespace()
        self.distributed = _GlooDistributed()
        for name in _FACTORIES:
            setattr(self, name, _factory_on_cpu(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


class CpuRNGStatesTracker:
    """Named RNG streams for megatron's model-parallel regions (dropout, init) on CPU.

    Each name owns a ``torch.Generator`` state. ``fork(name)`` swaps the global CPU generator to
    that state for the duration of the block and stores the advanced state back, so the
    tensor-parallel stream and the default stream stay independent, as CUDA's would.
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self):
        return bool(self.states_)

    def get_states(self):
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


# (module, class, method) of megatron code that moves tensors with ``tensor.cuda()``.
_METHODS_USING_TENSOR_CUDA = (
    ("megatron.core.models.common.language_module.language_module", "LanguageModule",
     "setup_embeddings_and_output_layer"),
)


def _with_tensor_method(name: str, make_replacement):
    """A wrapper factory: run a method with ``torch.Tensor.<name>`` replaced by
    ``make_replacement(original)`` for the duration of the call only."""
    def wrap(method):
        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            original = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, make_replacement(original))
            try:
                return method(*args, **kwargs)
            finally:
                setattr(torch.Tensor, name, original)

        wrapped._rlep_cpu_shim = True
        return wrapped

    return wrap


_tensor_cuda_is_identity = _with_tensor_method("cuda", lambda _original: (
    lambda self, *_args, **_kwargs: self))


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm,
                                      use_decoupled_grad=False):
    """megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assertion and fused
    kernel: scale every gradient by ``max_norm / (total_norm + 1e-6)`` when that is < 1."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for grad in grads:
            grad.detach().mul_(clip_coeff)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    """megatron's ``_get_cuda_rng_state`` on CPU: every random op runs on the CPU generator."""
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    """megatron's ``_set_cuda_rng_state`` on CPU (activation recomputation restores it)."""
    torch.set_rng_state(new_state)


def _gloo_reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    """``reduce_scatter_tensor`` for gloo, which lacks it: all-reduce a copy, keep this rank's
    equal slice. Used by megatron's distributed optimizer to reduce-scatter gradient buckets."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    average = op == dist.ReduceOp.AVG
    reduced = input.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if average else op, group=group)
    world = dist.get_world_size(group)
    piece = reduced.view(world, -1)[dist.get_rank(group)]
    output.copy_((piece / world if average else piece).view_as(output))
    return _DoneWork() if async_op else None


def _gloo_all_gather_into_tensor(output, input, group=None, async_op=False):
    """``all_gather_into_tensor`` through gloo's list all-gather into views of ``output``
    (the distributed optimizer gathers updated parameter shards this way)."""
    import torch.distributed as dist

    views = list(output.view(dist.get_world_size(group), -1).unbind(0))
    dist.all_gather(views, input.detach().reshape(-1).contiguous(), group=group)
    return _DoneWork() if async_op else None


class _DoneWork:
    """The handle of a collective that already completed (gloo collectives above are
    synchronous)."""

    def wait(self, *_args, **_kwargs):
        return True

    def is_completed(self):
        return True


@contextlib.contextmanager
def _no_coalescing(*_args, async_ops: bool = False, **_kwargs):
    """``torch.distributed._coalescing_manager`` without coalescing: gloo runs each collective
    as issued. Inside the block every ``all_reduce`` runs synchronously (the overlapped
    gradient reduction asks for asynchronous ones and waits on the block's handle, not on
    theirs), and the handle given for ``async_ops`` is one that has already completed."""
    import torch.distributed as dist

    issue = dist.all_reduce

    def all_reduce_now(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        issue(tensor, op=op, group=group, async_op=False)
        return _DoneWork() if async_op else None

    dist.all_reduce = all_reduce_now
    try:
        yield _DoneWork() if async_ops else None
    finally:
        dist.all_reduce = issue


_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


def _cuda_named_type(original):
    """``Tensor.type()`` answering CUDA type names for CPU tensors: the distributed optimizer
    sorts parameters into fp32 / 16-bit groups by those names."""
    def type_(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return result if args or kwargs else _CUDA_TYPE_NAMES.get(result, result)

    return type_


_cuda_type_names = _with_tensor_method("type", _cuda_named_type)


# (module, class, method) of megatron code that checks ``tensor.type()`` for CUDA names.
_METHODS_CHECKING_CUDA_TYPES = (
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
)

# (modules, function name, CPU replacement), patched in every listed module's namespace.
def _cpu_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``moe_utils.maybe_move_tensor_to_cpu`` turns the MoE all-to-all split
    sizes into numpy arrays only when they start on a GPU; on CPU they stay tensors, which
    ``all_to_all_single`` refuses as split sizes. The same conversion for CPU tensors."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


_CPU_FUNCTIONS = (
    (("megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings"),
     "dist_reduce_scatter_func", _gloo_reduce_scatter_tensor),
    (("megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings"),
     "dist_all_gather_func", _gloo_all_gather_into_tensor),
    (("megatron.core.distributed.param_and_grad_buffer",), "_coalescing_manager",
     _no_coalescing),
    (("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
      "megatron.core.optimizer.distrib_optimizer"), "clip_grad_by_total_norm_fp32",
     _cpu_clip_grad_by_total_norm_fp32),
    (("megatron.core.tensor_parallel.random",), "_get_cuda_rng_state", _cpu_get_rng_state),
    (("megatron.core.tensor_parallel.random",), "_set_cuda_rng_state", _cpu_set_rng_state),
    (("megatron.core.transformer.moe.token_dispatcher",), "maybe_move_tensor_to_cpu",
     _cpu_move_tensor_to_cpu),
)


def _megatron_modules():
    for package_name in _MEGATRON_PACKAGES:
        try:
            package = importlib.import_module(package_name)
        except Exception as err:  # an optional submodule that needs a GPU package
            logger.debug("megatron CPU shim: skipping %s (%s)", package_name, err)
            continue
        yield package
        for info in pkgutil.walk_packages(getattr(package, "__path__", []), package_name + "."):
            module = sys.modules.get(info.name)
            if module is None:
                try:
                    module = importlib.import_module(info.name)
                except Exception as err:
                    logger.debug("megatron CPU shim: skipping %s (%s)", info.name, err)
                    continue
            yield module


def install_megatron_cpu_shim() -> bool:
    """Make megatron-core run on CPU/gloo. No-op (returns False) when CUDA is available."""
    global _SHIM_INSTALLED
    if cuda_available():
        return False
    if _SHIM_INSTALLED:
        return True
    proxy = _TorchProxy()
    patched = 0
    for module in _megatron_modules():
        if getattr(module, "torch", None) is torch:
            module.torch = proxy
            patched += 1
    for methods, wrap in ((_METHODS_USING_TENSOR_CUDA, _tensor_cuda_is_identity),
                          (_METHODS_CHECKING_CUDA_TYPES, _cuda_type_names)):
        for module_name, class_name, method_name in methods:
            cls = getattr(importlib.import_module(module_name), class_name)
            method = getattr(cls, method_name)
            if not getattr(method, "_rlep_cpu_shim", False):
                setattr(cls, method_name, wrap(method))
    for module_names, function_name, replacement in _CPU_FUNCTIONS:
        for module_name in module_names:
            module = importlib.import_module(module_name)
            if hasattr(module, function_name):
                setattr(module, function_name, replacement)
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mcore_random.initialize_rng_tracker = _keep_cpu_tracker
    _SHIM_INSTALLED = True
    logger.debug("megatron CPU shim installed in %d modules", patched)
    return True


def megatron_moe_without_te() -> None:
    """megatron-core 0.16's MoE router gating (``moe_utils.RouterGatingLinearFunction``) tests
    ``te_general_gemm is not None``, a name bound only when TransformerEngine imports: without
    TE (CPU, or a GPU with the local spec) the router raises NameError. Bind it to None, which
    selects megatron's own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _keep_cpu_tracker(*_args, **_kwargs):
    """Replaces megatron's ``initialize_rng_tracker`` so a later call cannot swap the CPU
    tracker back for a CUDA one."""
    return None


def refresh_vllm_cpu_embedding_kernels(model: torch.nn.Module, tied: bool) -> int:
    """After an in-place weight reload on vLLM's CPU backend, rebuild the packed GEMM kernel of
    a tied LM head. The CPU backend packs a copy of the LM-head matrix when the model loads;
    with tied embeddings the head receives no weights of its own during a reload (the
    embedding's storage is updated in place), so its packed copy would keep serving the old
    matrix. Re-running the layer's own ``process_weights_after_loading`` repacks it from the
    current weight. An untied head is reloaded (and repacked by vLLM) like any other layer:
    nothing to do. No-op with CUDA. Returns the number of layers refreshed."""
    if cuda_available() or not tied:
        return 0
    refreshed = 0
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if (name.split(".")[-1] == "lm_head"
                and type(method).__name__ == "UnquantizedEmbeddingMethod"
                and hasattr(module, "cpu_linear")):
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def refresh_vllm_cpu_moe_kernels(model: torch.nn.Module) -> int:
    """After an in-place weight reload on vLLM's CPU backend, prepack every MoE layer's expert
    weights again. The CPU experts keep ``w13_weight`` / ``w2_weight`` in their grouped-GEMM
    layout, made by their ``process_weights_after_loading`` when the model loads; on a weight
    update vLLM 0.32's unquantized MoE method copies the new (checkpoint-layout) weights into
    the parameters but skips that prepacking, so the kernel would read unpacked matrices as
    packed ones (log-probs off by about 1e-2 on the tiny MoE). Running the experts' own
    processing again packs the freshly loaded weights. No-op with CUDA or without MoE layers.
    Returns the number of layers refreshed."""
    if cuda_available():
        return 0
    refreshed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def vllm_cpu_engine_settings(max_model_len: int) -> dict:
    """Extra ``vllm.LLM`` arguments on vLLM's CPU backend (empty with CUDA); also sets the KV
    cache size variable the CPU backend reads (GiB) unless the user set it.

    * the CPU backend refuses the default ``gpu_memory_utilization`` on small machines;
    * CUDA graphs do not exist on CPU (``enforce_eager``);
    * chunked prefill is off and every prompt fits one scheduler step: a partially prefilled
      request has its sampled token discarded, and vLLM then rewinds the request's seeded
      generator with ``set_offset``, which CPU generators do not support ("CPU Generator does
      not use offset"). Rollouts always use per-request seeds.
    """
    if cuda_available():
        return {}
    import os

    remove_stale_vllm_cpu_shm()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return {"gpu_memory_utilization": 0.2, "enforce_eager": True,
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(int(max_model_len), 8192)}


def remove_stale_vllm_cpu_shm(shm_dir: str = "/dev/shm") -> list[str]:
    """Remove the shared-memory files of vLLM's CPU tensor-parallel communicator that no live
    process maps. vLLM names them by the ranks of the group only (``...-[0-1]-cpushm_0``), and
    creates them exclusively: a job that was killed (or failed fast) leaves them behind and the
    next job with the same layout fails with "create shm in SHMManager failed. errno: 17".
    Files a running job has mapped are kept. Returns the removed paths."""
    import glob
    import os

    candidates = glob.glob(os.path.join(glob.escape(shm_dir), "*cpushm*"))
    if not candidates:
        return []
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split(None, 5)[-1].strip() for line in f if "cpushm" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    removed = []
    for path in candidates:
        if path not in mapped:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass  # another rank of this job removed it
    if removed:
        logger.warning("removed %d stale vLLM CPU shared-memory file(s) of an earlier job: %s",
                       len(removed), ", ".join(sorted(removed)))
    return removed

