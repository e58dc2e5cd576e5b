"""Shared pieces of the e2e tests: tiny task files, a pool built from reference solutions, and
running the ``rlep`` CLI (under torchrun for several ranks)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from rlep_megatron.data.schema import read_prompt_file
from rlep_megatron.replay.writer import pool_rows, write_pool
from rlep_megatron.tiny_task import make_tiny_task
from tests import forkserver
from tests.torchrun import REPO_ROOT, _env, once_per_run

CONTRACT_KEYS = ["step", "rollout/reward_mean", "rollout/acc_mean", "rollout/response_len_mean",
                 "replay/fraction", "replay/reward_mean", "train/pg_loss", "train/pg_clipfrac",
                 "train/grad_norm", "train/entropy", "rollout/logprob_abs_diff",
                 "timing/rollout_s", "timing/reward_s", "timing/train_s",
                 "timing/weight_sync_s", "timing/step_s"]


def small_task(directory: str) -> dict[str, str]:
    return make_tiny_task(directory, seed=0, num_train=48, num_val=8, max_operand=20)


def reference_pool(task: dict[str, str], path: str, wrong_second: bool = False) -> str:
    """A pool whose candidates are two correct solutions per training question; with
    ``wrong_second`` the second states a wrong answer (the trainer must re-score replays)."""
    rows = read_prompt_file(task["train"])
    solutions = {}
    for line in open(task["solutions"]):
        item = json.loads(line)
        solutions[item["question"]] = item["solution"]
    candidates = []
    for messages, truth in zip(rows.messages, rows.ground_truth):
        second = f"Answer: {int(truth) + 1}" if wrong_second else f"Answer: {truth}"
        candidates.append([solutions[messages[0]["content"]], second])
    write_pool(pool_rows(rows, candidates, min_correct=2), path)
    return path


def split_train_file(task: dict[str, str], directory: str) -> list[str]:
    """The task's training rows in two files, the first and second half."""
    from rlep_megatron.data.schema import rows_to_table, write_table_atomic

    rows = read_prompt_file(task["train"])
    half = len(rows) // 2
    paths = [os.path.join(directory, name) for name in ("first.parquet", "second.parquet")]
    for path, part in zip(paths, (range(half), range(half, len(rows)))):
        write_table_atomic(rows_to_table(rows.select(list(part))), path)
    return paths


def train_overrides(model_dir: str, task: dict[str, str], out: str, steps: int) -> list[str]:
    return [f"model.hf_dir={model_dir}", f"data.train_files=[{task['train']}]",
            f"data.val_files=[{task['val']}]", "data.train_batch_size=4",
            "data.max_prompt_tokens=96", "rollout.num_samples_per_prompt=4",
            "rollout.max_response_tokens=32", "reward.overlong_buffer_tokens=4",
            "reward.num_workers=1", "trainer.mini_batch_size=2", "optim.lr=1e-3",
            "optim.lr_warmup_steps=0", f"trainer.total_steps={steps}",
            "trainer.validation_interval_steps=2", "eval.num_samples_per_prompt=2",
            "checkpoint.save_interval_steps=2", f"trainer.output_dir={out}"]


# a tiny job takes well under a minute; this bounds a hung one (the suite's per-test deadline,
# pytest.ini's timeout, is longer: a test that runs several jobs has time for each)
JOB_TIMEOUT_S = 420


def run_rlep(args: list[str], nproc: int = 1, timeout_s: float = JOB_TIMEOUT_S,
             check: bool = True, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    """``rlep <args>`` (under torchrun for ``nproc`` > 1; the launcher and each rank forked
    from the test process's fork server, tests/forkserver.py), its output captured; a job still
    running after ``timeout_s`` is killed with every process it started, and the test fails
    with the tail of its output."""
    program = forkserver.command(["-m", "rlep_megatron.cli", *args])
    if nproc > 1:  # the launcher forked too; torchrun's -m when the ranks are not
        program = forkserver.command(["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={nproc}", *program])
    command = [sys.executable, *program]
    job = subprocess.Popen(command, cwd=REPO_ROOT, env=_env(env), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = job.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_job(job)
        stdout, stderr = job.communicate()
        raise AssertionError(f"rlep {args[0]} still running after {timeout_s:.0f} s: killed\n"
                             f"{(stdout + stderr)[-6000:]}") from None
    except BaseException:  # the suite's per-test deadline, or ^C: no orphans left running
        kill_job(job)
        raise
    proc = subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlep {args[0]} failed ({proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    return proc


def resume_from_checkpoint(args: list[str], out, step: int, nproc: int = 2
                           ) -> subprocess.CompletedProcess:
    """Remove the checkpoints that the finished ``rlep train`` ``args`` (output dir ``out``)
    wrote after ``step`` and run ``args`` again: it resumes from that periodic checkpoint, as
    after a crash, cuts ``metrics.jsonl`` after ``step`` and redoes the later steps."""
    root = os.path.join(str(out), "checkpoints")
    later = [name for name in os.listdir(root)
             if name.startswith("step_") and int(name[len("step_"):]) > step]
    assert later and os.path.isdir(os.path.join(root, f"step_{step:08d}")), os.listdir(root)
    for name in later:
        shutil.rmtree(os.path.join(root, name))
    proc = run_rlep(args, nproc=nproc)
    assert f"step_{step:08d} (step {step})" in proc.stdout + proc.stderr  # "resumed from"
    return proc


def read_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def recipe(name: str) -> str:
    return os.path.join(REPO_ROOT, "examples", name)


def kill_job(proc) -> None:
    """SIGKILL a torchrun job started in a session of its own: every descendant (torchrun
    starts each worker in a session of its own), then torchrun. A program forked from the fork
    server is not a descendant: the server kills it, with its own descendants, once its client
    here is dead (tests/forkserver.py)."""
    import psutil

    family = forkserver.kill_tree(proc.pid)
    proc.wait()
    psutil.wait_procs(family, timeout=30)


def eval_of_memorised(tmp_path_factory, memorised, name: str, overrides: list[str],
                      nproc: int) -> dict:
    """``rlep eval`` (tiny_cpu_baseline.yaml, vLLM in-process on each of ``nproc`` ranks) of the
    memorised model (tests/conftest.py) on its 6 training questions, with ``overrides``, run
    once per test run under ``name`` (:func:`tests.torchrun.once_per_run`) for the tests that
    share it: ``{"eval": the report file's content, "stdout": the job's}``."""
    from tests import requires

    requires("vllm")

    def make(directory):
        task, model = memorised(directory / "task", directory / "model")
        out = directory / "eval.json"
        result = run_rlep(["eval", "--config", recipe("tiny_cpu_baseline.yaml"),
                           f"model.hf_dir={model}", f"eval.files=[{task['train']}]",
                           f"eval.output_file={out}", f"trainer.output_dir={directory}",
                           *overrides], nproc=nproc)
        with open(out) as f:
            return {"eval": json.load(f), "stdout": result.stdout}
    return once_per_run(tmp_path_factory, name, make)


# the shared evals' settings, which the tests that compare another job with one of them give it
GREEDY_EVAL = ["eval.num_samples_per_prompt=1", "eval.temperature=0", "reward.num_workers=1",
               "rollout.max_response_tokens=32"]
SAMPLED_EVAL = ["eval.num_samples_per_prompt=4", "reward.num_workers=1",
                "rollout.max_response_tokens=32", "data.max_prompt_tokens=96"]


@pytest.fixture(scope="session")
def greedy_eval_of_memorised(tmp_path_factory, memorised):
    """One greedy answer per question on one rank: the reference that the rollout server
    (tests/e2e/test_collect_eval.py) and the Megatron engine
    (tests/e2e/test_megatron_backend.py) must reproduce token for token."""
    return eval_of_memorised(tmp_path_factory, memorised, "greedy_eval_of_memorised",
                             GREEDY_EVAL, nproc=1)


@pytest.fixture(scope="session")
def sampled_eval_of_memorised(tmp_path_factory, memorised):
    """4 sampled answers per question on two ranks: the one-node reference of the two-host eval
    (tests/e2e/test_multinode.py), and the report whose every metric
    tests/e2e/test_collect_eval.py recounts."""
    return eval_of_memorised(tmp_path_factory, memorised, "sampled_eval_of_memorised",
                             SAMPLED_EVAL, nproc=2)
