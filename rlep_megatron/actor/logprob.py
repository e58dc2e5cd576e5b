"""Per-token log-probs and entropy from vocab-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds logits for its slice ``[start, end)`` of the (padded)
vocabulary. Log-softmax needs the max and the sum of exponentials over the whole vocabulary:
they are reduced across the TP group (a max, then sums); the target logit is picked on the rank
that owns it and summed. Memory per rank is O(tokens x vocab / TP). Padded vocabulary entries
(ids >= the real vocabulary size) are masked to -inf, so they never take probability mass.

The sums go through megatron's autograd-aware all-reduce (forward: sum over TP; backward:
identity), which gives every rank the exact gradient of its own logits because all TP ranks
compute the same loss from the reduced values.
"""
from __future__ import annotations

from typing import Optional

import torch


def _reduce_sum(tensor: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    if group is None or torch.distributed.get_world_size(group) == 1:
        return tensor
    return reduce_from_tensor_model_parallel_region(tensor, group=group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, real_vocab_size: int,
                            tp_rank: int = 0, tp_group=None, temperature: float = 1.0,
                            with_entropy: bool = False, entropy_grad: bool = True
                            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of ``targets`` (and optionally the entropy) under ``softmax(logits / T)``.

    Args:
        logits: ``[..., vocab_shard]`` this TP rank's slice of the padded vocabulary.
        targets: ``[...]`` global token ids.
        real_vocab_size: ids at or above it are padding and masked out.
        tp_rank, tp_group: this rank's index and the tensor-parallel process group (None or a
            group of one for TP=1).
        temperature: logits are divided by it (the sampling temperature of the rollout).
        entropy_grad: keep the entropy in the autograd graph (needed only when it is part of
            the loss); otherwise it is computed without the ``[tokens, vocab]`` intermediates
            that autograd would keep for the backward pass.

    Returns:
        ``(logp [...], entropy [...] or None)`` in float32.

    Without autograd (the old-log-prob, reference and parity passes) the work runs in chunks
    of tokens (:func:`_logprobs_without_grad`): at most two float32 chunks are alive besides
    the logits, instead of several float32 copies of all of them.
    """
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return _logprobs_without_grad(logits, targets, real_vocab_size, tp_rank, tp_group,
                                      temperature, with_entropy)
    shard = logits.shape[-1]
    start = tp_rank * shard
    scaled = logits.float() / temperature
    vocab_ids = torch.arange(start, start + shard, device=logits.device)
    if start + shard > real_vocab_size:
        scaled = scaled.masked_fill(vocab_ids >= real_vocab_size, float("-inf"))
    with torch.no_grad():
        max_logit = scaled.max(dim=-1, keepdim=True).values
        if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
            from rlep_megatron import distributed

            distributed.all_reduce(max_logit, "max", tp_group)
    shifted = scaled - max_logit
    exp = torch.exp(shifted)
    sum_exp = _reduce_sum(exp.sum(dim=-1), tp_group)
    local_target = targets - start
    owned = (local_target >= 0) & (local_target < shard)
    picked = torch.gather(shifted, -1, local_target.clamp(0, shard - 1).unsqueeze(-1))[..., 0]
    target_logit = _reduce_sum(torch.where(owned, picked, torch.zeros_like(picked)), tp_group)
    log_sum_exp = torch.log(sum_exp)
    logp = target_logit - log_sum_exp
    entropy = None
    if with_entropy:
        # H = log Z - E_p[shifted]; masked (padded) entries give exp(-inf) * -inf = nan: 0
        if entropy_grad:
            weighted = torch.where(exp > 0, exp * shifted, torch.zeros_like(exp)).sum(dim=-1)
            entropy = log_sum_exp - _reduce_sum(weighted, tp_group) / sum_exp
        else:
            with torch.no_grad():  # one [tokens, vocab] temporary, modified in place
                product = exp * shifted
                product.masked_fill_(exp == 0, 0.0)
                weighted = product.sum(dim=-1)
                del product
                entropy = log_sum_exp - _reduce_sum(weighted, tp_group) / sum_exp
    return logp, entropy


NO_GRAD_CHUNK_BYTES = 256 * 2 ** 20
"""Float32 bytes of one chunk of logits in the forward-only path (two such buffers at most)."""


def _logprobs_without_grad(logits: torch.Tensor, targets: torch.Tensor, real_vocab_size: int,
                           tp_rank: int, tp_group, temperature: float, with_entropy: bool
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`vocab_parallel_logprobs` without autograd, chunk by chunk of tokens and in place:
    a float32 copy of the chunk's logits (scaled, masked, shifted by the max) and its
    exponentials (turned into ``p x shifted`` for the entropy). Per chunk one max and one sum
    (of the partition function, the target logit and the entropy's weighted sum together) over
    the TP group."""
    from rlep_megatron import distributed

    shard = logits.shape[-1]
    start = tp_rank * shard
    pad_from = real_vocab_size - start  # local columns at or after it are padding
    multi = tp_group is not None and torch.distributed.get_world_size(tp_group) > 1
    # [rows, tokens, shard] without copying: ``logits[:, :-1]`` of a padded batch cannot be
    # flattened in place, but a block of its rows can be copied into one float32 chunk
    blocks3d = logits if logits.dim() == 3 else logits.reshape(1, -1, shard)
    num_rows, row_len = blocks3d.shape[0], blocks3d.shape[1]
    count = num_rows * row_len
    logp = torch.empty(count, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logp) if with_entropy else None
    flat_targets = targets.reshape(-1)
    step = max(1, NO_GRAD_CHUNK_BYTES // (4 * shard))  # tokens per chunk
    if count == 0:
        chunks = []
    elif row_len <= step:  # whole rows per chunk (the same chunks on every TP rank)
        per = max(1, step // max(row_len, 1))
        chunks = [(r, min(r + per, num_rows), 0, row_len) for r in range(0, num_rows, per)]
    else:  # a row longer than a chunk: pieces of one row
        chunks = [(r, r + 1, t, min(t + step, row_len)) for r in range(num_rows)
                  for t in range(0, row_len, step)]
    with torch.no_grad():
        for r0, r1, t0, t1 in chunks:
            lo, hi = r0 * row_len + t0, (r1 - 1) * row_len + t1
            x = blocks3d[r0:r1, t0:t1].to(torch.float32, copy=True).reshape(-1, shard)
            if temperature != 1.0:
                x.div_(temperature)
            if pad_from < shard:
                x[:, max(pad_from, 0):] = float("-inf")
            max_logit = x.max(dim=-1, keepdim=True).values
            if multi:
                distributed.all_reduce(max_logit, "max", tp_group)
            x.sub_(max_logit)
            local_target = flat_targets[lo:hi] - start
            owned = (local_target >= 0) & (local_target < shard)
            picked = torch.gather(x, -1, local_target.clamp(0, shard - 1).unsqueeze(-1))[:, 0]
            exp = torch.exp(x)
            sums = [exp.sum(dim=-1), torch.where(owned, picked, torch.zeros_like(picked))]
            if with_entropy:
                weighted = exp.mul_(x)  # p x shifted (unnormalised), in place
                if pad_from < shard:
                    weighted[:, max(pad_from, 0):] = 0.0  # exp(-inf) x -inf = nan: 0
                sums.append(weighted.sum(dim=-1))
            del x, exp
            reduced = torch.stack(sums)
            if multi:
                distributed.all_reduce(reduced, "sum", tp_group)
            log_sum_exp = torch.log(reduced[0])
            logp[lo:hi] = reduced[1] - log_sum_exp
            if with_entropy:
                entropy[lo:hi] = log_sum_exp - reduced[2] / reduced[0]
    shape = targets.shape
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)
