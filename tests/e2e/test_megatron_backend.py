"""``rollout.backend=megatron`` end to end on CPU: the actor's own model generates for
``rlep train`` (TP 2 with replays, and one step off), ``rlep eval`` (of a training checkpoint,
on two data-parallel replicas; greedy answers equal vLLM's) and ``rlep collect``."""
import json
import math

import pytest

from rlep_megatron.data.schema import read_prompt_file
from rlep_megatron.reward import compute_score
from tests import requires
from tests.e2e.helpers import (CONTRACT_KEYS, GREEDY_EVAL, read_jsonl, recipe, reference_pool,
                               run_rlep, small_task, train_overrides)
from tests.e2e.helpers import greedy_eval_of_memorised  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

G, M = 4, 2
MEGATRON = "rollout.backend=megatron"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return small_task(str(tmp_path_factory.mktemp("task")))


def test_train_at_tp2_with_replays_then_eval_its_checkpoint(tiny_qwen2_dir, task, tmp_path):
    """Also ``replay.policy=unlikely`` (M = 1 of each question's 2 pool answers, the one the
    actor finds least likely): its scoring pass over the candidates, at TP 2, gives the chosen
    replays the log-probs the old-log-prob pass gives them (the same weights)."""
    pool = reference_pool(task, str(tmp_path / "pool.parquet"))
    out = tmp_path / "run"
    run_rlep(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
              *train_overrides(tiny_qwen2_dir, task, str(out), steps=3),
              f"replay.pool_files=[{pool}]", "replay.num_replays_per_prompt=1",
              "replay.policy=unlikely", "parallel.tensor_model_parallel_size=2", MEGATRON],
             nproc=2)
    entries = read_jsonl(out / "metrics.jsonl")
    assert [e["step"] for e in entries] == [0, 1, 2, 3]
    for entry in entries[1:]:
        for key in CONTRACT_KEYS:
            assert math.isfinite(entry[key]), (key, entry.get(key))
        assert entry["replay/fraction"] == pytest.approx(1 / (G + 1), abs=1e-12)
        # per token over the chosen replays, as the old-log-prob pass saw them (which of the
        # two is chosen: tests/unit/test_replay_policy.py)
        assert entry["replay/chosen_logprob_mean"] == pytest.approx(
            -entry["train/old_nll_mean/replay"], abs=1e-5)
        # the engine's log-prob of each fresh token is the actor's (fp32, the same weights:
        # its own, at TP 2), and nothing is streamed to it
        assert entry["rollout/logprob_abs_diff"] <= 1e-4
        assert entry["rollout/logprob_compared_tokens"] == entry[
            "rollout/response_len_mean"] * 4 * G
        assert entry["weight_sync/bytes"] == 0
    # the run's newest checkpoint (step 3), evaluated on two replicas of the engine
    report = tmp_path / "eval.json"
    run_rlep(["eval", "--config", recipe("tiny_cpu_baseline.yaml"),
              f"model.hf_dir={tiny_qwen2_dir}", f"eval.checkpoint={out}",
              f"eval.files=[{task['val']}]", f"eval.output_file={report}",
              "eval.num_samples_per_prompt=2", "reward.num_workers=1",
              "rollout.max_response_tokens=32", f"trainer.output_dir={tmp_path}", MEGATRON],
             nproc=2)
    result = json.load(open(report))
    assert result["report"]["tiny_arith"]["num_questions"] == 8
    assert [len(q["responses"]) for q in result["samples"]] == [2] * 8


def test_one_step_off(tiny_qwen2_dir, task, tmp_path):
    """trainer.max_staleness=1: a step that generates also generates the next step's prompts
    submitted by then, which train one version later (so stale batches come every other
    step); the tokens of the current version agree with the actor."""
    out = tmp_path / "run"
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
              *train_overrides(tiny_qwen2_dir, task, str(out), steps=3),
              "trainer.max_staleness=1", "algo.rollout_correction=truncate",
              "checkpoint.save_interval_steps=0", "trainer.validation_interval_steps=0",
              MEGATRON])
    entries = read_jsonl(out / "metrics.jsonl")
    assert [e["step"] for e in entries] == [1, 2, 3]
    assert [e["rollout/staleness_max"] for e in entries] == [0, 1, 0]
    for entry in entries:
        assert entry["rollout/logprob_abs_diff/current"] <= 1e-4


@pytest.fixture(scope="module")
def easy(tmp_path_factory, memorised):
    root = tmp_path_factory.mktemp("easy")
    return memorised(root / "task", root / "model")


def eval_args(task, model, out, *extra):
    """The greedy eval of greedy_eval_of_memorised, on ``extra``'s engine."""
    return ["eval", "--config", recipe("tiny_cpu_baseline.yaml"), f"model.hf_dir={model}",
            f"eval.files=[{task['train']}]", f"eval.output_file={out}", *GREEDY_EVAL,
            f"trainer.output_dir={out.parent}", *extra]


@pytest.mark.vllm
def test_greedy_answers_equal_vllms(easy, greedy_eval_of_memorised, tmp_path):
    """Greedy decoding of the memorised model: the engine on two replicas writes vLLM's
    answers (the suite's one greedy vLLM eval of it), token for token in text."""
    requires("vllm")
    task, model = easy
    ours = tmp_path / "megatron" / "eval.json"
    run_rlep(eval_args(task, model, ours, MEGATRON), nproc=2)
    ours, theirs = json.load(open(ours)), greedy_eval_of_memorised["eval"]
    assert [q["responses"] for q in ours["samples"]] == [q["responses"] for q in theirs["samples"]]
    assert ours["report"] == theirs["report"]
    assert ours["report"]["tiny_arith"]["mean@1"] >= 5 / 6  # the memorised answers


def test_collect(easy, tmp_path):
    """A pool collected by the engine: verified answers with the tokens and log-probs that
    sampled them."""
    task, model = easy
    out = tmp_path / "pool.parquet"
    run_rlep(["collect", "--config", recipe("tiny_cpu_rlep.yaml"), f"model.hf_dir={model}",
              f"data.train_files=[{task['train']}]", f"collect.checkpoint={model}",
              f"collect.output_file={out}", "collect.num_shards=2",
              "collect.num_samples_per_prompt=8", "reward.num_workers=1",
              "rollout.max_response_tokens=32", "data.max_prompt_tokens=96", MEGATRON])
    rows = read_prompt_file(str(out), behaviour=True)
    assert len(rows) >= 3
    for source, truth, candidates, entries in zip(rows.data_source, rows.ground_truth,
                                                  rows.candidates, rows.behaviour):
        assert len(candidates) >= 2
        assert all(compute_score(source, c, truth)["acc"] for c in candidates)
        for entry in entries:
            assert len(entry["logprobs"]) == len(entry["token_ids"]) > 0
            assert all(value <= 0 for value in entry["logprobs"])
