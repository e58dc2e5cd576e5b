"""The multi-node launcher across two hosts: two network namespaces joined by a veth pair, each
a "node" with its own address and interface, run `scripts/train_multinode.sh` (torchrun with a
c10d rendezvous on node 0's address, one rank each, gloo bound to each node's interface by
IFNAME); their metrics equal those of the same job launched as two ranks on one node."""
import os
import shutil
import subprocess
import sys

import pytest

from tests import requires
from tests.e2e.helpers import read_jsonl, recipe, run_rlep, small_task, train_overrides
from tests.torchrun import REPO_ROOT, _env

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """``[(namespace, address, interface)] x 2`` on a private /24, removed afterwards."""
    if shutil.which("ip") is None:
        pytest.fail("this test needs iproute2 (`ip netns`) and the right to create namespaces")
    tag = os.getpid() % 10000
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    hosts = [(f"rlep{tag}n{i}", f"{subnet}.{i + 1}", f"rlep{tag}v{i}") for i in range(2)]
    try:
        for namespace, _, _ in hosts:
            _ip("netns", "add", namespace)
        _ip("link", "add", hosts[0][2], "type", "veth", "peer", "name", hosts[1][2])
        for namespace, address, interface in hosts:
            _ip("link", "set", interface, "netns", namespace)
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
            _ip("-n", namespace, "link", "set", interface, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


SEPARATE = ("rollout.placement=separate", "rollout.num_ranks=1", "trainer.max_staleness=1",
            "algo.rollout_correction=truncate")


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_two_hosts_train_like_one_node_of_two_ranks(two_hosts, tiny_qwen2_dir, tmp_path,
                                                     placement):
    """``separate``: the rollout host is listed first (node 0, the rendezvous host, with the
    lower address, which torchrun's c10d rendezvous numbers first) and trains nothing: its
    rank starts the vLLM server (``NODE_ROLE=rollout``), which the training host reaches at
    the rollout host's address; the weights go the other way over rlep_gloo."""
    task = small_task(str(tmp_path / "task"))
    extra = SEPARATE if placement == "separate" else ()
    roles = ["rollout", "train"] if placement == "separate" else [None, None]
    args = lambda out: [*train_overrides(tiny_qwen2_dir, task, str(out), steps=2),  # noqa: E731
                        "trainer.validation_interval_steps=1", *extra]
    master = two_hosts[0][1]
    nodes = []
    for node_rank, (namespace, _, interface) in enumerate(two_hosts):
        env = _env({"NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": master,
                    "MASTER_PORT": "29500", "GPUS_PER_NODE": "1", "IFNAME": interface,
                    "PYTHON": sys.executable,
                    **({"NODE_ROLE": roles[node_rank]} if roles[node_rank] else {})})
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", namespace, "bash",
             os.path.join(REPO_ROOT, "scripts", "train_multinode.sh"),
             recipe("tiny_cpu_baseline.yaml"), *args(tmp_path / "nodes")],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True))
    try:
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-4000:]
    for (_, address, interface), output in zip(two_hosts, outputs):
        assert f"({address}), rendezvous {master}:29500" in output
        assert f"GLOO_SOCKET_IFNAME={interface}" in output
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
    if placement == "separate":
        # the server ran on the rollout host (node 0), and the trainer on the training host
        # (node 1) used it at the rollout host's address
        assert f"vLLM server(s) at http://{two_hosts[0][1]}:" in outputs[1], outputs[1][-3000:]
        assert "role rollout" in outputs[0] and "role train" in outputs[1]
        assert (tmp_path / "nodes" / "rollout_server_0.log").exists()
