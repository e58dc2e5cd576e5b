"""docs/quickstart.md's "Your own model and data on one GPU", on CPU.

* The block after ``<!-- own-data -->`` run as written, scaled down: each command line in a
  fresh directory that holds ``examples/`` (a link to the repository's), with the example reward
  file ``examples/reward_last_number.py``, a tiny model warm-started on a small task where the
  block expects ``models/Qwen2.5-Math-1.5B``, and CPU overrides appended to the jobs.
* The same path with a Qwen3 made with ``transformers`` (not this project's tiny-model tool), a
  JSONL dataset with its own column names -> ``tools/prepare_data.py`` -> ``rlep init`` ->
  ``rlep config`` -> 2 training steps -> ``rlep eval`` of the run's newest checkpoint."""
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from rlep_megatron.data.schema import read_prompt_file
from tests.e2e.helpers import read_jsonl, run_rlep
from tests.torchrun import REPO_ROOT, _env, rlep_in_process, run_tool_in_process

pytestmark = pytest.mark.e2e


def transformers_qwen3(directory: str, tokenizer_dir: str) -> str:
    """A small Qwen3 built and saved by ``transformers`` itself (its own initialisation, tied
    head), with a byte-level tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=320, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True,
                         pad_token_id=256, eos_token_id=258, bos_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tokenizer_dir, name), directory)
    return directory


def test_own_model_and_jsonl_data_through_prepare_init_train_eval(tiny_qwen2_dir, tmp_path):
    model = transformers_qwen3(str(tmp_path / "my-model"), tiny_qwen2_dir)
    records = [{"task": f"What is {a} + {b}?", "solution": str(a + b)}
               for a, b in [(1, 2), (3, 4), (5, 1), (2, 2), (6, 3), (4, 4)]]
    files = {}
    for split, part in (("train", records[:4]), ("val", records[4:])):
        src = tmp_path / f"{split}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in part))
        files[split] = str(tmp_path / f"{split}.parquet")
        proc = run_tool_in_process("tools/prepare_data.py", [
            "--input", str(src), "--output", files[split], "--data-source", "math_dapo",
            "--question-key", "task", "--answer-key", "solution"])
        assert proc.returncode == 0, proc.stderr
    assert read_prompt_file(files["val"]).ground_truth == ["9", "8"]

    recipe, out = str(tmp_path / "my_recipe.yaml"), str(tmp_path / "run")
    # the commands that build no model run in this process (their start-up is all they'd add)
    init = rlep_in_process(["init", recipe, "--model", model, "--train", files["train"], "--val",
                            files["val"], "--output-dir", out], cwd=REPO_ROOT)
    assert init.returncode == 0, init.stderr[-3000:]
    assert "from examples/one_gpu.yaml" in init.stdout and "rlep train --config" in init.stdout
    # the model's 1024 positions cut the one-GPU template's 1024 + 3072 token budget
    assert "the model's context is 1024 tokens" in init.stdout
    checked = rlep_in_process(["config", "--config", recipe], cwd=REPO_ROOT)
    assert checked.returncode == 0, checked.stderr[-3000:]
    # the one-GPU recipe, scaled down for 2 CPU cores (a user on a GPU runs it as written)
    cpu = ["trainer.device=cpu", "model.params_dtype=float32", "data.train_batch_size=2",
           "rollout.num_samples_per_prompt=2", "rollout.max_response_tokens=16",
           "reward.overlong_buffer_tokens=4", "reward.num_workers=1",
           "trainer.mini_batch_size=2", "trainer.micro_batch_max_tokens=2048",
           "trainer.total_steps=2", "trainer.validation_interval_steps=2",
           "eval.num_samples_per_prompt=2", "checkpoint.save_interval_steps=2",
           "optim.lr_warmup_steps=0"]
    run_rlep(["train", "--config", recipe, *cpu])
    records = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all("val/math_dapo/mean@2" in r for r in (records[0], records[2]))
    assert os.path.isdir(os.path.join(out, "checkpoints", "step_00000002"))

    report_file = str(tmp_path / "eval.json")
    result = run_rlep(["eval", "--config", recipe, *cpu, f"eval.checkpoint={out}",
                       f"eval.output_file={report_file}"])
    report = json.load(open(report_file))
    # the run directory stands for its newest checkpoint (recorded from the report's directory)
    assert report["checkpoint"] == os.path.join("run", "checkpoints", "step_00000002")
    assert report["report"]["math_dapo"]["num_questions"] == 2
    assert "math_dapo" in result.stdout


# the one-GPU recipe, scaled down for 2 CPU cores (a user on a GPU runs it as written)
CPU_JOB = ["trainer.device=cpu", "model.params_dtype=float32", "data.train_batch_size=2",
           "rollout.num_samples_per_prompt=4", "rollout.max_response_tokens=32",
           "reward.overlong_buffer_tokens=4", "reward.num_workers=1",
           "trainer.mini_batch_size=2", "trainer.micro_batch_max_tokens=2048",
           "trainer.total_steps=2", "trainer.validation_interval_steps=2",
           "eval.num_samples_per_prompt=2", "checkpoint.save_interval_steps=2",
           "optim.lr_warmup_steps=0", "collect.num_samples_per_prompt=8", "collect.num_shards=1",
           "collect.min_correct=1", "data.max_prompt_tokens=64"]


def doc_commands(name: str) -> list[list[str]]:
    """The command lines of the bash block after ``<!-- name -->`` in docs/quickstart.md,
    continuation lines joined, comments dropped."""
    text = open(os.path.join(REPO_ROOT, "docs", "quickstart.md")).read()
    block = text.split(f"<!-- {name} -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()
            if shlex.split(line, comments=True)]


def test_docs_own_data_quickstart_runs_as_written(tmp_path, memorised):
    commands = doc_commands("own-data")
    assert [c[:2] for c in commands] == [["python", "tools/prepare_data.py"]] * 2 + [
        ["rlep", sub] for sub in ("init", "config", "plan", "train", "collect", "init", "train",
                                  "eval")]
    assert any("examples/reward_last_number.py:score" in c for c in commands[2])
    os.symlink(os.path.join(REPO_ROOT, "examples"), tmp_path / "examples")
    # the block's model and JSONL files: a tiny model that memorises a small task in seconds,
    # and the task's questions and answers under the column names the block gives
    task, model = memorised(tmp_path / "task", tmp_path / "models" / "Qwen2.5-Math-1.5B")
    (tmp_path / "data").mkdir()
    for split in ("train", "val"):
        rows = read_prompt_file(task[split])
        with open(tmp_path / f"my_{split}.jsonl", "w") as f:
            for messages, truth in zip(rows.messages, rows.ground_truth):
                f.write(json.dumps({"problem": messages[-1]["content"], "answer": truth}) + "\n")

    outputs = {}
    for command in commands:
        extra = CPU_JOB if command[1] in ("train", "collect", "eval", "config", "plan") else []
        # the commands that build no model run in this process (their start-up is all they'd
        # add); the jobs run as programs
        if command[0] == "python":
            proc = run_tool_in_process(command[1], command[2:], cwd=str(tmp_path))
        elif command[1] in ("init", "config", "plan"):
            proc = rlep_in_process([*command[1:], *extra], cwd=str(tmp_path))
        else:
            proc = subprocess.run([sys.executable, "-m", "rlep_megatron.cli", *command[1:],
                                   *extra], cwd=tmp_path, env=_env(None), capture_output=True,
                                  text=True, timeout=600)
        assert proc.returncode == 0, (command, (proc.stdout + proc.stderr)[-5000:])
        outputs.setdefault(command[1], []).append(proc.stdout + proc.stderr)

    assert read_prompt_file(str(tmp_path / "data" / "val.parquet")).data_source == [
        "my_numbers"] * 2
    assert "1 GPUs" in outputs["plan"][0]
    for run in ("my_run", "my_rlep"):
        records = read_jsonl(tmp_path / "outputs" / run / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
        # the example reward scored the warm-started model's answers: some right
        assert max(r["rollout/acc_mean"] for r in records[1:]) > 0
    stats = json.load(open(tmp_path / "outputs" / "my_run" / "pool.stats.json"))
    assert stats["questions"] >= 1
    rlep = read_jsonl(tmp_path / "outputs" / "my_rlep" / "metrics.jsonl")
    assert rlep[1]["replay/num_sequences"] > 0
    report = json.load(open(tmp_path / "outputs" / "my_rlep" / "eval.json"))
    assert report["report"]["my_numbers"]["num_questions"] == 2
