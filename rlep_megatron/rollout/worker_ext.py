"""vLLM worker extension: the engine-side entry point of weight sync (vLLM mixes this class into
its worker; methods are prefixed ``rlep_`` so they never shadow vLLM's own, e.g. the worker's
``update_weights``)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class RolloutWorkerExtension:
    def rlep_reload_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load checkpoint-format ``(hf_name, full tensor)`` pairs in place through vLLM's
        layer-wise ``reload_weights`` (each layer is re-processed for its kernels once all of
        its tensors arrived; the CPU MoE experts padded and packed as at load,
        :func:`~rlep_megatron.platform.process_cpu_moe_experts_on_reload`), then repack a tied
        CPU LM-head's kernel. Returns the layers refreshed or re-processed."""
        from rlep_megatron import platform

        platform.process_cpu_moe_experts_on_reload()
        before = platform.cpu_moe_layers_reprocessed()
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        tied = bool(getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings",
                            False))
        model = self.model_runner.get_model()
        capture = getattr(self, "_rlep_routing", None)
        if capture is not None:
            capture.reset_prefixes()  # the caller resets the prefix cache too
        return (platform.refresh_vllm_cpu_embedding_kernels(model, tied)
                + platform.cpu_moe_layers_reprocessed() - before)

    def rlep_capture_routing(self, num_layers: int, topk: int) -> Optional[str]:
        """Start capturing each request's routed experts
        (:mod:`rlep_megatron.rollout.routing_capture`); returns ``None``, or why this engine
        cannot."""
        from rlep_megatron.rollout.routing_capture import RoutingCapture, capture_supported

        why = capture_supported(self.model_runner)
        if why is None:
            try:
                self._rlep_routing = RoutingCapture(self.model_runner, num_layers, topk)
            except ValueError as err:  # vLLM's binder refuses e.g. monolithic MoE kernels
                why = str(err)
        return why

    def rlep_routing_arm(self) -> None:
        self._rlep_routing.arm()

    def rlep_routing_take(self) -> dict:
        return self._rlep_routing.take()
