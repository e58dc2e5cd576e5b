"""The one thing an RL trainer exists for: on a learnable task the policy gets better.

A small arithmetic task (one-digit operands, 160 training questions) whose warm-start corpus
has a slipped solution next to every correct one, so the warm-started model samples the
correct result about a third of the time. A short baseline run (GRPO, no replay, the tiny
recipe's lr) must raise the fraction of rewarded fresh rollouts well beyond the step-to-step
noise.

Measured on 2 cores with these settings (same warm start): learning, the first 4 steps average
0.31 and the last 4 0.54; with lr 1e-12 (nothing learns) every step lies in 0.26-0.32 (step sd
0.02) and the two windows differ by 0.016. ``MIN_RISE`` is 6 step sds. With the loss sign
flipped, the weight sync skipped after the first or the advantages zeroed, the rise is at most
a few hundredths or negative, and the test fails.
"""
import statistics

import pytest

from rlep_megatron.tiny_model import make_tiny_model
from rlep_megatron.tiny_task import make_tiny_task, warm_start
from tests.e2e.helpers import read_jsonl, recipe, run_rlep
from tests import requires

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

WARM_START_STEPS = 1200
STEPS = 16
WINDOW = 4
MIN_RISE = 0.12


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    root = tmp_path_factory.mktemp("learnable")
    task = make_tiny_task(str(root / "task"), seed=0, num_train=160, num_val=16, max_operand=9,
                          num_slips_easy=1, num_slips_hard=1)
    model = make_tiny_model(str(root / "model"), seed=0)
    warm_start(model, task["solutions"], steps=WARM_START_STEPS, show_progress=False)
    return task, model


def test_training_reward_rises_on_a_learnable_task(learnable, tmp_path):
    task, model = learnable
    out = tmp_path / "run"
    # 32 prompts x 8 samples a step (the recipe has 16): halves the step-to-step noise
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"), f"model.hf_dir={model}",
              f"data.train_files=[{task['train']}]", "data.val_files=[]",
              "data.train_batch_size=32", "trainer.mini_batch_size=8",
              f"trainer.total_steps={STEPS}", "trainer.validation_interval_steps=0",
              "checkpoint.save_interval_steps=0", f"trainer.output_dir={out}"])
    accuracy = [e["rollout/acc_mean"] for e in read_jsonl(out / "metrics.jsonl")]
    assert len(accuracy) == STEPS
    first, last = accuracy[:WINDOW], accuracy[-WINDOW:]
    rise = statistics.fmean(last) - statistics.fmean(first)
    # the run's own noise: spread of single steps around their window's mean
    noise = statistics.pstdev([a - statistics.fmean(first) for a in first]
                              + [a - statistics.fmean(last) for a in last])
    assert rise >= MIN_RISE, (rise, accuracy)
    assert rise >= 3 * noise, (rise, noise, accuracy)
