"""This pipeline stage's weights as full (TP-gathered) tensors under HF names, one parameter at
a time, through the same mapping tables as the conversion tools. Used to compare layouts in
tests and as the source side of weight sync."""
from __future__ import annotations

from typing import Iterator

import torch

from rlep_megatron.actor.model import ActorModelInfo, iter_params_with_rules
from rlep_megatron.checkpoint import architecture_for, layout


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (or the chunk itself)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def iter_hf_tensors(chunks: list[torch.nn.Module], info: ActorModelInfo
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for the parameters of this rank's pipeline stage. Collective
    over the tensor-parallel group: every TP rank must iterate."""
    from megatron.core import parallel_state as ps

    rules = architecture_for(info.hf_config).rules(info.hf_config)
    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    tied = bool(info.hf_config.get("tie_word_embeddings"))
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param, rule, layer in iter_params_with_rules(model, rules):
            if tied and rule.mcore_name == "output_layer.weight":
                continue  # the last stage's copy of the tied embedding
            local = param.detach().contiguous()
            if rule.tp_dim is not None and tp_size > 1:
                shards = [torch.empty_like(local) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, local, group=tp_group)
            else:
                shards = [local]
            full = layout.gather(rule, shards)
            for hf_name, tensor in zip(rule.hf_names, layout.full_to_hf(rule, full, info.dims)):
                yield hf_name.format(layer=layer), tensor
