"""PEFT's LoRA adapter format in and out: ``adapter_config.json`` and
``adapter_model.safetensors`` with one ``lora_A`` / ``lora_B`` pair per HF projection
(``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`` ...), which ``peft`` and
``vllm serve --lora-modules`` load."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from rlep_megatron import distributed
from rlep_megatron.lora.adapters import Adapters, chunk_adapters
from rlep_megatron.lora.targets import MLP_TARGETS, TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_name(layer: int, projection: str, factor: str) -> str:
    """PEFT's tensor name of factor ``A`` or ``B`` of a projection's adapter at a layer."""
    return (f"base_model.model.model.layers.{layer}.{TARGETS[projection].hf_module}"
            f".lora_{factor}.weight")


def targets_of(tensors: dict[str, torch.Tensor]) -> set[str]:
    """The projections (``q_proj``, ...) a set of PEFT-named adapter tensors adapts."""
    return {name.split(".")[-3] for name in tensors}


def peft_config(lora, base_model: str = "", targets=None) -> dict:
    """``adapter_config.json`` of an adapter trained with ``lora`` (a
    :class:`~rlep_megatron.config.LoraConfig`); ``targets``: the projections it adapts (default
    the section's; a mixture-of-experts model's ``all-linear`` adapts fewer)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(targets or lora.targets()), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "base_model_name_or_path": base_model}


def lora_config_of(directory: str, **overrides):
    """The :class:`~rlep_megatron.config.LoraConfig` a PEFT adapter directory was made with
    (rank, alpha, dropout, targets), for tools that take an adapter as it is."""
    from rlep_megatron.config import LoraConfig

    with open(os.path.join(directory, CONFIG_FILE)) as f:
        config = json.load(f)
    targets = config.get("target_modules") or []
    targets = sorted(targets if isinstance(targets, list) else [targets])
    return LoraConfig(**{"rank": int(config["r"]), "alpha": float(config["lora_alpha"]),
                         "dropout": float(config.get("lora_dropout") or 0.0),
                         "target_modules": targets, **overrides})


def full_tensors(chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the model under its PEFT name, full (unsplit), in the
    parameters' dtype on the CPU, on every rank. Collective over the TP and PP groups."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    own: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        adapters = chunk_adapters(chunk)
        for layer, name, projection in (adapters.projections() if adapters else ()):
            for factor in ("A", "B"):
                tensor = getattr(projection, factor).detach()
                if tp_size > 1 and factor == projection.split:
                    parts = [torch.empty_like(tensor) for _ in range(tp_size)]
                    distributed.all_gather(parts, tensor.contiguous(), group=tp_group)
                    tensor = torch.cat(parts, dim=projection.axis)
                own[peft_name(layer, name, factor)] = tensor.cpu()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        merged: dict[str, torch.Tensor] = {}
        for part in distributed.all_gather_object(own, group=ps.get_pipeline_model_parallel_group()):
            merged.update(part)
        own = merged
    return dict(sorted(own.items()))


def save(directory: str, tensors: dict[str, torch.Tensor], lora, base_model: str = "",
         dtype: Optional[torch.dtype] = None) -> None:
    """Write a PEFT adapter directory (one rank calls it); each file lands whole or not at all
    (written aside, then renamed)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    weights = {name: (t.to(dtype) if dtype else t).contiguous() for name, t in tensors.items()}
    partial = os.path.join(directory, WEIGHTS_FILE + ".partial")
    save_file(weights, partial, metadata={"format": "pt"})
    os.replace(partial, os.path.join(directory, WEIGHTS_FILE))
    partial = os.path.join(directory, CONFIG_FILE + ".partial")
    with open(partial, "w") as f:
        json.dump(peft_config(lora, base_model, targets_of(tensors)), f, indent=2)
    os.replace(partial, os.path.join(directory, CONFIG_FILE))


def load(directory: str, lora, dims, moe: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a PEFT adapter directory, after checking that it is an adapter this run
    can start from: the rank, alpha and targets of ``lora``, the shapes of the model with
    ``dims`` (an adapter of another base is refused here, before it is applied), and every
    tensor the targets need at every layer (``moe``: a mixture-of-experts model, whose MLP
    layers may have none)."""
    from safetensors.torch import load_file

    from rlep_megatron.lora.targets import projection_shape

    config_path = os.path.join(directory, CONFIG_FILE)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"lora.init_from={directory}: no {os.path.basename(path)} "
                                    "(a PEFT LoRA adapter directory has adapter_config.json "
                                    "and adapter_model.safetensors)")
    with open(config_path) as f:
        config = json.load(f)
    theirs = config.get("target_modules") or []
    theirs = sorted(theirs if isinstance(theirs, list) else [theirs])
    mismatched = [f"{key}: adapter {got!r}, run {want!r}" for key, got, want in (
        ("peft_type", config.get("peft_type"), "LORA"), ("r", config.get("r"), lora.rank),
        ("lora_alpha", float(config.get("lora_alpha", 0)), float(lora.alpha)),
        ("target_modules", theirs, sorted(lora.targets())),
        ("use_rslora", bool(config.get("use_rslora")), False),
        ("use_dora", bool(config.get("use_dora")), False)) if got != want]
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
        if config.get(key):
            mismatched.append(f"{key}: {config[key]!r} (per-layer ranks, scales or layers, and "
                              "whole modules saved beside the adapter, are not supported)")
    if mismatched:
        raise ValueError(f"lora.init_from={directory} does not match the lora section: "
                         + "; ".join(mismatched))
    try:
        tensors = load_file(weights_path)
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"lora.init_from={directory}: {WEIGHTS_FILE} is unreadable: "
                         f"{err}") from None
    for name, tensor in tensors.items():
        parts = name.split(".")
        projection, factor = parts[-3], parts[-2][-1]
        if projection not in TARGETS or not parts[-2].startswith("lora_") or factor not in "AB":
            raise ValueError(f"lora.init_from={directory}: {name} is no LoRA factor of the "
                             "supported projections (q/k/v/o_proj, gate/up/down_proj)")
        out_features, in_features = projection_shape(projection, dims)
        want = (lora.rank, in_features) if factor == "A" else (out_features, lora.rank)
        if tuple(tensor.shape) != want:
            raise ValueError(f"lora.init_from={directory}: {name} has shape "
                             f"{tuple(tensor.shape)}, this model's {projection} needs {want}: "
                             "the adapter was trained on another base model")
    expected = {peft_name(layer, projection, factor) for layer in range(dims.num_layers)
                for projection in lora.targets() for factor in "AB"
                if not (moe and projection in MLP_TARGETS)}
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"lora.init_from={directory} lacks {len(missing)} of the tensors the "
                         f"lora section's targets need, e.g. {missing[0]}")
    return tensors


def assign(chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> None:
    """Copy full PEFT tensors into this rank's adapters (each takes its own shard); every
    adapter of the model must be present."""
    missing = []
    for chunk in chunks:
        adapters: Optional[Adapters] = chunk_adapters(chunk)
        for layer, name, projection in (adapters.projections() if adapters else ()):
            rank, size = adapters.tp
            for factor in ("A", "B"):
                full = tensors.get(peft_name(layer, name, factor))
                if full is None:
                    missing.append(peft_name(layer, name, factor))
                    continue
                if factor == projection.split:
                    full = full.chunk(size, dim=projection.axis)[rank]
                param = getattr(projection, factor)
                with torch.no_grad():
                    param.copy_(full.to(param.dtype))
    if missing:
        raise ValueError(f"the adapter lacks {len(missing)} tensor(s) this model's targets "
                         f"need, e.g. {missing[0]}")
