"""The rule table and HF-config reading shared by the Llama-family architectures (Llama,
Qwen2/Qwen2.5). An architecture module states what differs (biases, rope options)."""
from __future__ import annotations

from typing import Any

from rlep_megatron.models.layout import GPTDims, ParamRule

L = "{layer}"


def rope_theta(hf_config: dict[str, Any]) -> float:
    params = hf_config.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json has no rope_theta (nor rope_parameters.rope_theta)")
    return float(theta)


def rope_scaling(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling block (transformers 5 ``rope_parameters`` or the older
    ``rope_scaling``), or {} for plain RoPE."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.pop("rope_theta", None)
    kind = params.get("rope_type", params.get("type", "default"))
    return {} if kind in (None, "default") else params


def dims_from_config(hf_config: dict[str, Any]) -> GPTDims:
    try:
        heads = int(hf_config["num_attention_heads"])
        hidden = int(hf_config["hidden_size"])
        return GPTDims(
            num_layers=int(hf_config["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
            head_dim=int(hf_config.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(hf_config["intermediate_size"]),
            vocab_size=int(hf_config["vocab_size"]),
        )
    except KeyError as err:
        raise ValueError(f"config.json lacks the field {err.args[0]!r}") from None


def check_common(hf_config: dict[str, Any], arch: str) -> None:
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch}: hidden_act={act!r} is not supported (only 'silu')")
    if hf_config.get("mlp_bias"):
        raise ValueError(f"{arch}: mlp_bias=true is not supported")
    dims = dims_from_config(hf_config)
    if dims.num_attention_heads % dims.num_query_groups:
        raise ValueError(f"{arch}: num_attention_heads={dims.num_attention_heads} is not a "
                         f"multiple of num_key_value_heads={dims.num_query_groups}")


def rules(qkv_bias: bool, tied: bool) -> list[ParamRule]:
    p = f"model.layers.{L}."
    table = [
        ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
        ParamRule(f"decoder.layers.{L}.input_layernorm.weight", (p + "input_layernorm.weight",),
                  "copy", None),
        ParamRule(f"decoder.layers.{L}.self_attention.linear_qkv.weight",
                  (p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                   p + "self_attn.v_proj.weight"), "qkv", 0),
        ParamRule(f"decoder.layers.{L}.self_attention.linear_proj.weight",
                  (p + "self_attn.o_proj.weight",), "copy", 1),
        ParamRule(f"decoder.layers.{L}.pre_mlp_layernorm.weight",
                  (p + "post_attention_layernorm.weight",), "copy", None),
        ParamRule(f"decoder.layers.{L}.mlp.linear_fc1.weight",
                  (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"), "gate_up", 0),
        ParamRule(f"decoder.layers.{L}.mlp.linear_fc2.weight", (p + "mlp.down_proj.weight",),
                  "copy", 1),
        ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None),
        # Tied models have no lm_head: the output layer (last pipeline stage) reads the
        # embedding table.
        ParamRule("output_layer.weight",
                  ("model.embed_tokens.weight",) if tied else ("lm_head.weight",), "vocab", 0),
    ]
    if qkv_bias:
        table.append(ParamRule(f"decoder.layers.{L}.self_attention.linear_qkv.bias",
                               (p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                p + "self_attn.v_proj.bias"), "qkv", 0))
    return table
