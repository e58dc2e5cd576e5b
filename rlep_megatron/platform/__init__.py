"""Device and backend choice, and the only place with workarounds for megatron-core on CPU
(and without TransformerEngine) and for vLLM's CPU backend, split by what each adapts:

* :mod:`.device`: CUDA or CPU (``trainer.device``), NCCL or gloo, TransformerEngine or the
  local layer spec, and the GPU/driver checks that refuse a silent CPU fallback;
* :mod:`.megatron_shim` (with :mod:`.cpu_torch` and :mod:`.gloo`): megatron-core on CPU/gloo
  (:func:`install_megatron_cpu_shim`) and its fixes when TransformerEngine is absent;
* :mod:`.vllm_cpu`: vLLM's CPU backend settings and its kernels' refresh after a weight sync;
* :mod:`.heap`: Python's cyclic garbage collector paused while a job starts, its start-up heap
  frozen.

What the machine has (CUDA, the driver's GPUs, vLLM's build, TransformerEngine) is asked of
:mod:`.probe` at call time, by every module here and by this package's functions of the same
names: a test fakes a GPU node by replacing ``rlep_megatron.platform.probe.<name>`` (replacing the
package's ``cuda_available`` itself would reach only the callers outside this package).
"""
from rlep_megatron.platform import probe
from rlep_megatron.platform.device import (
    DEVICE_MODES, TRANSFORMER_ENGINE_MODES, DeviceError, Platform, choose_device,
    fused_softmax_available, megatron_config_overrides, quiet_megatron_accelerator_warnings,
    report_layer_spec, select_platform, use_transformer_engine)
from rlep_megatron.platform.megatron_shim import (
    install_megatron_cpu_shim, megatron_moe_without_te)
from rlep_megatron.platform.cpu_torch import CpuRNGStatesTracker
from rlep_megatron.platform.heap import freeze_startup_heap, pause_gc_for_startup
from rlep_megatron.platform.vllm_cpu import (
    cpu_moe_layers_reprocessed, name_vllm_cpu_shm_per_job, process_cpu_moe_experts_on_reload,
    refresh_vllm_cpu_embedding_kernels, remove_stale_vllm_cpu_shm, remove_truncated_inductor_binaries, run_vllm_cpu_helpers_eagerly,
    vllm_cpu_engine_settings, vllm_cpu_shm_job_token)


def cuda_available() -> bool:
    """Whether torch sees CUDA (:func:`.probe.cuda_available`, looked up when called)."""
    return probe.cuda_available()


def nvidia_gpus() -> list[str]:
    """The GPUs the NVIDIA driver sees (:func:`.probe.nvidia_gpus`, looked up when called)."""
    return probe.nvidia_gpus()


def transformer_engine_status() -> tuple[bool, str]:
    """``(usable, why not)`` for TransformerEngine (:func:`.probe.transformer_engine_status`,
    looked up when called)."""
    return probe.transformer_engine_status()


__all__ = [
    "DEVICE_MODES", "TRANSFORMER_ENGINE_MODES", "CpuRNGStatesTracker", "DeviceError", "Platform",
    "choose_device", "cuda_available", "freeze_startup_heap", "fused_softmax_available",
    "install_megatron_cpu_shim",
    "megatron_config_overrides", "megatron_moe_without_te", "name_vllm_cpu_shm_per_job",
    "nvidia_gpus", "pause_gc_for_startup",
    "quiet_megatron_accelerator_warnings", "refresh_vllm_cpu_embedding_kernels",
    "process_cpu_moe_experts_on_reload", "cpu_moe_layers_reprocessed", "remove_stale_vllm_cpu_shm",
    "remove_truncated_inductor_binaries", "report_layer_spec", "run_vllm_cpu_helpers_eagerly",
    "select_platform", "transformer_engine_status", "use_transformer_engine",
    "vllm_cpu_engine_settings", "vllm_cpu_shm_job_token", "probe"]
