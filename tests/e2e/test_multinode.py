"""The multi-node launcher across two hosts: two network namespaces joined by a veth pair, each
a "node" with its own address and interface, run `scripts/train_multinode.sh` (torchrun with a
c10d rendezvous on node 0's address, one rank each, gloo bound to each node's interface by
IFNAME) for `rlep train`, `collect` and `eval`; their metrics and outputs equal those of the
same job launched as two ranks on one node."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from rlep_megatron.data.schema import read_prompt_file
from tests import requires
from tests.e2e.helpers import (SAMPLED_EVAL, read_jsonl, recipe, run_rlep, small_task,
                               train_overrides)
from tests.e2e.helpers import sampled_eval_of_memorised  # noqa: F401 (fixture)
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


def on_two_hosts(two_hosts, job: str, args: list[str], roles=(None, None)) -> list[str]:
    """``JOB=job scripts/train_multinode.sh tiny_cpu_baseline.yaml args`` on each host (one
    rank each, node 0 the rendezvous host); the outputs of both, after checking that each
    node found its address and interface."""
    master = two_hosts[0][1]
    nodes = []
    for node_rank, (namespace, _, interface) in enumerate(two_hosts):
        env = _env({"NNODES": "2", "NODE_RANK": str(node_rank), "MASTER_ADDR": master,
                    "MASTER_PORT": "29500", "GPUS_PER_NODE": "1", "IFNAME": interface,
                    "PYTHON": sys.executable, "JOB": job,
                    **({"NODE_ROLE": roles[node_rank]} if roles[node_rank] else {})})
        nodes.append(subprocess.Popen(
            ["ip", "netns", "exec", namespace, "bash",
             os.path.join(REPO_ROOT, "scripts", "train_multinode.sh"),
             recipe("tiny_cpu_baseline.yaml"), *args],
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
        assert f"rlep {job}, node" in output and f"({address}), rendezvous {master}:29500" in output
        assert f"GLOO_SOCKET_IFNAME={interface}" in output
    return outputs


# two runs compared value for value: no response cut by an update, whose place would depend on
# timing (rollout.carry_over=finish, as in test_separate_placement.py)
SEPARATE = ("rollout.placement=separate", "rollout.num_ranks=1", "trainer.max_staleness=1",
            "algo.rollout_correction=truncate", "rollout.carry_over=finish")


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
    outputs = on_two_hosts(two_hosts, "train", args(tmp_path / "nodes"), roles)
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


def test_two_hosts_collect_and_evaluate_like_one_node(two_hosts, memorised,
                                                      sampled_eval_of_memorised, tmp_path):
    """``JOB=collect`` and ``JOB=eval`` through the same launcher on the two hosts (a model
    that answers its 6 questions, so the pool fills): the pool, with each answer's behaviour
    log-probs, and the evaluation's report equal those of the same jobs as two ranks on one
    node (the eval's: the suite's shared one, of the same model and settings)."""
    task, model = memorised(tmp_path / "task", tmp_path / "model")
    common = [f"model.hf_dir={model}", "reward.num_workers=1", "rollout.max_response_tokens=32",
              "data.max_prompt_tokens=96"]
    collect = lambda out: [*common, f"data.train_files=[{task['train']}]",  # noqa: E731
                           f"collect.checkpoint={model}", f"collect.output_file={out}",
                           "collect.num_shards=2", "collect.num_samples_per_prompt=4"]
    on_two_hosts(two_hosts, "collect", collect(tmp_path / "collect_nodes.parquet"))
    run_rlep(["collect", "--config", recipe("tiny_cpu_baseline.yaml"),
              *collect(tmp_path / "collect_one.parquet")], nproc=2)
    on_two_hosts(two_hosts, "eval", [f"model.hf_dir={model}", f"eval.files=[{task['train']}]",
                                     f"eval.output_file={tmp_path / 'eval_nodes.json'}",
                                     f"trainer.output_dir={tmp_path}", *SAMPLED_EVAL])
    nodes, one = (read_prompt_file(str(tmp_path / f"collect_{where}.parquet"), behaviour=True)
                  for where in ("nodes", "one"))
    assert len(nodes) >= 3 and nodes.messages == one.messages
    assert nodes.candidates == one.candidates
    for a, b in zip(nodes.behaviour, one.behaviour):
        assert [e["token_ids"].tolist() for e in a] == [e["token_ids"].tolist() for e in b]
        assert [e["logprobs"].tolist() for e in a] == [e["logprobs"].tolist() for e in b]
    nodes, one = json.load(open(tmp_path / "eval_nodes.json")), sampled_eval_of_memorised["eval"]
    assert nodes["report"] == one["report"] and nodes["samples"] == one["samples"]
    assert nodes["report"]["tiny_arith"]["mean@4"] > 0.3
