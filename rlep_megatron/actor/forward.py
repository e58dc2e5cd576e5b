"""Forward-only passes of the actor through megatron-core's pipeline schedule: per-token
log-probs (and entropy) of given sequences, used for old log-probs (the trainer's
:func:`actor_logprobs`), reference log-probs, the rollout parity probe and conversion checks.

Sequences are right-padded to one length (pipeline stages exchange fixed shapes) and cut into
micro-batches; results are returned on the last pipeline stage (``None`` elsewhere).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from rlep_megatron import distributed
from rlep_megatron.actor import routing
from rlep_megatron.actor.logprob import next_token_logprobs
from rlep_megatron.models.megatron import ActorModelInfo


def pad_sequences(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """``input_ids [n, max_len]`` right-padded with ``pad_id`` and ``lengths [n]``."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return ids, lengths


def micro_batches(input_ids: torch.Tensor, groups: list[list[int]], num_rows: int = 0,
                  widths: Optional[list[int]] = None) -> list[dict]:
    """Micro-batches of the given rows, padded with copies of their first row up to
    ``num_rows`` (fixed shapes; the caller drops the padded rows' results); each cut to its
    entry of ``widths`` columns when given (default: every column)."""
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    out = []
    for i, rows in enumerate(groups):
        width = input_ids.shape[1] if widths is None else widths[i]
        index = torch.tensor(list(rows) + [rows[0]] * max(0, num_rows - len(rows)))
        out.append({"input_ids": input_ids[index, :width],
                    "position_ids": positions[:, :width].expand(len(index), -1),
                    "num_rows": len(rows)})
    return out


def fit_to_schedule(groups: list[list[int]], chunks: list[torch.nn.Module]) -> list[list[int]]:
    """Row groups (micro-batches) adjusted to megatron's interleaved (virtual pipeline)
    schedule, which needs a multiple of PP micro-batches: the rows are re-cut into the next
    multiple of PP contiguous groups. Without virtual stages the groups are returned as is."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_world_size()
    if len(chunks) == 1 or len(groups) % pp == 0:
        return groups
    rows = [row for group in groups for row in group]
    if len(rows) < pp:
        raise ValueError(f"{len(rows)} sequences cannot fill the {pp} micro-batches that the "
                         "virtual pipeline schedule needs; use more sequences per step")
    target = min(-(-len(groups) // pp) * pp, len(rows) // pp * pp)
    bounds = [round(i * len(rows) / target) for i in range(target + 1)]
    return [rows[bounds[i]:bounds[i + 1]] for i in range(target)]


def no_ones(batch: dict) -> dict:
    """A copy of a micro-batch whose tokens are no one's (routing, expert counts)."""
    return {**batch, "route_rows": torch.full_like(batch["route_rows"], -1),
            "route_cols": torch.full_like(batch["route_cols"], -1)}


def match_expert_parallel_count(micro_batches: list, chunks: list[torch.nn.Module],
                                filler: Optional[dict] = None) -> list:
    """With expert parallelism every forward pass of a MoE layer exchanges tokens with the
    other EP ranks (all-to-all), so they must run the same number of micro-batches, while
    their data-parallel shares may need different counts. The count is agreed as the largest
    over the data- and context-parallel group (which holds the EP group) and the list is
    extended with ``filler`` (default: a copy of the first micro-batch), whose results the
    callers ignore (train steps pass one with no trained token). Without EP the list is
    returned as is."""
    from megatron.core import parallel_state as ps

    if (not getattr(chunks[0].config, "num_moe_experts", None)
            or ps.get_expert_model_parallel_world_size() == 1):
        return micro_batches
    count = torch.tensor([float(len(micro_batches))])
    distributed.all_reduce(count, "max",
                           ps.get_data_parallel_group(with_context_parallel=True))
    extra = int(count.item()) - len(micro_batches)
    return micro_batches + [filler or micro_batches[0]] * extra


def _logprob_micro_batches(chunks, input_ids: torch.Tensor, micro_batch_size: int,
                           lengths: Optional[torch.Tensor], pack_max_tokens: Optional[int]):
    """``(row groups, micro-batches, schedule shape)`` of :func:`sequence_logprobs`: packed, or
    padded rows; the same number of micro-batches on every expert-parallel rank."""
    from megatron.core import parallel_state as ps

    from rlep_megatron.actor import packing

    n, seq_len = input_ids.shape
    interleaved = len(chunks) > 1
    if pack_max_tokens is not None:
        lengths = (torch.full((n,), seq_len, dtype=torch.long) if lengths is None
                   else lengths.to(torch.long))
        groups, pad_to = packing.plan_packs(
            lengths.tolist(), pack_max_tokens,
            ps.get_pipeline_model_parallel_world_size() if interleaved else 0)
        batches = [packing.packed_micro_batch(input_ids, lengths, g, pad_to) for g in groups]
        for batch, rows in zip(batches, groups):
            batch.update(packing.packed_places(batch, rows))
        shape = {"seq_length": max(int(b["input_ids"].shape[1]) for b in batches),
                 "micro_batch_size": 1}
    else:
        groups = fit_to_schedule([list(range(i, min(i + micro_batch_size, n)))
                                  for i in range(0, n, micro_batch_size)], chunks)
        row_lengths = (torch.full((n,), seq_len, dtype=torch.long) if lengths is None
                       else lengths.to(torch.long))
        # the interleaved schedule needs micro-batches of one shape (see train_step); the
        # others are cut to their longest row
        widths = ([seq_len] * len(groups) if interleaved
                  else [int(row_lengths[g].max()) for g in groups])
        batches = micro_batches(input_ids, groups,
                                num_rows=max(len(g) for g in groups) if interleaved else 0,
                                widths=widths)
        for batch, rows, width in zip(batches, groups, widths):
            batch.update(packing.padded_places(rows, batch["input_ids"].shape[0], row_lengths,
                                               width))
        shape = {"seq_length": max(widths), "micro_batch_size": max(len(g) for g in groups)}

    # results of micro-batches past len(groups) (fillers) are not read
    batches = match_expert_parallel_count(batches, chunks, no_ones(batches[0]))
    return groups, batches, shape


def sequence_logprobs(chunks: list[torch.nn.Module], info: ActorModelInfo,
                      input_ids: torch.Tensor, micro_batch_size: int = 4,
                      temperature: float = 1.0, with_entropy: bool = False,
                      lengths: Optional[torch.Tensor] = None,
                      pack_max_tokens: Optional[int] = None
                      ) -> Optional[dict[str, torch.Tensor]]:
    """Log-probs of every token given its prefix.

    Args:
        input_ids: ``[n, seq]`` right-padded token ids, identical on every rank.
        micro_batch_size: rows per micro-batch (padded micro-batches).
        lengths: ``[n]`` tokens of each row (default: every column); only packing reads it.
        pack_max_tokens: pack the sequences (actor/packing.py) into micro-batches of at most
            this many tokens instead of padded micro-batches of ``micro_batch_size`` rows.

    Returns (last pipeline stage only): ``{"logp": [n, seq], "entropy": [n, seq]}`` where
    column t is about token t given tokens < t; column 0 is 0 (no prefix). Values at padded
    positions are meaningless (0 when packed): mask them with the sequence lengths.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rlep_megatron.actor import packing

    n, seq_len = input_ids.shape
    device = next(chunks[0].parameters()).device
    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()
    interleaved = len(chunks) > 1
    groups, batches, shape = _logprob_micro_batches(chunks, input_ids, micro_batch_size, lengths,
                                                    pack_max_tokens)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        ids = batch["input_ids"].to(device)
        packed = "cu_seqlens" in batch
        routing.note_micro_batch(batch, model.config)
        bounds = ({k: batch[k].to(device) for k in ("cu_seqlens", "max_seqlen")} if packed
                  else None)
        output = packing.run_model(model, ids, batch["position_ids"].to(device), bounds,
                                   hidden_states=bool(info.logprob_chunk_tokens))

        def collect(output):
            logp, entropy = next_token_logprobs(model, info, output, ids, tp_rank, tp_group,
                                                temperature, with_entropy, packed=bounds)
            zeros = torch.zeros(ids.shape[0], 1, dtype=logp.dtype, device=logp.device)
            values = {"logp": torch.cat([zeros, logp], dim=1).detach()}
            if with_entropy:
                values["entropy"] = torch.cat([zeros, entropy], dim=1).detach()
            if packed:
                unpack_at = {k: batch[k].to(device) for k in ("unpack_index", "unpack_valid")}
                result = {k: packing.unpack(v, unpack_at) for k, v in values.items()}
            else:
                result = {k: v[:batch["num_rows"]] for k, v in values.items()}
            return torch.zeros((), device=logp.device), result

        return output, collect

    iterators = ([iter(batches) for _ in chunks] if interleaved else iter(batches))
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=chunks if interleaved else chunks[0], num_microbatches=len(batches),
            forward_only=True, **{**shape, "seq_length": packing.schedule_seq_length(
                shape["seq_length"], chunks[0])})
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    result = {}
    for key in outputs[0]:
        full = torch.zeros(n, seq_len, dtype=outputs[0][key].dtype)
        for rows, out in zip(groups, outputs):
            full[rows, :out[key].shape[1]] = out[key].cpu()
        result[key] = full
    return result


def actor_logprobs(chunks: list[torch.nn.Module], info: ActorModelInfo, input_ids: torch.Tensor,
                   micro_batch_size: int = 8, temperature: float = 1.0,
                   everywhere: bool = True, lengths: Optional[torch.Tensor] = None,
                   pack_max_tokens: Optional[int] = None) -> Optional[torch.Tensor]:
    """The actor's per-token log-probs ``[n, seq]`` of the right-padded ``input_ids``, computed
    on the last pipeline stage; with ``everywhere`` broadcast over the pipeline group to every
    stage, otherwise ``None`` on the other stages (which only feed activations forward).
    Collective."""
    from megatron.core import parallel_state as ps

    result = sequence_logprobs(chunks, info, input_ids, micro_batch_size=micro_batch_size,
                               temperature=temperature, lengths=lengths,
                               pack_max_tokens=pack_max_tokens)
    logp: Optional[torch.Tensor] = None if result is None else result["logp"]
    if everywhere and ps.get_pipeline_model_parallel_world_size() > 1:
        device = next(chunks[0].parameters()).device
        buf = (logp.to(device, torch.float32) if logp is not None
               else torch.empty(input_ids.shape, dtype=torch.float32, device=device))
        distributed.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                              group=ps.get_pipeline_model_parallel_group())
        logp = buf.cpu()
    return logp


def actor_logprobs_everywhere(chunks: list[torch.nn.Module], info: ActorModelInfo,
                              sequences: Sequence[Sequence[int]], pad_id: int,
                              micro_batch_size: int = 8, temperature: float = 1.0
                              ) -> torch.Tensor:
    """:func:`actor_logprobs` of unpadded token lists, on every rank. Collective."""
    input_ids, _ = pad_sequences([list(s) for s in sequences], pad_id=pad_id)
    return actor_logprobs(chunks, info, input_ids, micro_batch_size, temperature)
