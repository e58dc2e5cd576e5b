"""``rlep init``: a recipe for your own model and data, made from the shipped templates.

The template follows the hardware: ``examples/one_gpu.yaml`` for one GPU,
``examples/one_node.yaml`` for one node of several GPUs, the paper's 64-GPU recipes
(``examples/dapo_nodyn_bs64.yaml``, ``examples/rlep.yaml`` with a pool) for several nodes. Into
it go the model directory, the data files, the output directory and (with ``--pool``) RLEP's
M = 2 replays, and (with ``--reward-function``) your own reward; tensor parallelism is lowered
until it divides the model's attention and key/value heads and the GPUs of a node, and the
response budget is cut to the model's context.
The result is checked like ``rlep config`` before it is written, and an existing file is never
overwritten without ``--force``.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import yaml

from rlep_megatron.staging import write_file_atomic
from rlep_megatron.models import num_experts


def template_name(gpus: int, nodes: int, pool: bool) -> str:
    if gpus < 1 or nodes < 1:
        raise ValueError(f"--gpus-per-node and --nodes must be >= 1, got {gpus} and {nodes}")
    if gpus * nodes == 1:
        return "one_gpu.yaml"
    if nodes == 1:
        return "one_node.yaml"
    return "rlep.yaml" if pool else "dapo_nodyn_bs64.yaml"


def _largest_divisor(start: int, *numbers: Optional[int]) -> int:
    """The largest d <= start that divides every given number."""
    for d in range(max(1, start), 0, -1):
        if all(not n or n % d == 0 for n in numbers):
            return d
    return 1


def _model_config(model_dir: str) -> dict:
    from rlep_megatron.config import resolve_hub_name

    path = os.path.join(resolve_hub_name(model_dir), "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir!r} is not an HF model directory (no config.json)")
    with open(path) as f:
        hf = json.load(f)
    from rlep_megatron.models import architecture_for

    architecture_for(hf)  # a supported family, or a clear error naming the supported ones
    return hf


def _training_rows(paths: list[str]) -> Optional[int]:
    """The rows of the training files, from their parquet metadata (None if one is not a
    readable parquet file: the pre-flight says what is wrong with it)."""
    import pyarrow.parquet as pq

    try:
        return sum(pq.ParquetFile(path).metadata.num_rows for path in paths)
    except Exception:  # noqa: BLE001 - reported by the pre-flight, with the file named
        return None


def make_recipe(model_dir: str, train_files: list[str], val_files: list[str], gpus: int = 1,
                nodes: int = 1, pool: str = "", output_dir: str = "",
                reward_function: str = "") -> tuple[dict, str, list[str]]:
    """``(recipe as a dict, template file name, notes on what was adapted)``."""
    from rlep_megatron.demo import examples_dir

    hf = _model_config(model_dir)
    name = template_name(gpus, nodes, bool(pool))
    with open(os.path.join(examples_dir(), name)) as f:
        raw = yaml.safe_load(f)
    notes: list[str] = []
    raw["model"]["hf_dir"] = model_dir
    raw["model"]["mcore_dir"] = ""
    raw["data"]["train_files"] = list(train_files)
    raw["data"]["val_files"] = list(val_files)
    raw["trainer"]["output_dir"] = output_dir or raw["trainer"]["output_dir"]
    raw["replay"]["num_replays_per_prompt"] = 2 if pool else 0
    raw["replay"]["pool_files"] = [pool] if pool else []
    if reward_function:
        raw.setdefault("reward", {})["function"] = reward_function
    raw.setdefault("collect", {})["output_file"] = ""  # <output_dir>/pool.parquet
    heads = hf.get("num_attention_heads")
    kv_heads = hf.get("num_key_value_heads", heads)
    for section in ("parallel", "rollout"):
        want = raw[section]["tensor_model_parallel_size"]
        tp = _largest_divisor(min(want, gpus), heads, kv_heads, gpus)
        if tp != want:
            notes.append(f"{section}.tensor_model_parallel_size {want} -> {tp} (divides the "
                         f"{heads} attention heads, {kv_heads} key/value heads and {gpus} GPUs "
                         f"per node)")
        raw[section]["tensor_model_parallel_size"] = tp
    world = gpus * nodes
    model_parallel = (raw["parallel"]["tensor_model_parallel_size"]
                      * raw["parallel"].get("pipeline_model_parallel_size", 1))
    if world % model_parallel:
        raw["parallel"]["pipeline_model_parallel_size"] = 1
        notes.append("parallel.pipeline_model_parallel_size -> 1 (the template's did not fit "
                     f"{world} GPUs)")
    if num_experts(hf) and raw["parallel"]["tensor_model_parallel_size"] > 1:
        raw["parallel"]["sequence_parallel"] = True
        notes.append("parallel.sequence_parallel -> true (a mixture-of-experts model at TP > 1 "
                     "needs it); parallel.expert_model_parallel_size splits the experts")
    # a dataset smaller than the template's batch (a first try on a small file): one batch of
    # all its rows, rather than a recipe that the pre-flight refuses (drop_last: no batch)
    rows = _training_rows(train_files)
    batch = raw["data"]["train_batch_size"]
    if rows is not None and 0 < rows < batch:
        raw["data"]["train_batch_size"] = rows
        mini = raw["trainer"].get("mini_batch_size", rows)
        raw["trainer"]["mini_batch_size"] = min(mini, rows)
        notes.append(f"data.train_batch_size {batch} -> {rows}"
                     + (f", trainer.mini_batch_size {mini} -> {rows}" if mini > rows else "")
                     + f": the training files hold {rows} rows")
    positions = hf.get("max_position_embeddings")
    prompt, response = raw["data"]["max_prompt_tokens"], raw["rollout"]["max_response_tokens"]
    if isinstance(positions, int) and prompt + response > positions:
        prompt = min(prompt, positions // 4)
        raw["data"]["max_prompt_tokens"] = prompt
        raw["rollout"]["max_response_tokens"] = positions - prompt
        notes.append(f"data.max_prompt_tokens {prompt}, rollout.max_response_tokens "
                     f"{positions - prompt}: the model's context is {positions} tokens")
    return raw, name, notes


def launch_command(recipe: str, gpus: int, nodes: int, roles: bool = False) -> str:
    """``roles``: some nodes generate (``rollout.num_ranks``): each node's line says which."""
    if gpus * nodes == 1:
        return f"rlep train --config {recipe}"
    if nodes == 1:
        return f"scripts/train_local.sh {gpus} {recipe}"
    role = "NODE_ROLE=<train|rollout> " if roles else ""
    return (f"NNODES={nodes} NODE_RANK=<this node> {role}MASTER_ADDR=<node 0> "
            f"GPUS_PER_NODE={gpus} scripts/train_multinode.sh {recipe}")


def launcher_lines(recipe: str, gpus: int, nodes: int, job: str = "train",
                   rollout_nodes: int = 0) -> list[str]:
    """Each node's line of the one launcher, ``scripts/train_multinode.sh`` (which the Slurm
    template of docs/multinode.md runs too): ``$MASTER_ADDR`` is node 0's address, left to the
    shell; ``JOB=collect`` / ``eval`` for the other jobs. With ``rollout_nodes`` the last
    nodes' lines say ``NODE_ROLE=rollout`` and the others ``train``."""
    prefix = "" if job == "train" else f"JOB={job} "
    if nodes == 1:
        return [f"{prefix}scripts/train_local.sh {gpus} {recipe}"]

    def role(rank: int) -> str:
        if not rollout_nodes:
            return ""
        return f"NODE_ROLE={'rollout' if rank >= nodes - rollout_nodes else 'train'} "
    return [f"{prefix}NNODES={nodes} NODE_RANK={rank} MASTER_ADDR=$MASTER_ADDR "
            f"GPUS_PER_NODE={gpus} {role(rank)}scripts/train_multinode.sh {recipe}"
            for rank in range(nodes)]


def separate_rollout(raw: dict, gpus: int, rollout_nodes: int, servers: list[str]) -> list[str]:
    """Generation on nodes of its own (``rollout_nodes``, every GPU a one-GPU vLLM server
    started by the job) or on running servers (``servers``), one step off; returns notes."""
    if rollout_nodes < 0 or (rollout_nodes and servers):
        raise ValueError("give --rollout-nodes (nodes of the job that run vLLM servers) or "
                         "--rollout-servers (running servers), not both")
    if not rollout_nodes and not servers:
        return []
    rollout = raw["rollout"]
    rollout["placement"] = "separate"
    if rollout_nodes:
        rollout["num_ranks"] = rollout_nodes * gpus
        rollout["tensor_model_parallel_size"] = 1
        where = f"{rollout_nodes} rollout node(s), {rollout_nodes * gpus} one-GPU vLLM servers"
    else:
        rollout["server_urls"] = list(servers)
        where = f"{len(servers)} running vLLM server(s)"
    raw["trainer"]["max_staleness"] = 1
    if raw["algo"].get("rollout_correction", "off") == "off":
        raw["algo"]["rollout_correction"] = "truncate"
    raw["algo"]["dynamic_sampling"] = False
    if raw["algo"].get("routing_replay") == "rollout":
        raw["algo"]["routing_replay"] = "actor"
    return [f"rollout.placement separate on {where}; trainer.max_staleness 1 with "
            "algo.rollout_correction truncate (generation overlaps training); "
            "algo.dynamic_sampling off"]


def serve_command(raw: dict) -> str:
    """The command a user starts each rollout server with (``--rollout-servers``)."""
    from rlep_megatron.config import config_from_dict
    from rlep_megatron.rollout.servers.launch import adapter_rank, serve_arguments

    cfg = config_from_dict(raw)
    args = serve_arguments(cfg.model.hf_dir, cfg.rollout, port=8000, host="0.0.0.0",
                           dtype="bfloat16", seed=cfg.trainer.seed,
                           max_model_len=cfg.data.max_prompt_tokens
                           + cfg.rollout.max_response_tokens, cuda=True,
                           lora_rank=adapter_rank(cfg))
    quoted = " ".join(f"'{a}'" if "{" in a else a for a in args)
    env = "VLLM_SERVER_DEV_MODE=1 "
    if adapter_rank(cfg):
        env += "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
    return env + "python -m vllm.entrypoints.openai.api_server " + quoted


def write_recipe(path: str, model_dir: str, train_files: list[str], val_files: list[str],
                 gpus: int = 1, nodes: int = 1, pool: str = "", output_dir: str = "",
                 force: bool = False, reward_function: str = "", rollout_nodes: int = 0,
                 rollout_servers: tuple = ()) -> dict:
    """Make, check (as ``rlep config`` does) and write the recipe; returns it. With
    ``rollout_nodes`` the job has that many more nodes, which generate."""
    from rlep_megatron.checks import preflight
    from rlep_megatron.config import config_from_dict

    if os.path.exists(path) and not force:
        raise FileExistsError(f"{path} exists; give another path or --force to replace it")
    if not train_files:
        raise ValueError("give at least one training file (--train)")
    # the run's own directory, named after the recipe (not the template's: that is the
    # paper baseline's, which a second recipe from the same template would share)
    output_dir = output_dir or os.path.join("outputs",
                                            os.path.splitext(os.path.basename(path))[0])
    raw, name, notes = make_recipe(model_dir, train_files, val_files, gpus, nodes, pool,
                                   output_dir, reward_function)
    notes += separate_rollout(raw, gpus, rollout_nodes, list(rollout_servers))
    training_nodes, nodes = nodes, nodes + rollout_nodes
    cfg = config_from_dict(raw)
    saved = os.environ.pop("WORLD_SIZE", None)  # checked for the recipe's own world size
    try:
        preflight(cfg, "config")
    finally:
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved
    header = [f"# Made by `rlep init` from examples/{name} for {gpus * nodes} GPU(s) "
              f"({nodes} node(s) x {gpus}"
              + (f"; nodes {training_nodes}..{nodes - 1} generate" if rollout_nodes else "")
              + ").",
              "# Every key: docs/CONFIG.md (`rlep config --reference`). Check before launch: "
              f"`rlep config --config {path}`.",
              f"# Launch: {launch_command(path, gpus, nodes, bool(rollout_nodes))}"]
    header += [f"# adapted: {note}" for note in notes]
    text = "\n".join(header) + "\n" + yaml.safe_dump(raw, sort_keys=False)
    write_file_atomic(path, text)
    for note in notes:
        print(f"adapted: {note}")
    print(f"wrote {path} (from examples/{name})\nnext: rlep config --config {path}\n"
          f"then: {launch_command(path, gpus, nodes, bool(rollout_nodes))}")
    if nodes > 1:
        lines = launcher_lines(path, gpus, nodes, rollout_nodes=rollout_nodes)
        print("on each node (MASTER_ADDR: node 0's address on the network the nodes share; "
              "IFNAME=<interface> on nodes with several; JOB=collect or JOB=eval in front for "
              "those jobs):")
        shown = lines if len(lines) <= 4 else lines[:2]
        for rank, line in enumerate(shown):
            print(f"  node {rank}: {line}")
        if len(shown) < len(lines):
            print(f"  node r = 2 .. {nodes - 1}: node 1's line with NODE_RANK=r")
    if rollout_nodes:
        print(f"nodes {training_nodes} .. {nodes - 1} (the last {rollout_nodes}) start the vLLM "
              "servers (NODE_ROLE=rollout); the "
              "others train (NODE_ROLE=train). Set the role on every node: torchrun numbers "
              "the nodes in its own order, not by NODE_RANK")
    if rollout_servers:
        print(f"start each rollout server first (one per URL in rollout.server_urls; its port "
              f"in --port):\n  {serve_command(raw)}")
    return raw
