"""vLLM worker extension: the engine-side entry points of weight sync and routing capture (vLLM
mixes this class into its worker; methods are prefixed ``rlep_`` so they never shadow vLLM's own,
e.g. the worker's ``start_weight_update``)."""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class RolloutWorkerExtension:
    """The colocated engine's end of the weight-update lifecycle (start -> buckets -> finish,
    :mod:`rlep_megatron.weight_sync.lifecycle`), the steps of
    :mod:`rlep_megatron.rollout.vllm_reload`."""

    # each step runs in vLLM's config context, as vLLM's own reload and weight-transfer
    # routes do (a weight loader or kernel set-up may read the current config)
    def rlep_start_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config

        from rlep_megatron import platform
        from rlep_megatron.rollout import vllm_reload

        self._rlep_reprocessed_before = platform.cpu_moe_layers_reprocessed()
        with set_current_vllm_config(self.vllm_config):
            vllm_reload.begin(self.model_runner.get_model())

    def rlep_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config

        from rlep_megatron.rollout import vllm_reload

        with set_current_vllm_config(self.vllm_config):
            vllm_reload.load(self.model_runner.get_model(), weights)

    def rlep_finish_weight_update(self) -> int:
        """Returns the layers refreshed or re-processed (tied LM-head kernels, CPU MoE
        experts)."""
        from rlep_megatron import platform
        from rlep_megatron.rollout import vllm_reload

        from vllm.config import set_current_vllm_config

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            refreshed = vllm_reload.finish(runner.get_model(), runner.model_config)
        # what vLLM's own in-place reload resets after new weights
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        capture = getattr(self, "_rlep_routing", None)
        if capture is not None:
            capture.reset_prefixes()  # the caller resets the prefix cache too
        return refreshed + platform.cpu_moe_layers_reprocessed() - self._rlep_reprocessed_before

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
