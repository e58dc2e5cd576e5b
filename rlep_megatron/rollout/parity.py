"""Train/rollout parity probe: how far vLLM's log-probs of its own samples are from the actor's
recomputation of the same tokens. The trainer logs the mean as ``rollout/logprob_abs_diff``; a
value that grows over training means the engine and the actor run different weights or numerics.

vLLM reports log-probs after temperature scaling and top-k/top-p filtering
(``logprobs_mode="processed_logprobs"``); the actor applies the temperature only, so compare
with top_p=1 and top_k=-1 (the training recipes' settings) or expect the nucleus
renormalisation to show up here.
"""
from __future__ import annotations

from typing import Sequence

import torch

from rlep_megatron.actor.forward import actor_logprobs_everywhere
from rlep_megatron.models.megatron import ActorModelInfo


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


def probe(chunks: list[torch.nn.Module], info: ActorModelInfo, prompts: Sequence[Sequence[int]],
          responses, pad_id: int, temperature: float = 1.0, micro_batch_size: int = 8
          ) -> dict[str, float]:
    """Parity of a rollout's responses (``RolloutEngine.generate`` output for ``prompts``)."""
    flat = [r for group in responses for r in group]
    sequences = [list(prompts[r.prompt_index]) + r.token_ids for r in flat]
    logp = actor_logprobs_everywhere(chunks, info, sequences, pad_id, micro_batch_size,
                                     temperature)
    return logprob_abs_diff([r.logprobs for r in flat], logp,
                            [len(prompts[r.prompt_index]) for r in flat])
