"""Qwen2 / Qwen2.5 (``model_type: qwen2``): Llama layout plus QKV bias; tied embeddings in the
small models. Sliding-window attention is refused (megatron's local attention is full)."""
from __future__ import annotations

from typing import Any

from rlep_megatron.models import llama_family

MODEL_TYPE = "qwen2"


def validate(hf_config: dict[str, Any]) -> None:
    llama_family.check_common(hf_config, MODEL_TYPE)
    if hf_config.get("use_sliding_window"):
        raise ValueError("qwen2: use_sliding_window=true is not supported")
    if llama_family.rope_scaling(hf_config):
        raise ValueError(f"qwen2: rope scaling {llama_family.rope_scaling(hf_config)} is not "
                         "supported")


def transformer_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {"add_qkv_bias": True}


def model_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {"rotary_base": llama_family.rope_theta(hf_config)}


def rules(hf_config: dict[str, Any]):
    return llama_family.rules(qkv_bias=True, tied=bool(hf_config.get("tie_word_embeddings")))
