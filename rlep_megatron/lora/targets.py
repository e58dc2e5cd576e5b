"""Where each HF projection of a LoRA target sits in megatron-core's layers, and the checks of a
``lora`` section against a model's ``config.json``, run before any model is built.

megatron fuses ``q_proj``/``k_proj``/``v_proj`` into ``linear_qkv`` (column-parallel, laid out
per query group) and ``gate_proj``/``up_proj`` into ``linear_fc1`` (column-parallel, ``[gate;
up]`` on each rank); ``o_proj`` is ``linear_proj`` and ``down_proj`` ``linear_fc2``, both
row-parallel. Each HF projection gets an adapter of its own, so that its A and B are PEFT's
tensors for that projection exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlep_megatron.config import LORA_TARGETS


@dataclass(frozen=True)
class Target:
    name: str       # the HF projection (q_proj, ...)
    module: str     # its megatron linear, relative to a transformer layer
    hf_module: str  # its HF module, relative to a decoder layer
    parallel: str   # column | row
    part: str       # q | k | v (linear_qkv), gate | up (linear_fc1), whole


TARGETS = {
    "q_proj": Target("q_proj", "self_attention.linear_qkv", "self_attn.q_proj", "column", "q"),
    "k_proj": Target("k_proj", "self_attention.linear_qkv", "self_attn.k_proj", "column", "k"),
    "v_proj": Target("v_proj", "self_attention.linear_qkv", "self_attn.v_proj", "column", "v"),
    "o_proj": Target("o_proj", "self_attention.linear_proj", "self_attn.o_proj", "row", "whole"),
    "gate_proj": Target("gate_proj", "mlp.linear_fc1", "mlp.gate_proj", "column", "gate"),
    "up_proj": Target("up_proj", "mlp.linear_fc1", "mlp.up_proj", "column", "up"),
    "down_proj": Target("down_proj", "mlp.linear_fc2", "mlp.down_proj", "row", "whole"),
}
assert tuple(TARGETS) == LORA_TARGETS
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def projection_shape(name: str, dims) -> tuple[int, int]:
    """``(out_features, in_features)`` of an HF projection of a model with ``dims``."""
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_query_groups * dims.head_dim
    return {"q_proj": (q, dims.hidden_size), "k_proj": (kv, dims.hidden_size),
            "v_proj": (kv, dims.hidden_size), "o_proj": (dims.hidden_size, q),
            "gate_proj": (dims.ffn_hidden_size, dims.hidden_size),
            "up_proj": (dims.ffn_hidden_size, dims.hidden_size),
            "down_proj": (dims.hidden_size, dims.ffn_hidden_size)}[name]


def check_model(lora, hf_config: dict[str, Any]) -> None:
    """Refuse a ``lora`` section (:class:`~rlep_megatron.config.LoraConfig`) that cannot apply
    to this model: a rank above a targeted projection's width, or adapters on a
    mixture-of-experts model's experts."""
    from rlep_megatron.models import num_experts
    from rlep_megatron.models.llama_family import dims_from_config

    if not lora.enabled:
        return
    dims = dims_from_config(hf_config)
    explicit = list(lora.target_modules) != ["all-linear"]
    if num_experts(hf_config) and explicit:
        on_experts = [n for n in lora.targets() if n in MLP_TARGETS]
        if on_experts:
            raise ValueError(
                f"lora.target_modules {on_experts} on a mixture-of-experts model: adapters on "
                "the experts are not supported; target the attention (q_proj, k_proj, v_proj, "
                "o_proj), or all-linear for the attention and any dense MLP layers")
    for name in lora.targets():  # (a MoE model's dense MLP layers are intermediate_size wide)
        width = min(projection_shape(name, dims))
        if lora.rank > width:
            raise ValueError(f"lora.rank={lora.rank} is above the width of {name} "
                             f"({' x '.join(map(str, projection_shape(name, dims)))}): a "
                             f"low-rank adapter needs rank <= {width}")

