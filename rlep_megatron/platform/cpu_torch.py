"""``torch`` as megatron-core's modules see it on CPU: ``torch.cuda`` answered by CPU
equivalents, tensor factories that turn ``device="cuda"`` into ``cpu``, gloo-capable
``torch.distributed`` (:mod:`.gloo`) and named RNG streams in place of CUDA's."""
from __future__ import annotations

import contextlib
import types

import torch

from rlep_megatron.platform.gloo import GlooDistributed


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


class TorchProxy(types.ModuleType):
    """``torch`` as seen by megatron-core modules on CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCudaNamespace()
        self.distributed = GlooDistributed()
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


def cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    """megatron's ``_get_cuda_rng_state`` on CPU: every random op runs on the CPU generator."""
    return torch.get_rng_state()


def cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    """megatron's ``_set_cuda_rng_state`` on CPU (activation recomputation restores it)."""
    torch.set_rng_state(new_state)
