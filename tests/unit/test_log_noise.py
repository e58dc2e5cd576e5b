"""Known library noise is filtered once at its source (rlep_megatron/platform/device.py;
docs/troubleshooting.md lists it), and ``RLEP_SHOW_ALL_WARNINGS=1`` keeps everything."""
import os
import subprocess
import sys

import pytest

from tests.torchrun import REPO_ROOT

pytestmark = pytest.mark.unit

PROGRAM = """
import logging, os, warnings
import rlep_megatron.platform
warnings.warn("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.",
              UserWarning)
warnings.warn("full scope is deprecated. Use empty cuda_graph_scope.", UserWarning)
warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
warnings.warn("an unrelated warning", UserWarning)
logging.basicConfig(level=logging.INFO)
logging.getLogger("megatron.core.optimizer").info("Setting up optimizer with config ...")
logging.getLogger("vllm.triton_utils.importing").warning(
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.")
print("VLLM_LOGGING_LEVEL=" + os.environ.get("VLLM_LOGGING_LEVEL", "unset"))
"""


def run(show_all: bool) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RLEP_SHOW_ALL_WARNINGS", "VLLM_LOGGING_LEVEL")}
    env["PYTHONPATH"] = REPO_ROOT
    if show_all:
        env["RLEP_SHOW_ALL_WARNINGS"] = "1"
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_known_noise_is_filtered_and_everything_else_kept():
    quiet = run(show_all=False)
    for noise in ("not a leaf Tensor", "full scope is deprecated", "reduce_op",
                  "Setting up optimizer", "CPU backend"):
        assert noise not in quiet, noise
    assert "an unrelated warning" in quiet
    assert "VLLM_LOGGING_LEVEL=WARNING" in quiet


def test_rlep_show_all_warnings_keeps_everything():
    loud = run(show_all=True)
    for noise in ("not a leaf Tensor", "full scope is deprecated", "reduce_op",
                  "Setting up optimizer", "CPU backend", "an unrelated warning"):
        assert noise in loud, noise
    assert "VLLM_LOGGING_LEVEL=unset" in loud
