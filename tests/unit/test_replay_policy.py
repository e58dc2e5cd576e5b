"""Replay policies (``replay.policy``, rlep_megatron/replay/policy.py), re-derived by hand: which
groups of a hand-built batch get replays under each policy (the draws re-made from the replay
sampler's own seed), the group statistics over fresh and replayed responses in float64, the
pass-rate tracker's moving average, and ``rescue`` under dynamic sampling (G', the rounds and
the groups kept) where the plain sampler runs out of rounds."""
import contextlib

import numpy as np
import pytest

from rlep_megatron.config import load_config
from rlep_megatron.data import PromptRows
from rlep_megatron.data.batch import FRESH, REPLAY
from rlep_megatron.data.schema import prompt_key
from rlep_megatron.replay.policy import (PassRateTracker, ReplayRecord, make_replay_policy,
                                         pass_rate_bin)
from rlep_megatron.replay.pool import ExperiencePool, ReplaySampler
from rlep_megatron.reward import compute_score
from rlep_megatron.rollout.response import Response
from rlep_megatron.rollout.side import RolloutSide

pytestmark = pytest.mark.unit

EOS = 258
SEED = 3


class CharTokenizer:
    eos_token_id = EOS

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 200 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if i != EOS)


class InProcessScorer:
    def score(self, requests):
        return [compute_score(r.data_source, r.solution_str, r.ground_truth) for r in requests]


class Timer:
    def phase(self, name):
        return contextlib.nullcontext()


def questions(n):
    return [[{"role": "user", "content": f"what is {i} + {i}?"}] for i in range(n)]


def training_rows(messages):
    rows = PromptRows()
    for i, m in enumerate(messages):
        rows.data_source.append("math_dapo")
        rows.messages.append(m)
        rows.ground_truth.append(str(2 * i))
        rows.candidates.append(None)
        rows.index.append(str(i))
    return rows


class Scheduler:
    """Hands out fixed generation rounds: per round, the rows and each row's answers."""

    def __init__(self, rounds):
        self.rounds = rounds

    def next_round(self, side, step, round_index):
        rows, answers = self.rounds[round_index]
        groups = [[Response(i, [1, 2, EOS], [-0.5] * 3, text, "stop")
                   for text in texts] for i, texts in enumerate(answers)]
        return rows, groups


def make_side(policy, pools, rounds, overrides=(), M=2):
    """A rollout side with the real replay, reward and dynamic-sampling code, over fixed
    generation rounds, in-process scoring and a character tokenizer."""
    messages = questions(8)
    cfg = load_config(None, [f"replay.num_replays_per_prompt={M}", f"replay.policy={policy}",
                             f"trainer.seed={SEED}", "rollout.max_response_tokens=64",
                             "reward.overlong_penalty_factor=0",
                             *overrides])
    pool = ExperiencePool({prompt_key(messages[q]): list(texts) for q, texts in pools.items()})
    side = RolloutSide.__new__(RolloutSide)
    side.cfg, side.scheduler = cfg, Scheduler(rounds)
    side.tokenizer, side.eos_token_id = CharTokenizer(), EOS
    side.train_rows, side.pool = training_rows(messages), pool
    side.replay_sampler = ReplaySampler(pool, M, SEED)
    side.online_pool = None
    side.scorer = InProcessScorer()
    side.replay_policy = make_replay_policy(policy)
    side.pass_rates = PassRateTracker(cfg.replay.pass_rate_ema)
    side.record = ReplayRecord(side.pass_rates)
    side._candidates = []
    side.admitted = 0
    side.likelihood, side._scored = None, ([], [])
    side.prompt_ids = lambda rows, row: [5, row]
    side._make_batch = (side._dynamic_batch if cfg.algo.dynamic_sampling
                        else side._plain_batch)
    side.add_replays = side._replays
    return side, messages


def right(q):
    return f"so the answer is Answer: {2 * q}"


def wrong(q):
    return f"so the answer is Answer: {2 * q + 1}"


# rows 0-3, G = 3 each: row 0 all wrong, row 1 one right, row 2 all right, row 3 all wrong;
# rows 0-2 have two pool answers each (M = 2: all of them, no random choice), row 3 none
ROUND = ([0, 1, 2, 3], [[wrong(0)] * 3, [right(1), wrong(1), wrong(1)], [right(2)] * 3,
                        [wrong(3)] * 3])
POOLS = {q: ["(a) " + right(q), "(b) " + right(q)] for q in range(3)}


def replayed_groups(batch):
    return sorted({s.group for s in batch.sequences if s.source == REPLAY})


def test_uniform_replays_every_group_with_a_pool():
    side, _ = make_side("uniform", POOLS, [ROUND])
    batch = side.next_batch(0, Timer())
    assert replayed_groups(batch) == [0, 1, 2]
    assert [len([s for s in batch.sequences if s.group == g]) for g in range(4)] == [5, 5, 5, 3]
    assert all(s.acc for s in batch.sequences if s.source == REPLAY)


def test_uniform_draws_as_the_replay_sampler_alone_did():
    """The default policy takes the replay sampler's draws group by group, as before policies
    existed: with more pool answers than M (a random choice per group), and with the online
    modes' own weighting (one uniform number per group with a pool, also at pass rate 1, when
    it keeps nothing), re-made here from a sampler of the same seed."""
    from rlep_megatron.replay import OnlinePool

    pools = {q: [f"({c}) " + right(q) for c in "abcde"] for q in range(3)}
    side, messages = make_side("uniform", pools, [ROUND])
    reference = ReplaySampler(ExperiencePool({prompt_key(messages[q]): list(t)
                                              for q, t in pools.items()}), 2, SEED)
    for step in range(3):
        batch = side.next_batch(step, Timer())
        drawn = [[s.pool_index for s in batch.sequences if s.group == g and s.source == REPLAY]
                 for g in range(4)]
        assert drawn == [reference.draw_indices(messages[r]) for r in ROUND[0]], step
        assert all(len(d) == 2 for d in drawn[:3])
    # replay.mode=online with replay.online_low_pass_weight: keep 1 - the online pass rate
    side, messages = make_side("uniform", {}, [ROUND], ["replay.mode=online",
                                                        "replay.online_low_pass_weight=true"])
    online = OnlinePool({prompt_key(messages[q]): list(t) for q, t in pools.items()}, 5)
    side.pool = side.online_pool = side.replay_sampler.pool = online
    for q, rate in ((0, 0.0), (1, 0.5), (2, 1.0)):
        online.pass_rate[prompt_key(messages[q])] = rate
    rng = np.random.default_rng([SEED, 0x5E1A7])
    for step in range(4):
        side._candidates = []
        batch = side._plain_batch(Timer(), step)
        drawn = [[s.pool_index for s in batch.sequences if s.group == g and s.source == REPLAY]
                 for g in range(3)]
        expected = []
        for keep in (1.0, 0.5, 0.0):
            if keep < 1.0 and rng.random() >= keep:
                expected.append([])
            else:
                expected.append([int(i) for i in rng.choice(5, size=2, replace=False)])
        assert drawn == expected, step


def test_rescue_replays_only_into_groups_whose_fresh_answers_all_failed():
    side, _ = make_side("rescue", POOLS, [ROUND])
    batch = side.next_batch(0, Timer())
    assert replayed_groups(batch) == [0]  # row 3 failed too, but has no pool
    m = side.metrics(batch, 0)
    assert m["replay/rescued_groups"] == 1.0
    assert m["replay/num_sequences"] == 2.0
    # every group with a pool was unseen: 1 of 3 got replays
    assert m["replay/groups_by_pass_rate/unseen"] == 3.0
    assert m["replay/share_by_pass_rate/unseen"] == pytest.approx(1 / 3)
    # the replays were scored (after the fresh answers the policy read)
    assert [s.reward for s in batch.sequences if s.source == REPLAY] == [1.0, 1.0]


def test_low_pass_replays_with_one_minus_the_tracked_pass_rate():
    """Step 0: every question unseen, every group with a pool gets its replays (no random
    number drawn). The tracker then holds the step's pass rates (0, 1/3, 1, 0). Step 1, the
    same round: row 0 (p = 0) always, row 2 (p = 1) never (no random number), row 1 when the
    sampler's next uniform number is below 1 - 1/3, re-drawn here from its seed, step by
    step."""
    side, messages = make_side("low_pass", POOLS, [ROUND], ["replay.pass_rate_ema=1.0"])
    batch = side.next_batch(0, Timer())
    assert replayed_groups(batch) == [0, 1, 2]
    rates = side.pass_rates.rates
    assert [rates[prompt_key(messages[q])] for q in range(4)] == pytest.approx([0, 1 / 3, 1, 0])
    rng = np.random.default_rng([SEED, 0x5E1A7])  # the replay sampler's stream
    outcomes = []
    for step in range(1, 9):
        batch = side.next_batch(step, Timer())
        expected = [0, 1] if rng.random() < 1 - 1 / 3 else [0]
        assert replayed_groups(batch) == expected, step
        outcomes.append(expected)
    assert [0] in outcomes and [0, 1] in outcomes  # both branches were taken
    m = side.metrics(batch, 5)
    assert m["replay/groups_by_pass_rate/lt25"] == 1.0  # row 0
    assert m["replay/share_by_pass_rate/lt25"] == 1.0
    assert m["replay/groups_by_pass_rate/ge75"] == 1.0  # row 2
    assert m["replay/share_by_pass_rate/ge75"] == 0.0
    assert m["replay/pass_rate_hist/lt25"] == 0.5  # rows 0 and 3 of the 4 tracked
    assert m["replay/pass_rate_questions"] == 4.0


def test_the_pass_rate_tracker_is_a_moving_average_of_fresh_accuracy():
    tracker = PassRateTracker(0.25)
    tracker.update([("a", [True, False, False, False]), ("b", [False, False])])
    assert tracker.rates == {"a": 0.25, "b": 0.0}
    # a question in two groups of one step counts once, over all of its answers
    tracker.update([("a", [True, True]), ("a", [True, True]), ("c", [])])
    assert tracker.rates["a"] == pytest.approx(0.75 * 0.25 + 0.25 * 1.0)
    assert "c" not in tracker.rates
    assert tracker.histogram() == {"lt25": 0.5, "25to50": 0.5, "50to75": 0.0, "ge75": 0.0}
    restored = PassRateTracker(0.25)
    restored.load_state_dict(tracker.state_dict())
    assert restored.rates == tracker.rates
    with pytest.raises(ValueError, match="pass_rate_ema=0.25, this run has 0.5"):
        PassRateTracker(0.5).load_state_dict(tracker.state_dict())
    assert [pass_rate_bin(r) for r in (None, 0.0, 0.2499, 0.25, 0.5, 0.74, 0.75, 1.0)] == [
        "unseen", "lt25", "lt25", "25to50", "50to75", "50to75", "ge75", "ge75"]


def test_group_statistics_include_the_rescued_replays():
    """A rescued group: G = 3 fresh answers scored -1, M = 2 replays scored +1. Mean and
    standard deviation (n - 1 in the denominator, as GRPO's reference code) over all 5, in
    float64."""
    from rlep_megatron.actor.learner import LearningSide

    side, _ = make_side("rescue", POOLS, [ROUND])
    batch = side.next_batch(0, Timer())
    learner = LearningSide.__new__(LearningSide)
    learner.cfg = side.cfg
    learner.advantage(batch)
    group = [s for s in batch.sequences if s.group == 0]
    rewards = np.array([s.reward for s in group], dtype=np.float64)
    assert rewards.tolist() == [-1, -1, -1, 1, 1]
    expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + side.cfg.algo.advantage_eps)
    assert [s.advantage for s in group] == pytest.approx(expected.tolist(), rel=1e-12)
    assert all(s.advantage > 0 for s in group if s.source == REPLAY)
    # the groups without replays keep their own statistics: all right or all wrong, 0
    assert all(s.advantage == 0 for s in batch.sequences if s.group in (2, 3))


# dynamic sampling, 3 groups wanted: round 0 has an all-wrong row with a pool (0) and an
# all-right one (2); round 1 an all-wrong row without a pool (3), an all-wrong row with one
# (1) and a mixed row with one (2); round 2 all-right rows only
DYNAMIC_ROUNDS = [([0, 2], [[wrong(0)] * 3, [right(2)] * 3]),
                  ([3, 1, 2], [[wrong(3)] * 3, [wrong(1)] * 3, [right(2), wrong(2), wrong(2)]]),
                  ([2, 2], [[right(2)] * 3, [right(2)] * 3])]
DYNAMIC = ["algo.dynamic_sampling=true", "data.train_batch_size=3",
           "algo.max_generation_rounds=3"]


def test_rescue_keeps_all_failed_groups_under_dynamic_sampling_where_plain_runs_out():
    # without replays (M = 0) only the mixed group has signal: out of rounds
    side, _ = make_side("uniform", {}, DYNAMIC_ROUNDS, DYNAMIC, M=0)
    side.replay_sampler = side.pass_rates = None
    side.add_replays = lambda batch, step: None
    with pytest.raises(RuntimeError, match="kept 1 of 3 groups in 3 rounds"):
        side.next_batch(0, Timer())
    side, _ = make_side("rescue", POOLS, DYNAMIC_ROUNDS, DYNAMIC)
    batch = side.next_batch(0, Timer())
    assert batch.generation_rounds == 2
    # the two rescued rows and the mixed one; row 2 all right and row 3 (no pool) go
    assert batch.rows == [0, 1, 2]
    # G' = G + M = 5 in each rescued group, its M replays last; G = 3 in the mixed group,
    # which rescue leaves alone (uniform would have replayed into it)
    assert [[s.source for s in batch.sequences if s.group == g] for g in (0, 1, 2)] == [
        [FRESH] * 3 + [REPLAY] * 2, [FRESH] * 3 + [REPLAY] * 2, [FRESH] * 3]
    assert [s.group for s in batch.sequences] == [0] * 5 + [1] * 5 + [2] * 3
    m = side.metrics(batch, 0)
    assert m["replay/rescued_groups"] == 2.0 and m["rollout/num_groups"] == 3.0
    assert m["replay/fraction"] == pytest.approx(4 / 10)  # of the groups with replays
    # the tracker saw every round's groups, the dropped ones too
    assert len(side.pass_rates.rates) == 4
    # uniform replays into every group with a pool: the all-right groups (replays right too)
    # are dropped, the rescued and the mixed ones kept with their replays
    side, _ = make_side("uniform", POOLS, DYNAMIC_ROUNDS, DYNAMIC)
    batch = side.next_batch(0, Timer())
    assert batch.rows == [0, 1, 2]
    assert [len([s for s in batch.sequences if s.group == g]) for g in (0, 1, 2)] == [5, 5, 5]


def fake_likelihood(calls):
    """A stand-in for the actor: per (prompt, response), in float64, the sum over the
    response's tokens of -(token id mod 7) / 10 and their count; the calls are kept."""
    def likelihood(prompts, responses):
        calls.append((list(prompts), [list(r) for r in responses]))
        return [(float(sum(-(t % 7) / 10 for t in r)), len(r)) for r in responses]
    return likelihood


def test_unlikely_replays_the_candidates_the_policy_finds_least_likely():
    """``unlikely``: per group with a pool, ``replay.unlikely_candidates`` = 3 of its 5 answers
    drawn from the replay sampler's stream (re-made here from its seed), all scored in one call,
    and the M = 2 of lowest mean log-prob per token replayed, re-derived in float64 from the
    answers' tokens (EOS appended); the group without a pool draws and scores nothing. The
    metrics are per token over the scored and the chosen candidates."""
    pools = {q: [f"({c}) " + right(q) + " " + "xyz!?"[:i] for i, c in enumerate("abcde")]
             for q in range(3)}
    side, messages = make_side("unlikely", pools, [ROUND], ["replay.unlikely_candidates=3"])
    calls = []
    side.likelihood = fake_likelihood(calls)
    rng = np.random.default_rng([SEED, 0x5E1A7])
    for step in range(3):
        calls.clear()
        batch = side.next_batch(step, Timer())
        assert len(calls) == 1  # one forward pass per generation round
        prompts, responses = calls[0]
        assert prompts == [[5, row] for row in ROUND[0][:3] for _ in range(3)]
        scored, chosen, expected, scored_tokens = [], [], [], []
        for q in range(3):
            indices = [int(i) for i in rng.choice(5, size=3, replace=False)]
            tokens = [[ord(c) % 200 for c in pools[q][i]] + [EOS] for i in indices]
            scored_tokens += tokens
            sums = [np.sum(-(np.asarray(t, dtype=np.float64) % 7) / 10) for t in tokens]
            means = [total / len(t) for total, t in zip(sums, tokens)]
            order = np.argsort(means, kind="stable")[:2]
            expected.append([indices[j] for j in order])
            scored += list(zip(sums, map(len, tokens)))
            chosen += [scored[-3 + j] for j in order]
        assert responses == scored_tokens
        drawn = [[s.pool_index for s in batch.sequences if s.group == g and s.source == REPLAY]
                 for g in range(4)]
        assert drawn == expected + [[]], step
        m = side.metrics(batch, step)
        for name, items in (("candidate", scored), ("chosen", chosen)):
            assert m[f"replay/{name}_logprob_mean"] == pytest.approx(
                sum(t for t, _ in items) / sum(n for _, n in items), rel=1e-12)
        assert m["replay/chosen_logprob_mean"] < m["replay/candidate_logprob_mean"]
    # unlikely_candidates=0, or at least the pool's size, scores every answer, in stored
    # order, drawing nothing
    for k in (0, 5, 8):
        side, _ = make_side("unlikely", pools, [ROUND], [f"replay.unlikely_candidates={k}"])
        side.likelihood = fake_likelihood(calls := [])
        state = side.replay_sampler._rng.bit_generator.state
        side.next_batch(0, Timer())
        assert calls[0][1] == [[ord(c) % 200 for c in text] + [EOS]
                               for q in range(3) for text in pools[q]], k
        assert side.replay_sampler._rng.bit_generator.state == state
    # without a likelihood function (the trainer gives it) a clear error
    side, _ = make_side("unlikely", pools, [ROUND])
    with pytest.raises(RuntimeError, match="no likelihood function"):
        side.next_batch(0, Timer())


def test_policy_settings_are_checked():
    with pytest.raises(ValueError, match="replay.policy: 'often' is not one of"):
        load_config(None, ["replay.num_replays_per_prompt=2", "replay.policy=often"])
    with pytest.raises(ValueError, match="replay.pass_rate_ema must be in"):
        load_config(None, ["replay.num_replays_per_prompt=2", "replay.pass_rate_ema=0"])
    with pytest.raises(ValueError, match="replay.policy=rescue .* replays nothing"):
        load_config(None, ["replay.policy=rescue"])
    with pytest.raises(ValueError, match="cannot combine with replay.policy=low_pass"):
        load_config(None, ["replay.num_replays_per_prompt=2", "replay.mode=online",
                           "replay.online_low_pass_weight=true", "replay.policy=low_pass"])
    with pytest.raises(ValueError, match="replay.policy must be one of"):
        make_replay_policy("often")
    with pytest.raises(ValueError, match="unlikely_candidates=1 leaves fewer candidates than "
                                         "the M=2"):
        load_config(None, ["replay.num_replays_per_prompt=2", "replay.policy=unlikely",
                           "replay.unlikely_candidates=1"])
    with pytest.raises(ValueError, match="unlikely_candidates must be >= 0"):
        load_config(None, ["replay.unlikely_candidates=-1"])
