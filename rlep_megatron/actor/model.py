"""Loading HF safetensors into this rank's ``GPTModel`` chunks at any TP/PP layout (the
chunks are built by :mod:`rlep_megatron.models.megatron`; dist checkpoints load through
:mod:`rlep_megatron.checkpoint.dist`)."""
from __future__ import annotations

import torch

from rlep_megatron.checkpoint.hf_io import SafetensorsReader, load_hf_config
from rlep_megatron.models import architecture_for, layout
from rlep_megatron.models.megatron import (ActorModelInfo, build_model, iter_params_with_rules,
                                           resolve_dtype)

def load_hf_weights(chunks: list[torch.nn.Module], hf_dir: str, info: ActorModelInfo) -> None:
    """Copy HF safetensors into this rank's shards, one tensor at a time."""
    from megatron.core import parallel_state as ps

    reader = SafetensorsReader(hf_dir)
    rules = architecture_for(info.hf_config).rules(info.hf_config)
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    # experts' matrices are split over the expert-tensor-parallel group
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    for chunk in chunks:
        for name, param, rule, layer, expert in iter_params_with_rules(chunk, rules):
            tp_rank, tp_size = etp if rule.per_expert else tp
            if rule.tp_dim is not None and tp_size > 1 and not getattr(
                    param, "tensor_model_parallel", False):
                raise AssertionError(f"{name} is TP-sharded but not marked tensor_model_parallel")
            hf_names = rule.hf_names_at(layer, expert)
            tensors = [reader.get(n) for n in hf_names]
            full = layout.hf_to_full(rule, tensors, info.dims, info.padded_vocab_size)
            local = layout.shard(rule, full, tp_rank, tp_size)
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF tensors {hf_names} give shape "
                                 f"{tuple(local.shape)} on this rank, the model expects "
                                 f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(local.to(param.dtype))


def build_from_hf(hf_dir: str, params_dtype: str = "auto",
                  recompute_activations: bool = False, transformer_engine: str = "auto",
                  moe_experts: str = "auto", **moe_losses: float):
    """Build this rank's chunks for an HF checkpoint and load its weights (``moe_losses``:
    :func:`build_model`'s ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff``)."""
    hf_config = load_hf_config(hf_dir)
    chunks, info = build_model(hf_config, resolve_dtype(params_dtype), recompute_activations,
                               transformer_engine=transformer_engine,
                               moe_experts=moe_experts, **moe_losses)
    load_hf_weights(chunks, hf_dir, info)
    return chunks, info


