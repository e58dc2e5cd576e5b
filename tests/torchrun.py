"""Run a script or a ``module:function`` under torchrun with N CPU ranks, from tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Optional, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env(extra: Optional[dict[str, str]], gpu: bool = False) -> dict[str, str]:
    """The environment of a test's subprocess. CPU tests hide every GPU
    (``CUDA_VISIBLE_DEVICES=""``), so that they test the CPU path on any machine; gpu tests
    keep the parent's ``CUDA_VISIBLE_DEVICES`` exactly, unset included."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_torchrun(script: str, nproc: int, args: Sequence[str] = (), timeout_s: float = 600,
                 env: Optional[dict[str, str]] = None, gpu: bool = False
                 ) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc script args``; raises with the output's tail
    when a rank fails or the run exceeds ``timeout_s``. ``gpu``: the ranks see the GPUs."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", script, *args]
    try:
        proc = subprocess.run(command, cwd=REPO_ROOT, env=_env(env, gpu), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        tail = (err.stdout or b"")[-4000:] if isinstance(err.stdout, bytes) else (err.stdout or "")
        raise AssertionError(f"torchrun {script} timed out after {timeout_s}s:\n{tail}") from None
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"torchrun {script} x{nproc} failed ({proc.returncode}):\n{output}")
    return proc


def run_function(target: str, nproc: int, kwargs: Optional[dict[str, Any]] = None,
                 timeout_s: float = 600) -> subprocess.CompletedProcess:
    """Run ``package.module:function(**kwargs)`` on every rank under torchrun."""
    runner = os.path.join(REPO_ROOT, "tests", "function_runner.py")
    return run_torchrun(runner, nproc, [target, json.dumps(kwargs or {})], timeout_s=timeout_s)
