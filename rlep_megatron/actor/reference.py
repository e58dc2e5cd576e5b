"""The frozen reference policy of the KL term: a copy of the actor's initial weights with the
actor's TP/PP/VPP layout, used only for forward passes.

It is built from the actor's chunks before any update (and before a resume loads a checkpoint
into the actor), so it always holds the run's initial weights; checkpoints need not store it.
With ``offload`` (GPU only) its weights live in CPU memory between uses and move to the GPU for
each forward pass.

With LoRA (:class:`InitialAdapters`) no copy of the model is made: the base is frozen, so the
initial policy is the actor's own base with its adapters' initial values, which are kept (the
adapters' size) and put in place for each reference pass.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from rlep_megatron.models.megatron import ActorModelInfo, build_model, unwrap


class ReferencePolicy:
    def __init__(self, actor_chunks: list[torch.nn.Module], info: ActorModelInfo,
                 offload: bool = False):
        self.info = info
        # the actor's own layer spec, whatever would be chosen now
        self.chunks, _ = build_model(info.hf_config, info.params_dtype,
                                     transformer_engine="required" if info.use_te else "off",
                                     moe_experts=info.moe_experts)
        for ref, actor in zip(self.chunks, actor_chunks):
            ref.load_state_dict(unwrap(actor).state_dict())
            ref.eval()
            for param in ref.parameters():
                param.requires_grad_(False)
        self.device = next(self.chunks[0].parameters()).device
        self.offload = offload and self.device.type != "cpu"
        if self.offload:
            self._move(torch.device("cpu"))

    def _move(self, device: torch.device) -> None:
        for chunk in self.chunks:
            for tensor in list(chunk.parameters()) + list(chunk.buffers()):
                tensor.data = tensor.data.to(device, non_blocking=True)

    @contextlib.contextmanager
    def on_device(self):
        """The reference's weights on the compute device for the duration (a no-op unless
        offloaded)."""
        if not self.offload:
            yield self.chunks
            return
        self._move(self.device)
        try:
            yield self.chunks
        finally:
            self._move(torch.device("cpu"))

    def logprobs(self, input_ids: torch.Tensor, micro_batch_size: int, temperature: float,
                 lengths: Optional[torch.Tensor] = None, pack_max_tokens: Optional[int] = None
                 ) -> Optional[torch.Tensor]:
        """Per-token log-probs of the right-padded ``input_ids`` on the last pipeline stage
        (``None`` elsewhere), batched exactly as the actor's old log-probs. Collective."""
        from rlep_megatron.actor.forward import actor_logprobs

        with self.on_device() as chunks:
            return actor_logprobs(chunks, self.info, input_ids, micro_batch_size, temperature,
                                  everywhere=False, lengths=lengths,
                                  pack_max_tokens=pack_max_tokens)


class InitialAdapters(ReferencePolicy):
    """The reference of a LoRA actor: the actor's chunks, their adapters' parameters set to the
    values they had when this was built (fresh adapters: B = 0, the base itself; with
    ``lora.init_from``, the imported adapter) for the duration of each pass, and restored
    after it bit for bit."""

    def __init__(self, actor_chunks: list[torch.nn.Module], info: ActorModelInfo):
        from rlep_megatron.lora.adapters import is_adapter_parameter

        self.info, self.offload = info, False
        self.chunks = actor_chunks  # the same parameter objects after DDP wraps them
        self.parameters = [param for chunk in actor_chunks
                           for name, param in unwrap(chunk).named_parameters()
                           if is_adapter_parameter(name)]
        self.initial = [param.detach().clone() for param in self.parameters]

    @contextlib.contextmanager
    def on_device(self):
        current = [param.detach().clone() for param in self.parameters]
        with torch.no_grad():
            for param, initial in zip(self.parameters, self.initial):
                param.copy_(initial)
        try:
            yield self.chunks
        finally:
            with torch.no_grad():
                for param, value in zip(self.parameters, current):
                    param.copy_(value)
