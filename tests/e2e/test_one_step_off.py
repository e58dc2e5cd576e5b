"""``trainer.max_staleness >= 1`` end to end on CPU (RLEP with a pool, 2 ranks, two rollout
replicas): the staleness every step reports stays within the bound and is really there, and a
run killed with SIGKILL between two checkpoints resumes to exactly the straight run."""
import signal

import pytest

from tests import requires
from tests.e2e.helpers import (CONTRACT_KEYS, read_jsonl, recipe, reference_pool,
                               run_rlep, small_task, split_train_file, train_overrides)
from tests.e2e.test_sync_equivalence import weights_digest

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_qwen2_dir):
    task = small_task(str(tmp_path_factory.mktemp("task")))
    pool = reference_pool(task, str(tmp_path_factory.mktemp("pool") / "pool.parquet"))
    return tiny_qwen2_dir, task, pool


def args_for(inputs, out, steps, *extra):
    hf_dir, task, pool = inputs
    return ["train", "--config", recipe("tiny_cpu_rlep.yaml"),
            *train_overrides(hf_dir, task, str(out), steps=steps),
            f"replay.pool_files=[{pool}]", "replay.num_replays_per_prompt=2",
            "algo.rollout_correction=truncate", *extra]


def test_every_token_is_within_the_staleness_bound(inputs, tmp_path):
    """Checkpoints only at the end: no token is more than ``staleness`` versions old, and
    batches generated ahead really are. The untrained model never stops before its budget, so
    every response of a batch ends in the same engine step: the batches ahead finish with the
    step's own, the next step finds its batch done and the one after starts fresh. Stale
    batches then come every other step at staleness 1, two in three at 2 (the learning test,
    whose responses end unevenly, sees them on most steps). Here at staleness 2 on one rank;
    staleness 1 on two ranks (two rollout replicas) is the next test's."""
    staleness = 2
    out = tmp_path / "run"
    run_rlep(args_for(inputs, out, 6, f"trainer.max_staleness={staleness}",
                      "checkpoint.save_interval_steps=0"))
    entries = read_jsonl(out / "metrics.jsonl")[1:]
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5, 6]
    for entry in entries:
        for key in CONTRACT_KEYS:
            assert key in entry, key
        assert 0 <= entry["rollout/staleness_mean"] <= entry["rollout/staleness_max"] <= staleness
    stale = [e["rollout/staleness_max"] for e in entries]
    assert stale == [0, 1, 2, 0, 1, 2]
    # the behaviour log-prob of a stale token is the older version's: the engine/actor gap is
    # on those tokens, not on the current version's
    carried = [e for e in entries if e["rollout/carried_over_frac"] > 0]
    assert carried and all(e["rollout/logprob_abs_diff/carried"] > 1e-3 for e in carried)
    assert all(e["rollout/logprob_abs_diff/current"] <= 1e-4 for e in entries)


def test_a_run_killed_between_checkpoints_resumes_to_the_straight_run(inputs, tmp_path):
    """One step off, checkpoints every 2 steps: the straight run, and the same run killed
    (SIGKILL to every process) once step 3 is logged, then started again: it resumes from
    step 2 and ends with the straight run's metrics and weights. In the straight run no token
    is more than one version old, and the steps before a checkpoint (drain points) train the
    batch generated ahead of them while the steps after one start afresh. The training rows
    come from two files mixed 3:1 (``data.train_weights``): the mixing sampler's place is part
    of what resumes exactly."""
    first, second = split_train_file(inputs[1], str(tmp_path))
    mixed = ("trainer.max_staleness=1", f"data.train_files=[{first},{second}]",
             f"data.train_weights={{{first}: 3, {second}: 1}}")
    straight = tmp_path / "straight"
    run_rlep(args_for(inputs, straight, 4, *mixed), nproc=2)
    stale = [e["rollout/staleness_max"] for e in read_jsonl(straight / "metrics.jsonl")[1:]]
    assert stale == [0, 1, 0, 1]
    killed = tmp_path / "killed"
    args = args_for(inputs, killed, 4, *mixed)
    # SIGKILL to every process as step 4's training begins (step 3 logged, its batch's
    # successor already generated ahead; the last checkpoint is step 2's)
    proc = run_rlep(args, nproc=2, check=False, env={"RLEP_FAULT_INJECT": "kill@train:4"})
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    assert [e["step"] for e in read_jsonl(killed / "metrics.jsonl")] == [0, 1, 2, 3]
    assert not (killed / "checkpoints" / "step_00000004").exists()
    resumed = run_rlep(args, nproc=2)
    log = resumed.stdout + resumed.stderr
    assert "step_00000002 (step 2)" in log, [line for line in log.splitlines() if "resum" in line]
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [e["step"] for e in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b):
        x = {k: v for k, v in x.items() if not k.startswith("timing/")}
        y = {k: v for k, v in y.items() if not k.startswith("timing/")}
        assert x == y, x["step"]
    assert any(e.get("rollout/staleness_max", 0) > 0 for e in b[3:])
    assert (weights_digest(str(straight / "checkpoints" / "step_00000004" / "dist"))
            == weights_digest(str(killed / "checkpoints" / "step_00000004" / "dist")))
