"""The token-level clipped policy loss of DAPO/RLEP (paper eq. 3/4, docs/ALGORITHM.md section 4).

Per token: ``ratio = exp(logp - old_logp)``; clip-higher
``L = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` dual-clip
``L = min(L, -A * clip_c)``.

Aggregation (``loss_agg_mode``):

* ``global_token_mean`` (default): ``sum(L over valid tokens) / global_num_tokens``. A mini-batch
  is split into micro-batches and data-parallel ranks; each call passes the token count of the
  *whole* mini-batch (summed across ranks by the caller), so summing the micro-batch losses gives
  the exact token mean of paper eq. 4.
* ``reference_micro_batch_mean``: the reference code's flavour: the token mean inside the
  micro-batch, weighted by ``num_sequences_in_micro_batch / global_num_sequences``; only
  approximately a global token mean when micro-batches differ in token counts.
"""
from __future__ import annotations

from typing import Optional

import torch

LOSS_AGG_MODES = ("global_token_mean", "reference_micro_batch_mean")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str,
               global_num_tokens: Optional[float],
               global_num_sequences: Optional[float]) -> torch.Tensor:
    if loss_agg_mode == "global_token_mean":
        if global_num_tokens is None:  # this micro-batch's count; 0 / 1 when it has none
            return (per_token * mask).sum() / mask.sum().clamp(min=1)
        if global_num_tokens <= 0:
            return (per_token * mask).sum() * 0.0
        return (per_token * mask).sum() / global_num_tokens
    if loss_agg_mode == "reference_micro_batch_mean":
        weight = 1.0 if global_num_sequences is None else mask.shape[0] / global_num_sequences
        return _masked_mean(per_token, mask) * weight
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


KL_ESTIMATORS = ("k1", "k2", "k3")
# k3's exp(-log r) overflows fp32 for log r < -88: the log-ratio is clamped first (verl's bound)
K3_LOG_RATIO_BOUND = 20.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3",
               clamp: Optional[float] = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020; the k1/k2/k3 of verl, OpenRLHF and NeMo-RL).

    With log r = logp - ref_logp: k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r.

    Values: k1 and k3 are unbiased estimates of KL(pi || pi_ref) (k2 is biased); k2 and k3 are
    non-negative. Gradients, as a loss term with the samples held fixed: d/d logp is 1, log r
    and 1 - exp(-log r), so the expected gradient of k1 is zero (E_pi[grad log pi] = 0), k2's
    is the gradient of KL(pi || pi_ref), and k3's is the gradient of KL(pi_ref || pi), the
    other direction. For k3 the log-ratio is first clamped to +-20 (``K3_LOG_RATIO_BOUND``;
    beyond it the gradient is 0), so that neither exp(-log r) nor its gradient overflows in
    fp32 or bf16. ``clamp`` bounds each token's value to [-clamp, clamp] (its gradient is then
    0): one token whose reference probability is tiny cannot dominate.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = 0.5 * log_ratio.pow(2)
    elif estimator == "k3":
        bounded = torch.clamp(log_ratio, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        value = torch.exp(-bounded) - 1.0 + bounded
    else:
        raise ValueError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}; "
                         f"got {estimator!r}")
    return value if clamp is None else torch.clamp(value, -clamp, clamp)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "global_token_mean",
                  global_num_tokens: Optional[float] = None,
                  global_num_sequences: Optional[float] = None) -> torch.Tensor:
    """Aggregated entropy (to subtract, times a coefficient, from the loss)."""
    return _aggregate(entropy, mask.to(entropy.dtype), loss_agg_mode, global_num_tokens,
                      global_num_sequences)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                clip_c: float = 10.0, *, loss_agg_mode: str = "global_token_mean",
                global_num_tokens: Optional[float] = None,
                global_num_sequences: Optional[float] = None,
                is_replay: Optional[torch.Tensor] = None,
                ref_logp: Optional[torch.Tensor] = None, kl_coef: float = 0.0,
                kl_estimator: str = "k3", kl_clamp: Optional[float] = None,
                entropy: Optional[torch.Tensor] = None, entropy_coef: float = 0.0,
                token_weights: Optional[torch.Tensor] = None,
                replay_clip_high: Optional[float] = None, metrics_on_device: bool = False
                ) -> tuple[torch.Tensor, dict]:
    """Clipped policy-gradient loss of one micro-batch.

    Args:
        logp: ``[batch, seq]`` log-probs of the response tokens under the current policy.
        old_logp: ``[batch, seq]`` log-probs under the policy that is being improved upon
            (recomputed before the update; replays start at ratio 1).
        advantages: ``[batch]`` (broadcast to every token) or ``[batch, seq]``.
        mask: ``[batch, seq]`` 1 for response tokens, 0 for padding.
        clip_low, clip_high, clip_c: eps_low, eps_high and the dual-clip constant c.
        loss_agg_mode: see the module docstring.
        global_num_tokens: valid tokens of the whole mini-batch across micro-batches and ranks
            (``global_token_mean``); ``None`` uses this micro-batch's count.
        global_num_sequences: sequences of the whole mini-batch (``reference_micro_batch_mean``).
        is_replay: ``[batch]`` bool, True for replayed responses; adds ``/fresh`` and
            ``/replay`` splits of the metrics.
        ref_logp, kl_coef, kl_estimator, kl_clamp: optional KL penalty to a reference policy
            (:func:`kl_penalty`; off when ``kl_coef`` is 0), aggregated like the policy loss.
            With ``ref_logp`` given, the metrics carry every estimator (``kl_k1`` ...),
            split fresh/replay, whatever the coefficient.
        entropy, entropy_coef: optional entropy bonus ``[batch, seq]`` (off when 0).
        token_weights: optional ``[batch, seq]`` constant weights of the per-token policy loss
            (rollout correction, :mod:`rlep_megatron.algo.correction`); no gradient flows
            through them, and the normaliser is unchanged (a weight-0 token counts as 0).
        replay_clip_high: eps_high for replayed rows instead of ``clip_high`` (needs
            ``is_replay``); ``None`` treats replays like fresh responses.
        metrics_on_device: return the metrics as detached 0-dim tensors (float32, float64 for
            float64 inputs) where the loss lives, none read here: the caller reduces them over
            micro-batches and reads them once (the actor's step: one device-to-host transfer
            per optimizer step); off, they are read here into floats in one transfer.

    Returns:
        ``(loss, metrics)``: the scalar loss to backpropagate and the metrics computed over
        the valid tokens of this micro-batch (``num_tokens`` weights them when averaging).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same shape")
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logp.dtype).expand_as(logp)
    mask = mask.to(logp.dtype)

    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    if replay_clip_high is None:
        clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    else:
        if is_replay is None:
            raise ValueError("replay_clip_high needs is_replay")
        rows = is_replay.to(device=ratio.device, dtype=torch.bool).unsqueeze(-1)
        bounds = torch.tensor([1.0 + replay_clip_high, 1.0 + clip_high], dtype=ratio.dtype,
                              device=ratio.device)
        upper = torch.where(rows, bounds[0], bounds[1])
        clipped_ratio = torch.minimum(torch.clamp(ratio, min=1.0 - clip_low), upper)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * clipped_ratio
    loss_clip_higher = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = torch.minimum(loss_clip_higher, -advantages * clip_c)
    negative = advantages < 0
    per_token = torch.where(negative, loss_dual, loss_clip_higher)
    if token_weights is not None:
        if token_weights.shape != logp.shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} must have the shape "
                             f"of logp {tuple(logp.shape)}")
        per_token = per_token * token_weights.detach().to(per_token.dtype)

    pg_loss = _aggregate(per_token, mask, loss_agg_mode, global_num_tokens, global_num_sequences)
    loss = pg_loss
    kl_value = None
    if kl_coef != 0.0:
        if ref_logp is None:
            raise ValueError("kl_coef != 0 needs ref_logp")
        kl_value = _aggregate(kl_penalty(logp, ref_logp, kl_estimator, kl_clamp), mask,
                              loss_agg_mode, global_num_tokens, global_num_sequences)
        loss = loss + kl_coef * kl_value
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs entropy")
        loss = loss - entropy_coef * entropy_bonus(entropy, mask, loss_agg_mode,
                                                   global_num_tokens, global_num_sequences)

    with torch.no_grad():
        clip_active = (loss_clipped > loss_unclipped).to(logp.dtype)
        flags = {
            "pg_clipfrac": clip_active,
            "pg_clipfrac_low": clip_active * (ratio < 1.0),
            "pg_clipfrac_high": clip_active * (ratio > 1.0),
            "pg_clipfrac_dual": (negative & (loss_dual < loss_clip_higher)).to(logp.dtype),
            "ratio_mean": ratio,
            "approx_kl": -log_ratio,
        }
        if ref_logp is not None:
            for estimator in KL_ESTIMATORS:
                flags[f"kl_{estimator}"] = kl_penalty(logp.detach(), ref_logp, estimator)
        metrics = {"pg_loss": pg_loss.detach()}
        if kl_value is not None:
            metrics["kl"] = kl_value.detach()
        groups = {"": mask}
        if is_replay is not None:
            replay_rows = is_replay.to(torch.bool).unsqueeze(-1).to(logp.dtype)
            groups["/fresh"] = mask * (1 - replay_rows)
            groups["/replay"] = mask * replay_rows
        for suffix, group_mask in groups.items():
            metrics[f"num_tokens{suffix}"] = group_mask.sum()
            for name, values in flags.items():
                metrics[f"{name}{suffix}"] = _masked_mean(values, group_mask)
            # ratios are positive: the masked maximum is 0 for a group without tokens
            metrics[f"ratio_max{suffix}"] = torch.where(group_mask > 0, ratio, 0.0).max() \
                if group_mask.numel() else group_mask.sum()
        keys = list(metrics)
        dtype = torch.promote_types(logp.dtype, torch.float32)
        stacked = torch.stack([metrics[key].to(dtype) for key in keys])
        if metrics_on_device:
            metrics = dict(zip(keys, stacked.unbind()))
        else:
            metrics = dict(zip(keys, stacked.tolist()))
    return loss, metrics
