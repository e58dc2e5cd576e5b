"""How evenly a mixture-of-experts actor spreads tokens over its experts: the tokens each
router sends to each expert, counted during the actor's forward passes of a step (the
old-log-prob pass), over real tokens only (padding, sequence-parallel fill, micro-batches that
only keep expert-parallel ranks in step and placeholder rows are not counted).

Per MoE layer, ``max over experts / mean over experts`` of the counts (1 = perfectly even; at
most E / top-k when every token picks the same experts); the step's metric is the worst layer's
(``moe/load_imbalance``) and which layer that is (``moe/load_imbalance_layer``, global index).
Each forward pass says which of its tokens are real (:func:`routing.note_micro_batch`).
Counts are summed over every rank (data-parallel shares, sequence- and context-parallel shards
and pipeline stages hold disjoint tokens or layers).
"""
from __future__ import annotations

import contextlib
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
        self.routing_match = torch.zeros(2, dtype=torch.float64, device=device)
        """(token-layer pairs compared with the engine's routing, pairs whose top-k differ)."""
        self.skip_rows: Optional[torch.Tensor] = None
        """Rows of the pass not to count (placeholder rows), or ``None``."""
        self._handles: list = []
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """No counting for the duration (a pass through the actor's routers that is not the
        policy's: LoRA's KL reference runs on the actor's own chunks)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __enter__(self) -> "ExpertLoad":
        routing.count_expert_load(self)
        self._handles = [router.register_forward_hook(self._hook(layer))
                         for layer, router in self.routers]
        return self

    def __exit__(self, *_exc) -> None:
        routing.count_expert_load(None)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def count(_module, _inputs, output):
            if self._paused:
                return
            routing_map = output[1]
            if self.valid is not None:
                if self.valid.numel() != routing_map.shape[0]:
                    raise RuntimeError(f"expert load: {self.valid.numel()} token flags for "
                                       f"{routing_map.shape[0]} routed tokens")
                routing_map = routing_map[self.valid.to(routing_map.device)]
            self.counts[layer] += routing_map.sum(dim=0).to(torch.float64)
        return count

    def note_routing_match(self, compared: int, differing: int) -> None:
        """Called by :mod:`rlep_megatron.actor.routing` for every layer's comparison of the
        actor's top-k with the engine's."""
        self.routing_match[0] += compared
        self.routing_match[1] += differing

    def totals(self) -> torch.Tensor:
        """``[layers, experts]`` tokens routed to each expert, summed over every rank
        (collective); rows of dense layers are 0."""
        counts = self.counts.clone()
        distributed.all_reduce(counts, "sum")
        return counts.cpu()

    def metrics(self, engine_routing: bool = False) -> dict[str, float]:
        """The step's ``moe/...`` metrics (collective over all ranks; {} for a dense model),
        and with ``engine_routing`` ``rollout/routing_mismatch_frac``: of the (token, layer)
        pairs whose engine routing is known, the fraction whose top-k expert set the actor's
        old-log-prob pass chose differently (``rollout/routing_compared`` pairs)."""
        if not self.num_experts:
            return {}
        both = torch.cat([self.counts.flatten(), self.routing_match])
        distributed.all_reduce(both, "sum")
        both = both.cpu()
        counts = both[:-2].view_as(self.counts)
        compared, differing = float(both[-2]), float(both[-1])
        out = {}
        if engine_routing:
            out = {"rollout/routing_mismatch_frac": differing / max(compared, 1.0),
                   "rollout/routing_compared": compared}
        routed = counts.sum(dim=1)
        layers = (routed > 0).nonzero().flatten()
        if not len(layers):
            return out
        ratio = counts[layers].max(dim=1).values / (routed[layers] / self.num_experts)
        worst = int(ratio.argmax())
        return {"moe/load_imbalance": float(ratio[worst]),
                "moe/load_imbalance_layer": float(layers[worst]), **out}


ROUTER_LOSSES = (("load_balancing_loss", "moe_aux_loss_coeff", "moe/aux_loss"),
                 ("z_loss", "moe_z_loss_coeff", "moe/z_loss"))
"""megatron's name of each router loss in its tracker, the config's coefficient, our metric."""


def router_loss_metrics(config, num_micro_batches: int) -> dict[str, float]:
    """The router losses of the train step that just ran (``algo.moe_aux_loss_coeff`` /
    ``moe_z_loss_coeff`` > 0), unweighted: per MoE layer the mean over micro-batches and
    data-parallel ranks, then the mean over MoE layers (with sequence or context parallelism
    the z-loss is the mean of the TP x CP shards' own means); the tracker is cleared for the
    next step. Read from megatron-core's router tracker, which each router adds its
    micro-batch value to (pipeline stages hold disjoint layers, sequence- and context-parallel
    shards partial sums of one micro-batch). Collective over every rank; {} when both losses
    are off."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)

    active = [(name, metric) for name, coeff, metric in ROUTER_LOSSES
              if (getattr(config, coeff, None) or 0) > 0]
    if not active:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    values = torch.stack([tracker[name]["values"].to(torch.float64) if name in tracker
                          else torch.zeros(config.num_layers, dtype=torch.float64,
                                           device=distributed.communication_device())
                          for name, _ in active])
    distributed.all_reduce(values, "sum")
    # megatron sums the load-balancing loss's shards over TP x CP to the micro-batch's value;
    # each shard's z-loss is the mean over its own tokens: averaged over the shards
    for row, (name, _) in enumerate(active):
        if name == "z_loss":
            values[row] /= (ps.get_tensor_model_parallel_world_size()
                            * ps.get_context_parallel_world_size())
    count = torch.tensor([float(num_micro_batches)])
    distributed.all_reduce(count, "sum", ps.get_data_parallel_group())
    clear_aux_losses_tracker()
    moe_layers = [i for i, freq in enumerate(_moe_layer_pattern(config)) if freq]
    per_layer = values.cpu()[:, moe_layers] / max(float(count), 1.0)
    return {metric: float(per_layer[i].mean()) for i, (_, metric) in enumerate(active)}


def _moe_layer_pattern(config) -> list[int]:
    """1 for each MoE layer of the model, 0 for a dense one (``config.moe_layer_freq``)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)
