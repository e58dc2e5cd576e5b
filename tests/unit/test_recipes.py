"""The shipped recipes load, and the paper's three 7B recipes carry docs/ALGORITHM.md section 6."""
import glob
import os

import pytest

from rlep_megatron.config import load_config
from rlep_megatron.actor.old_logprob import mini_batch_plan
from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit

EXAMPLES = os.path.join(REPO_ROOT, "examples")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml"))))
def test_recipe_loads(path):
    load_config(path)


@pytest.mark.parametrize("name,dynamic,mini_batch,replays,steps_per_step", [
    ("official_dapo", True, 32, 0, 16),
    ("dapo_nodyn_bs64", False, 64, 0, 8),
    ("rlep", False, 64, 2, 9),
])
def test_paper_recipes(name, dynamic, mini_batch, replays, steps_per_step):
    cfg = load_config(os.path.join(EXAMPLES, f"{name}.yaml"))
    assert cfg.algo.dynamic_sampling is dynamic
    if dynamic:
        assert cfg.algo.max_generation_rounds == 10
    assert cfg.data.train_batch_size == 512 and cfg.rollout.num_samples_per_prompt == 16
    assert cfg.replay.num_replays_per_prompt == replays
    assert (cfg.trainer.mini_batch_size, cfg.trainer.mini_batch_unit) == (mini_batch, "prompts")
    # the trainer's own plan for a full step: 512 prompts x (G + M) sequences
    plan = mini_batch_plan(512 * (16 + replays), cfg)
    assert len(plan) == steps_per_step
    assert [i for rows in plan for i in rows] == list(range(512 * (16 + replays)))
    assert (cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens) == (1024, 3072)
    assert (cfg.algo.clip_ratio_low, cfg.algo.clip_ratio_high, cfg.algo.clip_ratio_c) == (
        0.2, 0.28, 10.0)
    assert (cfg.reward.overlong_buffer_tokens, cfg.reward.overlong_penalty_factor) == (512, 1.0)
    assert (cfg.optim.lr, cfg.optim.lr_warmup_steps, cfg.optim.weight_decay,
            cfg.optim.clip_grad) == (1e-6, 10, 0.1, 1.0)
    assert (cfg.optim.adam_beta1, cfg.optim.adam_beta2) == (0.9, 0.999)
    assert (cfg.rollout.temperature, cfg.rollout.top_p) == (1.0, 1.0)
    assert cfg.trainer.validation_interval_steps == 5
    assert (cfg.eval.num_samples_per_prompt, cfg.eval.temperature) == (32, 1.0)
    assert (cfg.collect.num_samples_per_prompt, cfg.collect.temperature, cfg.collect.top_p,
            cfg.collect.min_correct) == (64, 0.7, 0.95, 2)
    assert cfg.algo.kl_coef == 0.0 and cfg.algo.entropy_coef == 0.0
    # 8 nodes x 8 GPUs: TP x PP divides 64 and the rollout TP divides it too
    assert 64 % (cfg.parallel.tensor_model_parallel_size
                 * cfg.parallel.pipeline_model_parallel_size) == 0
    assert 64 % cfg.rollout.tensor_model_parallel_size == 0


@pytest.mark.parametrize("name, heads, kv_heads, layers, experts", [
    # published config.json values of Qwen3-8B and Qwen3-30B-A3B
    ("qwen3_8b_rlep", 32, 8, 36, 0),
    ("qwen3_30b_a3b_rlep", 32, 4, 48, 128),
])
def test_qwen3_recipes_fit_their_models_on_64_gpus(name, heads, kv_heads, layers, experts):
    from rlep_megatron.distributed import validate_parallel_layout

    cfg = load_config(os.path.join(EXAMPLES, f"{name}.yaml"))
    validate_parallel_layout(64, cfg.parallel, heads, kv_heads, layers, num_experts=experts)
    assert heads % cfg.rollout.tensor_model_parallel_size == 0
    assert 64 % cfg.rollout.tensor_model_parallel_size == 0
    assert cfg.optim.offload_during_rollout and cfg.model.recompute_activations
    assert cfg.replay.num_replays_per_prompt == 2  # RLEP
