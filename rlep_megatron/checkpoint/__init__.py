"""HF <-> megatron-core checkpoints: per-architecture mappings, safetensors I/O, conversion.

Adding an architecture is one module with ``MODEL_TYPE``, ``validate``, ``transformer_kwargs``,
``model_kwargs`` and ``rules`` (see ``qwen2.py``), registered in ``ARCHITECTURES``.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from rlep_megatron.checkpoint import llama, qwen2

ARCHITECTURES: dict[str, ModuleType] = {qwen2.MODEL_TYPE: qwen2, llama.MODEL_TYPE: llama}


def architecture_for(hf_config: dict[str, Any]) -> ModuleType:
    """The mapping module for a config.json, after checking the options are supported."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)} (add a module in rlep_megatron/checkpoint/)")
    arch = ARCHITECTURES[model_type]
    arch.validate(hf_config)
    return arch
