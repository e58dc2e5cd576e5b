"""Context parallelism (``parallel.context_parallel_size``): every sequence of a micro-batch is
split over the CP ranks in megatron's load-balanced layout, so that each rank holds 1 / CP of
every layer's activations.

A sequence padded to a multiple of 2 x CP tokens is cut into 2 x CP equal chunks; rank i holds
chunk i and chunk 2 x CP - 1 - i (with causal attention the early chunks are cheap and the
late ones expensive: each rank gets one of each). A packed micro-batch pads each of its
sequences that way and keeps the *global* ``cu_seqlens`` (megatron's THD rotary embedding and
TransformerEngine's attention expect them); rows of a padded micro-batch are one sequence each.
Pad tokens sit at the end of their sequence, so under causal attention they change no real
token's output.

On TransformerEngine's spec the attention itself is TE's; on the local spec
:func:`local_cp_attention` all-gathers K and V over the CP group and masks by global position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def chunk_positions(bounds: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """Global positions of ``rank``'s tokens, sequence by sequence (``bounds``: the padded
    sequences' start offsets and the end, each length a multiple of 2 x CP): chunk ``rank``
    then chunk ``2 CP - 1 - rank`` of each."""
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * cp)
        for index in (rank, 2 * cp - 1 - rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def gathered_order(bounds: Sequence[int], cp: int) -> torch.Tensor:
    """Index that puts the CP ranks' tokens, concatenated in rank order (an all-gather), back
    into global order."""
    return torch.argsort(torch.cat([chunk_positions(bounds, cp, r) for r in range(cp)]))


@dataclass
class ContextLayout:
    """One micro-batch laid out for context parallelism (see the module docstring)."""

    input_ids: torch.Tensor
    """``[rows, padded]`` the whole micro-batch, each sequence padded to 2 x CP chunks."""
    position_ids: torch.Tensor
    bounds: list[int]
    """Padded sequences' starts and the end (a padded micro-batch: ``[0, padded]``)."""
    original: torch.Tensor
    """``[columns]`` padded position of each column of the original micro-batch."""
    local: torch.Tensor
    """Padded positions this rank holds."""
    packed: Optional[dict]
    """``cu_seqlens`` / ``max_seqlen`` of the padded pack (global), or ``None``."""

    def local_values(self, values: torch.Tensor, fill) -> torch.Tensor:
        """``[rows, columns]`` per-token values of the micro-batch -> ``[rows, local tokens]``:
        those of the tokens this CP rank holds, in the order it feeds them to the model;
        places the layout adds hold ``fill``."""
        full = torch.full((values.shape[0], self.bounds[-1]), fill, dtype=values.dtype,
                          device=values.device)
        full[:, self.original.to(values.device)] = values
        return full.index_select(1, self.local.to(values.device))


def layout(input_ids: torch.Tensor, packed: Optional[dict], cp: int, rank: int,
           multiple: int = 1) -> ContextLayout:
    """The CP layout of a micro-batch (``packed``: its ``cu_seqlens``; ``None``: padded rows;
    positions restart at 0 in every sequence). ``multiple``: each rank's token count must be a
    multiple of it (the TP size under sequence parallelism): a pack gets a filler sequence,
    padded rows more padding."""
    length = input_ids.shape[1]
    unit = 2 * cp
    if packed is None:
        step = unit * multiple
        padded = -(-length // step) * step
        ids = torch.nn.functional.pad(input_ids, (0, padded - length))
        positions = torch.arange(padded, device=input_ids.device).expand(input_ids.shape[0], -1)
        bounds = [0, padded]
        original = torch.arange(length)
        cu = None
    else:
        sizes = (packed["cu_seqlens"][1:] - packed["cu_seqlens"][:-1]).tolist()
        padded_sizes = [-(-int(s) // unit) * unit for s in sizes]
        total = sum(padded_sizes)
        filler = 0
        while (total + filler) % (cp * multiple):
            filler += unit
        if filler:
            padded_sizes.append(filler)
        bounds = [0]
        for size in padded_sizes:
            bounds.append(bounds[-1] + size)
        ids = torch.zeros(1, bounds[-1], dtype=input_ids.dtype, device=input_ids.device)
        original = torch.cat([torch.arange(bounds[i], bounds[i] + int(s))
                              for i, s in enumerate(sizes)])
        ids[0, original.to(ids.device)] = input_ids[0]
        positions = torch.cat([torch.arange(s) for s in padded_sizes]).unsqueeze(0)
        cu = {"cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
              "max_seqlen": torch.tensor(max(padded_sizes))}
    return ContextLayout(input_ids=ids, position_ids=positions.to(input_ids.device),
                         bounds=bounds, original=original,
                         local=chunk_positions(bounds, cp, rank), packed=cu)


class _GatherIdentical(torch.autograd.Function):
    """All-gather along dim 1 over the CP group, for values every CP rank then uses in the same
    way (the per-token log-probs: each CP rank computes the same loss from all of them): the
    backward keeps this rank's columns of the (identical) incoming gradient, no collective."""

    @staticmethod
    def forward(ctx, local, group, rank, size):
        from rlep_megatron import distributed

        parts = [torch.empty_like(local) for _ in range(size)]
        distributed.all_gather(parts, local.contiguous(), group=group)
        ctx.slice = (rank * local.shape[1], (rank + 1) * local.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.slice
        return grad[:, start:end], None, None, None


def gather_tokens(local: torch.Tensor, lay: ContextLayout) -> torch.Tensor:
    """``[rows, local tokens]`` values of every CP rank -> ``[rows, columns]`` in the original
    micro-batch's layout."""
    from megatron.core import parallel_state as ps

    group = ps.get_context_parallel_group()
    gathered = _GatherIdentical.apply(local, group, ps.get_context_parallel_rank(),
                                      ps.get_context_parallel_world_size())
    order = gathered_order(lay.bounds, ps.get_context_parallel_world_size()).to(local.device)
    return gathered.index_select(1, order).index_select(1, lay.original.to(local.device))


def causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """``[queries, keys]`` True where a query may attend a key of the same sequence."""
    return key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)


def local_cp_attention(attention, query, key, value, packed_seq_params) -> torch.Tensor:
    """The local spec's causal attention of this rank's queries over the whole sequences:
    K and V all-gathered over the CP group (the backward reduce-scatters their gradients),
    put back in global order, and masked by global position (:func:`causal_mask`).
    ``query``/``key``/``value``: ``[s, b, heads, dim]``, or ``[t, heads, dim]`` packed.
    Returns ``[s, b, h]`` / ``[t, h]``."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    group = ps.get_context_parallel_group()
    cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    packed = packed_seq_params is not None
    if packed:
        bounds = packed_seq_params.cu_seqlens_q.to(torch.long).tolist()
    else:
        bounds = [0, query.shape[0] * cp]
    order = gathered_order(bounds, cp).to(query.device)
    key_all, value_all = (gather_from_sequence_parallel_region(
        x.contiguous(), tensor_parallel_output_grad=True, group=group).index_select(0, order)
        for x in (key, value))
    mine = chunk_positions(bounds, cp, rank).to(query.device)
    scale = attention.softmax_scale
    outputs, offset = [], 0
    for start, end in zip(bounds[:-1], bounds[1:]):
        count = (end - start) // cp
        q_positions = mine[offset:offset + count] - start
        q = query[offset:offset + count]
        k, v = key_all[start:end], value_all[start:end]
        offset += count
        if not packed:  # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        else:  # [t, heads, dim] -> [1, heads, t, dim]
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v))
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        mask = causal_mask(q_positions, torch.arange(end - start, device=q.device))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               scale=scale)
        if not packed:  # [b, heads, s, dim] -> [s, b, heads * dim]
            outputs.append(out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1))
        else:  # [1, heads, t, dim] -> [t, heads * dim]
            outputs.append(out[0].permute(1, 0, 2).reshape(out.shape[2], -1))
    return torch.cat(outputs, dim=0)
