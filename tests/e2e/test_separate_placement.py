"""``rollout.placement: separate`` end to end on CPU: 2 processes of one torchrun job, 1 trainer
and 1 rollout rank (a stock vLLM server it starts), one step off. The run trains with the
staleness pattern of the colocated one-step-off run; killed with SIGKILL between checkpoints and
started again, it ends with the straight run's metrics and weights (``carry_over=finish``: no
response is cut by an update, whose place would depend on timing). The kill is the rollout
rank's alone, at a fixed point (``RLEP_FAULT_INJECT=kill@train:4:1``): it must end the whole job
within 60 s, naming the rollout rank."""
import re
import time

import pytest

from tests import requires
from tests.e2e.helpers import read_jsonl, run_rlep
from tests.e2e.test_one_step_off import args_for, inputs  # noqa: F401 (fixture)
from tests.e2e.test_sync_equivalence import weights_digest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

SEPARATE = ("trainer.max_staleness=1", "rollout.placement=separate", "rollout.num_ranks=1")
# no request cut by an update: where a cut falls depends on timing (docs/ASYNC.md)
EXACT = (*SEPARATE, "rollout.carry_over=finish")


def test_killed_and_resumed_equals_the_straight_run(inputs, tmp_path):  # noqa: F811
    """The straight run; the same run whose rollout rank is killed (SIGKILL) as step 4's
    training begins, which must end the whole job within 60 s naming that rank, with step 2's
    checkpoint the last; started again, it ends with the straight run's metrics and weights."""
    straight = tmp_path / "straight"
    run_rlep(args_for(inputs, straight, 4, *EXACT), nproc=2)
    entries = read_jsonl(straight / "metrics.jsonl")[1:]
    assert [e["rollout/staleness_max"] for e in entries] == [0, 1, 0, 1]
    # the current version's tokens: the server's log-probs are the actor's
    assert all(e["rollout/logprob_abs_diff/current"] <= 1e-4 for e in entries)
    # the server idles through every update (nothing runs on it while the weights change); a
    # step whose batch it generated within the step kept it busy part of the time, and a step
    # that trained a batch generated ahead may leave it idle throughout
    idle = [e["timing/server_idle_frac"] for e in entries]
    assert all(0.0 < value <= 1.0 for value in idle), idle
    generated = [v for v, e in zip(idle, entries) if e["rollout/staleness_max"] == 0]
    assert generated and all(value < 1.0 for value in generated), idle
    assert (straight / "rollout_server_0.log").exists()
    killed = tmp_path / "killed"
    args = args_for(inputs, killed, 4, *EXACT)
    proc = run_rlep(args, nproc=2, check=False, env={"RLEP_FAULT_INJECT": "kill@train:4:1"})
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    at = re.search(r"RLEP_FAULT_INJECT: killed rank 1 at ([0-9.]+)", output)
    assert at, output[-3000:]
    assert ended - float(at.group(1)) < 60, ended - float(at.group(1))
    # torchrun's report names the rollout rank (global rank 1) as the root cause, killed
    cause = output[output.index("Root Cause"):] if "Root Cause" in output else ""
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", cause), output[-3000:]
    assert re.search(r"exitcode\s*:\s*-9", cause), output[-3000:]
    assert [e["step"] for e in read_jsonl(killed / "metrics.jsonl")] == [0, 1, 2, 3]
    assert not (killed / "checkpoints" / "step_00000004").exists()
    resumed = run_rlep(args, nproc=2)
    assert "step_00000002 (step 2)" in resumed.stdout + resumed.stderr
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [e["step"] for e in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b):
        x = {k: v for k, v in x.items() if not k.startswith("timing/")}
        y = {k: v for k, v in y.items() if not k.startswith("timing/")}
        assert x == y, x["step"]
    assert (weights_digest(str(straight / "checkpoints" / "step_00000004" / "dist"))
            == weights_digest(str(killed / "checkpoints" / "step_00000004" / "dist")))


def test_two_trainer_ranks_share_one_server(inputs, tmp_path):  # noqa: F811
    """3 processes: 2 trainer ranks (data parallel) and 1 rollout rank. Only global rank 0
    talks to the server; the other trainer gets the responses through the gather and takes
    part in every pause and weight update without a server connection of its own."""
    out = tmp_path / "run"
    run_rlep(args_for(inputs, out, 4, *SEPARATE, "rollout.server_log_requests=true"), nproc=3)
    entries = read_jsonl(out / "metrics.jsonl")[1:]
    assert [e["rollout/staleness_max"] for e in entries] == [0, 1, 0, 1]
    assert all(e["rollout/logprob_abs_diff/current"] <= 1e-4 for e in entries)
    # counted where the requests arrive: every generate request the server received carries
    # the id of one and the same trainer process, global rank 0 (rlep-r<rank>-<pid>-<n>)
    log = (out / "rollout_server_0.log").read_text()
    senders = re.findall(r"Received request \S*?rlep-r(\d+)-(\d+)-\d+", log)
    assert len(senders) >= 4 * 4 * 4, len(senders)  # 4 steps x 4 prompts x G = 4 at least
    assert len(set(senders)) == 1, sorted(set(senders))
    assert senders[0][0] == "0", sorted(set(senders))
