"""Parquet schema validation, prompts, the resumable sampler and tools/prepare_data.py."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlep_megatron.data import (PromptSampler, read_prompt_file, read_prompt_files,
                                rows_to_table, tokenize_prompt, write_table_atomic)
from rlep_megatron.data.sampler import MixtureSampler, make_prompt_sampler, mixture_sources
from rlep_megatron.data.prepare import DAPO_PREFIX, DAPO_SUFFIX
from rlep_megatron.reward import compute_score
from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit

GSM8K_LINES = [
    {"question": "Natalia sold clips to 48 friends in April and half as many in May. "
                 "How many clips in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72"},
    {"question": "A tank holds 1,200 litres and leaks 400. How much is left?",
     "answer": "1,200 - 400 = 800\n#### 800"},
    {"question": "How much is 2,000 + 1,600?", "answer": "It is 3,600.\n#### 3,600"},
]


def write_jsonl(path, records):
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def prepare(tmp_path, records, source="gsm8k", repeat=1):
    src = write_jsonl(tmp_path / "in.jsonl", records)
    out = str(tmp_path / "out.parquet")
    proc = subprocess.run([sys.executable, "tools/prepare_data.py", "--input", src, "--output",
                           out, "--data-source", source, "--repeat", str(repeat)],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    return proc, out


def test_prepare_gsm8k_matches_the_spec_schema_field_by_field(tmp_path):
    proc, out = prepare(tmp_path, GSM8K_LINES, repeat=2)
    assert proc.returncode == 0, proc.stderr
    schema = pq.read_schema(out)
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert schema.field("data_source").type == pa.string()
    assert schema.field("prompt").type == pa.list_(
        pa.struct([("content", pa.string()), ("role", pa.string())]))
    assert schema.field("ability").type == pa.string()
    assert schema.field("reward_model").type == pa.struct(
        [("ground_truth", pa.string()), ("style", pa.string())])
    assert schema.field("extra_info").type == pa.struct([("index", pa.string())])
    table = pq.read_table(out).to_pylist()
    assert len(table) == 6 and table[0]["prompt"] == table[1]["prompt"]  # repeated rows
    assert [r["reward_model"]["ground_truth"] for r in table[::2]] == ["72", "800", "3600"]
    assert table[0]["prompt"][0]["role"] == "user"
    content = table[0]["prompt"][0]["content"]
    assert content.startswith(DAPO_PREFIX) and content.endswith(DAPO_SUFFIX)
    assert GSM8K_LINES[0]["question"] in content
    rows = read_prompt_file(out)  # the reader accepts it
    assert len(rows) == 6 and len(rows.deduplicate()) == 3
    # gold solutions written the way a model answers all score +1 with the DAPO rule
    for record, truth in zip(GSM8K_LINES, rows.ground_truth[::2]):
        body, final = record["answer"].rsplit("####", 1)
        assert compute_score("gsm8k", f"{body.rstrip()}\nAnswer: {final.strip()}", truth)["acc"]


def test_prepare_problem_answer_format_and_bad_input(tmp_path):
    proc, out = prepare(tmp_path, [{"problem": "What is $1/2+1/4$?", "answer": "\\frac{3}{4}"}],
                        source="math_verify")
    assert proc.returncode == 0, proc.stderr
    rows = read_prompt_file(out)
    assert rows.ground_truth == ["\\frac{3}{4}"] and rows.data_source == ["math_verify"]
    proc, _ = prepare(tmp_path, [{"q": "x", "a": "y"}])
    assert proc.returncode == 2 and "in.jsonl:1" in proc.stderr and "question+answer" in proc.stderr
    proc, _ = prepare(tmp_path, [{"question": "x", "answer": "no final line"}])
    assert proc.returncode == 2 and "####" in proc.stderr


def test_prepare_named_columns_from_jsonl_json_and_parquet(tmp_path):
    records = [{"q": "What is 2+3?", "sol": "2+3=5\n#### 5"}, {"q": "Half of 9?", "sol": "4.5"}]
    src = write_jsonl(tmp_path / "named.jsonl", records)
    (tmp_path / "named.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), str(tmp_path / "named.parquet"))
    for suffix in ("jsonl", "json", "parquet"):
        out = str(tmp_path / f"from_{suffix}.parquet")
        proc = subprocess.run([sys.executable, "tools/prepare_data.py", "--input",
                               str(tmp_path / f"named.{suffix}"), "--output", out,
                               "--data-source", "math_dapo", "--question-key", "q",
                               "--answer-key", "sol"], cwd=REPO_ROOT, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr
        rows = read_prompt_file(out)
        # auto: the GSM8K final answer where '####' is present, the whole answer elsewhere
        assert rows.ground_truth == ["5", "4.5"], suffix
        assert "Half of 9?" in rows.messages[1][0]["content"]
    proc = subprocess.run([sys.executable, "tools/prepare_data.py", "--input", src, "--output",
                           str(tmp_path / "x.parquet"), "--data-source", "math_dapo",
                           "--question-key", "question"], cwd=REPO_ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "named.jsonl:1: no 'question' or 'answer'" in proc.stderr


def base_table(n=3):
    return pa.table({
        "data_source": ["math_dapo"] * n,
        "prompt": [[{"content": f"question {i}", "role": "user"}] for i in range(n)],
        "ability": ["MATH"] * n,
        "reward_model": [{"ground_truth": str(i), "style": "rule-lang"} for i in range(n)],
        "extra_info": [{"index": f"id-{i}", "split": "train"} for i in range(n)],
        "some_extra_column": list(range(n)),
    })


def test_reader_accepts_extra_columns_and_fields(tmp_path):
    path = str(tmp_path / "ok.parquet")
    pq.write_table(base_table(), path)
    rows = read_prompt_file(path)
    assert rows.index == ["id-0", "id-1", "id-2"] and rows.candidates == [None] * 3
    assert rows.messages[1] == [{"role": "user", "content": "question 1"}]


@pytest.mark.parametrize("mutate, needles", [
    (lambda t: t.drop(["prompt"]), ["missing column 'prompt'", "list<struct<content"]),
    (lambda t: t.drop(["reward_model"]), ["missing column 'reward_model'"]),
    (lambda t: t.set_column(1, "prompt", pa.array(["q"] * 3)),
     ["column 'prompt'", "type string", "expected list<struct<content"]),
    (lambda t: t.set_column(0, "data_source", pa.array([1, 2, 3])),
     ["column 'data_source'", "expected string"]),
    (lambda t: t.set_column(3, "reward_model", pa.array([{"answer": "1"}] * 3)),
     ["'reward_model'", "ground_truth"]),
    (lambda t: t.set_column(3, "reward_model", pa.array(
        [{"ground_truth": "1", "style": "x", "candidates": "oops"}] * 3)),
     ["candidates", "list<string>"]),
])
def test_reader_names_file_column_and_expected_type(tmp_path, mutate, needles):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(mutate(base_table()), path)
    with pytest.raises(ValueError) as err:
        read_prompt_file(path)
    assert "bad.parquet" in str(err.value)
    for needle in needles:
        assert needle in str(err.value)


def test_reader_malformed_and_missing_files(tmp_path):
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError, match="garbage.parquet.*not a readable parquet"):
        read_prompt_file(str(garbage))
    with pytest.raises(FileNotFoundError, match="absent.parquet"):
        read_prompt_file(str(tmp_path / "absent.parquet"))
    with pytest.raises(ValueError, match="no parquet files"):
        read_prompt_files([])


def test_round_trip_with_candidates_and_dedup(tmp_path):
    path = str(tmp_path / "a.parquet")
    pq.write_table(base_table(), path)
    rows = read_prompt_files([path, path])
    assert len(rows) == 6 and len(read_prompt_files([path, path], deduplicate=True)) == 3
    rows.candidates = [["Answer: 1"], None, [], ["x"], None, None]
    out = str(tmp_path / "b.parquet")
    write_table_atomic(rows_to_table(rows), out)
    again = read_prompt_file(out)
    assert again.candidates == [["Answer: 1"], [], [], ["x"], [], []]
    assert again.ground_truth == rows.ground_truth
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
    assert os.stat(out).st_mode & 0o777 == 0o644  # readable by others, as any data file


def test_prompt_rendering_and_left_truncation(tiny_qwen2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    full = tokenize_prompt(tokenizer, messages, 10_000)
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(full.token_ids) == text and full.num_truncated_tokens == 0
    short = tokenize_prompt(tokenizer, messages, 12)
    assert short.token_ids == full.token_ids[-12:]  # the end (assistant turn) is kept
    assert short.num_truncated_tokens == len(full.token_ids) - 12
    tokenizer.chat_template = None
    plain = tokenize_prompt(tokenizer, messages, 100)
    assert tokenizer.decode(plain.token_ids) == "What is 2+2?"


def test_sampler_is_seeded_sharded_and_covers_an_epoch():
    sampler = PromptSampler(num_rows=10, batch_size=4, seed=3)
    batches = [sampler.next_global_batch() for _ in range(2)]
    assert len(set(batches[0] + batches[1])) == 8  # no repeats inside an epoch
    assert sampler.next_global_batch() != batches[0]  # epoch 1: a new permutation
    assert PromptSampler(10, 4, seed=3).next_global_batch() == batches[0]
    assert PromptSampler(10, 4, seed=4).next_global_batch() != batches[0]
    shards = [PromptSampler(10, 4, seed=3, data_parallel_rank=r, data_parallel_size=2)
              .next_batch() for r in range(2)]
    assert shards[0] + shards[1] == batches[0]
    ordered = PromptSampler(10, 4, seed=3, shuffle=False)
    assert ordered.next_global_batch() == [0, 1, 2, 3]
    keep_tail = PromptSampler(10, 4, seed=3, drop_last=False)
    assert [len(keep_tail.next_global_batch()) for _ in range(3)] == [4, 4, 2]


def test_sampler_resume_mid_epoch_gives_the_same_future():
    straight = PromptSampler(num_rows=23, batch_size=5, seed=11)
    expected = [straight.next_global_batch() for _ in range(9)]  # crosses epochs
    first = PromptSampler(num_rows=23, batch_size=5, seed=11)
    got = [first.next_global_batch() for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = PromptSampler(num_rows=23, batch_size=5, seed=11)
    resumed.load_state_dict(state)
    got += [resumed.next_global_batch() for _ in range(6)]
    assert got == expected
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(num_rows=23, batch_size=4, seed=11).load_state_dict(state)


def _mixture_files(tmp_path):
    """Three training files: a.parquet (6 rows of data_source s1), b.parquet (3 rows of s2)
    and c.parquet (2 rows, s1 and s2)."""
    from rlep_megatron.data.schema import PromptRows

    paths = []
    for name, sources in (("a", ["s1"] * 6), ("b", ["s2"] * 3), ("c", ["s1", "s2"])):
        rows = PromptRows(data_source=sources,
                          messages=[[{"role": "user", "content": f"{name}{i}"}]
                                    for i in range(len(sources))],
                          ground_truth=["1"] * len(sources), candidates=[None] * len(sources),
                          index=[f"{name}{i}" for i in range(len(sources))])
        path = str(tmp_path / f"{name}.parquet")
        write_table_atomic(rows_to_table(rows), path)
        paths.append(path)
    return paths, read_prompt_files(paths)


def _within_3_standard_errors(count, draws, probability):
    return abs(count - draws * probability) <= 3 * (draws * probability * (1 - probability)) ** .5


@pytest.mark.parametrize("by", ["file", "data_source"])
def test_mixing_weights_draw_each_source_in_proportion(tmp_path, by):
    """data.train_weights: over 1000 draws (250 batches of 4) each source's share is within 3
    binomial standard errors of weight / sum; rows come from their source in its own shuffle,
    each once per pass through the source; a weight of 0 leaves a source out."""
    import types

    paths, rows = _mixture_files(tmp_path)
    weights = ({paths[0]: 1.0, paths[1]: 3.0, paths[2]: 0.0} if by == "file"
               else {"s1": 1.0, "s2": 3.0})
    cfg = types.SimpleNamespace(
        data=types.SimpleNamespace(train_files=paths, train_weights=weights,
                                   train_batch_size=4, shuffle=True, drop_last=True),
        trainer=types.SimpleNamespace(seed=5))
    sampler = make_prompt_sampler(cfg, rows)
    assert isinstance(sampler, MixtureSampler)
    drawn = [row for _ in range(250) for row in sampler.next_global_batch()]
    column = rows.file if by == "file" else rows.data_source
    counts = {}
    for row in drawn:
        counts[column[row]] = counts.get(column[row], 0) + 1
    first, second = (paths[0], paths[1]) if by == "file" else ("s1", "s2")
    assert set(counts) == {first, second}  # c.parquet (weight 0) never drawn
    assert _within_3_standard_errors(counts[first], 1000, 0.25), counts
    assert _within_3_standard_errors(counts[second], 1000, 0.75), counts
    # each source is gone through in its own order: every row once per pass
    own = [row for row in drawn if column[row] == second]
    size = sum(1 for value in column if value == second)
    for start in range(0, len(own) - size + 1, size):
        assert sorted(own[start:start + size]) == sorted(
            i for i, value in enumerate(column) if value == second)


def test_mixing_sampler_resumes_exactly_and_refuses_other_weights(tmp_path):
    paths, rows = _mixture_files(tmp_path)
    groups = mixture_sources(rows, paths, {paths[0]: 2, paths[1]: 1, paths[2]: 1})
    make = lambda: MixtureSampler(groups[1], groups[2], groups[0], 5, seed=11)  # noqa: E731
    straight = make()
    expected = [straight.next_global_batch() for _ in range(9)]  # several passes of each
    first = make()
    got = [first.next_global_batch() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives serialisation
    resumed = make()
    resumed.load_state_dict(state)
    got += [resumed.next_global_batch() for _ in range(5)]
    assert got == expected
    other = MixtureSampler(groups[1], [2, 1, 2], groups[0], 5, seed=11)
    with pytest.raises(ValueError, match="data.train_weights"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved without data.train_weights"):
        make().load_state_dict(PromptSampler(11, 5, seed=11).state_dict())
    with pytest.raises(ValueError, match="saved with data.train_weights"):
        PromptSampler(11, 5, seed=11).load_state_dict(state)


def test_mixing_weights_bad_keys(tmp_path):
    paths, rows = _mixture_files(tmp_path)
    with pytest.raises(ValueError, match="not both"):
        mixture_sources(rows, paths, {paths[0]: 1, "s2": 1})
    with pytest.raises(ValueError, match="gives no weight to .*c.parquet"):
        mixture_sources(rows, paths, {paths[0]: 1, paths[1]: 1})
    with pytest.raises(ValueError, match="'s3' is neither a file"):
        mixture_sources(rows, paths, {"s1": 1, "s2": 1, "s3": 1})
    from rlep_megatron.config import load_config

    with pytest.raises(ValueError, match="data.train_weights: every weight"):
        load_config(None, ["data.train_weights={s1: -1}"])
    with pytest.raises(ValueError, match="data.train_weights: expected a mapping"):
        load_config(None, ["data.train_weights=[s1]"])


def test_sampler_bad_sizes():
    with pytest.raises(ValueError, match="divisible"):
        PromptSampler(10, 3, seed=0, data_parallel_size=2)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptSampler(3, 4, seed=0)
