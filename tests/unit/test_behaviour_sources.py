"""Where each token's behaviour log-prob comes from, and what the loss does with it:

* a fresh response carried over a weight update (one-step-off rollout) is weighed, token by
  token, against the log-prob the engine recorded under the version its span names;
* a replayed answer is weighed against the pool's behaviour log-probs by ``replay.correction``
  (``none``: the paper's weight 1);

each checked against a float64 re-derivation of the clipped loss (docs/ALGORITHM.md section 4)
with the rollout correction's weights; and the pool's optional behaviour columns round-trip,
while a pool in the public schema without them still loads (weight 1)."""
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlep_megatron.actor.old_logprob import train_batch
from rlep_megatron.algo import policy_loss
from rlep_megatron.config import load_config
from rlep_megatron.data import PromptRows
from rlep_megatron.data.batch import FRESH, REPLAY, Sample
from rlep_megatron.data.schema import read_prompt_file, rows_to_table
from rlep_megatron.replay.pool import ExperiencePool, OnlinePool
from rlep_megatron.replay.writer import pool_rows, write_pool

pytestmark = pytest.mark.unit

THRESHOLD = 1.5
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 10.0


def two_rows():
    """A fresh response of 5 tokens (2 sampled by version 3, 3 by version 4) and a replayed
    answer of 4 tokens, after 2-token prompts, with their recorded behaviour log-probs, the
    actor's old log-probs (version 4) and advantages of both signs."""
    fresh = Sample(0, [5, 6, 7, 8, 9], "x", FRESH,
                   engine_logprobs=[-1.0, -2.5, -0.7, -0.2, -1.9], versions=[(3, 2), (4, 3)])
    fresh.advantage = 0.8
    replay = Sample(0, [5, 6, 7, 8], "y", REPLAY, engine_logprobs=[-3.0, -0.4, -1.2, -0.9])
    replay.advantage = -0.6
    ids = torch.tensor([[1, 2, 5, 6, 7, 8, 9], [1, 2, 5, 6, 7, 8, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0]], dtype=torch.float32)
    old = torch.tensor([[0, 0, -1.6, -0.9, -0.7, -0.25, -1.0],
                        [0, 0, -1.5, -0.45, -3.1, -0.8, 0]], dtype=torch.float32)
    return [fresh, replay], (ids, mask, old, None, None)


def reference_loss(seqs, old, new, mask, fresh_mode: str, replay_mode: str) -> float:
    """float64: per token w x the clipped loss (dual clip for A < 0), over the kept tokens."""
    total, count = 0.0, 0
    for row, seq in enumerate(seqs):
        mode = fresh_mode if seq.source == FRESH else replay_mode
        for t, behaviour in enumerate(seq.engine_logprobs):
            column = 2 + t
            old_t, new_t = float(old[row, column]), float(new[row, column])
            rho = math.exp(old_t - behaviour)
            if mode == "truncate":
                weight = min(rho, THRESHOLD)
            elif mode == "mask":
                if not 1 / THRESHOLD <= rho <= THRESHOLD:
                    continue  # out of the loss and of its normaliser
                weight = rho
            else:
                weight = 1.0
            advantage = seq.advantage
            ratio = math.exp(new_t - old_t)
            loss = max(-advantage * ratio,
                       -advantage * min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH))
            if advantage < 0:
                loss = min(loss, -advantage * CLIP_C)
            total += weight * loss
            count += 1
    assert int(mask[:, 2:].sum()) == 9
    return total / count


@pytest.mark.parametrize("replay_mode", ["none", "truncate", "mask"])
@pytest.mark.parametrize("fresh_mode", ["off", "truncate", "mask"])
def test_each_token_is_weighed_against_the_policy_that_sampled_it(fresh_mode, replay_mode):
    algo = load_config(None, [f"algo.rollout_correction={fresh_mode}",
                              f"algo.rollout_correction_threshold={THRESHOLD}"]).algo
    seqs, tensors = two_rows()
    batch, sums, _ = train_batch(algo, seqs, False, tensors, [2, 2], version=4,
                                 replay_correction=replay_mode)
    new = batch.old_logp + torch.tensor([[0, 0, 0.3, -0.1, 0.5, 0.05, -0.4],
                                         [0, 0, -0.2, 0.4, 0.1, -0.6, 0]])
    mask = batch.trained_mask()
    loss, _ = policy_loss(new.double(), batch.old_logp.double(), batch.advantages.double(),
                          mask.double(), CLIP_LOW, CLIP_HIGH, CLIP_C,
                          token_weights=(batch.token_weights.double()
                                         if batch.token_weights is not None else None))
    reference = reference_loss(seqs, batch.old_logp, new, batch.response_mask,
                               "none" if fresh_mode == "off" else fresh_mode, replay_mode)
    assert float(loss) == pytest.approx(reference, rel=1e-6)
    # the version clock's split of the engine/actor gap: 2 tokens of version 3, 3 of 4
    assert sums["parity_carried_tokens"] == 2 and sums["parity_current_tokens"] == 3
    assert sums["parity_carried"] == pytest.approx(abs(-1.6 + 1.0) + abs(-0.9 + 2.5), rel=1e-6)
    assert sums["parity_replay_tokens"] == 4


def test_the_mutated_weighting_is_caught():
    """A control: weighing the carried-over tokens against the newest span's log-prob (one
    log-prob per response, as a trainer that ignores the spans might) moves the loss."""
    algo = load_config(None, ["algo.rollout_correction=truncate",
                              f"algo.rollout_correction_threshold={THRESHOLD}"]).algo
    seqs, tensors = two_rows()
    batch, _, _ = train_batch(algo, seqs, False, tensors, [2, 2], version=4)
    wrong = [Sample(0, seqs[0].token_ids, "x", FRESH, engine_logprobs=[-0.7] * 5,
                    versions=[(4, 5)]), seqs[1]]
    wrong[0].advantage = seqs[0].advantage
    mutated, _, _ = train_batch(algo, wrong, False, tensors, [2, 2], version=4)
    assert not torch.equal(batch.token_weights, mutated.token_weights)


def pool_with_behaviour() -> PromptRows:
    rows = PromptRows()
    for i in range(2):
        rows.data_source.append("math_dapo")
        rows.messages.append([{"role": "user", "content": f"q{i}"}])
        rows.ground_truth.append(str(i))
        rows.candidates.append(None)
        rows.index.append(str(i))
    candidates = [["Answer: 0", "So Answer: 0"], ["Answer: 1"]]
    behaviour = [[{"token_ids": [65, 66, 1], "logprobs": [-0.5, -1.25, -0.125], "version": 40},
                  None],
                 [{"token_ids": [67], "logprobs": [-2.0], "version": 40}]]
    return pool_rows(rows, candidates, behaviour=behaviour)


def test_the_behaviour_columns_round_trip(tmp_path):
    path = str(tmp_path / "pool.parquet")
    write_pool(pool_with_behaviour(), path)
    rows = read_prompt_file(path, behaviour=True)
    assert rows.candidates == [["Answer: 0", "So Answer: 0"], ["Answer: 1"]]
    as_lists = [[e and {k: v.tolist() if hasattr(v, "tolist") else v for k, v in e.items()}
                 for e in entries] for entries in rows.behaviour]
    assert as_lists == pool_with_behaviour().behaviour
    # read only when asked (replay.correction): the texts alone otherwise
    assert read_prompt_file(path).behaviour == [None, None]
    pool = ExperiencePool.from_rows(rows)
    assert pool.behaviour_of([{"role": "user", "content": "q0"}], 0)["version"] == 40
    assert pool.behaviour_of([{"role": "user", "content": "q0"}], 1) is None
    # the public RLEP schema, as released: no behaviour columns; loads, every answer weight 1
    plain = rows_to_table(read_prompt_file(path))
    reward = plain.column("reward_model").combine_chunks()
    public = pa.StructArray.from_arrays(
        [reward.field("ground_truth"), reward.field("style"), reward.field("candidates")],
        names=["ground_truth", "style", "candidates"])
    pq.write_table(plain.set_column(plain.schema.get_field_index("reward_model"),
                                    "reward_model", public), tmp_path / "public.parquet")
    old = read_prompt_file(str(tmp_path / "public.parquet"), behaviour=True)
    assert old.candidates == rows.candidates and old.behaviour == [None, None]
    assert ExperiencePool.from_rows(old).behaviour == {}


def test_a_malformed_behaviour_column_is_refused(tmp_path):
    table = rows_to_table(pool_with_behaviour())
    reward = table.column("reward_model").combine_chunks()
    fields = {name: reward.field(name) for name in ("ground_truth", "style", "candidates")}
    fields["candidate_logprobs"] = pa.array([["x", "y"], ["z"]], pa.list_(pa.string()))
    bad = pa.StructArray.from_arrays(list(fields.values()), names=list(fields))
    path = tmp_path / "bad.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("reward_model"),
                                    "reward_model", bad), path)
    with pytest.raises(ValueError, match="candidate_logprobs.*expected"):
        read_prompt_file(str(path))  # the schema is checked whether or not they are read


def test_online_answers_keep_their_behaviour_through_a_checkpoint():
    key = [{"role": "user", "content": "q"}]
    pool = OnlinePool({}, answers_per_question=2)
    entries = [{"token_ids": [i], "logprobs": [-float(i)], "version": 7} for i in range(3)]
    pool.admit(key, ["a", "b", "c"], [True] * 3, step=7, behaviour=entries)
    assert pool.get(key) == ["b", "c"] and pool.behaviour_of(key, 0) == entries[1]
    state = pool.state_dict()
    again = OnlinePool({}, answers_per_question=2)
    again.load_state_dict(state)
    assert again.get(key) == ["b", "c"] and again.behaviour_of(key, 1) == entries[2]
