"""``rollout.placement: separate`` before anything runs: the config's rules, `rlep plan`'s split
of trainer and rollout GPUs (checked against the colocated plan of the same recipe and a
re-derivation of the vLLM budget), `rlep init --rollout-nodes / --rollout-servers`, and the
version spans read from a server's generate response."""
import json
import os

import pytest

from rlep_megatron import config as config_lib

pytestmark = pytest.mark.unit

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.placement=separate"], "either rollout.num_ranks"),
    (["rollout.placement=separate", "rollout.num_ranks=1",
      "rollout.server_urls=[http://a:1]"], "not both"),
    (["rollout.num_ranks=1"], "need rollout.placement=separate"),
    (["rollout.carry_over=keep"], "need rollout.placement=separate"),
    (["rollout.placement=separate", "rollout.num_ranks=1",
      "rollout.tensor_model_parallel_size=2"], "its own GPU"),
    (["rollout.placement=separate", "rollout.num_ranks=1", "algo.routing_replay=rollout"],
     "returns no routing"),
    (["rollout.placement=elsewhere"], "not one of"),
])
def test_bad_separate_settings_are_refused_with_the_fix(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        config_lib.load_config(os.path.join(EXAMPLES, "tiny_cpu_baseline.yaml"), overrides)


def test_plan_splits_trainer_and_rollout_gpus():
    from rlep_megatron import plan

    recipe = os.path.join(EXAMPLES, "qwen3_8b_rlep.yaml")
    with open(os.path.join(EXAMPLES, "model_shapes", "qwen3-8b.json")) as f:
        hf_config = json.load(f)
    colocated = plan.plan(config_lib.load_config(recipe, ["rollout.tensor_model_parallel_size=1"]),
                          hf_config, 16)
    cfg = config_lib.load_config(recipe, ["rollout.placement=separate", "rollout.num_ranks=4",
                                          "rollout.tensor_model_parallel_size=1"])
    separate = plan.plan(cfg, hf_config, 16)
    assert (separate["gpus"], separate["train_gpus"], separate["rollout_gpus"]) == (16, 12, 4)
    # a rollout GPU holds vLLM alone: the server's budget of the card (its own key, higher
    # than a colocated engine's) plus the per-GPU overhead
    server_budget = cfg.rollout.server_gpu_memory_utilization * separate["gpu_mem_gib"]
    assert cfg.rollout.server_gpu_memory_utilization > cfg.rollout.gpu_memory_utilization
    assert separate["peak_rollout_gib"] == pytest.approx(server_budget + plan.OVERHEAD_GIB)
    budget = cfg.rollout.gpu_memory_utilization * separate["gpu_mem_gib"]
    # colocated, the rollout-time peak adds the actor's resident state to its budget; a
    # server's default share keeps its GPU under the planner's 90%
    assert colocated["peak_rollout_gib"] > (cfg.rollout.gpu_memory_utilization
                                            * colocated["gpu_mem_gib"] + plan.OVERHEAD_GIB)
    assert separate["peak_rollout_gib"] <= plan.PEAK_HEADROOM * separate["gpu_mem_gib"]
    # without sleep mode a colocated engine also sits through training; a separate one never
    awake = ["rollout.enable_sleep_mode=false", "rollout.tensor_model_parallel_size=1"]
    colocated_awake = plan.plan(config_lib.load_config(recipe, awake), hf_config, 12)
    separate_awake = plan.plan(config_lib.load_config(
        recipe, [*awake, "rollout.placement=separate", "rollout.num_ranks=4"]), hf_config, 16)
    assert separate_awake["peak_train_gib"] == pytest.approx(
        colocated_awake["peak_train_gib"] - budget)
    assert "12 trainer GPU(s)" in plan.format_plan(separate)
    with pytest.raises(ValueError, match="leaves no training GPU"):
        plan.plan(cfg, hf_config, 4)


def test_a_model_too_large_for_one_rollout_gpu_is_refused_naming_the_fix():
    """rollout.num_ranks serves on one GPU per rank: the 30B-A3B shape's 57 GiB of bf16
    weights do not fit a server's budget there (0.6 x 79.6 GiB here), and `rlep plan`
    refuses it before launch, naming the size and rollout.server_urls; tensor-parallel servers
    given by URL plan."""
    from rlep_megatron import plan

    recipe = os.path.join(EXAMPLES, "qwen3_30b_a3b_rlep.yaml")
    with open(os.path.join(EXAMPLES, "model_shapes", "qwen3-30b-a3b.json")) as f:
        hf_config = json.load(f)
    ranks = config_lib.load_config(recipe, [
        "rollout.placement=separate", "rollout.num_ranks=8", "rollout.tensor_model_parallel_size=1",
        "rollout.server_gpu_memory_utilization=0.6"])
    with pytest.raises(ValueError, match=r"30\.5B parameters take 56\.9 GiB.*rollout\.server_urls"):
        plan.plan(ranks, hf_config, 72)
    urls = config_lib.load_config(recipe, [
        "rollout.placement=separate", "rollout.tensor_model_parallel_size=4",
        "rollout.server_urls=[http://a:8000,http://b:8000]"])
    result = plan.plan(urls, hf_config, 64)
    assert result["rollout"]["weights"] / plan.GIB == pytest.approx(56.9 / 4, abs=0.1)


def test_a_server_takes_its_own_memory_share(tmp_path):
    from rlep_megatron.rollout.servers.launch import serve_arguments

    cfg = config_lib.load_config(os.path.join(EXAMPLES, "tiny_cpu_baseline.yaml"), [
        "rollout.placement=separate", "rollout.num_ranks=1",
        "rollout.server_gpu_memory_utilization=0.85"]).rollout
    args = serve_arguments(str(tmp_path), cfg, port=1, cuda=True, owns_gpu=True)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.85"
    # a server the user starts (rollout.server_urls) keeps rollout.gpu_memory_utilization
    args = serve_arguments(str(tmp_path), cfg, port=1, cuda=True)
    assert args[args.index("--gpu-memory-utilization") + 1] == str(cfg.gpu_memory_utilization)
    with pytest.raises(ValueError, match="server_gpu_memory_utilization"):
        config_lib.load_config(os.path.join(EXAMPLES, "tiny_cpu_baseline.yaml"),
                               ["rollout.server_gpu_memory_utilization=1.5"])


def _one_batch(path: str, rows: int = 512) -> None:
    """A training file as large as one batch of the multi-node templates (``rlep init`` runs
    the pre-flight, the batch size against the dataset included)."""
    import json as json_lib

    from rlep_megatron.data.prepare import convert_jsonl

    source = path + ".jsonl"
    with open(source, "w") as f:
        for i in range(rows):
            f.write(json_lib.dumps({"problem": f"{i} + 1?", "answer": str(i + 1)}) + "\n")
    convert_jsonl(source, path, "math_dapo")


def test_init_writes_rollout_nodes_and_servers(tmp_path, tiny_qwen2_dir, capsys):
    from rlep_megatron.recipe_init import write_recipe

    train = str(tmp_path / "train.parquet")
    _one_batch(train)
    raw = write_recipe(str(tmp_path / "a.yaml"), tiny_qwen2_dir, [train], [], gpus=8, nodes=2,
                       rollout_nodes=1)
    out = capsys.readouterr().out
    assert raw["rollout"]["placement"] == "separate" and raw["rollout"]["num_ranks"] == 8
    assert raw["trainer"]["max_staleness"] == 1
    # the rollout node's own line
    assert "NNODES=3 NODE_RANK=2 MASTER_ADDR=$MASTER_ADDR GPUS_PER_NODE=8 NODE_ROLE=rollout " in out
    raw = write_recipe(str(tmp_path / "b.yaml"), tiny_qwen2_dir, [train], [], gpus=8, nodes=1,
                       rollout_servers=("http://gen0:8000",))
    out = capsys.readouterr().out
    assert raw["rollout"]["server_urls"] == ["http://gen0:8000"]
    assert "VLLM_SERVER_DEV_MODE=1" in out and "--enable-scale-out" in out
    assert "--weight-transfer-config" in out
    with pytest.raises(ValueError, match="not both"):
        write_recipe(str(tmp_path / "c.yaml"), tiny_qwen2_dir, [train], [], gpus=8,
                     rollout_nodes=1, rollout_servers=("http://gen0:8000",))


def test_version_spans_of_a_generate_response():
    from rlep_megatron.rollout.servers.client import RolloutServerError, parse_choice

    choice = {"token_ids": [5, 6, 7], "finish_reason": "length",
              "logprobs": {"content": [{"token_id": t, "logprob": -float(t)} for t in (5, 6, 7)]},
              "weight_versions": [{"version": "3", "start": 0, "end": 2},
                                  {"version": "4", "start": 2, "end": 3}]}
    assert parse_choice(choice, 9) == ([5, 6, 7], [-5.0, -6.0, -7.0],
                                        [(3, 0, 2), (4, 2, 3)], "length")
    # a server that labels nothing (or "default"): the version the request was sent under
    choice["weight_versions"] = [{"version": "default", "start": 0, "end": 3}]
    assert parse_choice(choice, 9)[2] == [(9, 0, 3)]
    del choice["weight_versions"]
    assert parse_choice(choice, 9)[2] == [(9, 0, 3)]
    choice["logprobs"]["content"][1]["token_id"] = 99
    with pytest.raises(RolloutServerError, match="not those of the sampled tokens"):
        parse_choice(choice, 9)


def test_rollout_ranks_follow_the_node_roles_not_the_rank_order():
    """torchrun's c10d rendezvous numbers nodes in its own order: with NODE_ROLE set, the
    ranks of rollout nodes serve wherever they land, the trainers keep their order and are
    renumbered from 0; without roles, the last rollout.num_ranks ranks serve."""
    from rlep_megatron.distributed import assign_roles

    assert assign_roles([None] * 4, 2) == [("train", 0), ("train", 1), ("rollout", 0),
                                           ("rollout", 1)]
    # the rollout node numbered first (2 ranks per node)
    assert assign_roles(["rollout", "rollout", "train", "train"], 2) == [
        ("rollout", 0), ("rollout", 1), ("train", 0), ("train", 1)]
    assert assign_roles(["train", "rollout", "train"], 1) == [
        ("train", 0), ("rollout", 0), ("train", 1)]
    with pytest.raises(ValueError, match="not on global ranks \\[1\\]"):
        assign_roles(["rollout", None], 1)
    with pytest.raises(ValueError, match="rollout.num_ranks=1, but 2 rank"):
        assign_roles(["rollout", "rollout", "train"], 1)
    with pytest.raises(ValueError, match="leaves no training rank"):
        assign_roles(["rollout", "rollout"], 2)
