"""Bad input to the ``rlep`` commands: a clear error (exit 2) before any model is built."""
import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlep_megatron.checkpoint.dist import model_fingerprint
from rlep_megatron.data.schema import read_prompt_file
from rlep_megatron.replay.writer import pool_rows, write_pool
from rlep_megatron.tiny_task import make_tiny_task
from tests.e2e.helpers import recipe, run_rlep, small_task, train_overrides

pytestmark = pytest.mark.e2e

# every check below happens before torch.distributed, megatron or vLLM start
FAST_S = 60


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return small_task(str(tmp_path_factory.mktemp("task")))


_CAPTURE = {}


@pytest.fixture(autouse=True)
def in_process(capfd, monkeypatch):
    """The commands run in this process (no model is built before these errors, so a
    process of their own would only add its start-up); as in a test's subprocess, no GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    _CAPTURE["fd"] = capfd
    yield
    _CAPTURE.clear()


def expect_error(args, *needles):
    """``rlep <args>`` in this process: exit code 2 with each needle in its output, before
    torch.distributed or the rollout engine start."""
    import torch

    from rlep_megatron.cli import main

    capture = _CAPTURE["fd"]
    capture.readouterr()
    start = time.monotonic()
    code = main(list(args))
    elapsed = time.monotonic() - start
    out, err = capture.readouterr()
    output = out + err
    assert code == 2, output[-3000:]
    for needle in needles:
        assert needle in output, (needle, output[-3000:])
    assert elapsed < FAST_S, elapsed
    assert "rollout engine ready" not in output
    assert not torch.distributed.is_initialized(), "the process group started before the error"
    return output


def test_a_bad_input_ends_the_program_with_exit_code_2(tiny_qwen2_dir, task, tmp_path):
    """The program itself (the others call its main in this process): exit code 2 and the
    error on stderr, before any model."""
    proc = run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                     *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), steps=1),
                     "rollout.num_samples_per_prompts=4"], check=False, timeout_s=300)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "rollout.num_samples_per_prompt" in proc.stderr
    assert "rollout engine ready" not in proc.stdout + proc.stderr


def test_config_key_typo_lists_valid_keys(tiny_qwen2_dir, task, tmp_path):
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), 1),
                  "trainer.totl_steps=3"], "trainer.totl_steps", "trainer.total_steps")


def test_eval_parquet_without_reward_model(tiny_qwen2_dir, tmp_path):
    bad = tmp_path / "eval.parquet"
    pq.write_table(pa.table({"data_source": ["tiny_arith"],
                             "prompt": [[{"role": "user", "content": "1+1?"}]]}), bad)
    expect_error(["eval", "--config", recipe("tiny_cpu_baseline.yaml"),
                  f"model.hf_dir={tiny_qwen2_dir}", f"eval.files=[{bad}]",
                  f"trainer.output_dir={tmp_path / 'out'}"],
                 "missing column 'reward_model'", str(bad))


def test_pool_of_another_dataset(tiny_qwen2_dir, task, tmp_path):
    other = make_tiny_task(str(tmp_path / "other"), seed=5, num_train=16, num_val=4,
                           max_operand=300)
    rows = read_prompt_file(other["train"])
    pool = str(tmp_path / "pool.parquet")
    write_pool(pool_rows(rows, [[f"Answer: {t}"] for t in rows.ground_truth]), pool)
    expect_error(["train", "--config", recipe("tiny_cpu_rlep.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), 1),
                  f"replay.pool_files=[{pool}]"], "none of them is a question of the training")


def fake_checkpoint(out, model_dir, step, layout=None, layer_spec=None, **config_changes):
    """A complete-looking training checkpoint (meta.json only) of the model in ``model_dir``,
    with ``config_changes`` applied to its fingerprint: the checks below read nothing else."""
    directory = out / "checkpoints" / f"step_{step:08d}"
    os.makedirs(directory / "dist")
    config = {**json.load(open(os.path.join(model_dir, "config.json"))), **config_changes}
    meta = {"step": step, "model": model_fingerprint(config), "complete": True}
    if layout is not None:
        meta["layout"] = layout
    if layer_spec is not None:
        meta["layer_spec"] = layer_spec
    (directory / "meta.json").write_text(json.dumps(meta))


def test_output_dir_with_a_checkpoint_of_another_model(tiny_qwen2_dir, task, tmp_path):
    out = tmp_path / "run"
    fake_checkpoint(out, tiny_qwen2_dir, 3, hidden_size=4096)
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(out), 1)],
                 "of another model", "hidden_size")


def test_start_weights_from_a_checkpoint_of_another_model(tiny_qwen2_dir, task, tmp_path):
    fake_checkpoint(tmp_path / "other", tiny_qwen2_dir, 5, num_hidden_layers=8)
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), 1),
                  f"model.mcore_dir={tmp_path / 'other' / 'checkpoints' / 'step_00000005'}"],
                 "of another model", "num_hidden_layers")


def test_missing_model_directory(task, tmp_path):
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(str(tmp_path / "nope"), task, str(tmp_path / "run"), 1)],
                 "has no config.json")


def test_resume_at_another_tp_with_dp_sharded_optimizer_state(tiny_qwen2_dir, task, tmp_path):
    out = tmp_path / "run"
    layout = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
              "virtual_pipeline_model_parallel_size": None, "distributed_optimizer": True,
              "optimizer_format": "dp_reshardable"}
    fake_checkpoint(out, tiny_qwen2_dir, 2, layout=layout)
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(out), 3)],
                 "laid out for {'tensor_model_parallel_size': 2}",
                 "resume with that layout", "model.mcore_dir=<the checkpoint>")


def test_resume_with_another_layer_spec(tiny_qwen2_dir, task, tmp_path):
    """A checkpoint saved with TransformerEngine's spec (a GPU run) resumed by a run that builds
    the local spec: the optimizer state's order differs, so it is refused with what to do."""
    out = tmp_path / "run"
    fake_checkpoint(out, tiny_qwen2_dir, 2, layer_spec="transformer_engine")
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(out), 3)],
                 "saved with the transformer_engine layer spec", "builds the local spec",
                 "model.mcore_dir=<the checkpoint>")


def test_resume_with_other_settings_is_refused_and_nothing_is_overwritten(tiny_qwen2_dir, task,
                                                                          tmp_path):
    """The checkpoint records its run's config.yaml: a relaunch in the same output directory
    with another learning rate stops before any work, naming the key, and touches nothing;
    run-length keys may change (checked here through the config comparison; the e2e resume
    tests resume with the same settings)."""
    from rlep_megatron.config import dump_config, load_config

    out = tmp_path / "run"
    overrides = train_overrides(tiny_qwen2_dir, task, str(out), 1)
    fake_checkpoint(out, tiny_qwen2_dir, 1)
    checkpoint = out / "checkpoints" / "step_00000001"
    dump_config(load_config(recipe("tiny_cpu_baseline.yaml"), overrides), str(checkpoint))
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (out / "config.yaml").write_text("the run's own copy\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    output = expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"), *overrides,
                           "optim.lr=5e-4", "trainer.total_steps=3"],
                          "belongs to a run with other settings", "optim.lr: 0.001 -> 0.0005",
                          "checkpoint.resume_with_changes=true", "new trainer.output_dir")
    assert "total_steps" not in output.split("belongs to")[1].split(";")[0]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_reward_function_that_fails_on_a_sample_stops_before_any_model(tiny_qwen2_dir, task,
                                                                          tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text("def score(data_source, solution_str, ground_truth):\n"
                      "    return solution_str['score']\n")
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), 1),
                  f"reward.function={reward}:score"],
                 f"reward.function='{reward}:score' failed on a sample of data.train_files",
                 "TypeError")


def test_a_data_source_no_rule_knows_stops_before_any_model(tiny_qwen2_dir, task, tmp_path):
    rows = read_prompt_file(task["val"])
    table = pq.read_table(task["val"])
    unknown = tmp_path / "val.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("data_source"), "data_source",
                                    pa.array(["my_quiz"] * len(rows.data_source))), unknown)
    expect_error(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                  *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), 1),
                  f"data.val_files=[{unknown}]"],
                 "data.val_files: no reward rule for data_source 'my_quiz'", "Known sources",
                 "reward.function=module:callable")
