"""HF <-> megatron-core checkpoints: per-architecture mappings, safetensors I/O, conversion.

Adding an architecture is one module with ``MODEL_TYPE``, ``validate``, ``transformer_kwargs``,
``model_kwargs``, ``rules`` and optionally ``spec_kwargs`` (arguments of megatron's layer-spec
builders; see ``qwen2.py``, ``qwen3.py``), registered in ``ARCHITECTURES``.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from rlep_megatron.checkpoint import llama, qwen2, qwen3

ARCHITECTURES: dict[str, ModuleType] = {qwen2.MODEL_TYPE: qwen2, qwen3.MODEL_TYPE: qwen3,
                                        llama.MODEL_TYPE: llama}


def spec_kwargs(arch: ModuleType, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The architecture's arguments for megatron's GPT layer-spec builders ({} by default)."""
    return arch.spec_kwargs(hf_config) if hasattr(arch, "spec_kwargs") else {}


def architecture_for(hf_config: dict[str, Any]) -> ModuleType:
    """The mapping module for a config.json, after checking the options are supported."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)} (add a module in rlep_megatron/checkpoint/)")
    arch = ARCHITECTURES[model_type]
    arch.validate(hf_config)
    return arch
