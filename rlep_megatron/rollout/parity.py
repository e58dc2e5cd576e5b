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
from rlep_megatron.actor.old_logprob import logprob_abs_diff
from rlep_megatron.models.megatron import ActorModelInfo

__all__ = ["logprob_abs_diff", "probe"]


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
