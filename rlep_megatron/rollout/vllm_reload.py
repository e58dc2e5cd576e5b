"""The vLLM-side steps of one in-place weight update, written once for both backends: the
colocated engine's worker extension (:mod:`rlep_megatron.rollout.colocated.worker_ext`) and the
servers' ``rlep_gloo`` transfer engine (:mod:`rlep_megatron.rollout.servers.gloo_transfer`).

``begin`` starts vLLM's layer-wise reload (each layer is re-processed for its kernels once all
of its tensors arrived; the CPU MoE experts padded and packed as at load,
:func:`~rlep_megatron.platform.process_cpu_moe_experts_on_reload`); ``load`` takes one bucket of
checkpoint-format ``(hf_name, full tensor)`` pairs (any number of calls); ``finish`` finalises
the reload and repacks a tied CPU LM head's kernel. Runs inside a vLLM worker.
"""
from __future__ import annotations

from typing import Iterable

import torch


def begin(model: torch.nn.Module) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    from rlep_megatron import platform

    platform.process_cpu_moe_experts_on_reload()
    initialize_layerwise_reload(model)


def load(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    model.load_weights(weights)


def finish(model: torch.nn.Module, model_config) -> int:
    """Returns the tied LM-head kernels repacked."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from rlep_megatron import platform

    finalize_layerwise_reload(model, model_config)
    tied = bool(getattr(model_config.hf_config, "tie_word_embeddings", False))
    return platform.refresh_vllm_cpu_embedding_kernels(model, tied)
