"""CUDA or CPU, NCCL or gloo, TransformerEngine or megatron-core's local layer spec."""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from rlep_megatron.platform import probe

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Platform:
    """What this process runs on."""

    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


DEVICE_MODES = ("auto", "cuda", "cpu")


class DeviceError(RuntimeError):
    """The device ``trainer.device`` asks for cannot be used here (reported without a
    traceback, before anything is built)."""


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
        if (torch.version.cuda is not None and not probe.vllm_is_cpu_build()
                and probe.nvidia_gpus()):
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
    gpus = [] if probe.gpus_hidden_on_purpose() else probe.nvidia_gpus()
    if mode == "auto" and not gpus:
        return "cpu"
    where = (f"the NVIDIA driver {probe.nvidia_driver_version()} sees {len(gpus)} GPU(s) "
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
    if probe.cuda_available():
        torch.cuda.set_device(local_rank)
        return Platform(device=torch.device("cuda", local_rank), backend="nccl")
    return Platform(device=torch.device("cpu"), backend="gloo")


def fused_softmax_available() -> bool:
    """megatron's fused masked-softmax kernels (``scaled_upper_triang_masked_softmax_cuda``,
    ``scaled_masked_softmax_cuda``): built by apex / Megatron-LM, not by megatron-core's wheel.
    Without them ``masked_softmax_fusion`` would crash the local layer spec on a GPU as soon as
    a batch shape selects the fused path."""
    if not probe.cuda_available():
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
    return {} if probe.cuda_available() else {"batch_p2p_comm": False}


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
    usable, reason = probe.transformer_engine_status()
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
    reason = probe.transformer_engine_status()[1]
    if probe.cuda_available():
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


# Known library noise, each said once here at its source (docs/troubleshooting.md explains
# them); RLEP_SHOW_ALL_WARNINGS=1 keeps everything.
_HARMLESS_WARNINGS = (
    # megatron's optimizer probes `param.main_grad` / `.grad` with hasattr on every parameter,
    # non-leaf views included: torch warns on each probe, the gradients are where they belong
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf Tensor is being "
                  r"accessed"),
    # megatron-core's TransformerConfig default (cuda_graph_scope "full"), not a setting of ours
    (UserWarning, r"full scope is deprecated"),
    # vLLM's Triton dispatcher walks torch.distributed's attributes, the deprecated alias too
    (FutureWarning, r"`torch\.distributed\.reduce_op` is deprecated"),
)
# megatron's INFO dumps of its whole DDP and optimizer configs (about 2 KB each, every run)
_CONFIG_DUMP_LOGGERS = ("megatron.core.distributed.distributed_data_parallel",
                        "megatron.core.optimizer")


def quiet_library_noise() -> None:
    """Filter the library warnings and dumps a run prints that say nothing about the run:
    :data:`_HARMLESS_WARNINGS`, megatron's config dumps, and vLLM's INFO lines (its engine
    config dump of about 3.4 KB, its per-sync reload notices; vLLM's own
    ``VLLM_LOGGING_LEVEL`` set to WARNING unless the user set it). vLLM reads that variable
    when it is first imported, so this runs when the package's platform is imported, before
    any engine. ``RLEP_SHOW_ALL_WARNINGS=1`` turns all of it off."""
    import warnings

    if os.environ.get("RLEP_SHOW_ALL_WARNINGS") == "1":
        return
    for category, pattern in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name in _CONFIG_DUMP_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # without a GPU driver vLLM's import says three times that Triton has no CPU backend (no
    # CUDA probe here: this runs at import, before any process forks)
    importing = logging.getLogger("vllm.triton_utils.importing")
    if not any(isinstance(f, _TritonOnCpuNotices) for f in importing.filters):
        importing.addFilter(_TritonOnCpuNotices())


class _TritonOnCpuNotices(logging.Filter):
    """vLLM's import-time notices that Triton has no CPU backend or no active driver (a
    machine without a GPU), and its INFO line that follows them."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (record.levelno <= logging.INFO
                    or "CPU backend" in text or "0 active driver" in text)


quiet_megatron_accelerator_warnings()
quiet_library_noise()
