"""What a run configuration says, checked against the files it names and the model's HF config,
before any model, process group or engine exists: ``rlep config`` runs these checks, and so does
every job (``train``, ``collect``, ``eval``) before its first expensive step.

Field-level checks (types, ranges, enumerations) live in the config dataclasses; here are the
ones that need the filesystem or several fields at once: the model directory and its
``config.json`` and its architecture, tensor/pipeline parallelism against heads, key/value heads and layers (and
against the world size under torchrun), the rollout's tensor parallelism, the files each job
reads, and ``checkpoint.resume``. Every problem found is reported, one line each.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

from rlep_megatron.config import RunConfig

COMMANDS = ("config", "train", "collect", "eval")


def _hf_config(cfg: RunConfig, problems: list[str]) -> Optional[dict]:
    hf_dir = cfg.model.hf_dir
    if not hf_dir:
        problems.append("model.hf_dir is required: the HF checkpoint directory the run starts "
                        "from (config.json, tokenizer, weights)")
        return None
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        where = "is not a directory" if not os.path.isdir(hf_dir) else "is not an HF checkpoint"
        problems.append(f"model.hf_dir={hf_dir!r} has no config.json ({where}); a hub "
                        "name must already be in the local HF cache (hf download <name>)")
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        problems.append(f"model.hf_dir={hf_dir!r}: config.json is unreadable: {err}")
        return None


def _check_layout(cfg: RunConfig, hf: dict, problems: list[str]) -> None:
    from rlep_megatron.distributed import validate_parallel_layout
    from rlep_megatron.models import layout_limits

    parallel = cfg.parallel
    heads = hf.get("num_attention_heads")
    # outside torchrun: the smallest world the layout fits (experts share the data-parallel
    # ranks)
    stage = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
    model_parallel = math.lcm(stage * parallel.context_parallel_size,
                              stage * parallel.expert_model_parallel_size)
    world = int(os.environ.get("WORLD_SIZE", model_parallel))
    try:
        validate_parallel_layout(world, parallel, **layout_limits(hf))
    except ValueError as err:
        problems.append(f"parallel: {err}")
    if cfg.algo.routing_replay != "off" and not layout_limits(hf)["num_experts"]:
        problems.append(f"algo.routing_replay={cfg.algo.routing_replay} needs a "
                        "mixture-of-experts model; this one is dense: use off")
    elif cfg.algo.routing_replay == "rollout":
        from rlep_megatron.rollout.routing_capture import eager_v1_engine_settings

        try:
            eager_v1_engine_settings(_gpu_engine(), os.environ)
        except ValueError as err:
            problems.append(str(err))
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if getattr(cfg.algo, key) > 0 and not layout_limits(hf)["num_experts"]:
            problems.append(f"algo.{key} needs a mixture-of-experts model; this one is dense: "
                            "use 0")
    if (cfg.rollout.backend == "megatron" and layout_limits(hf)["num_experts"]
            and parallel.tensor_model_parallel_size > 1):
        problems.append("rollout.backend=megatron with a mixture-of-experts model at "
                        "parallel.tensor_model_parallel_size > 1: megatron's MoE layer needs "
                        "sequence parallelism there, which decoding one token at a time cannot "
                        "split; use tensor_model_parallel_size=1 (data-parallel replicas) or "
                        "rollout.backend=vllm")
    rollout_tp = cfg.rollout.tensor_model_parallel_size
    if heads and heads % rollout_tp:
        problems.append(f"rollout.tensor_model_parallel_size={rollout_tp} does not divide the "
                        f"model's {heads} attention heads")
    # (separate placement: the servers' TP, not the trainers')
    if ("WORLD_SIZE" in os.environ and world % rollout_tp  # under torchrun
            and cfg.rollout.placement == "colocated"):
        problems.append(f"rollout.tensor_model_parallel_size={rollout_tp} does not divide the "
                        f"world size {world}")
    positions = hf.get("max_position_embeddings")
    budget = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    if isinstance(positions, int) and budget > positions:
        problems.append(f"data.max_prompt_tokens + rollout.max_response_tokens = {budget} is "
                        f"more than the model's max_position_embeddings ({positions})")


def _check_lora(cfg: RunConfig, hf: dict, problems: list[str]) -> None:
    """The ``lora`` section against the model, and its ``init_from`` adapter."""
    if not cfg.lora.enabled:
        return
    from rlep_megatron.lora.preflight import check

    try:
        check(cfg.lora, hf)
    except (ValueError, OSError) as err:
        problems.append(str(err))


def _check_files(key: str, paths: list[str], problems: list[str],
                 required: bool = False) -> None:
    if required and not paths:
        problems.append(f"{key} is empty: give at least one parquet file")
    for path in paths:
        if not os.path.isfile(path):
            problems.append(f"{key}: {path!r} does not exist")


def _check_resume(cfg: RunConfig, problems: list[str]) -> None:
    mode = cfg.checkpoint.resume
    if mode in ("auto", "never"):
        return
    if not os.path.isfile(os.path.join(mode, "meta.json")):
        problems.append(f"checkpoint.resume={mode!r} is neither auto, never nor a complete "
                        "checkpoint directory (<output_dir>/checkpoints/step_XXXXXXXX)")


def _check_checkpoint(key: str, path: str, problems: list[str]) -> None:
    if path and not os.path.isdir(path):
        problems.append(f"{key}={path!r} does not exist")


def check_run_config(cfg: RunConfig, command: str = "config") -> None:
    """Raise ValueError listing every problem of ``cfg`` for ``command`` (``config`` checks what
    training needs)."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}; one of {COMMANDS}")
    problems: list[str] = []
    hf = _hf_config(cfg, problems)
    if hf is not None:
        from rlep_megatron.models import architecture_for

        try:
            architecture_for(hf)  # a supported family, with options it can map
        except ValueError as err:
            problems.append(f"model.hf_dir={cfg.model.hf_dir!r}: {err}")
        _check_layout(cfg, hf, problems)
        if command in ("config", "train"):
            _check_lora(cfg, hf, problems)
    if command in ("config", "train"):
        _check_files("data.train_files", cfg.data.train_files, problems, required=True)
        _check_files("data.val_files", cfg.data.val_files, problems)
        _check_files("replay.pool_files", cfg.replay.pool_files, problems)
        _check_resume(cfg, problems)
    elif command == "collect":
        _check_files("data.train_files", cfg.data.train_files, problems, required=True)
        # empty: the pool is sampled from model.hf_dir
        _check_checkpoint("collect.checkpoint", cfg.collect.checkpoint, problems)
    elif command == "eval":
        # eval.files, or the validation files when it is empty
        _check_files("eval.files", cfg.eval.files or cfg.data.val_files, problems,
                     required=True)
        _check_checkpoint("eval.checkpoint", cfg.eval.checkpoint, problems)
    if problems:
        if len(problems) == 1:
            raise ValueError(problems[0])
        raise ValueError(f"{len(problems)} problems in the configuration:\n  - "
                         + "\n  - ".join(problems))


def preflight(cfg: RunConfig, command: str = "config"):
    """Every check ``rlep train`` runs before its first expensive step, in one place, which
    ``rlep config`` and ``rlep init`` run too (so they cannot disagree with the job): the
    installed loggers, :func:`check_run_config`, and, for ``config`` and ``train``, the data
    (each file's schema, a reward for every ``data_source`` with the configured function called
    on a sample, the pool's overlap with the training questions) and the batch size against
    the dataset. Returns ``(train_rows, val_rows, pool)`` for ``config`` and ``train`` (what
    the trainer goes on with), else None. Builds no model."""
    from rlep_megatron.metrics import check_loggers

    check_loggers(cfg.trainer.loggers)
    check_run_config(cfg, command)
    if command not in ("config", "train"):
        return None
    from rlep_megatron.data.sampler import make_prompt_sampler
    from rlep_megatron.rollout.side import load_training_data

    data = load_training_data(cfg)
    # data.drop_last: a dataset smaller than one batch gives no batch at all; the mixing
    # weights name files and data sources the data has
    make_prompt_sampler(cfg, data[0])
    return data


def _gpu_engine() -> bool:
    """Whether the rollout engine would run on a GPU (no CUDA initialisation)."""
    from rlep_megatron import platform

    return platform.cuda_available()
