"""scripts/gpu_check.sh --bare on a machine without a GPU: the preflight (wheels, imports, the
collection of the GPU tests) runs, then it stops where a GPU is needed and says so."""
import os
import subprocess
import sys

from tests.torchrun import REPO_ROOT


def test_bare_mode_runs_its_preflight_and_stops_before_the_gpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, TMPDIR=str(tmp_path))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(["bash", os.path.join(REPO_ROOT, "scripts", "gpu_check.sh"), "--bare",
                           "--wheels", str(tmp_path / "no-wheels")],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "| imports | ok |" in out
    collected = int(out.split("| GPU tests collected | ok | ")[1].split(" ")[0])
    assert collected >= 20
    assert "the preflight passed" in out and "needs a CUDA device" in out
    assert "Stopped here." in out
