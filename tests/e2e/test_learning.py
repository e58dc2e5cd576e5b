"""The one thing an RL trainer exists for: on a learnable task the policy gets better.

A small arithmetic task (one-digit operands) whose warm-start corpus shows a slipped solution
next to every correct one, so the warm-started model computes the answer but samples a slip
about half the time. A short baseline run (GRPO, no replay) must raise the fraction of
rewarded fresh rollouts by a margin several times the step-to-step noise; a broken learning
signal (loss sign flipped, weight sync skipped, advantages zeroed) does not.
"""
import statistics

import pytest

from rlep_megatron.tiny_model import make_tiny_model
from rlep_megatron.tiny_task import make_tiny_task, warm_start
from tests.e2e.helpers import read_jsonl, recipe, run_rlep

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 16
WINDOW = 5


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    root = tmp_path_factory.mktemp("learnable")
    task = make_tiny_task(str(root / "task"), seed=0, num_train=160, num_val=16, max_operand=9,
                          num_slips_easy=1, num_slips_hard=1)
    model = make_tiny_model(str(root / "model"), seed=0)
    warm_start(model, task["solutions"], steps=WARM_START_STEPS, show_progress=False)
    return task, model


WARM_START_STEPS = 800


def test_training_reward_rises_on_a_learnable_task(learnable, tmp_path):
    task, model = learnable
    out = tmp_path / "run"
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"), f"model.hf_dir={model}",
              f"data.train_files=[{task['train']}]", "data.val_files=[]",
              f"trainer.total_steps={STEPS}", "trainer.validation_interval_steps=0",
              "checkpoint.save_interval_steps=0", f"trainer.output_dir={out}"])
    accuracy = [e["rollout/acc_mean"] for e in read_jsonl(out / "metrics.jsonl")]
    assert len(accuracy) == STEPS
    first, last = accuracy[:WINDOW], accuracy[-WINDOW:]
    # noise: the spread of one step's accuracy around its window's mean (128 samples a step)
    noise = statistics.pstdev([a - statistics.fmean(first) for a in first]
                              + [a - statistics.fmean(last) for a in last])
    rise = statistics.fmean(last) - statistics.fmean(first)
    assert rise >= MIN_RISE, (rise, accuracy)
    assert rise >= 3 * max(noise, 0.02), (rise, noise, accuracy)


MIN_RISE = 0.15
