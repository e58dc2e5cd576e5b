"""The gpu tests' programs see the GPUs as the parent does: with ``CUDA_VISIBLE_DEVICES``
unset (a plain node, ssh, most containers) it stays unset, so they run on the GPU; CPU tests
hide the GPUs. Checked with a faked GPU and a faked subprocess (this machine has none)."""
import subprocess

import pytest
import torch

from tests.gpu import test_gpu
from tests.torchrun import _env

pytestmark = pytest.mark.unit


def launched_env(monkeypatch, run):
    seen = {}

    def fake_run(command, **kwargs):
        seen["env"] = kwargs["env"]
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    run()
    return seen["env"]


def test_gpu_programs_keep_cuda_visible_devices_as_the_parent_has_it(monkeypatch):
    gpu_program = lambda: test_gpu.run_on_gpu("tests/distributed/actor_logprob_program.py",  # noqa: E731
                                              ["--out", "x"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in launched_env(monkeypatch, gpu_program)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert launched_env(monkeypatch, gpu_program)["CUDA_VISIBLE_DEVICES"] == "1,3"
    # the fp32 checks also switch TF32 off for every library
    fp32 = lambda: test_gpu.run_on_gpu("x.py", [], env=test_gpu.NO_TF32)  # noqa: E731
    assert launched_env(monkeypatch, fp32)["NVIDIA_TF32_OVERRIDE"] == "0"


def test_cpu_programs_hide_the_gpus(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _env(None)["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert _env(None)["CUDA_VISIBLE_DEVICES"] == ""


def test_a_gpu_test_that_ran_on_the_cpu_fails():
    with pytest.raises(AssertionError, match="ran on cpu"):
        test_gpu.assert_on_cuda("cpu")
    test_gpu.assert_on_cuda("cuda:0")
