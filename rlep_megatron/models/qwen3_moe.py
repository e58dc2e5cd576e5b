"""Qwen3-MoE (``model_type: qwen3_moe``, e.g. Qwen3-30B-A3B): Qwen3's attention (q/k RMSNorm,
no QKV bias, free ``head_dim``) with a mixture-of-experts MLP on megatron-core's MoE layer.

The router is the HF one: a bias-free linear ``mlp.gate`` giving one logit per expert, a
softmax over all experts, the top-k experts, and (``norm_topk_prob``) the k gates renormalised
to sum to one. The renormalised softmax over the top k equals a softmax over the top-k logits,
which is megatron's ``moe_router_pre_softmax=false``; without renormalisation megatron's
``pre_softmax=true`` (softmax over all, then top-k) is the same. No shared expert. A layer is
sparse unless it is listed in ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step != 0``
(HF's rule); dense layers keep the Qwen3 MLP of ``intermediate_size``.

Experts are split across ``parallel.expert_model_parallel_size`` ranks (expert ``e`` lives on
EP rank ``e // (E / EP)``) and each expert's matrices across the expert-tensor-parallel group
(megatron's default: the TP size); at TP > 1 megatron's MoE layer trains only with sequence
parallelism. The load-balancing auxiliary loss and the router z-loss are off by default, as RL
peers run them (``algo.moe_aux_loss_coeff``, ``algo.moe_z_loss_coeff`` turn them on).
"""
from __future__ import annotations

from typing import Any

from rlep_megatron.models import llama_family, qwen3
from rlep_megatron.models.layout import ParamRule

MODEL_TYPE = "qwen3_moe"
L, E = llama_family.L, "{expert}"


def num_experts(hf_config: dict[str, Any]) -> int:
    """The expert count (``num_experts`` in Qwen's configs, ``num_local_experts`` in the ones
    transformers 5 writes)."""
    value = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if not value:
        raise ValueError("qwen3_moe: config.json has neither num_experts nor num_local_experts")
    return int(value)


def moe_layer_pattern(hf_config: dict[str, Any]) -> list[int]:
    """1 for each sparse (MoE) layer, 0 for each dense one, by HF's rule."""
    layers = int(hf_config["num_hidden_layers"])
    dense = set(hf_config.get("mlp_only_layers") or [])
    step = int(hf_config.get("decoder_sparse_step", 1) or 1)
    return [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]


def validate(hf_config: dict[str, Any]) -> None:
    qwen3.validate({**hf_config, "model_type": "qwen3"})
    experts, topk = num_experts(hf_config), int(hf_config.get("num_experts_per_tok", 0))
    if not 1 <= topk <= experts:
        raise ValueError(f"qwen3_moe: num_experts_per_tok={topk} must be in [1, {experts}]")
    if not hf_config.get("moe_intermediate_size"):
        raise ValueError("qwen3_moe: config.json lacks moe_intermediate_size")
    if hf_config.get("shared_expert_intermediate_size"):
        raise ValueError("qwen3_moe: a shared expert (shared_expert_intermediate_size) is not "
                         "supported")
    bad = [i for i in hf_config.get("mlp_only_layers") or []
           if not 0 <= int(i) < int(hf_config["num_hidden_layers"])]
    if bad:
        raise ValueError(f"qwen3_moe: mlp_only_layers {bad} are not layer indices")


def transformer_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    pattern = moe_layer_pattern(hf_config)
    return {
        **qwen3.transformer_kwargs(hf_config),
        "num_moe_experts": num_experts(hf_config),
        "moe_ffn_hidden_size": int(hf_config["moe_intermediate_size"]),
        "moe_router_topk": int(hf_config["num_experts_per_tok"]),
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not bool(hf_config.get("norm_topk_prob", False)),
        "moe_layer_freq": pattern,
        "moe_shared_expert_intermediate_size": None,
        "moe_router_enable_expert_bias": False,
        "moe_token_dispatcher_type": "alltoall",
        # the router's softmax and top-k in float32 whatever the parameters' dtype (HF takes
        # the softmax in float32 too)
        "moe_router_dtype": "fp32",
    }


def spec_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return qwen3.spec_kwargs(hf_config)


def model_kwargs(hf_config: dict[str, Any]) -> dict[str, Any]:
    return qwen3.model_kwargs(hf_config)


def rules(hf_config: dict[str, Any]) -> list[ParamRule]:
    """Qwen3's table (whose MLP rules serve the dense layers) plus the router and the experts'
    matrices; ``{expert}`` is the global expert index."""
    layer, p = f"decoder.layers.{L}.mlp.", f"model.layers.{L}.mlp."
    experts = layer + f"experts.local_experts.{E}."
    return qwen3.rules(hf_config) + [
        ParamRule(layer + "router.weight", (p + "gate.weight",), "copy", None),
        ParamRule(experts + "linear_fc1.weight",
                  (p + f"experts.{E}.gate_proj.weight", p + f"experts.{E}.up_proj.weight"),
                  "gate_up", 0),
        ParamRule(experts + "linear_fc2.weight", (p + f"experts.{E}.down_proj.weight",),
                  "copy", 1),
    ]
