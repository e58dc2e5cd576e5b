"""Qwen3 dense (``model_type: qwen3``): the Llama layout without QKV bias, plus an RMSNorm over
each query and key head (``q_norm`` / ``k_norm``, one weight vector of ``head_dim`` shared by
all heads, megatron's ``qk_layernorm``), a ``head_dim`` that need not be hidden / heads, and a
tied or untied head. Sliding-window attention, attention biases and rope scaling are refused."""
from __future__ import annotations

from typing import Any

from rlep_megatron.models import llama_family
from rlep_megatron.models.layout import ParamRule

MODEL_TYPE = "qwen3"


def validate(hf_config: dict[str, Any]) -> None:
    llama_family.check_common(hf_config, MODEL_TYPE)
    if hf_config.get("use_sliding_window"):
        raise ValueError("qwen3: use_sliding_window=true is not supported")
    if hf_config.get("attention_bias"):
        raise ValueError("qwen3: attention_bias=true is not supported")
    if llama_family.rope_scaling(hf_config):
        raise ValueError(f"qwen3: rope scaling {llama_family.rope_scaling(hf_config)} is not "
                         "supported")


def transformer_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {"add_qkv_bias": False, "qk_layernorm": True}


def spec_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Arguments of megatron's GPT layer-spec builders."""
    return {"qk_layernorm": True}


def model_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {"rotary_base": llama_family.rope_theta(hf_config)}


def rules(hf_config: dict[str, Any]) -> list[ParamRule]:
    table = llama_family.rules(qkv_bias=False, tied=bool(hf_config.get("tie_word_embeddings")))
    return table + qk_norm_rules()


def qk_norm_rules() -> list[ParamRule]:
    """The per-head query/key RMSNorm weights: ``[head_dim]``, the same on every TP rank (each
    rank normalises its own heads with it; megatron sums their gradients over TP)."""
    layer, p = f"decoder.layers.{llama_family.L}.self_attention.", f"model.layers.{llama_family.L}.self_attn."
    return [ParamRule(layer + "q_layernorm.weight", (p + "q_norm.weight",), "copy", None),
            ParamRule(layer + "k_layernorm.weight", (p + "k_norm.weight",), "copy", None)]
