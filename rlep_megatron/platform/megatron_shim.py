"""megatron-core on CPU/gloo, and its fixes without TransformerEngine.

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
  modules that import them, by CPU versions with the same semantics (:data:`_CPU_FUNCTIONS`);
  so is the rotary embedding, whose per-call costs are a visible share of a small model's
  step on CPU (:func:`_cpu_rotary_bshd`, the same arithmetic).
* gloo lacks the reduce-scatter and all-gather-into-tensor collectives that megatron's
  distributed optimizer uses, and the optimizer groups parameters by CUDA type names: the
  collectives are replaced by gloo equivalents in the modules that bind them, and
  :data:`_METHODS_CHECKING_CUDA_TYPES` run with ``Tensor.type()`` answering CUDA names.
* megatron's CUDA RNG tracker is replaced by :class:`CpuRNGStatesTracker`, which keeps its own
  ``torch.Generator`` states per name; mapping the tracker onto the global CPU generator makes
  megatron warn "CPU RNG state changed within GPU RNG context" and couples the streams.

The shim is active only when CUDA is absent (:func:`.probe.cuda_available` is false) and is
idempotent.
"""
from __future__ import annotations

import functools
import importlib
import logging
import pkgutil
import sys

import torch

from rlep_megatron.platform.cpu_torch import (CpuRNGStatesTracker, TorchProxy,
                                             cpu_get_rng_state, cpu_set_rng_state)
from rlep_megatron.platform.gloo import (gloo_all_gather_into_tensor,
                                        gloo_reduce_scatter_tensor, no_coalescing)
from rlep_megatron.platform import probe

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


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron's ``get_pos_emb_on_this_cp_rank`` (the rotary embedding of this context-parallel
    rank's chunks i and 2 CP - 1 - i) without its pinned-memory CUDA index."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    chunks = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    chunks = chunks.index_select(seq_dim, index)
    return chunks.view(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


_megatron_rotary_bshd = None  # megatron's own, for the cases the CPU version passes on
_rotary_tables: list = []  # (freqs, version, mscale, dtype, cos, sin), newest first
_rotary_last_seen: list = [None]  # the latest frequency tensor without tables


def _rotary_cos_sin(freqs, mscale: float, dtype):
    """cos and sin of ``freqs`` times ``mscale`` in ``dtype``, as megatron computes them; kept
    for a frequency tensor seen more than once (unpacked batches: megatron's rotary embedding
    caches one per sequence length, shared by every layer's queries and keys), the latest
    four. Packed batches get a new tensor per call and are not kept. Nothing is kept under
    inference mode (its tensors cannot be saved for a later backward)."""
    def tables():
        return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)

    if torch.is_inference_mode_enabled() or freqs.is_inference():
        return tables()
    key = (freqs._version, mscale, dtype)
    for entry in _rotary_tables:
        if entry[0] is freqs and entry[1:4] == key:
            return entry[4], entry[5]
    cos, sin = tables()
    if _rotary_last_seen[0] is freqs:
        _rotary_tables.insert(0, (freqs, *key, cos, sin))
        del _rotary_tables[4:]
    _rotary_last_seen[0] = freqs
    return cos, sin


def _cpu_rotary_bshd(t, freqs, rotary_interleaved: bool = False,
                     multi_latent_attention: bool = False, mscale: float = 1.0):
    """megatron's ``_apply_rotary_pos_emb_bshd`` where the rotation covers the whole head in
    halves (the models here), with the same arithmetic and without its per-call costs on CPU:
    megatron takes cos and sin of the frequencies for every query and key of every layer
    (:func:`_rotary_cos_sin` keeps them) and concatenates the result with an empty
    pass-through part (a copy of the whole tensor). Interleaved, multi-latent or partial
    rotations go to megatron's own function."""
    if (rotary_interleaved or multi_latent_attention or freqs.shape[-1] != t.shape[-1]
            or freqs.requires_grad):
        return _megatron_rotary_bshd(t, freqs, rotary_interleaved, multi_latent_attention,
                                     mscale)
    cos, sin = _rotary_cos_sin(freqs, mscale, t.dtype)
    first, second = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin


_CPU_FUNCTIONS = (
    (("megatron.core.models.common.embeddings.rope_utils",
      "megatron.core.models.common.embeddings.rotary_pos_embedding"),
     "_apply_rotary_pos_emb_bshd", _cpu_rotary_bshd),
    (("megatron.core.models.common.embeddings.rope_utils",
      "megatron.core.models.common.embeddings.rotary_pos_embedding"),
     "get_pos_emb_on_this_cp_rank", _cpu_pos_emb_on_this_cp_rank),
    (("megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings"),
     "dist_reduce_scatter_func", gloo_reduce_scatter_tensor),
    (("megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings"),
     "dist_all_gather_func", gloo_all_gather_into_tensor),
    (("megatron.core.distributed.param_and_grad_buffer",), "_coalescing_manager",
     no_coalescing),
    (("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer",
      "megatron.core.optimizer.distrib_optimizer"), "clip_grad_by_total_norm_fp32",
     _cpu_clip_grad_by_total_norm_fp32),
    (("megatron.core.tensor_parallel.random",), "_get_cuda_rng_state", cpu_get_rng_state),
    (("megatron.core.tensor_parallel.random",), "_set_cuda_rng_state", cpu_set_rng_state),
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
    if probe.cuda_available():
        return False
    if _SHIM_INSTALLED:
        return True
    proxy = TorchProxy()
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
    global _megatron_rotary_bshd
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils._apply_rotary_pos_emb_bshd is not _cpu_rotary_bshd:
        _megatron_rotary_bshd = rope_utils._apply_rotary_pos_emb_bshd
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
