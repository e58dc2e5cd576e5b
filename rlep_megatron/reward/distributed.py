"""Reward scoring split over all ranks: each rank scores a contiguous share of the requests in
its own scorer pool; every rank gets every result back (in request order)."""
from __future__ import annotations

from typing import Sequence

import torch


def score_across_ranks(scorer, requests: Sequence) -> list[dict]:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return scorer.score(list(requests))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    n = len(requests)
    local = scorer.score(list(requests[rank * n // world:(rank + 1) * n // world]))
    gathered: list = [None] * world
    torch.distributed.all_gather_object(gathered, local)
    return [result for part in gathered for result in part]
