"""A reward of the user's own, named in the recipe (``reward.function=module:callable``), scores
every fresh and replayed response of a training run (here a constant, so that the logged
rewards show it was used; overlong shaping off)."""
import os

import pytest

from tests import requires
from tests.e2e.helpers import read_jsonl, recipe, run_rlep, small_task, train_overrides
from tests.torchrun import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


def test_training_with_a_reward_function_from_the_recipe(tiny_qwen2_dir, tmp_path):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "quiz.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth):\n"
        "    return {'score': 0.25, 'acc': False, 'pred': solution_str[-3:]}\n")
    task = small_task(str(tmp_path / "task"))
    out = tmp_path / "run"
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
              *train_overrides(tiny_qwen2_dir, task, str(out), steps=1),
              "reward.function=my_rewards.quiz:compute_score", "reward.overlong_buffer_tokens=0"],
             env={"PYTHONPATH": os.pathsep.join([str(tmp_path), REPO_ROOT])})
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["val/tiny_arith/mean@2"] == 0.0  # validation scores with it too
    assert records[1]["rollout/reward_mean"] == 0.25 and records[1]["rollout/acc_mean"] == 0.0
