"""``rollout.placement: separate`` end to end on CPU: 2 processes of one torchrun job, 1 trainer
and 1 rollout rank (a stock vLLM server it starts), one step off. The run trains with the
staleness pattern of the colocated one-step-off run; killed with SIGKILL between checkpoints and
started again, it ends with the straight run's metrics and weights (``carry_over=finish``: no
response is cut by an update, whose place would depend on timing); and killing the rollout
rank's process ends the trainer within 60 s, with an error that names the rollout rank."""
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests import requires
from tests.e2e.helpers import kill_job as kill_all, read_jsonl, run_rlep
from tests.e2e.test_one_step_off import args_for, inputs  # noqa: F401 (fixture)
from tests.e2e.test_sync_equivalence import weights_digest
from tests.torchrun import REPO_ROOT, _env

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

SEPARATE = ("trainer.max_staleness=1", "rollout.placement=separate", "rollout.num_ranks=1")
# no request cut by an update: where a cut falls depends on timing (docs/ASYNC.md)
EXACT = (*SEPARATE, "rollout.carry_over=finish")


def launch(args):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "-m", "rlep_megatron.cli", *args]
    return subprocess.Popen(command, cwd=REPO_ROOT, env=_env(None), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_step(proc, metrics, step, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and any(e["step"] == step for e in read_jsonl(metrics)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or stalled before step {step}")


def test_killed_and_resumed_equals_the_straight_run(inputs, tmp_path):  # noqa: F811
    straight = tmp_path / "straight"
    run_rlep(args_for(inputs, straight, 6, *EXACT), nproc=2)
    entries = read_jsonl(straight / "metrics.jsonl")[1:]
    assert [e["rollout/staleness_max"] for e in entries] == [0, 1, 0, 1, 0, 1]
    # the current version's tokens: the server's log-probs are the actor's
    assert all(e["rollout/logprob_abs_diff/current"] <= 1e-4 for e in entries)
    assert all(0.0 <= e["timing/server_idle_frac"] <= 1.0 for e in entries)
    assert (straight / "rollout_server_0.log").exists()
    killed = tmp_path / "killed"
    args = args_for(inputs, killed, 6, *EXACT)
    proc = launch(args)
    wait_for_step(proc, killed / "metrics.jsonl", 3)
    kill_all(proc)
    assert not (killed / "checkpoints" / "step_00000004").exists()
    resumed = run_rlep(args, nproc=2)
    assert "step_00000002 (step 2)" in resumed.stdout + resumed.stderr
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [e["step"] for e in b] == [0, 1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b):
        x = {k: v for k, v in x.items() if not k.startswith("timing/")}
        y = {k: v for k, v in y.items() if not k.startswith("timing/")}
        assert x == y, x["step"]
    assert (weights_digest(str(straight / "checkpoints" / "step_00000006" / "dist"))
            == weights_digest(str(killed / "checkpoints" / "step_00000006" / "dist")))


def test_killing_the_rollout_rank_ends_the_trainer_naming_it(inputs, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    proc = launch(args_for(inputs, out, 30, *SEPARATE, "checkpoint.save_interval_steps=0"))
    try:
        wait_for_step(proc, out / "metrics.jsonl", 2)
        workers = psutil.Process(proc.pid).children()
        rollout = [p for p in workers if "rlep_megatron.cli" in " ".join(p.cmdline())
                   and p.environ().get("RANK") == "1"]
        assert len(rollout) == 1, [p.cmdline() for p in workers]
        rollout[0].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        ended = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            kill_all(proc)
    assert proc.returncode != 0
    assert ended < 60, ended
    # torchrun's report names the rollout rank (global rank 1) as the root cause, killed
    cause = output[output.index("Root Cause"):] if "Root Cause" in output else ""
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", cause), output[-3000:]
    assert re.search(r"exitcode\s*:\s*-9", cause), output[-3000:]
    steps = [e["step"] for e in read_jsonl(out / "metrics.jsonl")]
    assert steps and steps[-1] < 30


def test_two_trainer_ranks_share_one_server(inputs, tmp_path):  # noqa: F811
    """3 processes: 2 trainer ranks (data parallel) and 1 rollout rank. Only global rank 0
    talks to the server; the other trainer gets the responses through the gather and takes
    part in every pause and weight update without a server connection of its own."""
    out = tmp_path / "run"
    run_rlep(args_for(inputs, out, 4, *SEPARATE), nproc=3)
    entries = read_jsonl(out / "metrics.jsonl")[1:]
    assert [e["rollout/staleness_max"] for e in entries] == [0, 1, 0, 1]
    assert all(e["rollout/logprob_abs_diff/current"] <= 1e-4 for e in entries)
