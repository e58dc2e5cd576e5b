"""docs/quickstart.md's "The tiny default step by step", run as written: each command line of the block
after ``<!-- walkthrough -->``, in a fresh directory that holds ``examples/`` (a link to the
repository's) and a small task and model where ``rlep demo --prepare-only`` puts them, with
overrides appended that scale the runs down (2 steps, few samples). The recipes' paths, the
run directory standing for its newest checkpoint, and the order of the phases are what is
tested; the learning itself is the demo's."""
import json
import os
import shlex
import subprocess
import sys

import pytest

from rlep_megatron.demo import _check_settings
from tests.e2e.helpers import read_jsonl
from tests.torchrun import REPO_ROOT, _env

pytestmark = pytest.mark.e2e

SMALL = ["trainer.total_steps=2", "trainer.validation_interval_steps=2",
         "checkpoint.save_interval_steps=1", "data.train_batch_size=4",
         "rollout.num_samples_per_prompt=4", "trainer.mini_batch_size=2",
         "rollout.max_response_tokens=32", "reward.overlong_buffer_tokens=4",
         "eval.num_samples_per_prompt=2", "collect.num_samples_per_prompt=8",
         "collect.num_shards=1"]


def walkthrough_commands() -> list[list[str]]:
    text = open(os.path.join(REPO_ROOT, "docs", "quickstart.md")).read()
    block = text.split("<!-- walkthrough -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_docs_walkthrough_runs_as_written(tmp_path, memorised):
    commands = walkthrough_commands()
    assert [c[:2] for c in commands] == [["rlep", "demo"]] + [
        ["rlep", sub] for sub in ("train", "collect", "train", "eval")]
    os.symlink(os.path.join(REPO_ROOT, "examples"), tmp_path / "examples")
    # where `rlep demo --prepare-only` looks: a task the tiny model memorises in seconds (the
    # demo's own takes 2500 warm-start steps), recorded with the demo's settings
    tiny = tmp_path / "outputs" / "tiny"
    tiny.mkdir(parents=True)
    _check_settings(str(tiny), 0)
    memorised(tiny / "task", tiny / "model")

    for command in commands:
        args = [sys.executable, "-m", "rlep_megatron.cli", *command[1:]]
        if command[1] != "demo":
            args += SMALL
        proc = subprocess.run(args, cwd=tmp_path, env=_env(None), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, (command, (proc.stdout + proc.stderr)[-5000:])
        if command[1] == "demo":
            assert "greedy accuracy" in proc.stdout and "warm-starting" not in proc.stdout

    walk = tiny / "walkthrough"
    for arm in ("baseline", "rlep"):
        records = read_jsonl(walk / arm / "metrics.jsonl")
        assert [r["step"] for r in records] == [0, 1, 2]
    stats = json.load(open(walk / "pool.stats.json"))
    # collected from the baseline's newest checkpoint, recorded from the pool's directory
    assert stats["checkpoint"] == os.path.join("baseline", "checkpoints", "step_00000002")
    assert stats["questions"] >= 1
    rlep = read_jsonl(walk / "rlep" / "metrics.jsonl")
    assert rlep[1]["replay/num_sequences"] > 0
    report = json.load(open(walk / "rlep" / "eval.json"))
    # the run's newest checkpoint, recorded from the report's own directory (the run's)
    assert report["checkpoint"] == os.path.join("checkpoints", "step_00000002")
