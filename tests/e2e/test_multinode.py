"""The multi-node launcher, run as two "nodes" on this machine: two `scripts/train_multinode.sh`
processes (torchrun with a c10d rendezvous on localhost, one rank each) train a few tiny steps,
and their metrics equal those of the same job launched as two ranks on one node."""
import os
import socket
import subprocess
import sys

import pytest

from tests import requires
from tests.e2e.helpers import read_jsonl, recipe, run_rlep, small_task, train_overrides
from tests.torchrun import REPO_ROOT, _env

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_localhost_nodes_train_like_one_node_of_two_ranks(tiny_qwen2_dir, tmp_path):
    task = small_task(str(tmp_path / "task"))
    args = lambda out: [*train_overrides(tiny_qwen2_dir, task, str(out), steps=2),  # noqa: E731
                        "trainer.validation_interval_steps=1"]
    port = free_port()
    nodes = []
    for node_rank in (0, 1):
        env = _env({"NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "GPUS_PER_NODE": "1", "PYTHON": sys.executable})
        nodes.append(subprocess.Popen(
            ["bash", os.path.join(REPO_ROOT, "scripts", "train_multinode.sh"),
             recipe("tiny_cpu_baseline.yaml"), *args(tmp_path / "nodes")],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"), *args(tmp_path / "one")],
             nproc=2)
    multi = read_jsonl(tmp_path / "nodes" / "metrics.jsonl")
    single = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [e["step"] for e in multi] == [e["step"] for e in single] == [0, 1, 2]
    for a, b in zip(multi, single):
        keys = {k for k in a if not k.startswith("timing/")}
        assert keys == {k for k in b if not k.startswith("timing/")}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    assert multi[2]["train/grad_norm"] > 0
