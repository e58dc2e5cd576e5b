"""The policy losses ``algo.loss`` chooses (docs/ALGORITHM.md section 4): each a small class
behind :class:`rlep_megatron.algo.loss.PolicyLoss`, registered by name.

* ``dapo`` (default): the token-level clip-higher loss of DAPO / RLEP (paper eq. 3/4) with the
  dual clip for negative advantages.
* ``gspo``: GSPO's sequence-level ratio (Zheng et al. 2025, "Group sequence policy
  optimization"), clipped per sequence, averaged over sequences.
* ``cispo``: CISPO's clipped, stop-gradient importance weight on a REINFORCE term (MiniMax-M1,
  2025): no token's gradient is ever clipped away, only its weight is bounded.

Adding a loss: a subclass with ``@register_loss("name")`` whose ``from_config`` reads its
options (keys of ``AlgoConfig``), the name in ``AlgoConfig.loss``'s choices (config.py), and a float64
re-derivation test of its paper's formula.
"""
from __future__ import annotations

from typing import Optional

import torch

from rlep_megatron.algo.loss import (LossBatch, Normaliser, Penalties, PolicyLoss, register_loss,
                                     sequence_mean)


@register_loss("dapo")
class DapoClip(PolicyLoss):
    """Per token: ``ratio = exp(logp - old_logp)``; clip-higher
    ``L = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` the
    dual clip ``L = min(L, -A * clip_c)``. ``replay_clip_high``: eps_high of replayed rows
    instead of ``clip_high`` (``None``: replays are clipped like fresh responses)."""

    split_flags = ("pg_clipfrac",)
    whole_flags = ("pg_clipfrac_low", "pg_clipfrac_high", "pg_clipfrac_dual")

    def __init__(self, penalties: Penalties = Penalties(), clip_low: float = 0.2,
                 clip_high: float = 0.28, clip_c: float = 10.0,
                 replay_clip_high: Optional[float] = None):
        super().__init__(penalties)
        self.clip_low, self.clip_high, self.clip_c = clip_low, clip_high, clip_c
        self.replay_clip_high = replay_clip_high

    @classmethod
    def from_config(cls, algo, penalties: Penalties, replay_clip_high: Optional[float] = None):
        return cls(penalties, algo.clip_ratio_low, algo.clip_ratio_high, algo.clip_ratio_c,
                   replay_clip_high)

    def surrogate(self, batch: LossBatch, ratio: torch.Tensor):
        advantages = batch.advantages
        if self.replay_clip_high is None:
            clipped_ratio = torch.clamp(ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        else:
            if batch.is_replay is None:
                raise ValueError("replay_clip_high needs is_replay")
            rows = batch.is_replay.to(device=ratio.device, dtype=torch.bool).unsqueeze(-1)
            bounds = torch.tensor([1.0 + self.replay_clip_high, 1.0 + self.clip_high],
                                  dtype=ratio.dtype, device=ratio.device)
            upper = torch.where(rows, bounds[0], bounds[1])
            clipped_ratio = torch.minimum(torch.clamp(ratio, min=1.0 - self.clip_low), upper)
        loss_unclipped = -advantages * ratio
        loss_clipped = -advantages * clipped_ratio
        loss_clip_higher = torch.maximum(loss_unclipped, loss_clipped)
        loss_dual = torch.minimum(loss_clip_higher, -advantages * self.clip_c)
        negative = advantages < 0
        per_token = torch.where(negative, loss_dual, loss_clip_higher)
        with torch.no_grad():
            clip_active = (loss_clipped > loss_unclipped).to(ratio.dtype)
            flags = {"pg_clipfrac": clip_active,
                     "pg_clipfrac_low": clip_active * (ratio < 1.0),
                     "pg_clipfrac_high": clip_active * (ratio > 1.0),
                     "pg_clipfrac_dual": (negative & (loss_dual < loss_clip_higher)
                                          ).to(ratio.dtype)}
        return per_token, flags


@register_loss("gspo")
class GspoClip(PolicyLoss):
    """GSPO: per sequence i, ``s_i = exp(mean_t(logp - old_logp))`` over its trained tokens (the
    length-normalised sequence ratio), ``L_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 +
    clip_high))``, the loss ``sum_i L_i / num_sequences``. Written per token as GSPO-token with
    ``s_it = sg(s_i) * pi(y_t) / sg(pi(y_t))`` (the same value, and with one advantage per
    sequence the same gradient ``-A_i s_i / |y_i| * grad logp_t``), so token weights (rollout
    correction) and masks apply per token. The clip range is the paper's (3e-4, 4e-4) by
    default: a sequence ratio moves far less than a token's."""

    split_flags = ("pg_clipfrac",)
    whole_flags = ("pg_clipfrac_low", "pg_clipfrac_high", "sequence_ratio_mean")

    def __init__(self, penalties: Penalties = Penalties(), clip_low: float = 3e-4,
                 clip_high: float = 4e-4):
        super().__init__(penalties)
        self.clip_low, self.clip_high = clip_low, clip_high

    @classmethod
    def from_config(cls, algo, penalties: Penalties, replay_clip_high: Optional[float] = None):
        return cls(penalties, algo.gspo_clip_ratio_low, algo.gspo_clip_ratio_high)

    def surrogate(self, batch: LossBatch, ratio: torch.Tensor):
        mask, advantages = batch.mask, batch.advantages
        log_ratio = batch.logp - batch.old_logp
        sequence_log_ratio = ((log_ratio * mask).sum(dim=-1)
                              / mask.sum(dim=-1).clamp(min=1)).unsqueeze(-1)
        token_ratio = torch.exp(sequence_log_ratio.detach() + batch.logp - batch.logp.detach())
        clipped = torch.clamp(token_ratio, 1.0 - self.clip_low, 1.0 + self.clip_high)
        loss_unclipped = -advantages * token_ratio
        loss_clipped = -advantages * clipped
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        with torch.no_grad():
            clip_active = (loss_clipped > loss_unclipped).to(ratio.dtype)
            flags = {"pg_clipfrac": clip_active,
                     "pg_clipfrac_low": clip_active * (token_ratio < 1.0),
                     "pg_clipfrac_high": clip_active * (token_ratio > 1.0),
                     "sequence_ratio_mean": token_ratio.detach().expand_as(mask)}
        return per_token, flags

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor,
                  normaliser: Normaliser) -> torch.Tensor:
        return sequence_mean(per_token, mask, normaliser.global_num_sequences)


@register_loss("cispo")
class CispoWeight(PolicyLoss):
    """CISPO: ``L = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp`` per token, the
    paper's objective (its value is not on the clip losses' scale; its gradient is ``-w A grad
    logp`` for every token, clipped or not). ``clip_low`` ``None``: no lower bound on the
    weight, as MiniMax-M1 ran it."""

    split_flags = ("pg_clipfrac",)
    whole_flags = ("pg_clipfrac_low", "pg_clipfrac_high")

    def __init__(self, penalties: Penalties = Penalties(), clip_low: Optional[float] = None,
                 clip_high: float = 0.28):
        super().__init__(penalties)
        self.clip_low, self.clip_high = clip_low, clip_high

    @classmethod
    def from_config(cls, algo, penalties: Penalties, replay_clip_high: Optional[float] = None):
        return cls(penalties, algo.cispo_clip_ratio_low, algo.cispo_clip_ratio_high)

    def surrogate(self, batch: LossBatch, ratio: torch.Tensor):
        lower = None if self.clip_low is None else 1.0 - self.clip_low
        weight = torch.clamp(ratio.detach(), min=lower, max=1.0 + self.clip_high)
        per_token = -batch.advantages * weight * batch.logp
        with torch.no_grad():
            low = (ratio < lower).to(ratio.dtype) if lower is not None else \
                torch.zeros_like(ratio)
            high = (ratio > 1.0 + self.clip_high).to(ratio.dtype)
            flags = {"pg_clipfrac": low + high, "pg_clipfrac_low": low,
                     "pg_clipfrac_high": high}
        return per_token, flags
