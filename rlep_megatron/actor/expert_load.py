"""How evenly a mixture-of-experts actor spreads tokens over its experts: the tokens each
router sends to each expert, counted during the actor's forward passes of a step (the
old-log-prob pass), over real tokens only (padding, sequence-parallel fill, micro-batches that
only keep expert-parallel ranks in step and placeholder rows are not counted).

Per MoE layer, ``max over experts / mean over experts`` of the counts (1 = perfectly even; at
most E / top-k when every token picks the same experts); the step's metric is the worst layer's
(``moe/load_imbalance``) and which layer that is (``moe/load_imbalance_layer``, global index).
Each forward pass says which of its tokens are real (:func:`routing.note_micro_batch`).
Counts are summed over every rank (data-parallel shares, sequence-parallel shards and pipeline
stages hold disjoint tokens or layers).
"""
from __future__ import annotations

from typing import Optional

import torch

from rlep_megatron import distributed
from rlep_megatron.actor import routing

class ExpertLoad:
    """Context manager that counts routed tokens per expert in this rank's MoE layers."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from rlep_megatron.models.megatron import unwrap

        self.routers = []
        self.num_layers = 0
        self.num_experts = 0
        for chunk in chunks:
            model = unwrap(chunk)
            self.num_layers = model.config.num_layers
            self.num_experts = model.config.num_moe_experts or 0
            for layer in model.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    self.routers.append((layer.layer_number - 1, router))
        device = next(chunks[0].parameters()).device
        self.counts = torch.zeros(self.num_layers, max(self.num_experts, 1), dtype=torch.float64,
                                  device=device)
        self.valid: Optional[torch.Tensor] = None
        self.enabled = True
        self._handles: list = []

    def __enter__(self) -> "ExpertLoad":
        routing._EXPERT_LOAD = self
        self._handles = [router.register_forward_hook(self._hook(layer))
                         for layer, router in self.routers]
        return self

    def __exit__(self, *_exc) -> None:
        routing._EXPERT_LOAD = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def count(_module, _inputs, output):
            routing_map = output[1]
            if not self.enabled:
                return
            if self.valid is not None:
                if self.valid.numel() != routing_map.shape[0]:
                    raise RuntimeError(f"expert load: {self.valid.numel()} token flags for "
                                       f"{routing_map.shape[0]} routed tokens")
                routing_map = routing_map[self.valid.to(routing_map.device)]
            self.counts[layer] += routing_map.sum(dim=0).to(torch.float64)
        return count

    def totals(self) -> torch.Tensor:
        """``[layers, experts]`` tokens routed to each expert, summed over every rank
        (collective); rows of dense layers are 0."""
        counts = self.counts.clone()
        distributed.all_reduce(counts, "sum")
        return counts.cpu()

    def metrics(self) -> dict[str, float]:
        """The step's ``moe/...`` metrics (collective over all ranks; {} for a dense model)."""
        if not self.num_experts:
            return {}
        counts = self.totals()
        routed = counts.sum(dim=1)
        layers = (routed > 0).nonzero().flatten()
        if not len(layers):
            return {}
        ratio = counts[layers].max(dim=1).values / (routed[layers] / self.num_experts)
        worst = int(ratio.argmax())
        return {"moe/load_imbalance": float(ratio[worst]),
                "moe/load_imbalance_layer": float(layers[worst])}
