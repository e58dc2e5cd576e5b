"""Pure parts of weight sync and rollout: the bucket plan, request seeds, the parity probe's
arithmetic (no vLLM, no torch.distributed)."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlep_megatron.rollout.requests import request_seed, split_by_budget
from rlep_megatron.rollout.parity import logprob_abs_diff
from rlep_megatron.weight_sync.streamer import RuleEntry, TensorSpec, plan_buckets

pytestmark = pytest.mark.unit


def entry(index, numel, dtype="torch.float32"):
    return RuleEntry(index, dtype, (numel,), False, (TensorSpec(f"t{index}", (numel,)),))


def test_buckets_respect_size_dtype_and_order():
    stage0 = [entry(0, 10), entry(1, 10), entry(2, 10), entry(3, 100), entry(4, 5, "torch.bfloat16"),
              entry(5, 5, "torch.bfloat16")]
    stage1 = [entry(0, 3), entry(1, 3)]
    buckets = plan_buckets([stage0, stage1], bucket_bytes=80)
    layout = [(b.stage, b.dtype, [e.index for e in b.entries]) for b in buckets]
    assert layout == [
        (0, "torch.float32", [0, 1]),          # 80 bytes: full
        (0, "torch.float32", [2]),             # the next one would overflow with entry 3
        (0, "torch.float32", [3]),             # 400 bytes alone: larger than a bucket
        (0, "torch.bfloat16", [4, 5]),         # dtype change starts a bucket
        (1, "torch.float32", [0, 1]),          # stages never share a bucket
    ]
    assert sum(b.nbytes for b in buckets) == 4 * (10 + 10 + 10 + 100 + 3 + 3) + 2 * 10
    # every bucket fits unless it holds a single oversized entry
    assert all(b.nbytes <= 80 or len(b.entries) == 1 for b in buckets)


def test_bucket_bytes_must_be_positive():
    with pytest.raises(ValueError, match="bucket size"):
        plan_buckets([[entry(0, 1)]], 0)


def test_request_seeds_are_reproducible_and_leave_room_for_n_samples():
    n = 16
    seeds = [request_seed(7, i, n) for i in range(2000)]
    assert seeds == [request_seed(7, i, n) for i in range(2000)]
    assert seeds != [request_seed(8, i, n) for i in range(2000)]
    # vLLM seeds sample j of a request with seed + j (a 32-bit signed seed): the requests'
    # ranges are consecutive blocks of n, so none overlaps, for any seed
    for base in (0, 7, 2 ** 40 + 3):
        block = [request_seed(base, i, n) for i in range(2000)]
        assert [b - a for a, b in zip(block, block[1:])] == [n] * 1999
        assert 0 <= block[0] and block[-1] + n <= 2 ** 31
    with pytest.raises(ValueError, match="seed range"):
        request_seed(7, 2 ** 30 // n, n)


def test_logprob_abs_diff_matches_hand_computation():
    # two sequences: prompt lengths 2 and 3; the actor's column t is token t's log-prob
    actor = torch.tensor([[0.0, -9.0, -1.0, -2.0, -3.0],
                          [0.0, -9.0, -9.0, -0.5, -9.0]])
    engine = [[-1.1, -2.0, -2.5], [-0.25]]
    result = logprob_abs_diff(engine, actor, [2, 3])
    expected = [0.1, 0.0, 0.5, 0.25]
    assert result["tokens"] == 4
    assert math.isclose(result["mean"], sum(expected) / 4, rel_tol=1e-12)
    assert math.isclose(result["max"], 0.5, rel_tol=1e-12)


def test_logprob_abs_diff_rejects_misaligned_input():
    with pytest.raises(ValueError, match="do not fit"):
        logprob_abs_diff([[-1.0, -1.0, -1.0]], torch.zeros(1, 4), [2])
    with pytest.raises(ValueError, match="must agree"):
        logprob_abs_diff([[-1.0]], torch.zeros(2, 4), [2])


def test_wake_up_is_staged_weights_then_sync_then_kv_cache():
    """GPU sleep mode, with vLLM's LLM faked: waking brings the weights back for the sync, and
    the KV cache only when generation needs it (vLLM resumes scheduling once both are back)."""
    from rlep_megatron.rollout.colocated.engine import RolloutEngine
    from rlep_megatron.rollout.contract import IncompleteWeightsError

    calls = []

    class FakeLLM:
        def sleep(self, level):
            calls.append(("sleep", level))

        def wake_up(self, tags=None):
            calls.append(("wake_up", tags))

    engine = RolloutEngine.__new__(RolloutEngine)
    engine.llm, engine.sleep_enabled = FakeLLM(), True
    engine._asleep = engine._kv_cache_asleep = False
    engine._incomplete_reason = None
    with engine.released():
        assert engine.memory_state() == "asleep"
        with pytest.raises(IncompleteWeightsError, match="slept"):  # weights released
            engine.generate([[1, 2]])
    assert calls == [("sleep", 2), ("wake_up", ["weights"])]
    assert engine.memory_state() == "weights only"
    with pytest.raises(IncompleteWeightsError, match="slept"):  # a sync must come first
        engine.generate([[1, 2]])
    engine._incomplete_reason = None  # what a completed weight sync does
    engine._wake_kv_cache()  # the first step of generate
    assert calls[-1] == ("wake_up", ["kv_cache"]) and engine.memory_state() == "awake"
    engine._wake_kv_cache()
    assert len(calls) == 3


@given(st.lists(st.integers(min_value=0, max_value=500), max_size=40),
       st.integers(min_value=1, max_value=8))
def test_replica_shares_cover_the_prompts_in_order_balanced_by_budget(costs, parts):
    """Each replica samples a contiguous range of the prompts; the ranges cover every prompt
    once, in order, and no replica's budget exceeds an even share by more than one prompt's."""
    shares = split_by_budget(costs, parts)
    assert len(shares) == parts
    assert [i for share in shares for i in share] == list(range(len(costs)))
    biggest = max(costs, default=0)
    for share in shares:
        assert sum(costs[i] for i in share) <= sum(costs) / parts + biggest


def test_equal_prompts_split_evenly_and_a_lone_prompt_leaves_a_replica_empty():
    assert [len(s) for s in split_by_budget([5] * 7, 2)] in ([3, 4], [4, 3])
    assert [len(s) for s in split_by_budget([5] * 8, 4)] == [2, 2, 2, 2]
    assert sorted(len(s) for s in split_by_budget([9], 2)) == [0, 1]
    # one long prompt against three short ones: the long one is a share of its own
    assert [list(s) for s in split_by_budget([300, 100, 100, 100], 2)] == [[0], [1, 2, 3]]


def test_only_the_expected_reload_warnings_are_dropped(monkeypatch, caplog):
    """At every weight sync vLLM warns that the rotary embedding (and a tied LM head) received
    no weights: expected, dropped; another layer without weights is still reported (once per
    process, as every vLLM warning; an info line once per format), and
    RLEP_SHOW_ALL_WARNINGS=1 keeps everything."""
    from rlep_megatron.rollout.colocated import engine
    import logging

    from rlep_megatron.rollout.colocated.engine import _quiet_expected_reload_warnings

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(engine._WARN_ONCE, "seen", set())
    monkeypatch.delenv("RLEP_SHOW_ALL_WARNINGS", raising=False)

    def warned(tied, layer):
        _quiet_expected_reload_warnings(tied)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("%s: Failed to load weights", layer)
        return len(caplog.records) == 1

    assert not warned(True, "RotaryEmbedding") and not warned(True, "ParallelLMHead")
    assert warned(False, "ParallelLMHead")  # an untied head must receive its weights
    assert warned(True, "QKVParallelLinear")
    assert len(logger.filters) == 2  # one of each, not stacked per engine
    assert warned(True, "QKVParallelLinear") is False  # a repeated warning is printed once
    # an info line of every weight sync: its first time only, whatever its numbers
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=logger.name):
        for seconds in (0.16, 0.06, 0.06):
            logger.info("Reloading and processing weights took %.2f seconds", seconds)
        logger.info("another info line")
    assert [r.getMessage() for r in caplog.records] == [
        "Reloading and processing weights took 0.16 seconds", "another info line"]
    logger.filters.clear()
    monkeypatch.setenv("RLEP_SHOW_ALL_WARNINGS", "1")
    assert warned(True, "RotaryEmbedding")
