"""``rlep collect`` and ``rlep eval`` on a warm-started tiny model: the pool is the RLEP schema
and loads as the trainer's pool; a collection killed mid-run resumes without redoing finished
shards; eval reports every metric per data_source."""
import glob
import json
import os
import signal

import pyarrow.parquet as pq
import pytest

from rlep_megatron.data.schema import read_prompt_file, rows_to_table
from rlep_megatron.replay.pool import ExperiencePool
from rlep_megatron.reward import compute_score
from tests.e2e.helpers import GREEDY_EVAL, recipe, run_rlep
from tests.e2e.helpers import greedy_eval_of_memorised, sampled_eval_of_memorised  # noqa: F401
from tests.torchrun import rlep_in_process
from tests import requires

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


@pytest.fixture(scope="module")
def easy(tmp_path_factory, memorised):
    """A task the tiny model can memorise (6 training questions) and a model warm-started on it."""
    root = tmp_path_factory.mktemp("easy")
    return memorised(root / "task", root / "model")


def collect_args(task, model, out, shards):
    return ["collect", "--config", recipe("tiny_cpu_rlep.yaml"), f"model.hf_dir={model}",
            f"data.train_files=[{task['train']}]", f"collect.checkpoint={model}",
            f"collect.output_file={out}", f"collect.num_shards={shards}",
            "collect.num_samples_per_prompt=8", "reward.num_workers=1",
            "rollout.max_response_tokens=32", "data.max_prompt_tokens=96"]


def test_collect_is_resumable_and_writes_the_rlep_schema(easy, tmp_path):
    task, model = easy
    out = tmp_path / "pool.parquet"
    shard_dir = str(out) + ".shards"
    # killed (SIGKILL, as kill -9) as it starts the third shard: two are finished
    killed = run_rlep(collect_args(task, model, out, shards=6), check=False,
                      env={"RLEP_FAULT_INJECT": "kill@shard:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    finished = sorted(glob.glob(os.path.join(shard_dir, "shard_*.json")))
    assert [os.path.basename(p) for p in finished] == ["shard_00000.json", "shard_00001.json"]
    assert not out.exists()  # the pool appears only when complete
    before = {path: open(path).read() for path in finished}

    result = run_rlep(collect_args(task, model, out, shards=6))
    log = result.stdout + result.stderr
    assert log.count("already finished, skipped") == len(finished)
    for number in range(len(finished)):
        assert f"shard {number + 1}/6 already finished, skipped" in log
    assert json.loads(before[finished[0]])["rows"] == [0]

    # field by field the public RLEP schema (with the optional behaviour columns), and the
    # trainer's pool reader accepts it
    rows = read_prompt_file(str(out), behaviour=True)
    assert pq.read_schema(out).equals(rows_to_table(rows, with_candidates=True).schema)
    assert all(len(c) >= 1 for c in rows.candidates)
    # min_correct (2) counts correct samples, duplicates included: a question of a finished
    # shard is in the pool exactly when that shard recorded >= 2 correct samples for it
    # and every correct sample is a pool answer (the paper's M counts samples, not texts)
    kept = {m[0]["content"]: c for m, c in zip(rows.messages, rows.candidates)}
    train = read_prompt_file(task["train"])
    for text in before.values():
        shard = json.loads(text)
        for row, count in zip(shard["rows"], shard["correct_counts"]):
            question = train.messages[row][0]["content"]
            assert (question in kept) == (count >= 2), (row, count)
            assert question not in kept or len(kept[question]) == count
    for source, truth, candidates in zip(rows.data_source, rows.ground_truth, rows.candidates):
        assert all(compute_score(source, c, truth)["acc"] for c in candidates)
    # each answer carries what the policy that wrote it gave it (replay.correction's input):
    # the tokens it sampled, which the trainer's re-tokenisation of the text reproduces, one
    # log-prob per token, and no version (an HF directory, not a training step)
    from transformers import AutoTokenizer

    from rlep_megatron.replay.pool import tokenize_replays

    tokenizer = AutoTokenizer.from_pretrained(model)
    for candidates, entries in zip(rows.candidates, rows.behaviour):
        assert len(entries) == len(candidates)
        for text, entry in zip(candidates, entries):
            assert entry["version"] is None
            assert len(entry["logprobs"]) == len(entry["token_ids"])
            assert all(value <= 0 for value in entry["logprobs"])
            [item] = tokenize_replays([text], tokenizer, 32, tokenizer.eos_token_id)
            assert item.token_ids == entry["token_ids"].tolist(), text
    pool = ExperiencePool.from_rows(rows)
    pool.check_matches(read_prompt_file(task["train"]), str(out))
    assert len(pool) >= 3
    stats = json.load(open(tmp_path / "pool.stats.json"))
    assert stats["training_questions"] == 6 and stats["questions"] == len(rows)
    assert stats["checkpoint"] == os.path.relpath(model, tmp_path)  # from the pool's directory
    assert not os.path.exists(shard_dir)
    # a pool file that already exists is never overwritten: refused before any model is built,
    # so the command runs in this process (a process of its own would only add its start-up;
    # tests/e2e/test_bad_input.py runs the program itself for its exit code)
    again = rlep_in_process(collect_args(task, model, out, shards=6))
    assert again.returncode == 2 and "already exists" in again.stderr, again.stderr[-3000:]
    assert not os.path.exists(shard_dir)


def test_eval_reports_every_metric(sampled_eval_of_memorised):
    """4 samples per question on two ranks (the one-node eval of tests/e2e/test_multinode.py):
    the report and its table have every metric, each equal to a count of the samples here."""
    report, stdout = sampled_eval_of_memorised["eval"], sampled_eval_of_memorised["stdout"]
    table = report["report"]["tiny_arith"]
    assert set(table) == {"mean@4", "maj@4", "best@4", "pass@4", "num_questions"}
    assert table["num_questions"] == 6
    assert table["mean@4"] > 0.3  # the memorised questions
    assert "tiny_arith" in stdout and "mean@4" in stdout
    # the report against an independent count of the eval's own samples: re-scored here, and
    # with k = n = 4 pass@4 is "any correct" and maj@4 the most frequent answer's correctness
    samples = report["samples"]
    assert len(samples) == 6 and all(len(q["responses"]) == 4 for q in samples)
    acc = [[compute_score(q["data_source"], text, q["ground_truth"])["acc"]
            for text in q["responses"]] for q in samples]
    assert acc == [q["acc"] for q in samples]
    assert table["mean@4"] == pytest.approx(sum(map(sum, acc)) / 24, abs=1e-12)
    assert table["pass@4"] == pytest.approx(sum(map(any, acc)) / 6, abs=1e-12)
    majority = []
    for q, flags in zip(samples, acc):
        preds = [compute_score(q["data_source"], t, q["ground_truth"])["pred"]
                 for t in q["responses"]]
        top = max(preds.count(p) for p in preds)
        winner = next(p for p in preds if preds.count(p) == top)
        majority.append(any(f for f, p in zip(flags, preds) if p == winner))
    assert table["maj@4"] == pytest.approx(sum(majority) / 6, abs=1e-12)
    # best@4 is a bootstrap of 1000 draws of 4 with replacement: its expectation per question
    # is 1 - (1 - c/4)^4; the estimate's standard error is below 0.016 per question
    expected_best = sum(1 - (1 - sum(f) / 4) ** 4 for f in acc) / 6
    assert table["best@4"] == pytest.approx(expected_best, abs=0.05)


def test_eval_and_collect_run_on_the_jobs_own_rollout_server(easy, greedy_eval_of_memorised,
                                                            tmp_path):
    """``rollout.placement=separate`` with a rollout rank: ``rlep eval`` and ``rlep collect``
    sample on a vLLM server the job starts (the HF checkpoint's tensors reach it in one weight
    update; it starts with dummy weights). Greedy decoding gives the colocated engine's answers
    token for token; the collected pool is the RLEP schema, from the checkpoint it names."""
    task, model = easy

    separate = ("rollout.placement=separate", "rollout.num_ranks=1")
    separate_out = tmp_path / "sep" / "eval.json"
    run_rlep(["eval", "--config", recipe("tiny_cpu_baseline.yaml"), f"model.hf_dir={model}",
              f"eval.files=[{task['train']}]", f"eval.output_file={separate_out}", *GREEDY_EVAL,
              f"trainer.output_dir={separate_out.parent}", *separate], nproc=2)
    # the colocated engine's answers: the suite's one greedy eval of the memorised model
    colocated, served = greedy_eval_of_memorised["eval"], json.load(open(separate_out))
    assert [q["responses"] for q in served["samples"]] == \
        [q["responses"] for q in colocated["samples"]]
    assert served["report"] == colocated["report"]
    assert colocated["report"]["tiny_arith"]["mean@1"] > 0.3  # real weights, not dummy ones

    out = tmp_path / "pool.parquet"
    run_rlep([*collect_args(task, model, out, shards=2), *separate,
              f"trainer.output_dir={tmp_path}"], nproc=2)
    rows = read_prompt_file(str(out), behaviour=True)
    assert pq.read_schema(out).equals(rows_to_table(rows, with_candidates=True).schema)
    for source, truth, candidates in zip(rows.data_source, rows.ground_truth, rows.candidates):
        assert candidates and all(compute_score(source, c, truth)["acc"] for c in candidates)
    ExperiencePool.from_rows(rows).check_matches(read_prompt_file(task["train"]), str(out))
    stats = json.load(open(tmp_path / "pool.stats.json"))
    assert stats["checkpoint"] == os.path.relpath(model, tmp_path)
    assert stats["questions"] >= 3 and stats["sample_accuracy"] > 0.3
