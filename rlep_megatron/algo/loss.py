"""Policy losses as plug-ins (``algo.loss``, docs/ALGORITHM.md section 4): the contract every
loss implements, the registry, and the parts every loss shares (aggregation, the KL and entropy
terms, the metrics).

A loss is a small class (:class:`PolicyLoss`) that turns one micro-batch's :class:`LossBatch`
into a per-token surrogate and its own clip flags; the base class weights the tokens (rollout
correction), aggregates (``algo.loss_agg_mode``), adds the KL and entropy terms and computes the
metrics every loss reports, split fresh/replay. Each loss declares how its metrics reduce over
micro-batches and ranks (:meth:`PolicyLoss.metric_reductions`); the actor reduces by that
declaration. The losses themselves live in :mod:`rlep_megatron.algo.surrogates`.

Aggregation (``loss_agg_mode``):

* ``global_token_mean`` (default): ``sum(L over valid tokens) / global_num_tokens``. A mini-batch
  is split into micro-batches and data-parallel ranks; each call passes the token count of the
  *whole* mini-batch (summed across ranks by the caller), so summing the micro-batch losses gives
  the exact token mean of paper eq. 4.
* ``reference_micro_batch_mean``: the reference code's flavour: the token mean inside the
  micro-batch, weighted by ``num_sequences_in_micro_batch / global_num_sequences``; only
  approximately a global token mean when micro-batches differ in token counts.
* ``constant_length``: Dr. GRPO's ``sum(L over valid tokens) / (global_num_sequences x L_max)``
  with a constant ``L_max`` (``algo.loss_constant_length_tokens``, by default the rollout's
  ``max_response_tokens``): no response-length bias.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from rlep_megatron.algo.registry import Registry

LOSS_AGG_MODES = ("global_token_mean", "reference_micro_batch_mean", "constant_length")
# how a metric of one micro-batch becomes the mini-batch's: summed and reported (``sum``),
# summed and used only as a weight (``count``), weighted by its split's token count
# (``token_mean``), or the maximum (``max``)
REDUCTIONS = ("sum", "count", "token_mean", "max")
SPLITS = ("", "/fresh", "/replay")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


@dataclass(frozen=True)
class Normaliser:
    """What one micro-batch's summed loss is divided by: the mini-batch's totals, summed over
    micro-batches and data-parallel ranks by the caller (``None``: this micro-batch's own)."""

    loss_agg_mode: str = "global_token_mean"
    global_num_tokens: Optional[float] = None
    global_num_sequences: Optional[float] = None
    constant_length_tokens: Optional[float] = None
    """``L_max`` of ``constant_length``."""


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, normaliser: Normaliser) -> torch.Tensor:
    """``[batch, seq]`` per-token values -> this micro-batch's share of the mini-batch loss."""
    mode, tokens = normaliser.loss_agg_mode, normaliser.global_num_tokens
    sequences = normaliser.global_num_sequences
    if mode == "global_token_mean":
        if tokens is None:  # this micro-batch's count; 0 / 1 when it has none
            return (per_token * mask).sum() / mask.sum().clamp(min=1)
        if tokens <= 0:
            return (per_token * mask).sum() * 0.0
        return (per_token * mask).sum() / tokens
    if mode == "reference_micro_batch_mean":
        weight = 1.0 if sequences is None else mask.shape[0] / sequences
        return _masked_mean(per_token, mask) * weight
    if mode == "constant_length":
        if normaliser.constant_length_tokens is None:
            raise ValueError("loss_agg_mode constant_length needs constant_length_tokens")
        if sequences is None:
            sequences = float((mask.sum(dim=-1) > 0).sum())
        if sequences <= 0:
            return (per_token * mask).sum() * 0.0
        return (per_token * mask).sum() / (sequences * normaliser.constant_length_tokens)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def sequence_mean(per_token: torch.Tensor, mask: torch.Tensor,
                  global_num_sequences: Optional[float]) -> torch.Tensor:
    """The mean over sequences of each sequence's token mean (GSPO's aggregation): ``sum_i
    (sum_t L_it / n_i) / global_num_sequences`` over the rows with valid tokens."""
    per_row = (per_token * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    if global_num_sequences is None:
        global_num_sequences = float((mask.sum(dim=-1) > 0).sum())
    if global_num_sequences <= 0:
        return per_row.sum() * 0.0
    return per_row.sum() / global_num_sequences


KL_ESTIMATORS = ("k1", "k2", "k3")
# the penalty may also take k3 weighted by the importance ratio to the sampling policy
KL_PENALTIES = KL_ESTIMATORS + ("k3_importance_weighted",)
# k3's exp(-log r) overflows fp32 for log r < -88: the log-ratio is clamped first (verl's bound)
K3_LOG_RATIO_BOUND = 20.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3",
               clamp: Optional[float] = None,
               old_logp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples (Schulman, "Approximating KL
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

    ``k3_importance_weighted`` (needs ``old_logp``, the log-probs of the policy that sampled the
    tokens): ``(pi / pi_old) x k3`` with the gradient through both factors. Over samples of
    pi_old its expected gradient is exactly that of KL(pi || pi_ref), also when pi has moved
    away from pi_old during the update (Zhang et al. 2025, "On the design of KL-regularized
    policy gradient algorithms for LLM reasoning"; DeepSeek-V3.2's unbiased KL estimate);
    plain k3 gives the reverse direction's gradient even on-policy. Its ratio's log is clamped
    to +-20 like k3's.
    """
    log_ratio = logp - ref_logp
    if estimator == "k1":
        value = log_ratio
    elif estimator == "k2":
        value = 0.5 * log_ratio.pow(2)
    elif estimator in ("k3", "k3_importance_weighted"):
        bounded = torch.clamp(log_ratio, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
        value = torch.exp(-bounded) - 1.0 + bounded
        if estimator == "k3_importance_weighted":
            if old_logp is None:
                raise ValueError("kl estimator k3_importance_weighted needs old_logp")
            weight = torch.exp(torch.clamp(logp - old_logp, -K3_LOG_RATIO_BOUND,
                                           K3_LOG_RATIO_BOUND))
            value = weight * value
    else:
        raise ValueError(f"kl estimator must be one of {', '.join(KL_PENALTIES)}; "
                         f"got {estimator!r}")
    return value if clamp is None else torch.clamp(value, -clamp, clamp)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "global_token_mean",
                  global_num_tokens: Optional[float] = None,
                  global_num_sequences: Optional[float] = None) -> torch.Tensor:
    """Aggregated entropy (to subtract, times a coefficient, from the loss)."""
    return aggregate(entropy, mask.to(entropy.dtype),
                     Normaliser(loss_agg_mode, global_num_tokens, global_num_sequences))


@dataclass
class LossBatch:
    """One micro-batch's loss inputs, ``[batch, seq]`` unless said (rows are whole sequences)."""

    logp: torch.Tensor
    """Log-probs of the response tokens under the current policy (with gradient)."""
    old_logp: torch.Tensor
    """Log-probs under the policy being improved upon (recomputed before the update; replays
    start at ratio 1)."""
    advantages: torch.Tensor
    """``[batch]`` (broadcast to every token) or ``[batch, seq]``."""
    mask: torch.Tensor
    """1 for trained response tokens, 0 for padding."""
    is_replay: Optional[torch.Tensor] = None
    """``[batch]`` bool, True for replayed responses: adds ``/fresh`` and ``/replay`` splits
    of the metrics."""
    ref_logp: Optional[torch.Tensor] = None
    """Reference-policy log-probs (the KL term and its metrics)."""
    entropy: Optional[torch.Tensor] = None
    """Per-token entropy (the entropy bonus)."""
    token_weights: Optional[torch.Tensor] = None
    """Constant weights of each token's policy loss (rollout correction); no gradient flows
    through them and the normaliser is unchanged (a weight-0 token counts as 0)."""

    def __post_init__(self):
        if self.logp.shape != self.old_logp.shape or self.logp.shape != self.mask.shape:
            raise ValueError(f"logp {tuple(self.logp.shape)}, old_logp "
                             f"{tuple(self.old_logp.shape)} and mask {tuple(self.mask.shape)} "
                             "must have the same shape")
        if self.token_weights is not None and self.token_weights.shape != self.logp.shape:
            raise ValueError(f"token_weights {tuple(self.token_weights.shape)} must have the "
                             f"shape of logp {tuple(self.logp.shape)}")
        advantages = self.advantages
        if advantages.dim() == self.logp.dim() - 1:
            advantages = advantages.unsqueeze(-1)
        self.advantages = advantages.to(self.logp.dtype).expand_as(self.logp)
        self.mask = self.mask.to(self.logp.dtype)


@dataclass(frozen=True)
class Penalties:
    """The terms added to every policy loss, aggregated like it (off at coefficient 0)."""

    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_clamp: Optional[float] = None
    entropy_coef: float = 0.0


LOSSES = Registry("algo.loss")
register_loss = LOSSES.register


class PolicyLoss:
    """The contract of a policy loss. A subclass implements :meth:`surrogate` (and may override
    :meth:`aggregate`); it lists in ``split_flags`` the flags of its surrogate reported per
    split (whole, fresh, replay) and in ``whole_flags`` those reported for all tokens only."""

    name: ClassVar[str] = ""
    split_flags: ClassVar[tuple[str, ...]] = ("pg_clipfrac",)
    whole_flags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, penalties: Penalties = Penalties()):
        self.penalties = penalties

    @classmethod
    def from_config(cls, algo, penalties: Penalties,
                    replay_clip_high: Optional[float] = None) -> "PolicyLoss":
        """The loss with its options read from an ``AlgoConfig`` (``replay_clip_high``: the
        ``replay`` section's eps_high for replays, for the losses that clip per token)."""
        raise NotImplementedError

    def surrogate(self, batch: LossBatch, ratio: torch.Tensor
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(per_token, flags)``: the ``[batch, seq]`` loss of each token (to be aggregated)
        and ``[batch, seq]`` 0/1 flags (token means in the metrics). ``ratio``:
        ``exp(logp - old_logp)``."""
        raise NotImplementedError

    def aggregate(self, per_token: torch.Tensor, mask: torch.Tensor,
                  normaliser: Normaliser) -> torch.Tensor:
        return aggregate(per_token, mask, normaliser)

    def metric_reductions(self, with_ref: bool = False) -> dict[str, str]:
        """How each metric of :meth:`__call__` reduces over micro-batches and ranks (see
        :data:`REDUCTIONS`); ``token_mean`` keys are weighted by the ``num_tokens`` of their
        split. ``kl`` is always there (0 when the KL term is off)."""
        out = {"pg_loss": "sum", "kl": "sum", "num_tokens": "sum",
               "num_tokens/fresh": "count", "num_tokens/replay": "count"}
        token_means = [f"{name}{suffix}" for name in
                       (*self.split_flags, "ratio_mean", "approx_kl") for suffix in SPLITS]
        token_means += list(self.whole_flags)
        if with_ref:
            token_means += [f"kl_{e}{suffix}" for e in KL_ESTIMATORS for suffix in SPLITS]
        out.update({key: "token_mean" for key in token_means})
        out.update({f"ratio_max{suffix}": "max" for suffix in SPLITS})
        return out

    def __call__(self, batch: LossBatch, normaliser: Normaliser = Normaliser(),
                 metrics_on_device: bool = False) -> tuple[torch.Tensor, dict]:
        """``(loss, metrics)`` of one micro-batch: the scalar loss to backpropagate, and the
        metrics over its valid tokens (``num_tokens`` weights them when averaging). With
        ``metrics_on_device`` the metrics are detached 0-dim tensors (float32, float64 for
        float64 inputs) where the loss lives, none read here (the caller reduces them and reads
        them once); off, they are read here into floats in one transfer."""
        logp, mask, penalties = batch.logp, batch.mask, self.penalties
        log_ratio = logp - batch.old_logp
        ratio = torch.exp(log_ratio)
        per_token, flags = self.surrogate(batch, ratio)
        if batch.token_weights is not None:
            per_token = per_token * batch.token_weights.detach().to(per_token.dtype)

        pg_loss = self.aggregate(per_token, mask, normaliser)
        loss = pg_loss
        kl_value = None
        if penalties.kl_coef != 0.0:
            if batch.ref_logp is None:
                raise ValueError("kl_coef != 0 needs ref_logp")
            kl_value = self.aggregate(kl_penalty(logp, batch.ref_logp, penalties.kl_estimator,
                                                 penalties.kl_clamp, batch.old_logp),
                                      mask, normaliser)
            loss = loss + penalties.kl_coef * kl_value
        if penalties.entropy_coef != 0.0:
            if batch.entropy is None:
                raise ValueError("entropy_coef != 0 needs entropy")
            loss = loss - penalties.entropy_coef * self.aggregate(
                batch.entropy, mask.to(batch.entropy.dtype), normaliser)
        metrics = self._metrics(batch, ratio, log_ratio, flags, pg_loss, kl_value,
                                metrics_on_device)
        return loss, metrics

    @torch.no_grad()
    def _metrics(self, batch: LossBatch, ratio, log_ratio, flags, pg_loss, kl_value,
                 on_device: bool) -> dict:
        logp, mask = batch.logp, batch.mask
        flags = {**flags, "ratio_mean": ratio, "approx_kl": -log_ratio}
        if batch.ref_logp is not None:
            for estimator in KL_ESTIMATORS:
                flags[f"kl_{estimator}"] = kl_penalty(logp.detach(), batch.ref_logp, estimator)
        metrics = {"pg_loss": pg_loss.detach()}
        if kl_value is not None:
            metrics["kl"] = kl_value.detach()
        groups = {"": mask}
        if batch.is_replay is not None:
            replay_rows = batch.is_replay.to(torch.bool).unsqueeze(-1).to(logp.dtype)
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
        if on_device:
            return dict(zip(keys, stacked.unbind()))
        return dict(zip(keys, stacked.tolist()))


def build_loss(name: str, penalties: Penalties = Penalties(), **options) -> PolicyLoss:
    """The registered loss ``name`` with its options (see each class)."""
    return LOSSES.choose(name)(penalties=penalties, **options)


def loss_from_config(algo, replay_clip_high: Optional[float] = None) -> PolicyLoss:
    """The loss ``algo.loss`` names, with its options and the KL and entropy terms of ``algo``
    (an ``AlgoConfig``)."""
    loss = LOSSES.choose(algo.loss)
    penalties = Penalties(algo.kl_coef, algo.kl_estimator, algo.kl_clamp, algo.entropy_coef)
    return loss.from_config(algo, penalties, replay_clip_high)


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
    """The default loss (DAPO's clip-higher with dual clip, :class:`surrogates.DapoClip`) of
    one micro-batch, as one call: tensors as in :class:`LossBatch`, aggregation as in
    :class:`Normaliser`, the KL and entropy terms as in :class:`Penalties`;
    ``replay_clip_high``: eps_high for replayed rows (needs ``is_replay``). Returns
    ``(loss, metrics)`` (see :meth:`PolicyLoss.__call__`)."""
    loss = build_loss("dapo", Penalties(kl_coef, kl_estimator, kl_clamp, entropy_coef),
                      clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                      replay_clip_high=replay_clip_high)
    batch = LossBatch(logp, old_logp, advantages, mask, is_replay, ref_logp, entropy,
                      token_weights)
    return loss(batch, Normaliser(loss_agg_mode, global_num_tokens, global_num_sequences),
                metrics_on_device)
