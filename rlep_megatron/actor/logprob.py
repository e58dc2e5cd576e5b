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

import contextlib
import functools
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


def _chunk_logprobs(x: torch.Tensor, local_target: torch.Tensor, pad_from: int, tp_group,
                    multi: bool, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                              Optional[torch.Tensor]]:
    """Log-probs of one chunk of float32 logits ``x [tokens, shard]`` (already divided by the
    temperature), reduced over the TP group: one max and one sum of the partition function,
    the target logit and the entropy's weighted sum together. ``x`` is overwritten.

    Returns ``(logp, log_sum_exp, entropy or None)``, each ``[tokens]``."""
    from rlep_megatron import distributed

    shard = x.shape[-1]
    if pad_from < shard:
        x[:, max(pad_from, 0):] = float("-inf")
    max_logit = x.max(dim=-1, keepdim=True).values
    if multi:
        distributed.all_reduce(max_logit, "max", tp_group)
    x.sub_(max_logit)
    owned = (local_target >= 0) & (local_target < shard)
    picked = torch.gather(x, -1, local_target.clamp(0, shard - 1).unsqueeze(-1))[:, 0]
    exp = torch.exp(x)
    sums = [exp.sum(dim=-1), torch.where(owned, picked, torch.zeros_like(picked))]
    if with_entropy:
        weighted = exp.mul_(x)  # p x shifted (unnormalised), in place
        if pad_from < shard:
            weighted[:, max(pad_from, 0):] = 0.0  # exp(-inf) x -inf = nan: 0
        sums.append(weighted.sum(dim=-1))
    del exp
    reduced = torch.stack(sums)
    if multi:
        distributed.all_reduce(reduced, "sum", tp_group)
    shifted_lse = torch.log(reduced[0])
    entropy = shifted_lse - reduced[2] / reduced[0] if with_entropy else None
    return reduced[1] - shifted_lse, shifted_lse + max_logit[:, 0], entropy


def _logprobs_without_grad(logits: torch.Tensor, targets: torch.Tensor, real_vocab_size: int,
                           tp_rank: int, tp_group, temperature: float, with_entropy: bool
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`vocab_parallel_logprobs` without autograd, chunk by chunk of tokens and in place
    (:func:`_chunk_logprobs`): a float32 copy of the chunk's logits and its exponentials."""
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
            logp[lo:hi], _, chunk_entropy = _chunk_logprobs(
                x, flat_targets[lo:hi] - start, pad_from, tp_group, multi, with_entropy)
            if with_entropy:
                entropy[lo:hi] = chunk_entropy
    shape = targets.shape
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


# --------------------------------------------------------------------------------------------
# Log-probs from the last hidden states, the output layer applied chunk by chunk


class _ChunkedOutputLogprobs(torch.autograd.Function):
    """``logp`` (and the entropy) of ``hidden @ weight.T / T`` computed ``chunk`` tokens at a
    time: the forward keeps only ``[tokens]`` statistics (log-partition, entropy) besides its
    inputs, and the backward recomputes each chunk's logits from ``hidden`` and ``weight``, so
    at most one chunk's logits and their gradient are alive at any time. The gradient of the
    logits is analytic: with ``q = softmax``, ``d logp / d z = onehot(target) - q`` and
    ``d H / d z = -q (log q + H)`` (each divided by the temperature); the TP ranks' shards need
    no communication in the backward because the partition function is already global."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, real_vocab_size, tp_rank, tp_group, temperature,
                with_entropy, entropy_grad, chunk):
        shard = weight.shape[0]
        multi = tp_group is not None and torch.distributed.get_world_size(tp_group) > 1
        count = hidden.shape[0]
        logp = torch.empty(count, dtype=torch.float32, device=hidden.device)
        log_z = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        start = tp_rank * shard
        for lo in range(0, count, chunk):
            hi = min(lo + chunk, count)
            x = torch.nn.functional.linear(hidden[lo:hi], weight).float()
            if temperature != 1.0:
                x.div_(temperature)
            logp[lo:hi], log_z[lo:hi], chunk_entropy = _chunk_logprobs(
                x, targets[lo:hi] - start, real_vocab_size - start, tp_group, multi,
                with_entropy)
            del x
            if with_entropy:
                entropy[lo:hi] = chunk_entropy
        ctx.save_for_backward(hidden, weight, targets, log_z,
                              entropy if entropy_grad else None)
        ctx.settings = (real_vocab_size, start, temperature, chunk)
        ctx.set_materialize_grads(False)
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        real_vocab_size, start, temperature, chunk = ctx.settings
        if entropy is None:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None,) * 10
        shard = weight.shape[0]
        pad_from = real_vocab_size - start
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(lo + chunk, hidden.shape[0])
            h = hidden[lo:hi]
            # log q of the chunk, in place: the logits recomputed, scaled, normalised
            log_q = torch.nn.functional.linear(h, weight).float()
            if temperature != 1.0:
                log_q.div_(temperature)
            log_q.sub_(log_z[lo:hi, None])
            if pad_from < shard:
                log_q[:, max(pad_from, 0):] = float("-inf")
            if grad_entropy is None:  # one chunk-sized buffer: log q -> q -> the gradient
                grad = log_q.exp_()
                grad.mul_(-grad_logp[lo:hi, None])
            else:  # two: q, and q (log q + H) in place of log q
                q = torch.exp(log_q)
                log_q.add_(entropy[lo:hi, None]).mul_(q)  # padding: 0 x -inf = nan
                if pad_from < shard:
                    log_q[:, max(pad_from, 0):] = 0.0
                grad = q.mul_(-grad_logp[lo:hi, None]) if grad_logp is not None else q.zero_()
                grad.addcmul_(log_q, grad_entropy[lo:hi, None], value=-1.0)
            del log_q
            if grad_logp is not None:
                g = grad_logp[lo:hi]
                local = targets[lo:hi] - start
                owned = (local >= 0) & (local < shard)
                grad[rows[:hi - lo][owned], local[owned]] += g[owned]
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = grad @ weight
            if grad_weight is not None:
                if grad.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad.t(), h)
                else:  # a bfloat16 model: the chunk's product, summed in float32
                    grad_weight.add_(grad.t() @ h)
            del grad
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def output_layer_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          real_vocab_size: int, tp_rank: int = 0, tp_group=None,
                          temperature: float = 1.0, with_entropy: bool = False,
                          entropy_grad: bool = True, chunk_tokens: int = 2048
                          ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`vocab_parallel_logprobs` of the logits ``hidden @ weight.T`` without ever holding
    them all: ``chunk_tokens`` tokens' logits at a time, recomputed in the backward
    (:class:`_ChunkedOutputLogprobs`).

    Args:
        hidden: ``[..., hidden]`` last hidden states (after the final norm), the full sequence
            on every TP rank (sequence-parallel shards already gathered).
        weight: ``[vocab_shard, hidden]`` this TP rank's rows of the output layer.
        targets: ``[...]`` global token ids.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    shape = targets.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    logp, entropy = _ChunkedOutputLogprobs.apply(
        flat, weight, targets.reshape(-1), real_vocab_size, tp_rank, tp_group, temperature,
        with_entropy, with_entropy and entropy_grad and torch.is_grad_enabled(),
        chunk_tokens)
    return logp.view(shape), (entropy.view(shape) if with_entropy else None)


def _hidden_passthrough(layer, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                        runtime_gather_output: Optional[bool] = None):
    """Stands in for the output layer's forward (``ColumnParallelLinear``): the input made
    whole on every TP rank the way the layer does it (all-gather of the sequence-parallel
    shards, its backward a reduce-scatter; otherwise the identity whose backward sums the
    input gradient over TP), without the matmul."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)

    if layer.sequence_parallel:
        whole = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                     group=layer.tp_group)
    elif torch.distributed.get_world_size(layer.tp_group) > 1:
        whole = copy_to_tensor_model_parallel_region(input_, group=layer.tp_group)
    else:
        return input_, None
    # the model returns ``output.transpose(0, 1)``: its gradient arrives transposed, and the
    # collectives above need it contiguous (the logits' matmul gave them that)
    return _ContiguousGrad.apply(whole), None


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the incoming gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


@contextlib.contextmanager
def hidden_states_out(model: torch.nn.Module):
    """Within it, the last pipeline stage's ``model(...)`` returns the last hidden states
    ``[batch, seq, hidden]`` instead of the logits (for :func:`output_layer_logprobs` with
    :func:`output_weight`); a no-op on other stages."""
    from rlep_megatron.models.megatron import unwrap

    gpt = unwrap(model)
    layer = getattr(gpt, "output_layer", None) if gpt.post_process else None
    if layer is None:
        yield
        return
    if layer.bias is not None:
        raise NotImplementedError("chunked log-probs assume an output layer without bias")
    layer.forward = functools.partial(_hidden_passthrough, layer)
    try:
        yield
    finally:
        del layer.forward


def output_weight(model: torch.nn.Module) -> torch.Tensor:
    """The output layer's weight of the last pipeline stage (the shared embedding when tied)."""
    from rlep_megatron.models.megatron import unwrap

    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def next_token_logprobs(model: torch.nn.Module, info, output: torch.Tensor,
                        input_ids: torch.Tensor, tp_rank: int, tp_group, temperature: float,
                        with_entropy: bool, entropy_grad: bool = True,
                        packed: Optional[dict] = None
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``[rows, seq - 1]`` log-probs (and entropy) of ``input_ids[:, 1:]`` from the last
    stage's ``output`` of :func:`rlep_megatron.actor.packing.run_model`: hidden states when
    ``info.logprob_chunk_tokens`` is set (the output layer applied chunk by chunk), logits
    otherwise. Trailing columns past ``input_ids`` (sequence-parallel fill) are ignored. With
    context parallelism ``packed`` (the micro-batch's ``cu_seqlens``, for a pack) says how the
    sequences were split."""
    width = input_ids.shape[1] - 1
    config = model.config
    if config.context_parallel_size > 1:
        return _context_parallel_logprobs(model, info, output, input_ids, tp_rank, tp_group,
                                          temperature, with_entropy, entropy_grad, packed)
    if info.logprob_chunk_tokens:
        return output_layer_logprobs(
            output[:, :width], output_weight(model), input_ids[:, 1:], info.dims.vocab_size,
            tp_rank, tp_group, temperature, with_entropy, entropy_grad,
            info.logprob_chunk_tokens)
    return vocab_parallel_logprobs(output[:, :width], input_ids[:, 1:], info.dims.vocab_size,
                                   tp_rank, tp_group, temperature, with_entropy, entropy_grad)


def _context_parallel_logprobs(model, info, output, input_ids, tp_rank, tp_group, temperature,
                               with_entropy, entropy_grad, packed):
    """:func:`next_token_logprobs` when the model saw only this CP rank's chunks of each
    sequence: each local position's target is the next token of the whole sequence, and the
    per-token values of every CP rank are gathered back into the micro-batch's layout (each CP
    rank then computes the same loss; the gather's backward keeps this rank's columns)."""
    from megatron.core import parallel_state as ps

    from rlep_megatron.models import context_parallel

    config = model.config
    multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
    lay = context_parallel.layout(input_ids, packed, config.context_parallel_size,
                                  ps.get_context_parallel_rank(), multiple)
    following = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
    targets = torch.zeros_like(lay.input_ids)
    targets[:, lay.original.to(targets.device)] = following
    local = targets.index_select(1, lay.local.to(targets.device))
    count = local.shape[1]
    if info.logprob_chunk_tokens:
        logp, entropy = output_layer_logprobs(
            output[:, :count], output_weight(model), local, info.dims.vocab_size, tp_rank,
            tp_group, temperature, with_entropy, entropy_grad, info.logprob_chunk_tokens)
    else:
        logp, entropy = vocab_parallel_logprobs(output[:, :count], local, info.dims.vocab_size,
                                                tp_rank, tp_group, temperature, with_entropy,
                                                entropy_grad)
    width = input_ids.shape[1] - 1
    logp = context_parallel.gather_tokens(logp, lay)[:, :width]
    if with_entropy:
        entropy = context_parallel.gather_tokens(entropy, lay)[:, :width]
    return logp, entropy
