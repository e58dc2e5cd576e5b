"""Token-balanced partitions and the packed micro-batch layout, checked against brute force
and direct constructions (the packed forward itself: tests/distributed/test_packing.py)."""
import itertools
import random

import pytest
import torch

from rlep_megatron.actor.packing import (balanced_partition, pack_by_token_budget,
                                         packed_micro_batch, unpack)


def _sums(lengths, groups):
    return [sum(lengths[r] for r in g) for g in groups]


@pytest.mark.parametrize("seed", range(20))
def test_balanced_partition_covers_every_row_once_and_is_near_optimal(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 9))]
    parts = rng.randint(1, 3)
    groups = balanced_partition(lengths, parts)
    assert len(groups) == parts
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    assert all(g == sorted(g) for g in groups)
    assert groups == balanced_partition(lengths, parts)  # deterministic
    # brute force over every assignment: longest-first greedy is within 4/3 of the best
    # makespan (Graham's bound for LPT)
    best = min(max(_sums(lengths, [[r for r in range(len(lengths)) if a[r] == p]
                                   for p in range(parts)]))
               for a in itertools.product(range(parts), repeat=len(lengths)))
    assert max(_sums(lengths, groups)) <= 4 / 3 * best + 1e-9


def test_balanced_partition_beats_contiguous_slices_on_sorted_lengths():
    lengths = [100, 90, 80, 70, 10, 8, 6, 4]  # long sequences first, as a group's may be
    contiguous = [[0, 1, 2, 3], [4, 5, 6, 7]]
    balanced = balanced_partition(lengths, 2)
    assert max(_sums(lengths, contiguous)) == 340
    assert max(_sums(lengths, balanced)) == 184  # the optimum: 184 / 184


@pytest.mark.parametrize("seed", range(20))
def test_packs_respect_the_budget(seed):
    rng = random.Random(100 + seed)
    lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
    budget = rng.randint(20, 120)
    multiple = rng.choice([1, 2]) if len(lengths) >= 2 else 1
    groups = pack_by_token_budget(lengths, budget, multiple_of=multiple)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    rows_fill_a_multiple = len(lengths) // multiple * multiple
    for group in groups:
        assert (len(group) == 1 or sum(lengths[r] for r in group) <= budget
                or len(groups) == rows_fill_a_multiple)  # no more packs could be made
    if len(lengths) >= multiple:
        assert len(groups) % multiple == 0  # always, even where packs must exceed the budget
    # balanced: with every row within the budget, no pack is far below the mean pack size
    # (the greedy's count is the first that fits, so the packs are not spread thin)
    if max(lengths) <= budget and len(groups) > 1:
        assert min(_sums(lengths, groups)) >= sum(lengths) / len(groups) - max(lengths)


def test_a_row_over_the_budget_goes_alone():
    groups = pack_by_token_budget([5, 200, 7, 6], 20)
    assert [1] in groups
    assert sorted(r for g in groups for r in g) == [0, 1, 2, 3]


def test_packed_layout_and_unpack_against_a_direct_construction():
    ids = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0], [6, 7, 8, 9, 10]])
    lengths = torch.tensor([3, 2, 5])
    batch = packed_micro_batch(ids, lengths, [2, 0], pad_to=11, pad_id=0)
    assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 10, 1, 2, 3, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 11]
    assert int(batch["max_seqlen"]) == 5
    # per-position values: position j holds j; column c of each row maps to start + c,
    # column 0 and columns past the row's length are 0
    values = torch.arange(11, dtype=torch.float32).unsqueeze(0)
    assert unpack(values, batch).tolist() == [[0, 1, 2, 3, 4], [0, 6, 7, 0, 0]]


def test_the_interleaved_schedule_always_gets_a_multiple_of_the_pipeline_size():
    # three 10-token rows, budget 15: three packs would fit, the schedule needs an even count
    groups = pack_by_token_budget([10, 10, 10], 15, multiple_of=2)
    assert len(groups) == 2 and sorted(r for g in groups for r in g) == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot fill the 2 micro-batches"):
        pack_by_token_budget([10], 15, multiple_of=2)
