"""Which experts each token goes to in a mixture-of-experts actor: the tokens' places in the
routers' order, and routing replay.

Every forward pass first announces its micro-batch (:func:`note_micro_batch`): for each token
the routers see, the batch row and column it comes from (-1 for padding and fill). The routers
see ``[s, b]`` flattened (sequence-major), the sequence extended to a multiple of TP and, with
sequence parallelism, only this rank's shard of it; with context parallelism, only this rank's
chunks of every sequence, in its order (as :func:`rlep_megatron.actor.packing.run_model` feeds
the model).

Routing replay (``algo.routing_replay=actor``): the old-log-prob pass *records* each token's
top-k experts per MoE layer (:meth:`RoutingReplay.recording`), and every update of that
mini-batch *replays* them (:meth:`RoutingReplay.replaying`): the router still computes its
logits, and the gate weights are the softmax over the replayed experts' logits, so the router
keeps learning, but the choice of experts is the one the old policy made, whatever the
micro-batch layout of the update (padding, packing, pipeline stages, sequence-parallel shards).
With sequence or context parallelism each rank routes (and records) only its shard of a
micro-batch's tokens; at the end of the recording the shards' records are shared within the
tensor- and context-parallel group, so that an update may shard its micro-batches differently.
With full activation recompute a layer's forward runs twice per micro-batch (under no_grad, then
again in backward): the replayed experts of the first run are queued for the second.

The engine's routing (:mod:`rlep_megatron.rollout.routing_capture`), when given to
:meth:`RoutingReplay.recording`, is compared with the actor's own top-k on every token and layer
it covers (the ``rollout/routing_mismatch_frac`` counts, kept in the step's
:class:`~rlep_megatron.actor.expert_load.ExpertLoad`), and with ``follow_engine``
(``algo.routing_replay=rollout``) it is what the pass routes by and records, wherever it is
known; elsewhere (replayed pool answers, the last token of a response) the actor's own choice is
used and recorded.

The hook is megatron-core's own: each router's ``router_replay`` object is asked for the top-k.

Host traffic: nothing moves between the host and the device per layer. A recording keeps each
layer's top-k on the device and copies the pass's records to the host once, at its end; the
engine's experts (for the comparison) and a replay's records travel once per micro-batch, all
layers together, when the micro-batch is announced.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Optional

import torch

_EXPERT_LOAD = None  # the counting ExpertLoad, if any (actor/expert_load.py)


def count_expert_load(load) -> None:
    """The :class:`~rlep_megatron.actor.expert_load.ExpertLoad` that counts the routers' choices
    from now on (``None``: none)."""
    global _EXPERT_LOAD
    _EXPERT_LOAD = load


_REPLAY: Optional["RoutingReplay"] = None  # the recording / replaying RoutingReplay, if any


def router_order(values: torch.Tensor, config, fill: int,
                 packed: Optional[dict] = None) -> torch.Tensor:
    """``values [b, s]`` -> the flat ``[tokens]`` the routers of this rank see (module doc);
    ``packed``: the micro-batch's ``cu_seqlens`` when it is packed."""
    from megatron.core import parallel_state as ps

    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    if config.context_parallel_size > 1:
        from rlep_megatron.actor.packing import context_parallel_layout

        # the CP layout already makes every rank's share a multiple of TP
        values = context_parallel_layout(values, packed, config).local_values(values, fill)
    columns = values.t()
    extra = -columns.shape[0] % tp
    if extra:
        columns = torch.cat([columns, columns.new_full((extra, columns.shape[1]), fill)])
    if tp > 1:
        columns = columns.chunk(tp)[ps.get_tensor_model_parallel_rank()]
    return columns.reshape(-1)


def note_micro_batch(batch: dict, config) -> None:
    """Called before each forward pass with the micro-batch (its ``route_rows`` /
    ``route_cols``); no-op unless an expert count or a routing replay is active."""
    if _EXPERT_LOAD is None and _REPLAY is None:
        return
    packed = batch if "cu_seqlens" in batch else None
    rows = router_order(batch["route_rows"], config, -1, packed)
    if _EXPERT_LOAD is not None:
        valid = rows >= 0
        skip = _EXPERT_LOAD.skip_rows
        if skip is not None and skip.numel():
            valid &= ~torch.isin(rows, skip.to(rows.device))
        _EXPERT_LOAD.valid = valid
    if _REPLAY is not None:
        _REPLAY.announce(rows, router_order(batch["route_cols"], config, -1, packed))


class _LayerHook:
    """megatron's ``router_replay`` interface for one MoE layer."""

    def __init__(self, owner: "RoutingReplay", layer: int):
        self.owner, self.layer = owner, layer

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        return self.owner.topk(self.layer, scores, topk, num_groups, group_topk,
                               default_compute_topk)


class RoutingReplay:
    """Records and replays the top-k experts of this rank's MoE layers (module doc)."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from rlep_megatron.models.megatron import unwrap

        self.layers = []
        for chunk in chunks:
            model = unwrap(chunk)
            self.topk_size = model.config.moe_router_topk
            # the records' dtype: expert ids in 16 bits (a quarter of int64's host memory)
            self.dtype = (torch.int16 if (model.config.num_moe_experts or 0) < 2 ** 15
                          else torch.int32)
            self.recompute = model.config.recompute_granularity == "full"
            self.device = next(model.parameters()).device
            for layer in model.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    number = layer.layer_number - 1
                    router.router_replay = _LayerHook(self, number)
                    self.layers.append(number)
        self.mode: Optional[str] = None
        self.store: dict[int, torch.Tensor] = {}
        self.places: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._queues: dict[int, collections.deque] = {}
        self.engine: Optional[dict[int, torch.Tensor]] = None
        self.follow_engine = False
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        # per announced micro-batch: its places on the device, the layers' recorded top-k
        self._recorded: list[tuple[tuple[torch.Tensor, torch.Tensor], dict]] = []
        self._batch_experts: Optional[torch.Tensor] = None  # [layers, tokens, k], device
        self._match = None  # (compared, differing) device counters of the comparison
        self._valid: Optional[torch.Tensor] = None  # the expert count's real tokens, device

    @contextlib.contextmanager
    def recording(self, num_rows: int, num_columns: int,
                  engine: Optional[dict[int, torch.Tensor]] = None, follow_engine: bool = False,
                  share: bool = True):
        """Record every layer's top-k of the forward passes inside into :attr:`store`
        (``{layer: [rows, columns, k]}`` in :attr:`dtype`, -1 where no token was routed,
        on the host). ``engine``: the rollout engine's experts in the same frame (-1:
        unknown), compared with the actor's and, with ``follow_engine``, routed by (module
        doc). ``share``: give every rank of the
        tensor- and context-parallel group every token's record at the end (collective), as a
        replay needs; ``False`` when the record only serves the comparison with the engine."""
        self.store = {layer: torch.full((num_rows, num_columns, self.topk_size), -1,
                                        dtype=self.dtype) for layer in self.layers}
        self.engine, self.follow_engine = engine, follow_engine
        self._recorded, self._match = [], None
        try:
            with self._active("record"):
                yield self.store
                self._flush_records()
            if share:
                self._share_between_shards()
        finally:
            self.engine, self.follow_engine = None, False
            self._recorded, self._match = [], None

    def _flush_records(self) -> None:
        """The pass's top-k, kept on the device, into the host store: one copy for the pass
        (each micro-batch's layers stacked, ``[layers, tokens, k]``, and its places), and the
        comparison's two counts."""
        if self._match is not None and _EXPERT_LOAD is not None:
            compared, differing = torch.stack(self._match).tolist()
            _EXPERT_LOAD.note_routing_match(int(compared), int(differing))
        parts = [(places, recorded) for places, recorded in self._recorded if recorded]
        if not parts:
            return
        experts = torch.cat([torch.stack(list(recorded.values())).flatten(0, 1)
                             for _, recorded in parts]).cpu()
        rows = torch.cat([places[0] for places, _ in parts]).cpu()
        cols = torch.cat([places[1] for places, _ in parts]).cpu()
        offset = start = 0
        for places, recorded in parts:
            count = places[0].numel()
            block = experts[offset:offset + len(recorded) * count].view(len(recorded), count,
                                                                         self.topk_size)
            mb_rows, mb_cols = rows[start:start + count], cols[start:start + count]
            valid = mb_rows >= 0
            for i, layer in enumerate(recorded):
                self.store[layer][mb_rows[valid], mb_cols[valid]] = block[i][valid].to(
                    self.dtype)
            offset += len(recorded) * count
            start += count

    def _share_between_shards(self) -> None:
        """With sequence or context parallelism each rank routed only its shard of every
        micro-batch, and an update's micro-batches may shard the tokens differently: every
        rank of the tensor- and context-parallel group gets every token's record (each token
        was recorded by one of them, the others hold -1). Collective over that group."""
        from megatron.core import parallel_state as ps

        from rlep_megatron import distributed

        if ps.get_tensor_and_context_parallel_world_size() == 1:
            return
        group = ps.get_tensor_and_context_parallel_group()
        for layer, experts in self.store.items():
            # int32 on the wire (NCCL has no int16 reduction; expert ids fit)
            self.store[layer] = distributed.all_reduce(experts.to(torch.int32), "max",
                                                       group).to(experts.dtype)

    @contextlib.contextmanager
    def replaying(self, store: dict[int, torch.Tensor]):
        """Route every token inside by ``store`` (as :meth:`recording` made it)."""
        self.store = store
        self._queues = {layer: collections.deque() for layer in self.layers}
        with self._active("replay"):
            yield
        self._batch_experts = None

    @contextlib.contextmanager
    def _active(self, mode: str):
        global _REPLAY
        self.mode, _REPLAY = mode, self
        try:
            yield
        finally:
            self.mode, _REPLAY, self.places = None, None, None
            self._batch_experts = None

    def announce(self, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """A micro-batch's places (the routers' token order: batch row and column, -1 for
        none), before its forward pass: kept on the device; a replay's records, or a
        recording's engine experts, of every layer for these places sent to the device at
        once."""
        host = (rows.cpu(), cols.cpu())
        self.places = (rows.to(self.device), cols.to(self.device))
        valid = None if _EXPERT_LOAD is None else _EXPERT_LOAD.valid
        self._valid = None if valid is None else valid.to(self.device)
        if self.mode == "record":
            self._recorded.append((self.places, {}))
            if self.engine is not None:
                self._batch_experts = self._host_experts(self.engine, *host, fill=-1)
        elif self.mode == "replay":
            self._batch_experts = self._host_experts(self.store, *host, fill=None)

    def _host_experts(self, table: dict, rows: torch.Tensor, cols: torch.Tensor,
                      fill: Optional[int]) -> torch.Tensor:
        """``[layers of this rank, tokens, k]`` on the device: ``table[layer][row, col]`` for
        every token of the micro-batch; tokens of no row get ``fill`` (-1), or with ``None``
        the first k experts (their outputs reach no real token) and a recorded -1 on a real
        token is an error (a replay must know every token's experts)."""
        host_rows, host_cols = rows, cols
        valid = host_rows >= 0
        count = host_rows.numel()
        if fill is None:
            out = torch.arange(self.topk_size).expand(len(self.layers), count,
                                                      self.topk_size).clone()
        else:
            out = torch.full((len(self.layers), count, self.topk_size), fill, dtype=torch.long)
        for i, layer in enumerate(self.layers):
            if layer not in table:
                continue
            known = table[layer][host_rows[valid], host_cols[valid]].long()
            if fill is None and (known < 0).any():
                raise RuntimeError(f"routing replay: layer {layer} has no recorded experts "
                                   f"for {int((known < 0).any(dim=1).sum())} tokens")
            out[i, valid] = known
        return out.to(self.device)

    def topk(self, layer, scores, topk, num_groups, group_topk, default_compute_topk):
        if self.mode is None:
            return default_compute_topk(scores, topk, num_groups=num_groups,
                                        group_topk=group_topk)
        if self.mode == "record":
            probs, indices = default_compute_topk(scores, topk, num_groups=num_groups,
                                                  group_topk=group_topk)
            self._places(scores)
            if self._batch_experts is not None and layer in self.engine:
                indices = self._against_engine(layer, indices)
                if self.follow_engine:
                    probs = scores.gather(1, indices)
            self._recorded[-1][1][layer] = indices.to(torch.int16)
            return probs, indices
        if self.recompute and torch.is_grad_enabled():
            indices = self._queues[layer].popleft()  # activation recompute in backward
        else:
            indices = self._replayed(layer, scores)
            if self.recompute:
                self._queues[layer].append(indices)
        return scores.gather(1, indices), indices

    def _against_engine(self, layer, indices):
        """Count where the actor's top-k set differs from the engine's (device counters, read
        once at the end of the pass); with :attr:`follow_engine`, the engine's experts where it
        has them."""
        engine = self._batch_experts[self._position[layer]]
        known = (engine >= 0).all(dim=1)
        if self._valid is not None:
            known &= self._valid  # placeholder rows are not compared
        differ = (indices.sort(dim=1).values != engine.sort(dim=1).values).any(dim=1) & known
        counts = (known.sum(), differ.sum())
        self._match = counts if self._match is None else (self._match[0] + counts[0],
                                                          self._match[1] + counts[1])
        if not self.follow_engine:
            return indices
        return torch.where(known.unsqueeze(1), engine.to(indices.dtype), indices)

    def _places(self, scores):
        if self.places is None or self.places[0].numel() != scores.shape[0]:
            raise RuntimeError(f"routing replay: {scores.shape[0]} routed tokens, but the "
                               "micro-batch announced "
                               f"{None if self.places is None else self.places[0].numel()}")
        return self.places

    def _replayed(self, layer, scores):
        self._places(scores)
        return self._batch_experts[self._position[layer]]
