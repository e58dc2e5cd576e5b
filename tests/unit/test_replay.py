"""The experience pool: draws as docs/ALGORITHM.md section 3.4 defines them, tokenisation, the
writer's schema, atomicity and statistics."""
import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlep_megatron.data import PromptRows, read_prompt_file
from rlep_megatron.data.schema import prompt_key
from rlep_megatron.replay import (REPLAY, ExperiencePool, ReplaySampler, pool_rows, pool_stats,
                                  tokenize_replays, write_pool)
from rlep_megatron.reward import compute_score

pytestmark = pytest.mark.unit


def rows_with(candidates):
    rows = PromptRows()
    for i, cands in enumerate(candidates):
        rows.data_source.append("math_dapo")
        rows.messages.append([{"role": "user", "content": f"q{i}"}])
        rows.ground_truth.append(str(i))
        rows.candidates.append(cands)
        rows.index.append(str(i))
    return rows


def msg(i):
    return [{"role": "user", "content": f"q{i}"}]


def test_draw_rules():
    pool = ExperiencePool.from_rows(rows_with([
        ["a", "b", "c", "d", "e"],  # more than M: M distinct, uniformly
        ["x", "y"],                 # exactly M: all, in stored order
        ["only"],                   # fewer than M: all of them
        None,                       # no pool: no replays
        ["", "  ", "real"],         # empty texts are dropped, never an empty slot
    ]))
    sampler = ReplaySampler(pool, num_replays_per_prompt=2, seed=0)
    assert sampler.draw(msg(1)) == ["x", "y"]
    assert sampler.draw(msg(2)) == ["only"]
    assert sampler.draw(msg(3)) == []
    assert sampler.draw(msg(4)) == ["real"]
    assert sampler.draw([{"role": "user", "content": "unknown"}]) == []
    draws = [tuple(sampler.draw(msg(0))) for _ in range(3000)]
    assert all(len(set(d)) == 2 for d in draws)  # without replacement
    counts = Counter(text for d in draws for text in d)
    assert set(counts) == set("abcde")
    for text in "abcde":  # uniform: each text in 2/5 of draws
        assert counts[text] / 3000 == pytest.approx(0.4, abs=0.04)
    assert ReplaySampler(pool, 0, seed=0).draw(msg(0)) == []


def test_draws_are_reproducible_and_resumable():
    pool = ExperiencePool.from_rows(rows_with([list("abcdefgh")]))
    straight = ReplaySampler(pool, 3, seed=5)
    expected = [straight.draw(msg(0)) for _ in range(8)]
    first = ReplaySampler(pool, 3, seed=5)
    got = [first.draw(msg(0)) for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = ReplaySampler(pool, 3, seed=5)
    resumed.load_state_dict(state)
    got += [resumed.draw(msg(0)) for _ in range(4)]
    assert got == expected
    assert [ReplaySampler(pool, 3, seed=6).draw(msg(0)) for _ in range(8)] != expected


def test_replay_counts_summarise_every_answer_and_survive_a_resume():
    pool = ExperiencePool.from_rows(rows_with([list("abcd"), ["x", "y"], ["z"], list("pq")]))
    sampler = ReplaySampler(pool, 2, seed=3)
    expected = Counter()
    for _ in range(5):
        for i in (0, 1, 2):
            for index in sampler.draw_indices(msg(i)):
                sampler.record(msg(i), index)
                expected[(i, index)] += 1
    # counted independently: 9 answers in the pool, question 3 never drawn
    summary = sampler.replay_counts_summary()
    assert summary["times_replayed_mean"] == pytest.approx(sum(expected.values()) / 9)
    assert summary["times_replayed_max"] == max(expected.values()) == 5  # "z" every time
    assert summary["answers_replayed_frac"] == pytest.approx(len(expected) / 9)
    assert summary["answers_replayed_frac"] < 1
    resumed = ReplaySampler(pool, 2, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert resumed.replay_counts_summary() == summary
    resumed.record(msg(3), 1)
    assert resumed.replay_counts_summary()["answers_replayed_frac"] == pytest.approx(
        (len(expected) + 1) / 9)
    assert ReplaySampler(pool, 2, seed=3).replay_counts_summary() == {
        "times_replayed_mean": 0.0, "times_replayed_max": 0.0, "answers_replayed_frac": 0.0}


def test_tokenize_replays_appends_eos_and_truncates(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    eos = tokenizer.eos_token_id
    text = "2+3=5\nAnswer: 5"
    replay = tokenize_replays([text], tokenizer, max_response_tokens=100)[0]
    assert replay.token_ids == list(text.encode()) + [eos]
    assert replay.source == REPLAY and replay.text == text
    assert tokenizer.decode(replay.token_ids[:-1]) == text
    short = tokenize_replays([text], tokenizer, max_response_tokens=6)[0]
    assert short.token_ids == list(text.encode())[:6]
    # what is scored is what is trained: the kept tokens' text, which lost its Answer line
    assert short.text == text[:6]
    assert not compute_score("tiny_arith", short.text, "5")["acc"]
    assert compute_score("tiny_arith", replay.text, "5")["acc"]
    # exactly at the budget (text + EOS): nothing cut, the pool text is kept
    exact = tokenize_replays([text], tokenizer, max_response_tokens=len(text) + 1)[0]
    assert exact.text == text and exact.token_ids[-1] == eos


def test_min_correct_counts_correct_samples_not_distinct_texts():
    """docs/ALGORITHM.md section 1: a question needs at least 2 correct answers; two correct samples
    with the same text are two correct answers (one distinct text is stored)."""
    questions = rows_with([None, None, None])
    rows = pool_rows(questions, [["Answer: 0"], ["Answer: 1"], ["Answer: 2", "so\nAnswer: 2"]],
                     min_correct=2, correct_counts=[2, 1, 2])
    assert rows.ground_truth == ["0", "2"]
    assert rows.candidates == [["Answer: 0"], ["Answer: 2", "so\nAnswer: 2"]]


def test_writer_schema_round_trip_and_stats(tmp_path, tiny_qwen2_dir):
    from transformers import AutoTokenizer

    questions = rows_with([None, None, None])
    rows = pool_rows(questions, [["Answer: 0", "so\nAnswer: 0"], ["Answer: 1"], []],
                     min_correct=2)
    assert rows.ground_truth == ["0"]  # fewer than min_correct answers: dropped
    path = str(tmp_path / "pool.parquet")
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    stats = write_pool(rows, path, tokenizer=tokenizer)
    schema = pq.read_schema(path)
    assert schema.field("reward_model").type == pa.struct([
        ("ground_truth", pa.string()), ("style", pa.string()),
        ("candidates", pa.list_(pa.string()))])
    again = read_prompt_file(path)
    assert again.candidates == [["Answer: 0", "so\nAnswer: 0"]]
    assert ExperiencePool.from_rows(again).get(msg(0)) == ["Answer: 0", "so\nAnswer: 0"]
    assert stats == json.load(open(tmp_path / "pool.stats.json"))
    assert stats["questions"] == 1 and stats["answers"] == 2
    assert stats["answers_per_question_mean"] == 2.0
    assert stats["answer_tokens_mean"] == pytest.approx((9 + 12) / 2)
    assert sorted(os.listdir(tmp_path)) == ["pool.parquet", "pool.stats.json"]


def test_pool_that_matches_no_training_question_is_an_error():
    pool = ExperiencePool.from_rows(rows_with([["Answer: 1"]]))
    other = rows_with([None])
    other.messages[0] = [{"role": "user", "content": "a different question"}]
    with pytest.raises(ValueError, match="none of them is a question of the training files"):
        pool.check_matches(other, "pool.parquet")
    pool.check_matches(rows_with([None]), "pool.parquet")
    assert pool_stats(rows_with([["a"], ["b", "c"]]))["answers_per_question_max"] == 2


def test_collection_keeps_every_correct_sample_by_default():
    """The paper's pool: every correct sample of a question (a common answer as often as the
    model wrote it), its count including duplicates; one copy per text is an option."""
    from rlep_megatron.collect import correct_indices
    from rlep_megatron.config import CollectConfig

    texts = ["a", "b", "a", "c", "a", "c"]
    correct = [True, False, True, True, False, True]
    assert correct_indices(texts, correct, distinct=False) == [0, 2, 3, 5]
    assert correct_indices(texts, correct, distinct=True) == [0, 3]
    assert correct_indices(texts, [False] * 6, distinct=False) == []
    assert CollectConfig().distinct_texts is False


def test_pooled_rows_are_the_training_rows_with_a_pool():
    pool = ExperiencePool.from_rows(rows_with([None, ["1"], ["2", "2"], None]))
    rows = PromptRows(data_source=["s"] * 4, messages=[msg(2), msg(0), msg(1), msg(2)],
                      ground_truth=["2", "0", "1", "2"], candidates=[None] * 4,
                      index=["a", "b", "c", "d"])
    assert pool.pooled_rows(rows) == [0, 2, 3]
    from rlep_megatron.config import ReplayConfig

    assert ReplayConfig().pooled_questions_only is True  # the authors' training file


def test_online_pool_history_worked_by_hand():
    """Admission of verified answers only, the per-question cap (most recent K), ages, the
    offline answers kept first (mode both), and the state round trip."""
    from rlep_megatron.replay import OnlinePool

    key0, key1 = prompt_key(msg(0)), prompt_key(msg(1))
    pool = OnlinePool({key1: ["off"]}, answers_per_question=3)
    assert len(pool) == 1 and pool.get(msg(0)) == []
    # step 0: question 0 gets two correct of four (one empty text is never admitted)
    assert pool.admit(msg(0), ["a", "x", "b", " "], [True, False, True, True], step=0) == 2
    assert pool.get(msg(0)) == ["a", "b"] and pool.pass_rate[key0] == 0.75
    # step 2: two more; the cap keeps the 3 most recent (a leaves)
    assert pool.admit(msg(0), ["c", "d", "y"], [True, True, False], step=2) == 2
    assert pool.get(msg(0)) == ["b", "c", "d"] and pool.born[key0] == [0, 2, 2]
    assert [pool.age(msg(0), i, step=5) for i in range(3)] == [5, 3, 3]
    # a failed group: nothing admitted, its pass rate recorded
    assert pool.admit(msg(0), ["z"], [False], step=3) == 0 and pool.pass_rate[key0] == 0.0
    # a correct answer cut at the response budget counts as a pass but is not admitted
    assert pool.admit(msg(0), ["cut", "w"], [True, False], step=3, ended=[False, True]) == 0
    assert pool.pass_rate[key0] == 0.5 and pool.get(msg(0)) == ["b", "c", "d"]
    # mode both: the offline answers stay first and are not capped or aged
    assert pool.admit(msg(1), ["e", "f", "g", "h"], [True] * 4, step=4) == 4
    assert pool.get(msg(1)) == ["off", "f", "g", "h"]
    assert pool.age(msg(1), 0, step=9) is None and pool.age(msg(1), 1, step=9) == 5
    assert pool.num_online_answers() == 6
    # the state round trip, into a pool that has moved on
    state = json.loads(json.dumps(pool.state_dict()))
    other = OnlinePool({key1: ["off"]}, answers_per_question=3)
    other.admit(msg(2), ["q"], [True], step=0)
    other.load_state_dict(state)
    assert other.answers == pool.answers and other.born == pool.born
    assert other.pass_rate == pool.pass_rate
    with pytest.raises(ValueError, match="online_answers_per_question"):
        OnlinePool({}, answers_per_question=2).load_state_dict(state)


def test_online_replays_are_drawn_resumed_and_weighted_toward_failed_questions():
    from rlep_megatron.replay import OnlinePool

    pool = OnlinePool({}, answers_per_question=4)
    sampler = ReplaySampler(pool, 1, seed=3)
    assert sampler.draw_indices(msg(0)) == []  # an empty pool replays nothing
    pool.admit(msg(0), ["a", "b"], [True, True], step=0)
    pool.admit(msg(1), ["c", "x"], [True, False], step=0)
    sampler.record(msg(0), 0)  # online answers are not counted
    assert sampler.replay_counts_summary()["times_replayed_max"] == 0
    # the state (RNG and pool) restores the same draws
    state = sampler.state_dict()
    first = [sampler.draw_indices(msg(i % 2)) for i in range(20)]
    fresh_pool = OnlinePool({}, answers_per_question=4)
    again = ReplaySampler(fresh_pool, 1, seed=99)
    again.load_state_dict(state)
    assert fresh_pool.get(msg(0)) == ["a", "b"]
    assert [again.draw_indices(msg(i % 2)) for i in range(20)] == first
    # weighting: a group gets replays with probability 1 - pass rate
    got = [bool(sampler.draw_indices(msg(1), keep_prob=0.5)) for _ in range(2000)]
    assert 0.45 < sum(got) / len(got) < 0.55
    assert not any(sampler.draw_indices(msg(0), keep_prob=0.0) for _ in range(50))
    with pytest.raises(ValueError, match="without an online pool"):
        again.load_state_dict({"bit_generator": state["bit_generator"], "counts": {}})


def test_online_replay_settings_are_checked():
    from rlep_megatron.config import ReplayConfig

    with pytest.raises(ValueError, match="replays nothing"):
        ReplayConfig(mode="online")
    with pytest.raises(ValueError, match="use replay.mode=both"):
        ReplayConfig(num_replays_per_prompt=1, mode="online", pool_files=["p.parquet"])
    with pytest.raises(ValueError, match="needs replay.mode=online or both"):
        ReplayConfig(num_replays_per_prompt=1, online_low_pass_weight=True)
    ReplayConfig(num_replays_per_prompt=1, mode="both", pool_files=["p.parquet"])
