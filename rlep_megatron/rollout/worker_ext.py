"""vLLM worker extension: the engine-side entry point of weight sync (vLLM mixes this class into
its worker; methods are prefixed ``rlep_`` so they never shadow vLLM's own, e.g. the worker's
``update_weights``)."""
from __future__ import annotations

from typing import Iterable

import torch


class RolloutWorkerExtension:
    def rlep_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format ``(hf_name, full tensor)`` pairs in place through vLLM's
        layer-wise ``reload_weights`` (each layer is re-processed for its kernels once all of
        its tensors arrived), then repack a tied CPU LM-head's kernel and the CPU MoE layers'
        expert weights. Returns layers refreshed."""
        from rlep_megatron import platform

        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings",
                            False))
        model = self.model_runner.get_model()
        return (platform.refresh_vllm_cpu_embedding_kernels(model, tied)
                + platform.refresh_vllm_cpu_moe_kernels(model))
