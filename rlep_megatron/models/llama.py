"""Llama 2/3 (``model_type: llama``): no biases (unless ``attention_bias``), untied embeddings
in most models, Llama-3 rope scaling (``rope_type: llama3``) with megatron's fixed low/high
frequency factors 1/4 and original context 8192; other scalings are refused."""
from __future__ import annotations

from typing import Any

from rlep_megatron.models import llama_family

MODEL_TYPE = "llama"


def validate(hf_config: dict[str, Any]) -> None:
    llama_family.check_common(hf_config, MODEL_TYPE)
    scaling = llama_family.rope_scaling(hf_config)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}
        if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in expected.items()):
            raise ValueError(f"llama: rope scaling {scaling} is not supported (only llama3 with "
                             f"{expected})")


def transformer_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {"add_qkv_bias": bool(hf_config.get("attention_bias", False))}


def model_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"rotary_base": llama_family.rope_theta(hf_config)}
    scaling = llama_family.rope_scaling(hf_config)
    if scaling:
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))
    return kwargs


def rules(hf_config: dict[str, Any]):
    return llama_family.rules(qkv_bias=bool(hf_config.get("attention_bias", False)),
                              tied=bool(hf_config.get("tie_word_embeddings")))
