"""No silent CPU fall-back: on a machine whose NVIDIA driver sees a GPU that torch cannot use,
`rlep train` stops before building anything and says why; `trainer.device=cpu` runs on the
CPU on purpose. The driver is faked by an `nvidia-smi` on PATH (this machine has no GPU)."""
import os
import stat
import subprocess
import sys
import time

import pytest

from tests import requires
from tests.e2e.helpers import read_jsonl, recipe, small_task, train_overrides
from tests.torchrun import REPO_ROOT, _env

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

FAKE_NVIDIA_SMI = """#!/bin/sh
case "$*" in
  *-L*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-0000-0000-0000-000000000000)";;
  *driver_version*) echo "535.104.05";;
  *) echo "NVIDIA-SMI 535.104.05";;
esac
"""


def test_a_gpu_torch_cannot_use_stops_train_at_once_and_cpu_runs_on_purpose(tiny_qwen2_dir,
                                                                            tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_NVIDIA_SMI)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    env = _env({"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    env.pop("CUDA_VISIBLE_DEVICES")  # a plain node: nothing hidden
    task = small_task(str(tmp_path / "task"))
    command = [sys.executable, "-m", "rlep_megatron.cli", "train",
               "--config", recipe("tiny_cpu_baseline.yaml"),
               *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"), steps=1)]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "NVIDIA driver 535.104.05 sees 1 GPU(s) (GPU 0: NVIDIA H100" in proc.stderr
    assert "trainer.device=cpu" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing was built or written
    assert elapsed < 60, elapsed

    # (and without the validation at step 0: trainer.validate_before_train=false)
    proc = subprocess.run(command + ["trainer.device=cpu", "trainer.validate_before_train=false"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1]
    assert not any(key.startswith("val/") for key in records[0])
