"""Rollout correction: the gap between the rollout engine's sampling probabilities and the
actor's, measured and (optionally) corrected.

The engine samples a fresh response with its own numerics (vLLM kernels, bf16, another
parallel layout), so the tokens come from ``pi_rollout``, while the loss's importance ratio is
taken against ``pi_old``, the actor's recomputation with the same weights. Per token,
``log rho = old_logp - rollout_logp``; with identical numerics rho is 1.

Weights, constant in the loss (no gradient), multiplying each token's policy loss
(``algo.rollout_correction``, ``algo.rollout_correction_level``, threshold ``C`` =
``algo.rollout_correction_threshold``):

* ``truncate``: ``w = min(rho, C)`` -- truncated importance sampling (TIS; Yao et al., "Your
  efficient RL framework secretly brings you off-policy RL training", 2025).
* ``mask``: masked importance sampling (Liu et al., "When speed kills stability", 2025; verl's
  rollout correction): a token (or sequence) whose ``rho`` lies inside ``[1/C, C]`` keeps the
  importance weight ``w = rho``; outside, it is dropped, from the loss and from the token
  count that normalises it (the caller removes it from the loss mask: :func:`rollout_loss_mask`).
* ``reject``: rejection only: ``w = 1`` inside ``[1/C, C]``, else 0, and a rejected token still
  counts in the normaliser (so rejection also shrinks the step).

and the ratio ``rho`` is taken per ``token``, per ``sequence`` (``exp(sum_t log rho_t)``) or as
the sequence's ``geometric`` mean (``exp(mean_t log rho_t)``), which stays near 1 for long
responses where the sequence product drifts. Everything is computed in log space, so a long
sequence's product cannot overflow. Replays have no rollout log-probs (they were not sampled by
this engine): their weight is 1 and they are left out of every figure here.

Pure tensors, float64 inside.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

CORRECTION_MODES = ("off", "truncate", "mask", "reject")
CORRECTION_LEVELS = ("token", "sequence", "geometric")


def _level_log_ratio(log_rho: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    if level == "token":
        return log_rho
    total = (log_rho * mask).sum(dim=1, keepdim=True)
    if level == "sequence":
        return total.expand_as(log_rho)
    if level == "geometric":
        return (total / mask.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(log_rho)
    raise ValueError(f"rollout correction level must be one of {CORRECTION_LEVELS}, "
                     f"got {level!r}")


def rollout_correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                               rollout_mask: torch.Tensor, mode: str, level: str = "token",
                               threshold: float = 2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights of the policy loss and which tokens they changed.

    Args:
        old_logp: ``[n, seq]`` the actor's log-probs of the sampled tokens.
        rollout_logp: ``[n, seq]`` the engine's log-probs of the same tokens (any value where
            ``rollout_mask`` is 0).
        rollout_mask: ``[n, seq]`` 1 on response tokens that have an engine log-prob (fresh
            responses), 0 elsewhere (prompts, padding, replays).
        mode, level, threshold: see the module docstring; ``threshold`` > 1.

    Returns:
        ``(weights, changed)``: ``[n, seq]`` float64 weights (1 wherever ``rollout_mask`` is 0
        or ``mode`` is ``off``; 0 on dropped tokens), and a bool mask of the rollout tokens
        whose weight was truncated, masked or rejected.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction mode must be one of {CORRECTION_MODES}, "
                         f"got {mode!r}")
    if threshold <= 1:
        raise ValueError(f"rollout correction threshold must be > 1, got {threshold}")
    mask = rollout_mask.to(torch.float64)
    if mode == "off":
        return torch.ones_like(mask), torch.zeros_like(mask, dtype=torch.bool)
    log_rho = (old_logp.to(torch.float64) - rollout_logp.to(torch.float64)) * mask
    level_log_rho = _level_log_ratio(log_rho, mask, level)
    log_c = math.log(threshold)
    if mode == "truncate":
        weights = torch.exp(torch.clamp(level_log_rho, max=log_c))
        changed = level_log_rho > log_c
    else:
        kept = level_log_rho.abs() <= log_c
        inside = torch.exp(level_log_rho) if mode == "mask" else torch.ones_like(level_log_rho)
        weights = torch.where(kept, inside, torch.zeros_like(inside))
        changed = ~kept
    on = mask > 0
    return torch.where(on, weights, torch.ones_like(weights)), changed & on


def rollout_loss_mask(mode: str, changed: torch.Tensor) -> Optional[torch.Tensor]:
    """With ``mask`` (masked importance sampling): ``[n, seq]`` 1 except 0 on the dropped tokens,
    to multiply into the loss mask so that they leave the normaliser too; ``None`` for the
    other modes (their normaliser is every response token)."""
    if mode != "mask":
        return None
    return (~changed).to(torch.float32)


def mismatch_kl(old_logp: torch.Tensor, rollout_logp: torch.Tensor,
                rollout_mask: torch.Tensor) -> dict[str, float]:
    """Sums over the rollout tokens of the k1 and k3 estimates of KL(pi_rollout || pi_old)
    (samples are from the engine): with ``log r = old_logp - rollout_logp``, k1 = -log r and
    k3 = exp(log r) - 1 - log r. Divide by ``tokens`` for the means."""
    mask = rollout_mask.to(torch.float64)
    log_r = (old_logp.to(torch.float64) - rollout_logp.to(torch.float64)) * mask
    k3 = (torch.exp(log_r) - 1.0 - log_r) * mask
    return {"k1": float((-log_r).sum()), "k3": float(k3.sum()), "tokens": float(mask.sum())}
