"""Independent rollout replicas: a generate call with fewer prompts than replicas (some replicas
get none) ends, in `rlep train` (rollout and validation) and in `rlep eval`. With the replicas
coupled as one vLLM data-parallel world, a replica without prompts skipped the engine while the
others all-reduced at every engine step: the job hung until its collective timeout."""
import json

import pytest

from rlep_megatron.tiny_task import make_tiny_task
from tests import requires
from tests.e2e.helpers import read_jsonl, recipe, run_rlep, train_overrides

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


def test_fewer_or_uneven_prompts_over_two_replicas(tiny_qwen2_dir, tmp_path):
    """One training prompt (one replica gets none) and three validation prompts (2 + 1) in
    `rlep train`; `rlep eval` of the one-question file (one replica gets none)."""
    task = make_tiny_task(str(tmp_path / "task"), seed=0, num_train=1, num_val=3,
                          max_operand=20)
    out = tmp_path / "run"
    # actor TP=2 (one data-parallel rank takes the whole batch), rollout TP=1: two replicas
    overrides = [*train_overrides(tiny_qwen2_dir, task, str(out), steps=1),
                 "parallel.tensor_model_parallel_size=2", "rollout.tensor_model_parallel_size=1",
                 "data.train_batch_size=1", "trainer.mini_batch_size=1",
                 "trainer.validation_interval_steps=1", "checkpoint.save_interval_steps=1"]
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"), *overrides], nproc=2,
             timeout_s=300)
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["rollout/num_groups"] == 1
    assert all(f"val/tiny_arith/mean@2" in r for r in records)
    # M = 0: the contract's replay keys (0), no means over an empty set of replays
    replay_keys = sorted(k for k in records[1] if k.startswith("replay/") or k.endswith("/replay"))
    assert replay_keys == ["replay/fraction", "replay/num_sequences", "replay/reward_mean"]
    assert [records[1][k] for k in replay_keys] == [0.0, 0.0, 0.0]

    report_file = tmp_path / "eval.json"
    run_rlep(["eval", "--config", recipe("tiny_cpu_baseline.yaml"),
              f"model.hf_dir={tiny_qwen2_dir}", f"eval.files=[{task['train']}]",
              f"eval.output_file={report_file}", "eval.num_samples_per_prompt=2",
              "reward.num_workers=1", "rollout.max_response_tokens=16",
              "rollout.tensor_model_parallel_size=1", f"trainer.output_dir={tmp_path / 'eval'}"],
             nproc=2, timeout_s=300)
    report = json.load(open(report_file))
    assert report["report"]["tiny_arith"]["num_questions"] == 1
    assert [len(q["responses"]) for q in report["samples"]] == [2]
