"""Forward-only passes of the actor through megatron-core's pipeline schedule: per-token
log-probs (and entropy) of given sequences, used for old log-probs, reference log-probs, the
rollout parity probe and conversion checks.

Sequences are right-padded to one length (pipeline stages exchange fixed shapes) and cut into
micro-batches; results are returned on the last pipeline stage (``None`` elsewhere).
"""
from __future__ import annotations

from typing import Optional

import torch

from rlep_megatron.actor.logprob import vocab_parallel_logprobs
from rlep_megatron.actor.model import ActorModelInfo


def pad_sequences(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """``input_ids [n, max_len]`` right-padded with ``pad_id`` and ``lengths [n]``."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    ids = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return ids, lengths


def micro_batches(input_ids: torch.Tensor, micro_batch_size: int) -> list[dict]:
    n, seq_len = input_ids.shape
    positions = torch.arange(seq_len).unsqueeze(0)
    return [{"input_ids": input_ids[i:i + micro_batch_size],
             "position_ids": positions.expand(min(micro_batch_size, n - i), -1)}
            for i in range(0, n, micro_batch_size)]


def sequence_logprobs(chunks: list[torch.nn.Module], info: ActorModelInfo,
                      input_ids: torch.Tensor, micro_batch_size: int = 4,
                      temperature: float = 1.0, with_entropy: bool = False
                      ) -> Optional[dict[str, torch.Tensor]]:
    """Log-probs of every token given its prefix.

    Args:
        input_ids: ``[n, seq]`` right-padded token ids, identical on every rank.

    Returns (last pipeline stage only): ``{"logp": [n, seq], "entropy": [n, seq]}`` where
    column t is about token t given tokens < t; column 0 is 0 (no prefix). Values at padded
    positions are meaningless: mask them with the sequence lengths.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n, seq_len = input_ids.shape
    if n % micro_batch_size:
        raise ValueError(f"{n} sequences are not divisible into micro-batches of "
                         f"{micro_batch_size}")
    device = next(chunks[0].parameters()).device
    tp_group = ps.get_tensor_model_parallel_group()
    tp_rank = ps.get_tensor_model_parallel_rank()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        ids = batch["input_ids"].to(device)
        output = model(ids, batch["position_ids"].to(device), attention_mask=None)

        def collect(logits):
            logp, entropy = vocab_parallel_logprobs(
                logits[:, :-1], ids[:, 1:], info.dims.vocab_size, tp_rank, tp_group,
                temperature, with_entropy)
            zeros = torch.zeros(ids.shape[0], 1, dtype=logp.dtype, device=logp.device)
            result = {"logp": torch.cat([zeros, logp], dim=1).detach()}
            if with_entropy:
                result["entropy"] = torch.cat([zeros, entropy], dim=1).detach()
            return torch.zeros((), device=logp.device), result

        return output, collect

    batches = micro_batches(input_ids, micro_batch_size)
    iterators = ([iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches))
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators,
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(batches),
            seq_length=seq_len, micro_batch_size=micro_batch_size, forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return {key: torch.cat([o[key] for o in outputs], dim=0).cpu() for key in outputs[0]}
