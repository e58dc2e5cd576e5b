"""One optimizer step of the actor on a mini-batch: micro-batches by a token budget, forward +
backward through megatron-core's pipeline schedule with the RLEP loss, then the optimizer.

Normalisation (docs/ALGORITHM.md section 4): the number of valid response tokens of the whole
mini-batch is summed over data-parallel ranks once (:func:`global_counts`, which also sums the
token slots for ``padding_frac``; the metrics are reduced after the step) and passed to ``policy_loss``, so the micro-batch losses add
up to the exact global token mean. Megatron's schedule divides each micro-batch loss by the
number of micro-batches and its DDP averages gradients over data-parallel ranks; the loss handed
to megatron is multiplied by both factors so that the gradient is that of the exact global mean.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from rlep_megatron import distributed
from rlep_megatron.actor import packing
from rlep_megatron.actor import routing
from rlep_megatron.actor.expert_load import router_loss_metrics
from rlep_megatron.actor.forward import no_ones, fit_to_schedule, match_expert_parallel_count
from rlep_megatron.actor.logprob import next_token_logprobs
from rlep_megatron.models.megatron import ActorModelInfo
from rlep_megatron.actor.optimizer import ActorOptimizer
from rlep_megatron.algo import LossBatch, Normaliser, PolicyLoss, loss_from_config
from rlep_megatron.config import AlgoConfig


@dataclass
class TrainBatch:
    """This data-parallel rank's share of a mini-batch (identical on its TP/PP ranks)."""

    input_ids: torch.Tensor
    """``[n, seq]`` prompt + response, right-padded."""
    response_mask: torch.Tensor
    """``[n, seq]`` 1 where column t is a response token whose log-prob is trained."""
    old_logp: torch.Tensor
    """``[n, seq]`` log-probs before the update, aligned like ``sequence_logprobs``."""
    advantages: torch.Tensor
    """``[n]`` one advantage per sequence."""
    is_replay: torch.Tensor
    """``[n]`` bool, True for replayed pool answers."""
    ref_logp: Optional[torch.Tensor] = None
    """``[n, seq]`` reference-policy log-probs (only with a KL term)."""
    token_weights: Optional[torch.Tensor] = None
    """``[n, seq]`` constant weights of each token's policy loss (only with a rollout
    correction)."""
    loss_mask: Optional[torch.Tensor] = None
    """``[n, seq]`` 0 on response tokens left out of the loss and of its normaliser (the
    ``mask`` rollout correction's dropped tokens); ``None``: every response token. The
    micro-batch layout follows ``response_mask`` alone, so it is the same on every pipeline
    stage whatever this holds."""
    routing: Optional[dict] = None
    """``{layer: [n, seq, k]}`` experts each token of this rank's MoE layers is routed to in
    the update (routing replay, :mod:`rlep_megatron.actor.routing`); ``None``: the routers
    choose."""

    def trained_mask(self) -> torch.Tensor:
        """``response_mask`` without the tokens ``loss_mask`` drops."""
        if self.loss_mask is None:
            return self.response_mask
        return self.response_mask * self.loss_mask.to(self.response_mask.dtype)

    def lengths(self) -> torch.Tensor:
        """``[n]`` columns each row needs: through its last trained token; at least 2 (one
        next-token log-prob), which only a fully masked placeholder row would go below."""
        positions = torch.arange(self.input_ids.shape[1])
        last = torch.where(self.response_mask > 0, positions, torch.zeros_like(positions))
        return torch.clamp(last.max(dim=1).values + 1, min=min(2, self.input_ids.shape[1]))


def split_by_token_budget(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive rows grouped so that rows x longest row <= ``max_tokens`` (a row longer than
    the budget goes alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for row, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def global_counts(batch: TrainBatch, token_slots: int) -> dict[str, float]:
    """Summed over data-parallel ranks in one collective: ``tokens`` and ``sequences``, the
    mini-batch's valid response tokens and sequences (the loss normalisers; a fully masked row,
    a placeholder on a rank left without sequences, is not a sequence), and ``real_tokens`` /
    ``token_slots``, the tokens the micro-batches hold and the slots they feed through the
    model (padding included)."""
    from megatron.core import parallel_state as ps

    return distributed.reduce_values(
        {"tokens": float(batch.trained_mask().sum()),
         "sequences": float((batch.trained_mask().sum(dim=1) > 0).sum()),
         "real_tokens": float(batch.lengths().sum()), "token_slots": float(token_slots)},
        "sum", ps.get_data_parallel_group())


def _loss_inputs(batch: TrainBatch, index: torch.Tensor, width: int) -> dict:
    """The loss's inputs of rows ``index``, cut to ``width`` columns."""
    out = {"response_mask": batch.trained_mask()[index, :width].float(),
           "old_logp": batch.old_logp[index, :width].float(),
           "advantages": batch.advantages[index].float(),
           "is_replay": batch.is_replay[index]}
    for key in ("ref_logp", "token_weights"):
        value = getattr(batch, key)
        if value is not None:
            out[key] = value[index, :width].float()
    return out


def _micro_batch(batch: TrainBatch, lengths: torch.Tensor, rows: list[int],
                 length: Optional[int] = None, num_rows: Optional[int] = None) -> dict:
    """Rows of the batch cut to ``length`` columns (default: their longest), padded with
    all-masked copies of the first row up to ``num_rows`` (masked rows add nothing to the loss
    or its gradient)."""
    length = length or int(lengths[rows].max())
    padding = max(0, (num_rows or len(rows)) - len(rows))
    index = torch.tensor(list(rows) + [rows[0]] * padding)
    out = _loss_inputs(batch, index, length)
    out["response_mask"] *= (torch.arange(len(index)) < len(rows)).float().unsqueeze(1)
    out.update(input_ids=batch.input_ids[index, :length],
               position_ids=torch.arange(length).unsqueeze(0).expand(len(rows), -1),
               **packing.padded_places(rows, len(index), lengths, length))
    return out


def _packed_micro_batch(batch: TrainBatch, lengths: torch.Tensor, rows: list[int],
                        pad_to: Optional[int] = None) -> dict:
    """Rows of the batch packed into one sequence of tokens (:func:`packing.packed_micro_batch`)
    with their loss inputs as ``[rows, longest]``, aligned like the unpacked log-probs."""
    out = packing.packed_micro_batch(batch.input_ids, lengths, rows, pad_to)
    out.update(_loss_inputs(batch, torch.tensor(rows), int(out["unpack_index"].shape[1])))
    out.update(packing.packed_places(out, rows))
    return out


def _micro_batches(batch: TrainBatch, chunks: list[torch.nn.Module], micro_batch_max_tokens: int,
                   sequence_packing: bool) -> tuple[list[list[int]], list[dict], dict]:
    """``(row groups, micro-batches, schedule shape)`` of the mini-batch: packed, or padded
    consecutive rows; the same number of micro-batches on every expert-parallel rank."""
    from megatron.core import parallel_state as ps

    lengths = batch.lengths()
    interleaved = len(chunks) > 1
    if sequence_packing:
        groups, pad_to = packing.plan_packs(
            lengths.tolist(), micro_batch_max_tokens,
            ps.get_pipeline_model_parallel_world_size() if interleaved else 0)
        micro_batches = [_packed_micro_batch(batch, lengths, rows, pad_to) for rows in groups]
        schedule_shape = {"seq_length": max(int(mb["input_ids"].shape[1])
                                            for mb in micro_batches), "micro_batch_size": 1}
    else:
        groups = fit_to_schedule(split_by_token_budget(lengths.tolist(), micro_batch_max_tokens),
                                 chunks)
        # the interleaved (virtual pipeline) schedule exchanges fixed-shape buffers between
        # stages: give every micro-batch the shape of the largest
        shape = ({"length": int(lengths.max()), "num_rows": max(len(g) for g in groups)}
                 if interleaved else {})
        micro_batches = [_micro_batch(batch, lengths, rows, **shape) for rows in groups]
        schedule_shape = {"seq_length": max(int(mb["input_ids"].shape[1])
                                            for mb in micro_batches),
                          "micro_batch_size": max(len(g) for g in groups)}
    # the routers' auxiliary losses (when on) see real tokens only; a filler below keeps the
    # mask of the micro-batch it copies (an all-padding one would give them 0 / 0)
    for mb in micro_batches:
        mb["padding_mask"] = mb["route_rows"] < 0
    # the same number of micro-batches on every EP rank; a filler trains no token
    micro_batches = match_expert_parallel_count(
        micro_batches, chunks, {**no_ones(micro_batches[0]),
                                "response_mask": torch.zeros_like(micro_batches[0]["response_mask"])})
    return groups, micro_batches, schedule_shape


def train_mini_batch(chunks: list[torch.nn.Module], optimizer: ActorOptimizer,
                     info: ActorModelInfo, batch: TrainBatch, algo: AlgoConfig,
                     micro_batch_max_tokens: int, temperature: float = 1.0,
                     replay_clip_high: Optional[float] = None,
                     sequence_packing: bool = False,
                     routing_replay: Optional[routing.RoutingReplay] = None,
                     constant_length_tokens: Optional[int] = None) -> dict[str, float]:
    """Forward/backward over the mini-batch and one optimizer step with the loss ``algo.loss``;
    returns metrics (same on every rank). With ``batch.ref_logp`` the metrics carry the KL
    estimators (``kl_k1`` ..., split fresh/replay). ``constant_length_tokens``: the normaliser
    of ``algo.loss_agg_mode=constant_length`` when ``algo.loss_constant_length_tokens`` is
    null. ``sequence_packing`` packs the rows into token-balanced micro-batches
    of at most ``micro_batch_max_tokens`` real tokens (actor/packing.py); otherwise
    micro-batches are consecutive rows, padded, within rows x longest <= the budget."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device
    tp_group, tp_rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    interleaved = len(chunks) > 1
    groups, micro_batches, schedule_shape = _micro_batches(batch, chunks, micro_batch_max_tokens,
                                                           sequence_packing)
    # token slots the model really processes (padded rows and columns, or the packs' fill)
    counts = global_counts(batch, sum(int(mb["input_ids"].numel()) for mb in micro_batches))
    global_tokens, global_sequences = counts["tokens"], counts["sequences"]
    # undo megatron's 1/num_micro_batches (schedule) and 1/DP (DDP gradient averaging)
    compensation = len(micro_batches) * ps.get_data_parallel_world_size()
    loss_fn = loss_from_config(algo, replay_clip_high)
    normaliser = Normaliser(algo.loss_agg_mode, global_tokens, global_sequences,
                            algo.loss_constant_length_tokens or constant_length_tokens)

    def forward_step(data_iterator, model):
        mb = {k: v.to(device) for k, v in next(data_iterator).items()}
        packed = "cu_seqlens" in mb
        routing.note_micro_batch(mb, model.config)
        output = packing.run_model(model, mb["input_ids"], mb["position_ids"],
                                   mb if packed else None,
                                   hidden_states=bool(info.logprob_chunk_tokens),
                                   padding_mask=mb["padding_mask"])

        def loss_func(output):
            # the entropy is always reported; it needs autograd only as a loss term
            logp, entropy = next_token_logprobs(model, info, output, mb["input_ids"], tp_rank,
                                                tp_group, temperature, with_entropy=True,
                                                entropy_grad=algo.entropy_coef != 0.0,
                                                packed=mb if packed else None)
            zeros = torch.zeros_like(logp[:, :1])
            logp, entropy = torch.cat([zeros, logp], 1), torch.cat([zeros, entropy], 1)
            if packed:  # back to [rows, columns], like the batch's other tensors
                logp, entropy = packing.unpack(logp, mb), packing.unpack(entropy, mb)
            loss, metrics = loss_fn(
                LossBatch(logp, mb["old_logp"], mb["advantages"], mb["response_mask"],
                          is_replay=mb["is_replay"], ref_logp=mb.get("ref_logp"),
                          entropy=entropy, token_weights=mb.get("token_weights")),
                normaliser, metrics_on_device=True)
            metrics["entropy_sum"] = (entropy.detach() * mb["response_mask"]).sum()
            return loss * compensation, metrics

        return output, loss_func

    optimizer.zero_grad(chunks)
    if batch.routing is not None and routing_replay is None:
        raise ValueError("the batch carries replayed routing but no RoutingReplay was given")
    replaying = (routing_replay.replaying(batch.routing) if batch.routing is not None
                 else contextlib.nullcontext())
    with replaying:
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter(micro_batches) for _ in chunks] if interleaved
            else iter(micro_batches),
            model=chunks if interleaved else chunks[0], num_microbatches=len(micro_batches),
            forward_only=False, **{**schedule_shape, "seq_length": packing.schedule_seq_length(
                schedule_shape["seq_length"], chunks[0])})
    applied, grad_norm = optimizer.step()
    router_losses = router_loss_metrics(chunks[0].config, len(micro_batches))
    metrics = _reduce_metrics(outputs, ps.is_pipeline_last_stage(ignore_virtual=True),
                              loss_fn, with_kl=batch.ref_logp is not None)
    metrics.update({"grad_norm": grad_norm, "step_applied": float(applied),
                    "lr": optimizer.current_lr(), "num_micro_batches": float(len(groups)),
                    "padding_frac": 1.0 - counts["real_tokens"] / max(counts["token_slots"],
                                                                       1.0)})
    metrics.update(router_losses)
    return metrics


def _token_count_key(key: str) -> str:
    return "num_tokens" + (key[key.index("/"):] if "/" in key else "")


def _reduce_metrics(outputs: list[dict], is_last_stage: bool, loss_fn: PolicyLoss,
                    with_kl: bool = False) -> dict[str, float]:
    """Micro-batch metrics reduced over micro-batches and DP ranks on the last pipeline stage,
    as the loss declares (:meth:`PolicyLoss.metric_reductions`: losses already carry the global
    normaliser and are summed, like the counts; token means are weighted by their split's token
    count), then broadcast to the whole pipeline. ``kl`` (the penalty term) is 0 when the KL
    term is off; ``with_kl`` adds the token means of every estimator."""
    from megatron.core import parallel_state as ps

    reductions = {**loss_fn.metric_reductions(with_kl), "entropy_sum": "count"}
    keys = tuple(k for k, how in reductions.items() if how in ("sum", "count", "token_mean"))
    max_keys = tuple(k for k, how in reductions.items() if how == "max")
    packed = torch.zeros(len(keys) + len(max_keys), dtype=torch.float64)
    if is_last_stage and outputs:
        # the micro-batches' metrics are tensors where the loss lives: weighted and summed
        # there, then read in one transfer
        zero = torch.zeros((), dtype=torch.float64, device=outputs[0]["pg_loss"].device)

        def value(out, key):
            return out[key].to(torch.float64) if key in out else zero

        rows = [torch.stack([value(out, key) * (1.0 if reductions[key] != "token_mean" else
                                                value(out, _token_count_key(key)))
                             for key in keys]) for out in outputs]
        maxima = [torch.stack([value(out, key) for key in max_keys]) for out in outputs]
        packed = torch.cat([torch.stack(rows).sum(0),
                            torch.stack(maxima).max(0).values.clamp(min=0.0)]).cpu()
    sums, maxima = packed[:len(keys)].clone(), packed[len(keys):].clone()
    dp_group = ps.get_data_parallel_group()
    distributed.all_reduce(sums, "sum", dp_group)
    distributed.all_reduce(maxima, "max", dp_group)
    packed = torch.cat([sums, maxima])
    distributed.broadcast(packed, src=ps.get_pipeline_model_parallel_last_rank(),
                          group=ps.get_pipeline_model_parallel_group())
    values = dict(zip(keys, packed[:len(keys)].tolist()))
    result = {key: values[key] / max(values[_token_count_key(key)], 1.0)
              for key in keys if reductions[key] == "token_mean"}
    result.update({key: values[key] for key in keys if reductions[key] == "sum"})
    result["entropy"] = values["entropy_sum"] / max(values["num_tokens"], 1.0)
    result.update(zip(max_keys, packed[len(keys):].tolist()))
    return result
