"""Group-relative advantages over mixed groups of fresh and replayed responses (paper eq. 5).

Every response of a group, fresh or replayed, counts: RLEP's G' = G + M responses share one
mean and one standard deviation (docs/ALGORITHM.md section 3, step 6).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch


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
