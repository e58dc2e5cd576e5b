"""LoRA adapters out of a run: a training checkpoint's adapter as a PEFT directory
(:func:`export_adapter`, ``tools/lora_export.py``), and a PEFT adapter merged into its HF base
checkpoint (:func:`merge_adapter`, ``tools/lora_merge.py``). Neither builds a model: the
checkpoint's adapter tensors are read by name, the base's weights one tensor at a time."""
from __future__ import annotations

import os
import time
import warnings

import torch

from rlep_megatron.lora import peft_io
from rlep_megatron.lora.targets import TARGETS


def checkpoint_adapter(checkpoint_dir: str) -> tuple[object, str, dict[str, torch.Tensor]]:
    """``(lora config, base model, PEFT-named tensors)`` of a training checkpoint
    (``<output_dir>/checkpoints/step_XXXXXXXX``) of a run with LoRA."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from rlep_megatron.config import CONFIG_FILE_NAME, load_config

    config_path = os.path.join(checkpoint_dir, CONFIG_FILE_NAME)
    dist_dir = os.path.join(checkpoint_dir, "dist")
    if not (os.path.isfile(config_path) and os.path.isdir(dist_dir)):
        raise FileNotFoundError(f"{checkpoint_dir} is not a training checkpoint (it needs "
                                f"{CONFIG_FILE_NAME} and dist/: <output_dir>/checkpoints/"
                                "step_XXXXXXXX)")
    cfg = load_config(config_path)
    if not cfg.lora.enabled:
        raise ValueError(f"{checkpoint_dir} is a checkpoint of a run without LoRA (lora.rank "
                         "is 0): it has no adapter; convert its full weights with "
                         "tools/convert_mcore_to_hf.py")
    metadata = FileSystemReader(dist_dir).read_metadata().state_dict_metadata
    keys = sorted(k for k in metadata if k.startswith("lora.layers."))
    state = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=dist_dir, no_dist=True)
    tensors = {}
    for key, tensor in state.items():
        _, _, layer, projection, factor = key.split(".")
        tensors[peft_io.peft_name(int(layer), projection, factor)] = tensor
    return cfg.lora, cfg.model.hf_dir, tensors


def export_adapter(checkpoint_dir: str, out_dir: str, dtype: str = "float32") -> str:
    """Write a training checkpoint's adapter as a PEFT adapter directory (atomically); returns
    a summary line."""
    from rlep_megatron.staging import staged_output

    start = time.perf_counter()
    lora, base, tensors = checkpoint_adapter(checkpoint_dir)
    with staged_output(out_dir) as staging:
        peft_io.save(staging, tensors, lora, base_model=base, dtype=getattr(torch, dtype))
    size = sum(t.numel() for t in tensors.values())
    return (f"LoRA export: {len(tensors)} tensors ({size:,} parameters, rank {lora.rank}) "
            f"-> {out_dir} in {time.perf_counter() - start:.1f} s")


def merge_adapter(adapter_dir: str, hf_dir: str, out_dir: str,
                  max_shard_bytes: int = 5 * 1024 ** 3) -> str:
    """The HF checkpoint ``hf_dir`` with the PEFT adapter merged in (each adapted weight
    ``W + alpha / r x B A``, computed in float32, stored in the base's dtype), written to
    ``out_dir`` atomically with the base's config and tokenizer; returns a summary line."""
    from safetensors.torch import save_file

    from rlep_megatron.checkpoint.convert import ShardWriter, copy_hf_side_files
    from rlep_megatron.checkpoint.hf_io import SafetensorsReader, load_hf_config
    from rlep_megatron.models.llama_family import dims_from_config
    from rlep_megatron.staging import staged_output

    start = time.perf_counter()
    from rlep_megatron.models import num_experts

    lora = peft_io.lora_config_of(adapter_dir)
    hf_config = load_hf_config(hf_dir)
    tensors = peft_io.load(adapter_dir, lora, dims_from_config(hf_config),
                           moe=bool(num_experts(hf_config)))
    reader = SafetensorsReader(hf_dir)
    scale = lora.alpha / lora.rank
    merged = 0
    with staged_output(out_dir) as staging:
        writer = ShardWriter(staging, max_shard_bytes, save_file)
        for name in reader.names():
            weight = reader.get(name)
            a = tensors.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
            if a is not None:
                b = tensors[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
                weight = (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
                merged += 1
            writer.add(name, weight)
        if merged * 2 != len(tensors):  # (the staged output is then removed)
            raise ValueError(f"{adapter_dir} adapts {len(tensors) // 2} weights, {hf_dir} "
                             f"has {merged} of them")
        writer.finish()
        copy_hf_side_files(hf_dir, staging)
    names = sorted({t.hf_module for t in TARGETS.values() if t.name in lora.targets()})
    return (f"LoRA merge: {merged} weights ({', '.join(names)}) of {hf_dir} -> {out_dir} in "
            f"{time.perf_counter() - start:.1f} s")
