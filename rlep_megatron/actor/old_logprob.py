"""The old-log-prob pass of a training step and the mini-batches it feeds.

One forward pass of the actor (and of the reference policy, with a KL term) over this
data-parallel rank's sequences of every mini-batch of the step, then, per mini-batch, the
:class:`~rlep_megatron.actor.train_step.TrainBatch` the update trains on: old log-probs,
advantages, the rollout correction's weights from the log-probs of the policy version that
sampled each token (``algo.rollout_correction``; replays: ``replay.correction`` with the pool's
behaviour log-probs), engine routing, and the sums and maxima of the step's metrics.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from rlep_megatron.actor.packing import balanced_partition

if TYPE_CHECKING:  # the rollout side's batch; imported where used (rollout imports actor)
    from rlep_megatron.data.batch import Sample, StepBatch


def mini_batch_plan(num_sequences: int, cfg) -> list[list[int]]:
    """Sequence indices of each optimizer mini-batch of a step (in order; the last may be
    short). ``trainer.mini_batch_unit=prompts`` counts ``mini_batch_size x G`` sequences per
    mini-batch (G fresh samples, replays not counted: the reference's rule, so an RLEP step
    with G + M sequences per prompt takes more optimizer steps)."""
    trainer = cfg.trainer
    per = (trainer.mini_batch_size * cfg.rollout.num_samples_per_prompt
           if trainer.mini_batch_unit == "prompts" else trainer.mini_batch_size)
    return [list(range(i, min(i + per, num_sequences))) for i in range(0, num_sequences, per)]


def training_rows(prompts: list[list[int]], responses: list[list[int]], pad_id: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, mask)``, both ``[n, longest prompt + response]``: each row is its prompt
    followed by its response, right-padded with ``pad_id``; the mask is 1 on every response
    token (the EOS that ended a response included: stopping is part of what is trained) and 0
    on the prompt and the padding."""
    from rlep_megatron.actor.forward import pad_sequences

    ids, lengths = pad_sequences([p + r for p, r in zip(prompts, responses)], pad_id=pad_id)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    starts = torch.tensor([len(p) for p in prompts])[:, None]
    return ids, ((positions >= starts) & (positions < lengths[:, None])).float()


def old_logprob_pass(side, batch: StepBatch, plan: list[list[int]], load):
    """One forward pass of ``side``'s actor (and of its reference, with a KL term) over this DP
    rank's sequences of every mini-batch of the step (micro-batches by the token budget
    across mini-batches, not one pass per mini-batch: fewer, fuller micro-batches); yields
    per mini-batch its sequences, ``(ids, mask, old, ref, routing)`` cut to its rows and
    columns, and whether it is a placeholder. ``load`` counts the MoE routing of the pass
    (:mod:`rlep_megatron.actor.expert_load`), placeholder rows left out."""
    from rlep_megatron.actor.forward import actor_logprobs

    cfg = side.cfg
    dp, dp_rank = side.ctx.data_parallel_size, side.ctx.data_parallel_rank
    parts, seqs = [], []
    shares: list[list] = [[] for _ in range(dp)]  # what every DP rank trains
    for indices in plan:
        # split across DP ranks by token count, so that no rank waits on the longest
        # sequences
        sizes = [batch.length(batch.sequences[i]) for i in indices]
        split = balanced_partition(sizes, dp)
        for share, chosen_rows in zip(shares, split):
            share += [batch.sequences[indices[j]] for j in chosen_rows]
        mine = [indices[j] for j in split[dp_rank]]
        # a mini-batch with fewer sequences than DP ranks leaves some ranks none: they
        # still take part in every collective, with one fully masked row (no loss, no
        # gradient)
        chosen = [batch.sequences[i] for i in (mine or indices[:1])]
        parts.append((len(seqs), chosen, not mine))
        seqs += chosen
    ids, mask = training_rows([batch.prompts[s.group] for s in seqs],
                              [s.token_ids for s in seqs], side.pad_id)
    lengths = torch.tensor([batch.length(s) for s in seqs])
    placeholders = [row for start, chosen, placeholder in parts if placeholder
                    for row in range(start, start + len(chosen))]
    mask[placeholders] = 0.0
    budget = cfg.trainer.micro_batch_max_tokens
    micro = max(1, budget // max(1, ids.shape[1]))
    batching = {"lengths": lengths,
                "pack_max_tokens": budget if cfg.trainer.sequence_packing else None}
    temperature = cfg.rollout.temperature
    load.skip_rows = torch.tensor(placeholders, dtype=torch.long)  # not routed for real
    if side.routing_replay:
        deliver_routing(side, shares)
    engine = (engine_routing(side.routing_replay, seqs, placeholders, ids.shape)
              if side.routing_replay else None)
    replay = cfg.algo.routing_replay
    recording = (side.routing_replay.recording(*ids.shape, engine=engine,
                                               follow_engine=replay == "rollout",
                                               share=replay != "off")
                 if engine is not None or replay != "off" else contextlib.nullcontext())
    with recording as routing:  # algo.routing_replay=actor: the experts of this pass
        old = actor_logprobs(side.chunks, side.info, ids, micro, temperature,
                             everywhere=False, **batching)
    load.skip_rows = None
    ref = None
    if side.reference is not None:
        with load.paused():  # (LoRA's reference passes through the actor's own routers)
            ref = side.reference.logprobs(ids, micro, temperature, **batching)
    if old is None:
        # not the last pipeline stage: it only feeds activations forward; the loss and the
        # metrics below live on the last stage (old_logprob broadcasts the metrics)
        old = torch.zeros(ids.shape)
        ref = old if side.reference is not None else None
    for start, chosen, placeholder in parts:
        rows = slice(start, start + len(chosen))
        width = int(lengths[rows].max())  # the columns of this mini-batch's longest row
        yield chosen, placeholder, (
            ids[rows, :width], mask[rows, :width], old[rows, :width],
            None if ref is None else ref[rows, :width],
            None if routing is None or replay == "off"
            else {layer: experts[rows, :width] for layer, experts in routing.items()})


def deliver_routing(side, shares: list[list]) -> None:
    """The engine's routing of the sequences this DP rank trains, from the replicas that hold
    it (:func:`~rlep_megatron.actor.routing_store.deliver`); tables held longer than the
    staleness bound allows leave the hold. Collective over the rollout's gloo group whenever
    any sequence of the step has a held table (the same on every rank)."""
    from rlep_megatron import distributed
    from rlep_megatron.models import num_experts
    from rlep_megatron.actor import routing_store

    if any(seq.routing_key is not None and seq.routing is None
           for share in shares for seq in share):
        group = distributed.rollout_group()
        if side.share_of_rank is None:
            side.share_of_rank = distributed.all_gather_object(side.ctx.data_parallel_rank,
                                                               group=group)
        routing_store.deliver(
            shares, side.ctx.data_parallel_rank, side.share_of_rank, group,
            num_experts(side.info.hf_config))
    routing_store.HOLD.age_out(keep=side.cfg.trainer.max_staleness + 2)


def engine_routing(routing_replay, seqs: list[Sample], placeholders: list[int], shape
                   ) -> Optional[dict[int, torch.Tensor]]:
    """The engine's experts of the pass's sequences in its ``[rows, columns, k]`` frame,
    per MoE layer of this rank (-1: unknown: replayed pool answers, placeholder rows);
    ``None`` when the engine gave none."""
    if not any(s.routing is not None for s in seqs):
        return None
    layers = routing_replay.layers
    engine = torch.full((len(layers), *shape, routing_replay.topk_size), -1, dtype=torch.int16)
    skip = set(placeholders)
    for row, seq in enumerate(seqs):
        if seq.routing is not None and row not in skip:
            experts = torch.from_numpy(seq.routing[:, layers])  # [positions, layers, k]
            engine[:, row, :len(experts)] = experts.transpose(0, 1)
    return dict(zip(layers, engine))


def behaviour_logprobs(seqs: list[Sample], starts: list[int], like: torch.Tensor,
                       rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp, mask)``, both shaped like ``like`` (``[n, seq]``): the recorded log-prob of each
    response token of the sequences ``rows`` (the version that sampled it, or the pool's), and
    1 where one is recorded."""
    logp = torch.zeros_like(like)
    mask = torch.zeros_like(like)
    for row in rows:
        values = seqs[row].engine_logprobs
        logp[row, starts[row]:starts[row] + len(values)] = torch.tensor(values)
        mask[row, starts[row]:starts[row] + len(values)] = 1.0
    return logp, mask


def stale_token_mask(seqs: list[Sample], starts: list[int], like: torch.Tensor,
                     rows: list[int], version: int) -> torch.Tensor:
    """``[n, seq]`` 1 on the response tokens of ``rows`` that an older version than
    ``version`` sampled (carried over a weight update, or generated ahead)."""
    stale = torch.zeros_like(like)
    for row in rows:
        versions = torch.tensor(seqs[row].token_versions(), dtype=torch.long)
        stale[row, starts[row]:starts[row] + len(versions)] = (versions < version).float()
    return stale


def train_batch(algo, seqs: list[Sample], placeholder: bool, tensors, starts: list[int],
                version: int, replay_correction: str = "none"):
    """A mini-batch's slice on this DP rank as the actor trains it, with the old log-probs of
    :func:`old_logprob_pass`, plus this slice's sums and maxima for the step's metrics (reduced
    over DP ranks by :meth:`LearningSide.old_logprob`). ``starts``: each sequence's prompt
    length (where its response begins); ``version``: the policy version being trained (a
    token an older version sampled is stale).

    The rollout correction's behaviour log-prob of a fresh token is the one the engine
    recorded when it sampled it, under the version its span names: with one-step-off rollout
    a carried-over response mixes versions, and each token is weighed against its own. A
    replay's is the pool's (the policy that wrote it), weighed by ``replay_correction``
    (``replay.correction``) where the pool has it."""
    from rlep_megatron.actor.train_step import TrainBatch
    from rlep_megatron.algo import mismatch_kl, rollout_correction_weights, rollout_loss_mask
    from rlep_megatron.data.batch import FRESH, REPLAY

    ids, mask, old, ref, routing = tensors
    # the engine's log-probs of fresh tokens, aligned with the actor's columns
    fresh = [row for row, s in enumerate(seqs)
             if s.source == FRESH and s.engine_logprobs and not placeholder]
    rollout_logp, rollout_mask = behaviour_logprobs(seqs, starts, old, fresh)
    parity = logprob_abs_diff([seqs[r].engine_logprobs for r in fresh], old[fresh],
                              [starts[r] for r in fresh])
    weights, changed = rollout_correction_weights(
        old, rollout_logp, rollout_mask, algo.rollout_correction,
        algo.rollout_correction_level, algo.rollout_correction_threshold)
    is_replay = torch.tensor([s.source == REPLAY for s in seqs])
    mismatch = mismatch_kl(old, rollout_logp, rollout_mask)
    on = rollout_mask > 0
    nll = -old.to(torch.float64) * mask
    sums = {"parity": parity["mean"] * parity["tokens"], "parity_tokens": parity["tokens"],
            "mismatch_k1": mismatch["k1"], "mismatch_k3": mismatch["k3"],
            "rollout_tokens": mismatch["tokens"], "rollout_seqs": float(len(fresh)),
            "correction_weight": float((weights * rollout_mask).sum()),
            "correction_tokens": float(changed.sum()),
            "correction_seqs": float(changed.any(dim=1).sum())}
    maxima = {"correction_weight_max": float(weights[on].max()) if on.any() else 1.0,
              "correction_weight_neg_min": -float(weights[on].min()) if on.any() else -1.0,
              "ref_logp_abs_diff": (float(((old - ref).abs() * mask).max())
                                    if ref is not None else 0.0)}
    for name, rows_of in (("fresh", ~is_replay), ("replay", is_replay)):
        part = mask * rows_of.float().unsqueeze(1)
        sums[f"nll_{name}"] = float((nll * part).sum())
        sums[f"tokens_{name}"] = float(part.sum())
        maxima[f"nll_max_{name}"] = float((nll * part).max()) if part.any() else 0.0
    sums.update(_version_sums(seqs, starts, old, rollout_logp, rollout_mask, fresh, version))
    token_weights = weights.float() if algo.rollout_correction != "off" else None
    loss_mask = rollout_loss_mask(algo.rollout_correction, changed)
    # replays with the pool's behaviour log-probs: their mismatch, and replay.correction
    replays = [row for row, s in enumerate(seqs)
               if s.source == REPLAY and s.engine_logprobs and not placeholder]
    replay_logp, replay_mask = behaviour_logprobs(seqs, starts, old, replays)
    gap = (old.to(torch.float64) - replay_logp.to(torch.float64)).abs() * replay_mask
    sums["parity_replay"], sums["parity_replay_tokens"] = float(gap.sum()), float(
        replay_mask.sum())
    if replay_correction != "none":
        replay_weights, replay_changed = rollout_correction_weights(
            old, replay_logp, replay_mask, replay_correction, algo.rollout_correction_level,
            algo.rollout_correction_threshold)
        # fresh and replayed rows are disjoint, and each weight is 1 off its own rows
        token_weights = replay_weights.float() * (1.0 if token_weights is None
                                                  else token_weights)
        replay_loss_mask = rollout_loss_mask(replay_correction, replay_changed)
        if replay_loss_mask is not None:
            loss_mask = replay_loss_mask if loss_mask is None else loss_mask * replay_loss_mask
        sums["replay_correction_tokens"] = float(replay_changed.sum())
    train = TrainBatch(ids, mask, old, torch.tensor([s.advantage for s in seqs]), is_replay,
                       ref_logp=ref, token_weights=token_weights, loss_mask=loss_mask,
                       routing=routing)
    return train, sums, maxima


def _version_sums(seqs, starts, old, rollout_logp, rollout_mask, fresh, version
                  ) -> dict[str, float]:
    """|engine - actor| summed on the fresh tokens of the version being trained (``current``)
    and on those an older version sampled (``carried``: carried over a weight update or
    generated ahead)."""
    carried = rollout_mask * stale_token_mask(seqs, starts, old, fresh, version)
    current = rollout_mask - carried
    diff = (old.to(torch.float64) - rollout_logp.to(torch.float64)).abs()
    return {"parity_current": float((diff * current).sum()),
            "parity_current_tokens": float(current.sum()),
            "parity_carried": float((diff * carried).sum()),
            "parity_carried_tokens": float(carried.sum())}


def logprob_abs_diff(engine_logprobs: Sequence[Sequence[float]], actor_logp: torch.Tensor,
                     prompt_lengths: Sequence[int]) -> dict[str, float]:
    """Mean / max |engine - actor| over every response token.

    Args:
        engine_logprobs: per sequence, the engine's log-prob of each response token.
        actor_logp: ``[n, seq]`` where column t is the actor's log-prob of token t of the
            sequence ``prompt + response`` given its prefix (:func:`sequence_logprobs`).
        prompt_lengths: prompt length of each sequence.
    """
    if len(engine_logprobs) != actor_logp.shape[0] or len(prompt_lengths) != len(engine_logprobs):
        raise ValueError(f"{len(engine_logprobs)} engine rows, {actor_logp.shape[0]} actor rows "
                         f"and {len(prompt_lengths)} prompt lengths must agree")
    diffs = []
    for row, (engine, start) in enumerate(zip(engine_logprobs, prompt_lengths)):
        if not engine:
            continue
        actor = actor_logp[row, start:start + len(engine)].to(torch.float64)
        if actor.numel() != len(engine):
            raise ValueError(f"row {row}: {len(engine)} response tokens do not fit in the "
                             f"actor's {actor_logp.shape[1]} columns after a {start}-token prompt")
        diffs.append((actor - torch.tensor(engine, dtype=torch.float64)).abs())
    if not diffs:
        return {"mean": 0.0, "max": 0.0, "tokens": 0}
    flat = torch.cat(diffs)
    return {"mean": flat.mean().item(), "max": flat.max().item(), "tokens": int(flat.numel())}
