"""scripts/gpu_check.sh --bare on a machine without a GPU: the preflight (wheels, imports, the
collection of the GPU tests) runs, then it stops where a GPU is needed and says so."""
import os
import subprocess
import sys

from tests import bench_module
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


def test_the_gpu_part_fits_eight_minutes_by_its_own_limits():
    """The limits the script gives each step after the preflight add up to at most 480 s (one
    call of a lent machine, at most 10 minutes, leaves time for its start)."""
    import re

    text = open(os.path.join(REPO_ROOT, "scripts", "gpu_check.sh")).read()
    limits = [int(n) for n in re.search(r"LIMITS=\(([0-9 ]+)\)", text).group(1).split()]
    assert len(limits) == 5 and sum(limits) <= 480, limits
    # every timed step takes its limit from the list (no literal limit left behind)
    assert re.findall(r"timed ([^ ]+) ", text) == [
        '"${LIMITS[0]}"', '"${LIMITS[1]}"', '"${LIMITS[2]}"', '"${LIMITS[4]}"']
    # the whole-step program's own limits fit inside its step's: per shape, and the total the
    # last shape may grow to
    call = re.search(r"bench/gpu_step.py --shapes [a-z0-9.,-]+ \\\n *--timeout-s ([0-9,]+) "
                     r"--total-s ([0-9]+);", text)
    per_shape, total = call.group(1), int(call.group(2))
    assert sum(int(t) for t in per_shape.split(",")) <= total < limits[4], (call.groups(),
                                                                            limits[4])


def test_the_whole_step_program_runs_up_to_the_first_cuda_call(tmp_path):
    """bench/gpu_step.py (the script's whole-step rows) on this CPU machine: it builds the tiny
    MoE, the task and the pool, plans the job with rlep plan, and stops at rlep train's device
    check with exit code 2, naming it; nothing after it needs a GPU-free path."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "gpu_step.py"),
                           "--shapes", "tiny-moe", "--out", str(tmp_path / "out"),
                           "--timeout-s", "240"],  # the GPU's 60 s is tight on a busy CPU
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "gpu_step: tiny-moe: prepared in" in out and "plan peaks" in out
    assert "stopped at the first CUDA call" in out and "trainer.device=cuda" in out
    # no TransformerEngine here: rlep train builds the local spec, and the plan counts its
    # activations
    assert "'spec': 'local'" in out
    # what it prepared: an HF checkpoint, the task and a pool in the RLEP schema
    from rlep_megatron.data.schema import read_prompt_file

    root = tmp_path / "out" / "tiny-moe"
    assert (root / "model" / "config.json").is_file()
    pool = read_prompt_file(str(root / "pool.parquet"))
    assert len(pool) == 32 and all(len(c) == 2 for c in pool.candidates)


def test_the_last_shape_takes_what_the_others_left_of_the_total():
    shape_limit = bench_module("gpu_step").shape_limit
    assert shape_limit(60, False, 185, 0) == 60  # not the last: its own
    assert shape_limit(125, True, 185, 35.5) == 149.5  # the tiny MoE took 35.5 s of its 60
    assert shape_limit(125, True, 185, 70) == 125  # never below its own
    assert shape_limit(125, True, None, 35.5) == 125


def test_the_whole_step_row_holds_the_plan_to_the_steps_without_start_up():
    """A step's memory peak counts from the step before, so each process's first step (1, and
    the resumed step) also holds the HF or checkpoint load: reported beside the plan, and only
    a steady step above the plan fails the row."""
    summarise = bench_module("gpu_step").summarise

    def step(n, gib):
        return {"step": n, "timing/step_s": 1.0, "rollout/logprob_abs_diff": 1e-3,
                "replay/fraction": 0.1, "memory/max_allocated_gib": gib}
    plan = {"train": 4.0, "rollout": 3.0, "spec": "local"}
    row = summarise("s", [step(1, 6.5), step(2, 3.5), step(3, 7.0)], plan, True, 3)
    assert "| OK |" in row and "peak 3.50 GiB measured (first steps with start-up 7.00)" in row
    row = summarise("s", [step(1, 2.0), step(2, 4.5), step(3, 2.0)], plan, True, 3)
    assert "FAILED (peak 4.50 GiB above the plan's 4.00)" in row
    # the parity bound and a missing resume fail it too
    bad = step(2, 1.0) | {"rollout/logprob_abs_diff": 1e-2}
    row = summarise("s", [step(1, 1.0), bad, step(3, 1.0)], plan, False, 3)
    assert "rollout/logprob_abs_diff 0.01 > 0.005" in row and "did not resume" in row


def test_a_failed_run_prints_its_last_lines_and_keeps_all_of_them(tmp_path, capsys):
    """On a lent GPU machine only what is printed comes back: a failed rlep train's traceback
    must be in the output, its whole log in a file."""
    gpu_step = bench_module("gpu_step")
    path = tmp_path / "run.log"
    proc = gpu_step.rlep(["train", "--config", str(tmp_path / "missing.yaml")], 120, str(path))
    assert proc.returncode != 0
    gpu_step.failed("s: the first rlep train", proc.stdout + proc.stderr, str(path))
    printed = capsys.readouterr().out
    assert "missing.yaml" in printed and f"(all of them: {path})" in printed
    assert path.read_text() == proc.stdout + proc.stderr
