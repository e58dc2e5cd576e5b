"""vLLM's CPU backend: engine settings, and kernels to refresh after an in-place weight
reload."""
from __future__ import annotations

import logging
from typing import Optional

import torch

from rlep_megatron.platform import probe

logger = logging.getLogger(__name__)


def refresh_vllm_cpu_embedding_kernels(model: torch.nn.Module, tied: bool) -> int:
    """After an in-place weight reload on vLLM's CPU backend, rebuild the packed GEMM kernel of
    a tied LM head. The CPU backend packs a copy of the LM-head matrix when the model loads;
    with tied embeddings the head receives no weights of its own during a reload (the
    embedding's storage is updated in place), so its packed copy would keep serving the old
    matrix. Re-running the layer's own ``process_weights_after_loading`` repacks it from the
    current weight. An untied head is reloaded (and repacked by vLLM) like any other layer:
    nothing to do. No-op with CUDA. Returns the number of layers refreshed."""
    if probe.cuda_available() or not tied:
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


_MOE_REPROCESSED = [0]  # CPU MoE layers whose experts a weight update re-processed


def process_cpu_moe_experts_on_reload() -> None:
    """Make vLLM's in-place weight reload give the CPU MoE experts their kernel layout.

    The CPU experts (``fused_moe/experts/cpu_moe.py``) process their weights when the model
    loads: the expert intermediate size is zero-padded to the kernel's alignment (32: a
    ``moe_intermediate_size`` of 48 becomes 64, so ``w13`` goes from ``[E, 96, h]`` to
    ``[E, 128, h]``) and the matrices are prepacked into the grouped-GEMM layout. On a weight
    update vLLM 0.32's unquantized MoE method (``_setup_kernel``) skips that step, so the
    layer-wise reload then copies unpadded, unpacked matrices into the padded kernel storage:
    a shape error when the size needs padding (``The size of tensor a (128) must match the
    size of tensor b (96)``), and matrices read in the wrong layout when it does not (log-probs
    off by about 1e-2 on the tiny MoE). Wrapped here so that a weight update processes the
    experts as the first load does, before the reload copies them into the kernel's storage.
    Idempotent; no-op with CUDA."""
    if probe.cuda_available():
        return
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as module

    method = module.UnquantizedFusedMoEMethod
    if getattr(method._setup_kernel, "_rlep_cpu_experts", False):
        return
    original = method._setup_kernel

    def setup_kernel(self, layer, w13, w2):
        update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if update and experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(layer)
            _MOE_REPROCESSED[0] += 1

    setup_kernel._rlep_cpu_experts = True
    method._setup_kernel = setup_kernel


def cpu_moe_layers_reprocessed() -> int:
    """How many CPU MoE layers weight updates have re-processed so far in this process."""
    return _MOE_REPROCESSED[0]


# vLLM's CPU backend: at most 256 sequences per engine rank run at once (its default
# ``max_num_seqs`` for the ``LLM`` class; 128 for its server), in blocks of 128 tokens (a
# length rounded up to 256 is a whole number of blocks of any size up to 256)
CPU_MAX_SEQS_PER_RANK = 256
CPU_KV_CACHE_MAX_BYTES = 2**30     # the size it had before it was sized to the model: 1 GiB
CPU_KV_CACHE_MIN_BYTES = 64 * 2**20


def cpu_kv_cache_bytes(hf_config: dict, max_model_len: int, tensor_parallel_size: int = 1
                       ) -> int:
    """The KV cache (bytes per engine rank) that holds vLLM's most concurrent sequences on CPU
    (:data:`CPU_MAX_SEQS_PER_RANK` per rank), each ``max_model_len`` tokens long (rounded up to
    256), in fp32, within [64 MiB, 1 GiB]. However full the batch, the scheduler never waits
    for a free block, so the engine runs its requests as with a larger cache; for the tiny model
    at 128 tokens this is 128 MiB instead of the backend's 1 GiB (its engine built in 2.55 s
    against 2.81 s, medians of ``python bench/startup_costs.py --only kv_cache``).
    ``VLLM_CPU_KVCACHE_SPACE`` (GiB), when set, takes precedence (vLLM reads it)."""
    text = hf_config.get("text_config") or hf_config
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    # a rank holds its share of the KV heads, or one replicated head when there are fewer
    local_kv_heads = max(1, kv_heads // tensor_parallel_size)
    per_token = 2 * int(text["num_hidden_layers"]) * local_kv_heads * head_dim * 4
    tokens = CPU_MAX_SEQS_PER_RANK * tensor_parallel_size * (-(-int(max_model_len) // 256) * 256)
    return int(min(CPU_KV_CACHE_MAX_BYTES, max(CPU_KV_CACHE_MIN_BYTES, per_token * tokens)))


def vllm_cpu_engine_settings(max_model_len: int, hf_config: Optional[dict] = None,
                             tensor_parallel_size: int = 1) -> dict:
    """Extra ``vllm.LLM`` arguments on vLLM's CPU backend (empty with CUDA).

    * the CPU backend refuses the default ``gpu_memory_utilization`` on small machines;
    * CUDA graphs do not exist on CPU (``enforce_eager``);
    * chunked prefill is off and every prompt fits one scheduler step: a partially prefilled
      request has its sampled token discarded, and vLLM then rewinds the request's seeded
      generator with ``set_offset``, which CPU generators do not support ("CPU Generator does
      not use offset"). Rollouts always use per-request seeds;
    * the KV cache is sized to the model (:func:`cpu_kv_cache_bytes`, from ``hf_config``, the
      model's config.json); without it, 1 GiB.
    """
    if probe.cuda_available():
        return {}
    remove_stale_vllm_cpu_shm()
    remove_truncated_inductor_binaries()
    run_vllm_cpu_helpers_eagerly()
    name_vllm_cpu_shm_per_job()
    kv_bytes = (CPU_KV_CACHE_MAX_BYTES if hf_config is None
                else cpu_kv_cache_bytes(hf_config, max_model_len, tensor_parallel_size))
    return {"gpu_memory_utilization": 0.2, "enforce_eager": True,
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(int(max_model_len), 8192),
            "kv_cache_memory_bytes": kv_bytes}


# vLLM helpers wrapped in ``torch.compile`` that its CPU backend calls even with
# ``enforce_eager``: (module, name)
_COMPILED_VLLM_HELPERS = (
    # the rank of each sampled token among the vocabulary, for every rollout with log-probs
    ("vllm.v1.sample.sampler", "batched_count_greater_than"),
    # the vocabulary-parallel embedding's masking at rollout TP > 1
    ("vllm.model_executor.layers.vocab_parallel_embedding", "get_masked_input_and_mask"),
)


def run_vllm_cpu_helpers_eagerly() -> list[str]:
    """Call vLLM's small ``torch.compile``-wrapped helpers as the plain functions they wrap (the
    same code, eagerly) on the CPU backend. Compiling them costs every job about 2 s of tracing
    and a cache lookup at its first rollout (tens of seconds of C++ compilation with a cold
    cache), for a one-line tensor expression; and a job killed during that compilation is what
    leaves truncated kernels behind (:func:`remove_truncated_inductor_binaries`). vLLM's own
    comments give the reason for compiling (no extra copies of the logits on GPU): on CPU
    rollouts the batches are small. Module globals are replaced where the callers look them
    up; a vLLM without these names is left as it is. Returns the replaced names."""
    import importlib

    replaced = []
    for module_name, name in _COMPILED_VLLM_HELPERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(getattr(module, name, None), "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(module, name, original)
            replaced.append(f"{module_name}.{name}")
    return replaced


def vllm_cpu_shm_job_token() -> str:
    """A name for this job that all its ranks share and that a concurrent job on the same host
    does not: torchrun's master port and run id (a fresh uuid with ``--standalone``), or this
    process id without torchrun."""
    import os
    import re

    port, run_id = os.environ.get("MASTER_PORT"), os.environ.get("TORCHELASTIC_RUN_ID")
    token = f"{port}-{run_id}" if port or run_id else f"pid{os.getpid()}"
    return "rlep-" + re.sub(r"[^A-Za-z0-9_.-]", "_", token)[:64]


def name_vllm_cpu_shm_per_job() -> bool:
    """Prefix the shared-memory files of vLLM's CPU tensor-parallel communicator with
    :func:`vllm_cpu_shm_job_token`. vLLM names them by ``VLLM_DIST_IDENT``, which is the same for
    every in-process (``external_launcher``) engine, and by the group's ranks: two jobs with the
    same rollout layout on one host (``rlep demo --jobs`` with ``--nproc 2``, two users) would
    ask for the same exclusive files and the second would fail with "create shm in SHMManager
    failed. errno: 17". Idempotent; a vLLM without that naming function is left as it is.
    Returns whether the naming was replaced now."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return False
    shm_class = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    original = getattr(shm_class, "make_group_name", None)
    if original is None or getattr(original, "_rlep_job_token", False):
        return False

    def make_group_name(communicator) -> str:
        # vLLM's own name starts with "//" under external_launcher (its identifier is the tail
        # of "env://"): shm_open skips leading slashes only, so none may follow the prefix
        return f"{vllm_cpu_shm_job_token()}-{original(communicator)}".replace("/", "")

    make_group_name._rlep_job_token = True
    shm_class.make_group_name = staticmethod(make_group_name)
    return True


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
            except PermissionError:
                pass  # another user's (whose maps this process cannot read): theirs to remove
    if removed:
        logger.warning("removed %d stale vLLM CPU shared-memory file(s) of an earlier job: %s",
                       len(removed), ", ".join(sorted(removed)))
    return removed


def _elf_is_truncated(path: str) -> bool:
    """Whether a file that should be a 64-bit little-endian ELF shared object ends before the
    parts its own header points at: the header, the program headers, any loadable segment's
    bytes, or the section header table. A link killed part-way leaves such a file (empty, or
    cut short); the dynamic loader refuses it ("file too short")."""
    import os
    import struct

    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return True
        (phoff, shoff) = struct.unpack_from("<QQ", header, 0x20)
        (phentsize, phnum, shentsize, shnum) = struct.unpack_from("<HHHH", header, 0x36)
        if phentsize != 56 or (shnum and shentsize != 64):  # the ELF64 entry sizes
            return True
        if phoff + phentsize * phnum > size or shoff + shentsize * shnum > size:
            return True
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    for i in range(phnum):
        kind, _flags, offset, _vaddr, _paddr, filesz = struct.unpack_from(
            "<IIQQQQ", table, i * phentsize)
        if kind == 1 and offset + filesz > size:  # PT_LOAD
            return True
    return False


def inductor_cache_roots() -> list[str]:
    """The directories where torch's inductor keeps compiled kernels for this machine's jobs:
    ``TORCHINDUCTOR_CACHE_DIR`` when set, torch's default under the temp directory (vLLM
    points the variable elsewhere once it compiles, so the default is always included), and
    vLLM's compile cache (``VLLM_CACHE_ROOT``, by default under ``XDG_CACHE_HOME`` or
    ``~/.cache``), which holds inductor caches of its own. Only existing directories, each
    once; reading them creates nothing and sets no variable."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    try:
        from vllm import envs as vllm_envs

        vllm_root = vllm_envs.VLLM_CACHE_ROOT
    except ImportError:  # no vLLM: only torch's caches
        vllm_root = None
    candidates = [os.environ.get("TORCHINDUCTOR_CACHE_DIR"), default_cache_dir(),
                  os.path.join(vllm_root, "torch_compile_cache") if vllm_root else None]
    roots: list[str] = []
    for root in candidates:
        if root and os.path.isdir(root) and os.path.abspath(root) not in roots:
            roots.append(os.path.abspath(root))
    return roots


def remove_truncated_inductor_binaries(roots: list[str] | None = None) -> list[str]:
    """Remove the compiled kernel libraries (``*.so``) of torch's inductor cache that a killed
    job left cut short. Inductor links a kernel straight into its cache path and, on a later
    run, loads any library found there without checking it: a job killed during the link (a
    rank that fails fast while vLLM's CPU backend compiles) leaves a truncated file, and every
    later job that needs the same kernel then fails with "file too short". A removed library
    is compiled again when next needed. A library whose build lock (inductor's own,
    ``<cache>/locks/<key>.lock``) another process holds is being written and is left alone.
    Returns the removed paths."""
    import os
    import struct

    from filelock import FileLock, Timeout

    removed = []
    for root in inductor_cache_roots() if roots is None else roots:
        for folder, _dirs, files in os.walk(root):
            for name in files:
                if not name.endswith(".so"):
                    continue
                path = os.path.join(folder, name)
                lock = os.path.join(os.path.dirname(folder), "locks",
                                    name.split(".")[0] + ".lock")
                try:
                    # whole libraries are only read; a cut one is checked again under its
                    # build lock, so that one being written now is left to its writer
                    if not _elf_is_truncated(path):
                        continue
                    os.makedirs(os.path.dirname(lock), exist_ok=True)
                    with FileLock(lock, timeout=0):
                        if _elf_is_truncated(path):
                            os.unlink(path)
                            removed.append(path)
                except Timeout:
                    continue  # another process is building this kernel now
                except (OSError, struct.error):
                    continue  # gone already (another rank), or not ours to read or remove
    if removed:
        logger.warning("removed %d truncated inductor kernel librar%s left by an earlier job "
                       "(they are compiled again when needed): %s", len(removed),
                       "y" if len(removed) == 1 else "ies", ", ".join(sorted(removed)))
    return removed
