"""Pure parts of the RL loop, checked directly: the rows and loss mask the actor trains on, the
optimizer mini-batch plan, and the reward of replays (re-scored, overlong shaping included)."""
import pytest

from rlep_megatron.config import load_config
from rlep_megatron.data import PromptRows
from rlep_megatron.reward import compute_score
from rlep_megatron.actor.learner import LearningSide
from rlep_megatron.actor.old_logprob import (mini_batch_plan, old_logprob_pass, train_batch,
                                             training_rows)
from rlep_megatron.data.batch import FRESH, REPLAY, Sample, StepBatch
from rlep_megatron.rollout.side import RolloutSide, fresh_groups

pytestmark = pytest.mark.unit

EOS, PAD = 258, 256


def test_training_rows_mask_every_response_token_and_the_eos():
    prompts = [[1, 2, 3], [4, 5]]
    responses = [[10, 11, EOS], [12, 13, 14, 15]]  # stopped on EOS; cut at the length budget
    ids, mask = training_rows(prompts, responses, PAD)
    assert ids.tolist() == [[1, 2, 3, 10, 11, EOS], [4, 5, 12, 13, 14, 15]]
    assert mask.tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]]
    ids, mask = training_rows([[1, 2, 3], [4]], [[EOS], [12, 13, 14, 15, EOS]], PAD)
    assert ids[0].tolist() == [1, 2, 3, EOS, PAD, PAD]  # right padding, never trained
    assert mask.tolist() == [[0, 0, 0, 1, 0, 0], [0, 1, 1, 1, 1, 1]]


def test_mini_batch_plan_counts_prompts_or_sequences():
    # 4 prompts x (G = 4 fresh + M = 2 replays); mini_batch_size 2 prompts = 2 x G sequences
    cfg = load_config(None, ["rollout.num_samples_per_prompt=4", "trainer.mini_batch_size=2"])
    plan = mini_batch_plan(24, cfg)
    assert plan == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    cfg = load_config(None, ["trainer.mini_batch_unit=sequences", "trainer.mini_batch_size=23"])
    assert mini_batch_plan(24, cfg) == [list(range(23)), [23]]
    assert mini_batch_plan(0, cfg) == []


class InProcessScorer:
    def score(self, requests):
        return [compute_score(r.data_source, r.solution_str, r.ground_truth) for r in requests]


def test_replays_are_rescored_and_shaped_like_fresh_responses():
    """docs/ALGORITHM.md section 5: overlong shaping applies to replays too. max 32 tokens, buffer 8:
    a response of L > 24 tokens gets min(0, -(L - 24) / 8)."""
    cfg = load_config(None, ["rollout.max_response_tokens=32", "reward.overlong_buffer_tokens=8",
                             "reward.overlong_penalty_factor=1.0"])
    trainer = RolloutSide.__new__(RolloutSide)
    trainer.cfg, trainer.scorer = cfg, InProcessScorer()
    rows = PromptRows()
    rows.data_source.append("math_dapo")
    rows.messages.append([{"role": "user", "content": "1 + 1"}])
    rows.ground_truth.append("2")
    rows.candidates.append(None)
    rows.index.append("0")
    trainer.train_rows = rows

    def sample(source, text, length):
        return Sample(0, [0] * length, text, source)

    batch = StepBatch(rows=[0], prompts=[[1, 2]], sequences=[
        sample(FRESH, "Answer: 2", 10),      # correct, short: +1
        sample(REPLAY, "Answer: 2", 28),     # correct replay, 4 tokens into the buffer: +0.5
        sample(REPLAY, "Answer: 3", 32),     # wrong replay at the budget: -1 - 1
        sample(FRESH, "no answer", 26),      # wrong fresh: -1 - 0.25
    ])
    trainer.reward(batch)
    assert [s.acc for s in batch.sequences] == [True, True, False, False]
    assert [s.reward for s in batch.sequences] == [1.0, 0.5, -2.0, -1.25]


class RoundsStub:
    """What ``RolloutSide._dynamic_batch`` uses of a rollout side: its config and one generation round
    per call, here a fixed list of groups' correctness per round."""

    def __init__(self, rounds, overrides):
        self.cfg = load_config(None, ["data.train_batch_size=3", *overrides])
        self.rounds = rounds

    def _generate_round(self, timer, step, round_index):
        groups = self.rounds[round_index]
        batch = StepBatch(rows=[10 * round_index + g for g in range(len(groups))],
                          prompts=[[round_index, g] for g in range(len(groups))])
        for g, accs in enumerate(groups):
            batch.sequences += [Sample(g, [1], "x", FRESH, acc=a) for a in accs]
        return batch


def test_dynamic_sampling_stops_or_trains_on_a_partial_batch_when_rounds_run_out():
    # per round: groups with signal (True and False answers) and without
    rounds = [[(True, False), (True, True)], [(False, False), (False, True)], [(True, True)]]
    stub = RoundsStub(rounds, ["algo.max_generation_rounds=3"])
    with pytest.raises(RuntimeError, match=r"kept 2 of 3 groups in 3 rounds .*"
                       r"algo.max_generation_rounds.*dynamic_sampling_partial_batch=true"):
        RolloutSide._dynamic_batch(stub, timer=None, step=0)
    stub = RoundsStub(rounds, ["algo.max_generation_rounds=3",
                               "algo.dynamic_sampling_partial_batch=true"])
    batch = RolloutSide._dynamic_batch(stub, timer=None, step=0)
    assert batch.rows == [0, 11] and batch.generation_rounds == 3
    assert [s.group for s in batch.sequences] == [0, 0, 1, 1]
    # no group with signal at all: an error whatever the option
    stub = RoundsStub([[(True, True)]] * 2, ["algo.max_generation_rounds=2",
                                             "algo.dynamic_sampling_partial_batch=true"])
    with pytest.raises(RuntimeError, match="kept 0 of 3 groups in 2 rounds"):
        RolloutSide._dynamic_batch(stub, timer=None, step=0)


def test_online_admission_takes_every_generation_round_after_the_step():
    """replay.mode online: the groups of every round (dynamic sampling may drop some from the
    batch) are admitted once, after the step's replays were drawn, with their end flags."""
    import types

    from rlep_megatron.data.schema import prompt_key
    from rlep_megatron.replay import OnlinePool
    messages = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    rounds = []
    for rows, answers in (([0, 1], [("a", True, "stop"), ("x", False, "stop"),
                                    ("b", True, "length"), ("c", True, "stop")]),
                          ([2], [("d", True, "stop"), ("e", True, "stop")])):
        batch = StepBatch(rows=rows, prompts=[[1]] * len(rows))
        for i, (text, ok, finish) in enumerate(answers):
            batch.sequences.append(Sample(i * len(rows) // len(answers), [1], text, FRESH,
                                          finish_reason=finish, acc=ok))
        batch.sequences.append(Sample(0, [1], "replayed", REPLAY, acc=True))  # never admitted
        rounds += fresh_groups(batch)
    pool = OnlinePool({}, answers_per_question=4)
    trainer = types.SimpleNamespace(online_pool=pool, _candidates=rounds,
                                    train_rows=types.SimpleNamespace(messages=messages))
    assert RolloutSide._admit_online(trainer, step=7) == 4  # a, c, d, e
    assert pool.get(messages[0]) == ["a"] and pool.get(messages[1]) == ["c"]
    assert pool.get(messages[2]) == ["d", "e"] and pool.born[prompt_key(messages[2])] == [7, 7]
    assert pool.pass_rate[prompt_key(messages[1])] == 1.0  # "b" passed, cut at the budget
    assert trainer._candidates == []


def test_replays_reach_the_train_batch_with_their_group_advantage(monkeypatch):
    """The advantage of each replay (computed over its group with the fresh answers) is the one
    the actor trains it with, in the row of its tokens, marked as a replay: a correct replay in
    a group of mostly wrong answers pushes its tokens up. Replays given advantage 0, the
    opposite sign or another row's value fail this."""
    import types

    import torch

    from rlep_megatron.actor import forward

    cfg = load_config(None, ["rollout.num_samples_per_prompt=4", "trainer.mini_batch_size=2"])
    trainer = LearningSide.__new__(LearningSide)
    trainer.cfg, trainer.pad_id = cfg, PAD
    trainer.ctx = types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0)
    trainer.routing_replay = trainer.reference = trainer.chunks = trainer.info = None
    monkeypatch.setattr(forward, "actor_logprobs",
                        lambda chunks, info, ids, *args, **kwargs: torch.zeros(ids.shape))

    def sample(group, source, correct, length):
        s = Sample(group, [7] * length, "x", source, acc=correct)
        s.reward = 1.0 if correct else -1.0
        return s

    # group 0: 4 wrong fresh answers and a correct replay; group 1: 3 of 4 fresh correct, a
    # correct replay
    sequences = [sample(0, FRESH, False, 3 + i) for i in range(4)] + [sample(0, REPLAY, True, 9)]
    sequences += [sample(1, FRESH, i > 0, 2 + i) for i in range(4)] + [sample(1, REPLAY, True, 4)]
    batch = StepBatch(rows=[0, 1], prompts=[[1, 2, 3], [4, 5]], sequences=sequences)
    trainer.advantage(batch)
    replay_adv = [s.advantage for s in sequences if s.source == REPLAY]
    # group 0: rewards (-1 x 4, +1): mean -0.6, std sqrt(0.8); the replay (1 + 0.6) / 0.894
    assert replay_adv[0] == pytest.approx(1.6 / 0.8 ** 0.5, rel=1e-5)
    assert replay_adv[1] > 0 and all(s.advantage < 0 for s in sequences[:4])

    load = types.SimpleNamespace(skip_rows=None)
    plan = mini_batch_plan(len(batch.sequences), cfg)
    passes = list(old_logprob_pass(trainer, batch, plan, load))
    assert len(passes) == len(plan) == 2
    for indices, (seqs, placeholder, tensors) in zip(plan, passes):
        train, _, _ = train_batch(cfg.algo, seqs, placeholder, tensors,
                                  [len(batch.prompts[s.group]) for s in seqs], version=0)
        expected = [sequences[i] for i in indices]
        assert train.advantages.tolist() == pytest.approx([s.advantage for s in expected])
        assert train.is_replay.tolist() == [s.source == REPLAY for s in expected]
        # each row's tokens and trained mask are its own prompt and response, as if the
        # mini-batch had been laid out alone (the pass covers every mini-batch at once)
        ids, mask = training_rows([batch.prompts[s.group] for s in expected],
                                  [s.token_ids for s in expected], PAD)
        assert train.input_ids.tolist() == ids.tolist()
        assert train.response_mask.tolist() == mask.tolist()
    assert sum(map(len, plan)) == len(sequences)


def test_a_response_text_is_the_sampled_tokens_decoded_without_the_stop_token(tiny_qwen2_dir):
    """The engine asks vLLM for no text (``detokenize=False``) and for flat log-probs, and
    decodes each response once itself: special tokens skipped and the token that stopped the
    response left out, as vLLM's own text is (the vLLM tests compare the two on real samples)."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rlep_megatron.rollout.colocated.engine import _response

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    body = tokenizer("Answer: 42", add_special_tokens=False)["input_ids"]
    comma = tokenizer(",", add_special_tokens=False)["input_ids"]
    [eos] = tokenizer(tokenizer.eos_token, add_special_tokens=False)["input_ids"]

    def flat(ids, logprobs):
        return SimpleNamespace(token_ids=list(ids), logprobs=list(logprobs),
                               end_indices=list(range(1, len(ids) + 1)))

    def completion(ids, finish_reason):
        logprobs = [-0.5 - i for i in range(len(ids))]
        return SimpleNamespace(token_ids=ids, logprobs=flat(ids, logprobs), text=None,
                               finish_reason=finish_reason), logprobs

    stopped, logprobs = completion(body + [eos], "stop")
    response = _response(3, stopped, tokenizer)
    assert response.text == "Answer: 42" and response.token_ids == body + [eos]
    assert response.logprobs == logprobs and response.finish_reason == "stop"
    # a stop token that is not special (here a comma) is left out of the text all the same
    assert _response(0, completion(body + comma, "stop")[0], tokenizer).text == "Answer: 42"
    # cut at the length budget: every token is text
    assert _response(0, completion(body + comma, "length")[0], tokenizer).text == "Answer: 42,"
    assert _response(0, completion(body, None)[0], tokenizer).finish_reason == "length"
    # cut inside a character (byte-level tokens): its first byte is not shown as U+FFFD
    accent = tokenizer("\u00e9", add_special_tokens=False)["input_ids"]
    assert len(accent) == 2 and tokenizer.decode(body + accent[:1]).endswith("\ufffd")
    assert _response(0, completion(body + accent[:1], "length")[0], tokenizer).text == "Answer: 42"
    assert _response(0, completion(body + accent, "length")[0], tokenizer).text == "Answer: 42\u00e9"
    # after a prompt, as vLLM decodes: the same text here (byte-level tokens)
    prompt = tokenizer("What is 40+2?", add_special_tokens=False)["input_ids"]
    stopped, _ = completion(body + [eos], "stop")
    assert _response(0, stopped, tokenizer, prompt=prompt).text == "Answer: 42"
    # log-prob entries of other tokens than the sampled ones are refused
    wrong = SimpleNamespace(token_ids=body, logprobs=flat(body[::-1], [0.0] * len(body)),
                            text=None, finish_reason="length")
    with pytest.raises(RuntimeError, match="not those of the sampled tokens"):
        _response(0, wrong, tokenizer)


def test_a_response_keeps_the_leading_space_a_sentencepiece_decoder_drops_at_the_start():
    """A tokenizer whose decoder drops the leading space of the text's first word (SentencePiece's
    Metaspace, as Llama-2 and Mistral have): decoded alone the response's first word loses its
    space; vLLM decodes it after the prompt and keeps it, and so does the engine."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlep_megatron.rollout.colocated.engine import _response

    vocab = {"[UNK]": 0, "</s>": 1, "\u2581what": 2, "\u2581is": 3, "\u2581it": 4, "\u2581four": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]",
                                        eos_token="</s>")
    assert tokenizer.decode([5]) == "four"            # alone: the space is gone
    assert tokenizer.decode([2, 3, 4, 5]) == "what is it four"
    flat = SimpleNamespace(token_ids=[5, 1], logprobs=[-0.1, -0.2], end_indices=[1, 2])
    done = SimpleNamespace(token_ids=[5, 1], logprobs=flat, finish_reason="stop")
    assert _response(0, done, tokenizer, prompt=[2, 3, 4]).text == " four"
