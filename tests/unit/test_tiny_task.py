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
    assert not {_class(k) for k in _keys(paths["train"])} & {_class(k) for k in _keys(paths["val"])}
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


def test_column_task_worked_solutions_are_right_column_by_column(tmp_path):
    """The ``column`` kind: subtraction never goes below 0; a corpus question is written either
    directly (the correct result plus its slips, as ``arith``) or column by column (the correct
    result only), in about ``stepwise_fraction`` of the questions; every column step is checked
    with plain digit arithmetic."""
    paths = make_tiny_task(str(tmp_path), seed=1, kind="column", num_train=400, num_val=10,
                           max_operand=99, num_slips_easy=1, num_slips_hard=2,
                           stepwise_fraction=0.25)
    step_re = re.compile(r"units (\d+)([+-])(\d+)=(\d+), tens (\d+)[+-](\d+)([+-]1)?=(\d+), "
                         r"so (\d+)\nAnswer: (\d+)")
    stepwise = 0
    solutions = corpus_by_question(paths["solutions"])
    for question, texts in solutions.items():
        a, op, b = re.fullmatch(r"Compute (\d+) ([+-]) (\d+)\.", question).groups()
        a, b = int(a), int(b)
        value = a + b if op == "+" else a - b
        assert value >= 0
        if texts[0].startswith("units"):
            stepwise += 1
            assert len(texts) == 1  # no slips when worked column by column
            m = step_re.fullmatch(texts[0])
            assert m, texts[0]
            u_a, u_op, u_b, u_res, t_a, t_b, carry, t_res, result, answer = m.groups()
            assert u_op == op and int(u_b) == b % 10 and int(t_b) == b // 10
            assert int(t_a) == a // 10
            if op == "+":
                assert int(u_a) == a % 10 and int(u_res) == a % 10 + b % 10
                assert bool(carry) == (a % 10 + b % 10 >= 10)
            else:
                borrow = a % 10 < b % 10
                assert int(u_a) == a % 10 + 10 * borrow and int(u_res) == int(u_a) - b % 10
                assert bool(carry) == borrow
            assert int(t_res) * 10 + int(u_res) % 10 == value
            assert int(result) == int(answer) == value
        else:
            correct = f"{a} {op} {b} = {value}\nAnswer: {value}"
            hard = (a % 10 + b % 10 >= 10) if op == "+" else (a % 10 < b % 10)
            assert texts.count(correct) == 1 and len(set(texts)) == len(texts) == 2 + hard
            assert all(t.startswith(f"{a} {op} {b} = ") for t in texts)
    assert 0.18 * len(solutions) < stepwise < 0.32 * len(solutions), stepwise
    # without the option the same questions come back, all written directly
    plain = make_tiny_task(str(tmp_path / "plain"), seed=1, kind="column", num_train=400,
                           num_val=10, max_operand=99)
    assert set(corpus_by_question(plain["solutions"])) == set(solutions)
    assert not any(s.startswith("units") for t in corpus_by_question(plain["solutions"]).values()
                   for s in t)


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown tiny task kind"):
        make_tiny_task("unused", kind="sort")
    with pytest.raises(ValueError, match="only 8 distinct arith questions"):
        make_tiny_task("unused", num_train=8, num_val=1, max_operand=1)
    with pytest.raises(ValueError, match="num_slips"):
        make_tiny_task("unused", num_slips_hard=-1)
    with pytest.raises(ValueError, match="stepwise_fraction must be in"):
        make_tiny_task("unused", kind="column", stepwise_fraction=1.5)
    with pytest.raises(ValueError, match="needs kind='column'"):
        make_tiny_task("unused", stepwise_fraction=0.5)


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


def _keys(path):
    out = []
    for messages in read_prompt_file(path).messages:
        a, op, b = re.fullmatch(r"Compute (\d+) ([+-]) (\d+)\.", messages[0]["content"]).groups()
        out.append((int(a), op, int(b)))
    return out


def _class(key):  # commutativity of +, worked out here independently of the task module
    a, op, b = key
    return (op, frozenset((a, b)) if op == "+" else (a, b))


def test_the_demo_task_splits_are_disjoint_modulo_commutativity_and_questions_recur(tmp_path):
    """The demo's task: RL training, validation and warm-start corpus questions share no
    symmetry class (no ``5 + 3`` in validation when ``3 + 5`` is trained or in the corpus),
    and the quick demo's steps use every RL training question at least 3 times."""
    from rlep_megatron.config import load_config
    from rlep_megatron.data.sampler import PromptSampler
    from rlep_megatron.demo import QUICK, TASK, examples_dir

    paths = make_tiny_task(str(tmp_path), seed=0, **TASK)
    train, val = _keys(paths["train"]), _keys(paths["val"])
    corpus = set()
    for question in corpus_by_question(paths["solutions"]):
        a, op, b = re.fullmatch(r"Compute (\d+) ([+-]) (\d+)\.", question).groups()
        corpus.add(_class((int(a), op, int(b))))
    assert len(train) == TASK["num_rl_train"] and len(val) == TASK["num_val"]
    assert len(corpus) > len(train)
    train_classes, val_classes = {_class(k) for k in train}, {_class(k) for k in val}
    assert len(train_classes) == len(train) and len(val_classes) == len(val)
    assert not train_classes & val_classes
    assert not corpus & val_classes and not corpus & train_classes
    assert any(op == "+" for _, op, _ in val)  # the symmetry is there to be violated
    # recurrence, through the trainer's own sampler and the recipe's batch size
    cfg = load_config(os.path.join(examples_dir(), "tiny_cpu_baseline.yaml"))
    sampler = PromptSampler(len(train), cfg.data.train_batch_size, seed=1,
                            shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
    uses = [0] * len(train)
    for _ in range(QUICK["steps"]):
        for row in sampler.next_global_batch():
            uses[row] += 1
    assert min(uses) >= 3, sorted(uses)[:5]


def test_a_split_that_cannot_be_kept_apart_is_refused(tmp_path):
    with pytest.raises(ValueError, match="apart from the other splits modulo symmetry"):
        make_tiny_task(str(tmp_path), seed=0, num_train=6, num_val=2, max_operand=1)


def test_warm_start_reports_along_the_way_without_changing_its_course(tiny_qwen2_dir,
                                                                       tmp_path):
    """The report hook (bench/warm_start_curve.py) sees every report_every-th step and the last,
    in eval mode, and the weights it leaves equal those of a warm start without it."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from rlep_megatron import tiny_task

    task = tiny_task.make_tiny_task(str(tmp_path / "task"), seed=0, num_train=8, num_val=2)
    models = {}
    calls = []

    def report(step, loss, model, tokenizer):
        calls.append((step, loss > 0, model.training))
        model.generate(**tokenizer(["Compute 2 + 3."], return_tensors="pt"), max_new_tokens=3,
                       do_sample=False, pad_token_id=tokenizer.pad_token_id)

    for name, hook in (("plain", None), ("reported", report)):
        models[name] = str(tmp_path / name)
        shutil.copytree(tiny_qwen2_dir, models[name])
        tiny_task.warm_start(models[name], task["solutions"], steps=5, batch_size=4,
                             show_progress=False, report_every=2, report=hook)
    assert calls == [(2, True, False), (4, True, False), (5, True, False)]
    weights = [load_file(os.path.join(models[name], "model.safetensors")) for name in models]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
