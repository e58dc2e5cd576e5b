"""A failure on one rank ends the whole job: with ``RLEP_FAULT_INJECT=<phase>:<rank>`` a 2-rank
``rlep train`` exits non-zero within 60 s (start-up included) and prints the injected error,
whichever phase fails and whatever the other rank is blocked in (a pipeline peer waiting in
``recv_backward``, a data-parallel peer in an all-reduce, a checkpoint barrier). The next job
with the same layout starts cleanly (no stale vLLM shared memory): it is the checkpoint
barrier's case, which runs until step 2's checkpoint."""
import re
import time

import pytest

from tests.e2e.helpers import (JOB_TIMEOUT_S, read_jsonl, recipe, run_rlep, small_task,
                               train_overrides)
from tests.torchrun import rlep_in_process
from tests import requires

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return small_task(str(tmp_path_factory.mktemp("task")))


def run_failing_job(hf_dir, task, out, phase, rank, layout):
    """A 2-rank, 2-step ``rlep train`` (checkpoint at step 2) with
    ``RLEP_FAULT_INJECT=<phase>:<rank>``: it must exit non-zero within 60 s of the failure and
    print the injected error."""
    proc = run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                     *train_overrides(hf_dir, task, str(out), steps=2),
                     "trainer.validation_interval_steps=0", *layout],
                    nproc=2, timeout_s=JOB_TIMEOUT_S, check=False,
                    env={"RLEP_FAULT_INJECT": f"{phase}:{rank}"})
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"injected failure in phase '{phase}' on rank {rank}" in output, output[-3000:]
    # from the failure itself (not from the launch, whose start-up varies with the load)
    at = re.search(r"RLEP_FAULT_INJECT: raising in phase \S+ on rank \d+ at ([0-9.]+)", output)
    assert at, output[-3000:]
    assert ended - float(at.group(1)) < 60, f"the job took {ended - float(at.group(1)):.0f}s to end"


@pytest.mark.parametrize("phase, rank, layout", [
    ("rollout", 0, ["rollout.tensor_model_parallel_size=2"]),
    ("old_logprob", 1, ["parallel.tensor_model_parallel_size=2"]),
    # the last pipeline stage fails; the first waits in recv_backward
    ("train", 1, ["parallel.pipeline_model_parallel_size=2"]),
    # one-step-off rollout: a replica fails inside the request-level engine loop while the
    # other steps its own; and a failure in the update while requests wait to be carried over
    ("engine_step", 1, ["trainer.max_staleness=1"]),
    ("train", 0, ["trainer.max_staleness=1", "parallel.tensor_model_parallel_size=2"]),
])
def test_a_failing_rank_ends_the_job(tiny_qwen2_dir, task, tmp_path, phase, rank, layout):
    run_failing_job(tiny_qwen2_dir, task, tmp_path / "run", phase, rank, layout)
    if phase == "rollout":
        # the killed rollout replica's shared memory does not block the next job of the same
        # layout: it starts its engine, trains step 1, syncs the weights and generates step 2,
        # then fails in its checkpoint (rank 0 waits at the checkpoint barrier): the step
        # before the failed save was logged, and nothing half-written was left behind
        again = tmp_path / "again"
        run_failing_job(tiny_qwen2_dir, task, again, "checkpoint", 1, layout)
        assert [e["step"] for e in read_jsonl(again / "metrics.jsonl")] == [1]
        assert not (again / "checkpoints" / "step_00000002").exists()


def test_a_malformed_fault_setting_is_refused(tiny_qwen2_dir, task, tmp_path, monkeypatch):
    """Refused before any model is built, so the command runs in this process (a process of
    its own would only add its start-up), the setting in this process's environment."""
    monkeypatch.setenv("RLEP_FAULT_INJECT", "training:0")
    proc = rlep_in_process(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
                            *train_overrides(tiny_qwen2_dir, task, str(tmp_path / "run"),
                                             steps=1)])
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert "RLEP_FAULT_INJECT='training:0'" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
