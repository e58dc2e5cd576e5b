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


def test_the_gpu_part_fits_five_minutes_by_its_own_limits():
    """The limits the script gives each step after the preflight add up to at most 300 s (one
    call of a lent machine leaves time for its start and a rerun)."""
    import re

    text = open(os.path.join(REPO_ROOT, "scripts", "gpu_check.sh")).read()
    limits = [int(n) for n in re.search(r"LIMITS=\(([0-9 ]+)\)", text).group(1).split()]
    assert len(limits) == 4 and sum(limits) <= 300, limits
    # every timed step takes its limit from the list (no literal limit left behind)
    assert re.findall(r"timed ([^ ]+) ", text) == [
        '"${LIMITS[0]}"', '"${LIMITS[1]}"', '"${LIMITS[2]}"']
