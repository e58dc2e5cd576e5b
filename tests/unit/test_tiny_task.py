"""The tiny tasks' files: questions, ground truths and the warm-start corpus (correct solution
plus the asked number of slipped ones), checked with the reward rule and plain arithmetic."""
import json
import os
import re
from collections import defaultdict

import pytest

from rlep_megatron.data.schema import read_prompt_file
from rlep_megatron.reward import compute_score
from rlep_megatron.tiny_task import make_tiny_task

pytestmark = pytest.mark.unit


def corpus_by_question(path):
    solutions = defaultdict(list)
    for line in open(path):
        item = json.loads(line)
        solutions[item["question"]].append(item["solution"])
    return solutions


def test_arith_corpus_has_one_correct_and_the_slips(tmp_path):
    paths = make_tiny_task(str(tmp_path), seed=3, num_train=120, num_val=10, max_operand=20,
                           num_slips_easy=1, num_slips_hard=2)
    train, val = read_prompt_file(paths["train"]), read_prompt_file(paths["val"])
    questions = [m[0]["content"] for m in train.messages]
    assert not set(questions) & {m[0]["content"] for m in val.messages}
    solutions = corpus_by_question(paths["solutions"])
    assert set(solutions) == set(questions)
    hard_seen = easy_seen = 0
    for question, truth, source in zip(questions, train.ground_truth, train.data_source):
        a, op, b = re.fullmatch(r"Compute (\d+) ([+-]) (\d+)\.", question).groups()
        a, b = int(a), int(b)
        assert int(truth) == (a + b if op == "+" else a - b)
        hard = (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)
        correct = [s for s in solutions[question] if compute_score(source, s, truth)["acc"]]
        wrong = [s for s in solutions[question] if s not in correct]
        assert correct == [f"{a} {op} {b} = {truth}\nAnswer: {truth}"]
        assert len(wrong) == (2 if hard else 1) and len(set(wrong)) == len(wrong)
        for slip in wrong:  # the same worked form, a different result
            assert slip.startswith(f"{a} {op} {b} = ")
        hard_seen += hard
        easy_seen += not hard
    assert hard_seen and easy_seen


def test_max_task_and_no_slips_by_default(tmp_path):
    paths = make_tiny_task(str(tmp_path), kind="max", num_train=40, num_val=8)
    train = read_prompt_file(paths["train"])
    assert set(train.data_source) == {"tiny_max"}
    solutions = corpus_by_question(paths["solutions"])
    for messages, truth in zip(train.messages, train.ground_truth):
        numbers = [int(x) for x in messages[0]["content"][len("Largest of "):-1].split()]
        assert int(truth) == max(numbers) and len(numbers) == 4
        assert solutions[messages[0]["content"]] == [f"Answer: {truth}"]
        assert compute_score("tiny_max", f"Answer: {truth}", truth)["acc"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown tiny task kind"):
        make_tiny_task("unused", kind="sort")
    with pytest.raises(ValueError, match="only 8 distinct arith questions"):
        make_tiny_task("unused", num_train=8, num_val=1, max_operand=1)
    with pytest.raises(ValueError, match="num_slips"):
        make_tiny_task("unused", num_slips_hard=-1)


def test_warm_start_accuracy_decodes_as_far_as_the_longest_solution(tmp_path, tiny_qwen2_dir,
                                                                    monkeypatch):
    """Solutions longer than a fixed decoding budget would all be scored wrong: the greedy
    accuracy decodes the corpus' longest solution (and its EOS) at least."""
    import shutil

    from rlep_megatron import tiny_task

    model = str(tmp_path / "model")
    shutil.copytree(tiny_qwen2_dir, model)
    task = tiny_task.make_tiny_task(str(tmp_path / "task"), seed=0, num_train=4, num_val=2)
    long_solution = "First write the sum out in words, then in digits: 2 + 3 = 5\nAnswer: 5"
    solutions = tmp_path / "long.jsonl"
    solutions.write_text(json.dumps({"question": "Compute 2 + 3.", "solution": long_solution})
                         + "\n")
    seen = {}

    def fake_accuracy(model, tokenizer, parquet, limit=64, max_new_tokens=24):
        seen["budget"] = max_new_tokens
        seen["needed"] = len(tokenizer(long_solution, add_special_tokens=False)["input_ids"]) + 1
        return 0.5

    monkeypatch.setattr(tiny_task, "greedy_accuracy", fake_accuracy)
    result = tiny_task.warm_start(model, str(solutions), steps=1, eval_parquet=task["val"],
                                  show_progress=False)
    assert result["accuracy"] == 0.5
    assert seen["needed"] > 24 and seen["budget"] >= seen["needed"], seen
    record = json.load(open(os.path.join(model, tiny_task.WARM_START_RECORD)))
    assert record["greedy_max_new_tokens"] == seen["budget"]
