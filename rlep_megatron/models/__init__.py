"""What the project knows about each model architecture, in one place: one module per family
(``qwen2.py``, ``qwen3.py``, ``qwen3_moe.py``, ``llama.py``, the shared ``llama_family.py`` table) with
``MODEL_TYPE``, ``validate`` (what the family refuses), ``transformer_kwargs`` and
``model_kwargs`` (its megatron-core ``TransformerConfig`` / ``GPTModel`` arguments), optionally
``spec_kwargs`` (arguments of megatron's layer-spec builders) and ``rules`` (HF weight names and
layouts, applied by :mod:`layout`), registered in ``ARCHITECTURES``; :mod:`megatron` builds the
model from them. The actor, both conversion directions, the verify tool and the weight sync all
read these. Adding a family is adding one module (and its tests).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

from rlep_megatron.models import llama, qwen2, qwen3, qwen3_moe

ARCHITECTURES: dict[str, ModuleType] = {
    module.MODEL_TYPE: module for module in (qwen2, qwen3, qwen3_moe, llama)}


def spec_kwargs(arch: ModuleType, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The architecture's arguments for megatron's GPT layer-spec builders ({} by default)."""
    return arch.spec_kwargs(hf_config) if hasattr(arch, "spec_kwargs") else {}


def architecture_for(hf_config: dict[str, Any]) -> ModuleType:
    """The module of a config.json's architecture, after checking its options are supported."""
    model_type = hf_config.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{sorted(ARCHITECTURES)} (add a module in rlep_megatron/models/)")
    arch = ARCHITECTURES[model_type]
    arch.validate(hf_config)
    return arch


def num_experts(hf_config: dict[str, Any]) -> int:
    """The number of routed experts of a mixture-of-experts config.json; 0 for a dense model."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def layout_limits(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The model sizes a parallel layout must divide (keyword arguments of
    :func:`rlep_megatron.distributed.validate_parallel_layout`)."""
    heads = hf_config.get("num_attention_heads")
    return {"num_attention_heads": heads,
            "num_query_groups": hf_config.get("num_key_value_heads") or heads,
            "num_layers": hf_config.get("num_hidden_layers"),
            "num_experts": num_experts(hf_config)}
