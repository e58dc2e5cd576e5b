"""Sequence packing and token-balanced partitioning for the actor's forward passes.

Packed micro-batches concatenate whole sequences into one row of ``t`` tokens (megatron's THD
layout: ``PackedSeqParams`` with ``cu_seqlens``); attention never crosses a sequence boundary
and rotary positions restart at every sequence (megatron applies them per ``cu_seqlens``).
TransformerEngine's attention takes that layout natively; for megatron-core's local layer spec
(CPU, or a GPU without TE) :mod:`rlep_megatron.models.attention` computes the same thing. Log-probs are
computed on the packed tokens only and then unpacked to the ``[rows, columns]`` layout that the
loss and every caller use, so nothing downstream knows whether a batch was packed.

Partitions are deterministic functions of the sequence lengths (ties go to the lower index),
so a resumed run cuts its batches exactly as the original did.
"""
from __future__ import annotations

import heapq
from typing import Optional, Sequence

import torch


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices split into ``parts`` groups of near-equal token sums: longest first, each
    onto the group with the fewest tokens so far (then the fewest rows, then the lowest
    index). Groups list their rows in ascending order; a group may be empty when there are
    fewer rows than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    heap = [(0, 0, part) for part in range(parts)]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for row in sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r)):
        tokens, rows, part = heapq.heappop(heap)
        groups[part].append(row)
        heapq.heappush(heap, (tokens + int(lengths[row]), rows + 1, part))
    return [sorted(group) for group in groups]


def pack_by_token_budget(lengths: Sequence[int], max_tokens: int, multiple_of: int = 1
                         ) -> list[list[int]]:
    """Rows grouped into the fewest balanced micro-batches (:func:`balanced_partition`) whose
    token sums stay within ``max_tokens``; a row longer than the budget goes alone.

    The count is always a multiple of ``multiple_of`` (megatron's interleaved pipeline
    schedule needs a multiple of the pipeline size): where the budget would ask for more packs
    than the largest multiple that the rows can fill, that many packs are made and some exceed
    the budget (as the padded path re-cuts its micro-batches)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    n = len(lengths)
    if n == 0:
        return []
    if n < multiple_of:
        raise ValueError(f"{n} sequences cannot fill the {multiple_of} micro-batches that the "
                         "virtual pipeline schedule needs; use more sequences per step")
    most = n // multiple_of * multiple_of
    count = max(1, -(-sum(int(x) for x in lengths) // max_tokens))
    while True:
        count = min(-(-count // multiple_of) * multiple_of, most)
        groups = balanced_partition(lengths, count)
        if count == most or all(len(g) == 1 or sum(int(lengths[r]) for r in g) <= max_tokens
                                for g in groups):
            return groups
        count += 1


def plan_packs(lengths: Sequence[int], max_tokens: int, interleaved_stages: int = 0
               ) -> tuple[list[list[int]], Optional[int]]:
    """The packs of a batch (:func:`pack_by_token_budget`) and the size to fill them to: with
    megatron's interleaved schedule (``interleaved_stages`` = the pipeline size, 0 without
    virtual stages) a multiple of the pipeline size of packs, all of the largest one's size
    (the schedule exchanges fixed shapes); otherwise ``None``."""
    groups = pack_by_token_budget(lengths, max_tokens, multiple_of=interleaved_stages or 1)
    pad_to = (max(sum(int(lengths[r]) for r in g) for g in groups) if interleaved_stages
              else None)
    return groups, pad_to


def packed_micro_batch(input_ids: torch.Tensor, lengths: torch.Tensor, rows: list[int],
                       pad_to: Optional[int] = None, pad_id: int = 0) -> dict:
    """The rows' first ``lengths[row]`` tokens concatenated into ``input_ids [1, t]`` with
    per-sequence ``position_ids``, ``cu_seqlens [k + 1]`` (int32) and ``max_seqlen``. With
    ``pad_to`` the pack is filled up to that many tokens by one extra filler sequence (fixed
    shapes for the interleaved schedule); its outputs are never read.

    ``unpack_index [len(rows), L]`` / ``unpack_valid`` map column c of row i (c < its length,
    L the longest) to position ``start_i + c`` of the packed outputs; column 0 (no prefix) is
    not valid."""
    sizes = [int(lengths[row]) for row in rows]
    pieces = [input_ids[row, :size] for row, size in zip(rows, sizes)]
    total = sum(sizes)
    if pad_to is not None and pad_to > total:
        pieces.append(torch.full((pad_to - total,), pad_id, dtype=input_ids.dtype))
        sizes = sizes + [pad_to - total]
    bounds = torch.tensor([0] + sizes).cumsum(0)
    width = max(sizes[:len(rows)])
    columns = torch.arange(width)
    starts = bounds[:len(rows)].unsqueeze(1)
    valid = (columns.unsqueeze(0) < torch.tensor(sizes[:len(rows)]).unsqueeze(1)) & (columns > 0)
    index = torch.where(valid, starts + columns, torch.zeros_like(starts + columns))
    return {"input_ids": torch.cat(pieces).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(s) for s in sizes]).unsqueeze(0),
            "cu_seqlens": bounds.to(torch.int32),
            "max_seqlen": torch.tensor(max(sizes)),
            "unpack_index": index, "unpack_valid": valid}


def packed_seq_params(batch: dict):
    """megatron's ``PackedSeqParams`` (THD) of a :func:`packed_micro_batch` already on the
    model's device."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"].to(torch.int32)
    longest = int(batch["max_seqlen"])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def unpack(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-position values of a pack (``[1, t]``, position j about token j given the tokens
    before it) as ``[rows, L]`` aligned like the unpacked sequences; invalid columns are 0.
    Differentiable."""
    flat = values.reshape(-1)
    gathered = flat[batch["unpack_index"]]
    return torch.where(batch["unpack_valid"], gathered, torch.zeros_like(gathered))


def run_model(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
              packed: Optional[dict] = None, hidden_states: bool = False,
              padding_mask: Optional[torch.Tensor] = None):
    """``model(input_ids, position_ids)`` (THD-packed when ``packed`` holds the micro-batch's
    ``cu_seqlens`` / ``max_seqlen``). With sequence parallelism the token count must be a
    multiple of the TP size: the micro-batch is extended on the right (padded rows: pad
    tokens at the following positions; a pack: one filler sequence), which changes no earlier
    token's output under causal attention. The last stage's logits then have extra trailing
    columns: callers read the first ``input_ids.shape[1]`` only. ``hidden_states``: the last
    stage returns the last hidden states instead of the logits
    (:func:`rlep_megatron.actor.logprob.hidden_states_out`). ``padding_mask`` (``[b, s]``,
    True on tokens that are not real) reaches the routers' auxiliary losses of a
    mixture-of-experts model when they are on, and is ignored otherwise."""
    config = model.config
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    length = input_ids.shape[1]
    extra = -length % multiple
    router_losses = (getattr(config, "moe_aux_loss_coeff", 0) or 0) > 0 or (
        getattr(config, "moe_z_loss_coeff", 0) or 0) > 0
    if not router_losses:
        padding_mask = None
    if config.context_parallel_size > 1:  # this rank's chunks of every sequence
        lay = context_parallel_layout(input_ids, packed, config)
        input_ids, position_ids, packed = context_parallel_inputs(lay, input_ids.device)
        if padding_mask is not None:
            padding_mask = lay.local_values(padding_mask, fill=True)
        extra = 0
    if extra:
        input_ids = torch.nn.functional.pad(input_ids, (0, extra))
        if packed is None:
            tail = position_ids[:, -1:] + torch.arange(1, extra + 1, device=position_ids.device)
        else:
            tail = torch.arange(extra, device=position_ids.device).unsqueeze(0)
            bounds = packed["cu_seqlens"].to(torch.int32)
            packed = {"cu_seqlens": torch.cat([bounds, bounds[-1:] + extra]),
                      "max_seqlen": torch.clamp(packed["max_seqlen"], min=extra)}
        position_ids = torch.cat([position_ids, tail.expand(position_ids.shape[0], -1)], dim=1)
        if padding_mask is not None:
            padding_mask = torch.nn.functional.pad(padding_mask, (0, extra), value=True)
    extra_kwargs = {"packed_seq_params": packed_seq_params(packed)} if packed else {}
    if padding_mask is not None:
        from rlep_megatron.models.megatron import unwrap

        if multiple > 1 and not unwrap(model).pre_process:
            # megatron splits the mask over the sequence-parallel ranks on the first pipeline
            # stage only; a later stage's layers see their shard of the sequence as well
            from megatron.core import parallel_state as ps

            padding_mask = padding_mask.chunk(multiple, dim=1)[
                ps.get_tensor_model_parallel_rank()].contiguous()
        extra_kwargs["padding_mask"] = padding_mask.to(input_ids.device)
    if not hidden_states:
        return model(input_ids, position_ids, attention_mask=None, **extra_kwargs)
    from rlep_megatron.actor.logprob import hidden_states_out

    with hidden_states_out(model):
        return model(input_ids, position_ids, attention_mask=None, **extra_kwargs)


def context_parallel_layout(values: torch.Tensor, packed: Optional[dict], config):
    """This CP rank's layout of a micro-batch of ``values [b, s]`` (``packed``: its
    ``cu_seqlens``) as the model is fed it
    (:func:`rlep_megatron.models.context_parallel.layout`; each rank's share a multiple of TP
    under sequence parallelism)."""
    from megatron.core import parallel_state as ps

    from rlep_megatron.models import context_parallel

    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return context_parallel.layout(values, packed, config.context_parallel_size,
                                   ps.get_context_parallel_rank(), multiple)


def context_parallel_inputs(lay, device: torch.device):
    """This CP rank's tokens, positions and (global, padded) ``cu_seqlens`` of a micro-batch
    laid out by :func:`context_parallel_layout`."""
    local = lay.local.to(device)
    packed = (None if lay.packed is None
              else {k: v.to(device) for k, v in lay.packed.items()})
    return (lay.input_ids.index_select(1, local), lay.position_ids.index_select(1, local),
            packed)


def schedule_seq_length(longest: int, model: torch.nn.Module) -> int:
    """The sequence length to give megatron's schedule for micro-batches of at most
    ``longest`` tokens (rounded up to a multiple of TP under sequence parallelism, like
    :func:`run_model`)."""
    config = model.config
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    multiple *= 2 * config.context_parallel_size if config.context_parallel_size > 1 else 1
    return -(-longest // multiple) * multiple


def token_places(rows: torch.Tensor, columns: torch.Tensor) -> dict:
    """The ``{"route_rows", "route_cols"}`` micro-batch entries that
    :func:`rlep_megatron.actor.routing.note_micro_batch` reads, both ``[b, s]`` (-1: no
    token)."""
    return {"route_rows": rows, "route_cols": torch.where(rows >= 0, columns, -1)}


def padded_places(rows: list[int], num_rows: int, lengths: torch.Tensor, width: int) -> dict:
    """Routing places (:func:`token_places`) of a padded micro-batch of ``rows`` (their first
    ``lengths[row]`` tokens), ``num_rows`` x ``width``: rows past ``len(rows)`` and columns
    past a row's length are no one's."""
    owners = torch.full((num_rows, width), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        owners[i, :min(int(lengths[row]), width)] = row
    return token_places(owners, torch.arange(width).expand(num_rows, width))


def packed_places(batch: dict, rows: list[int]) -> dict:
    """Routing places of a :func:`packed_micro_batch` of ``rows`` (a filler sequence is no
    one's)."""
    bounds = batch["cu_seqlens"].to(torch.long)
    width = batch["input_ids"].shape[1]
    segment = torch.searchsorted(bounds[1:], torch.arange(width), right=True)
    owner_of = torch.tensor(list(rows) + [-1] * (len(bounds) - 1 - len(rows)), dtype=torch.long)
    return token_places(owner_of[segment].unsqueeze(0), batch["position_ids"].to(torch.long))
