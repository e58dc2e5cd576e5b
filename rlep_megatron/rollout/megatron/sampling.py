"""Next-token sampling for the megatron backend, as vLLM samples: the logits divided by the
temperature, top-k then top-p filtering, a draw from the softmax of what is left, and the drawn
token's log-prob under that same processed distribution (vLLM's ``processed_logprobs``, which
the actor's log-probs equal where top-k and top-p keep every token).

Every row has a generator of its own (seeded per request as vLLM seeds its samples), so the
draws of a response depend on its seed alone, not on which rows share its batch (the Gumbel-max
trick over uniforms drawn from the row's generator); the logits they are drawn from can differ
in the last bits with the batch's shape (other matrix-multiply tilings, in bf16 on a GPU
above all)."""
from __future__ import annotations

from typing import Sequence

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                   top_k: int = -1) -> torch.Tensor:
    """``[rows, vocab]`` float32 log-probs of the processed distribution: ``logits /
    temperature``, the tokens outside the ``top_k`` largest and outside the smallest set whose
    mass reaches ``top_p`` set to -inf, renormalised. Greedy (``temperature == 0``): the
    log-softmax of the logits as they are, no filter (vLLM turns top-k and top-p off for greedy
    requests)."""
    scaled = logits.float()
    if temperature == 0:
        return torch.log_softmax(scaled, dim=-1)
    scaled = scaled / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # the mass of the tokens ranked above
        drop = before >= top_p
        drop[:, 0] = False  # the most likely token is always kept
        scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.log_softmax(scaled, dim=-1)


def sample(logits: torch.Tensor, generators: Sequence[torch.Generator], temperature: float,
           top_p: float = 1.0, top_k: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` ``[rows, vocab]`` (the real vocabulary only) and its
    log-prob under the processed distribution (:func:`process_logits`). Row ``r`` draws from
    ``generators[r]`` only; greedy (``temperature == 0``) draws nothing."""
    if len(generators) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(generators)} generators")
    logp = process_logits(logits, temperature, top_p, top_k)
    if temperature == 0:
        tokens = torch.argmax(logp, dim=-1)
    else:
        vocab = logp.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g, device=logp.device,
                                          dtype=torch.float32) for g in generators])
        gumbel = -torch.log(-torch.log(uniform))
        tokens = torch.argmax(logp + gumbel, dim=-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator of ``device`` seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g
