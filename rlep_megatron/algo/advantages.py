"""Group-relative advantages over mixed groups of fresh and replayed responses (paper eq. 5),
and the advantage estimators ``algo.advantage`` chooses (``grpo``, ``dr_grpo``, ``rloo``), each a
small class registered by name. Adding one: a subclass with ``@register_advantage("name")``
(``from_config`` for its options), the name in ``AlgoConfig.advantage``'s choices, a float64
test.

Every response of a group, fresh or replayed, counts: RLEP's G' = G + M responses share one
mean and one standard deviation (docs/ALGORITHM.md section 3, step 6).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from rlep_megatron.algo.registry import Registry


def group_advantages(rewards: torch.Tensor, group_ids: Union[torch.Tensor, Sequence[int]],
                     eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    """Per-response advantages ``(r - mean_g) / (std_g + eps)``.

    Args:
        rewards: ``[num_responses]`` scalar reward of each response.
        group_ids: ``[num_responses]`` group label of each response (any integers; groups may be
            ragged and interleaved).
        eps: added to the standard deviation.
        normalize_std: divide by the *unbiased* (N - 1) standard deviation of the group (GRPO,
            the reference); ``False`` gives the mean-only variant (Dr. GRPO).

    Returns:
        ``[num_responses]`` advantages, same dtype as ``rewards``. A group whose rewards are all
        equal, and a group of one, get 0.
    """
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids "
                         f"{tuple(group_ids.shape)} must be 1-D of the same length")
    if rewards.numel() == 0:
        return rewards.clone()
    values = rewards.to(torch.float64)
    _, group_index = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group_index.max()) + 1
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, group_index, torch.ones_like(values))
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, values)
    means = sums / counts
    centered = values - means[group_index]
    if normalize_std:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index,
                                                                     centered * centered)
        # Unbiased estimator; a group of one has no spread and gets advantage 0 below.
        std = torch.sqrt(sq / (counts - 1).clamp(min=1))
        advantages = centered / (std[group_index] + eps)
    else:
        advantages = centered
    advantages = torch.where(counts[group_index] > 1, advantages, torch.zeros_like(advantages))
    return advantages.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


# ------------------------------------------------------------------ estimators (algo.advantage)

ADVANTAGE_ESTIMATORS = Registry("algo.advantage")
register_advantage = ADVANTAGE_ESTIMATORS.register


class AdvantageEstimator:
    """The contract of an advantage estimator: ``[num_responses]`` rewards and group labels
    (fresh and replayed responses alike) in, one advantage per response out."""

    name = ""

    @classmethod
    def from_config(cls, algo) -> "AdvantageEstimator":
        """The estimator with its options read from an ``AlgoConfig``."""
        return cls()

    def __call__(self, rewards: torch.Tensor,
                 group_ids: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        raise NotImplementedError


@register_advantage("grpo")
class GroupNormalised(AdvantageEstimator):
    """GRPO (the paper's eq. 5): ``(r - mean_g) / (std_g + eps)`` over the G' responses of the
    group; ``normalize_std`` false: ``r - mean_g``."""

    def __init__(self, eps: float = 1e-6, normalize_std: bool = True):
        self.eps, self.normalize_std = eps, normalize_std

    @classmethod
    def from_config(cls, algo) -> "GroupNormalised":
        return cls(algo.advantage_eps, algo.advantage_normalize_std)

    def __call__(self, rewards, group_ids):
        return group_advantages(rewards, group_ids, eps=self.eps,
                                normalize_std=self.normalize_std)


@register_advantage("dr_grpo")
class GroupCentred(AdvantageEstimator):
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): ``r - mean_g``, no
    division by the group's std (whose small values inflate nearly-solved and nearly-failed
    questions). Pair it with ``algo.loss_agg_mode=constant_length``, Dr. GRPO's other half."""

    def __call__(self, rewards, group_ids):
        return group_advantages(rewards, group_ids, normalize_std=False)


@register_advantage("rloo")
class LeaveOneOut(AdvantageEstimator):
    """RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j`` over the group, the baseline of
    each response the mean of the others' rewards (``= n / (n - 1) x (r_i - mean_g)``); a group
    of one gets 0."""

    def __call__(self, rewards, group_ids):
        centred = group_advantages(rewards, group_ids, normalize_std=False)
        group_ids = torch.as_tensor(group_ids, device=centred.device)
        _, index, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
        size = counts[index].to(torch.float64)
        scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
        return (centred.to(torch.float64) * scale).to(centred.dtype)


def estimator_from_config(algo) -> AdvantageEstimator:
    """The estimator ``algo.advantage`` names (``algo``: an ``AlgoConfig``)."""
    return ADVANTAGE_ESTIMATORS.choose(algo.advantage).from_config(algo)
