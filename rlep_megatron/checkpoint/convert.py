"""HF safetensors <-> megatron-core ``dist_checkpointing`` (torch_dist) conversion.

HF -> Megatron writes a ``dist_checkpointing`` checkpoint (loadable by megatron-core at any
TP/PP) of the TP=1 x PP=1 model, making each tensor from the HF safetensors (through the same
mapping tables as the actor and weight sync) only when the checkpoint writer reaches it. The HF
config and tokenizer files are copied into ``<out>/hf_config`` so the checkpoint is
self-describing.

Megatron -> HF reads that checkpoint (or a training checkpoint's model part) one layer at a time
and writes HF tensors, sharded with an index above ``max_shard_bytes``, plus config and
tokenizer files. Parameters keep the dtype of ``config.json``, so a round trip reproduces every
HF tensor bit for bit.

Both write into a temporary directory next to the output and rename it when complete: a failed
or interrupted conversion leaves no partial output.

Memory (:mod:`rlep_megatron.checkpoint.streaming`): neither direction holds the model; peak is
about one layer's tensors plus one tensor being re-laid out (plus, megatron -> HF, the
safetensors shard being filled).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Optional

import torch

from rlep_megatron.models import architecture_for, layout
from rlep_megatron.checkpoint.hf_io import INDEX_FILE, SafetensorsReader, load_hf_config
from rlep_megatron.staging import staged_output

logger = logging.getLogger(__name__)

HF_CONFIG_SUBDIR = "hf_config"
_HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_dtype(hf_config: dict[str, Any]) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"config.json dtype {name!r} is not supported; use one of "
                         f"{sorted(_DTYPES)}")
    return _DTYPES[name]


def copy_hf_side_files(src_dir: str, dst_dir: str) -> None:
    os.makedirs(dst_dir, exist_ok=True)
    for name in _HF_SIDE_FILES:
        path = os.path.join(src_dir, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst_dir, name))


def _single_process_model_parallel() -> None:
    from rlep_megatron import distributed
    from rlep_megatron.config import ParallelConfig

    distributed.init_model_parallel(ParallelConfig(), seed=0)


def _skeleton(hf_config: dict[str, Any]):
    """The TP=1 x PP=1 model on the meta device (names, shapes, sharding; no storage)."""
    from rlep_megatron.models.megatron import build_model

    chunks, info = build_model(hf_config, hf_dtype(hf_config), on_meta_device=True)
    return chunks[0], info


def _summary(kind: str, tensors: int, num_bytes: int, seconds: float) -> str:
    return (f"{kind}: {tensors} tensors, {num_bytes / 1e9:.3f} GB in {seconds:.1f} s "
            f"({num_bytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)")


def convert_hf_to_mcore(hf_dir: str, out_dir: str, show_progress: bool = True) -> str:
    """HF checkpoint directory -> megatron-core dist checkpoint; returns a summary line.

    Streams: each megatron tensor is made from its HF tensors when the checkpoint writer
    reaches it and is dropped once written."""
    from rlep_megatron.checkpoint.streaming import save_streaming
    from rlep_megatron.metrics import progress

    hf_config = load_hf_config(hf_dir)
    arch = architecture_for(hf_config)
    reader = SafetensorsReader(hf_dir)  # fails on missing weights before any work
    _single_process_model_parallel()
    start = time.perf_counter()
    totals = {"bytes": 0, "tensors": 0}
    with staged_output(out_dir) as staging:
        skeleton, info = _skeleton(hf_config)
        rules = arch.rules(hf_config)
        dtype = hf_dtype(hf_config)

        def materialize(rule, layer, expert):
            names = rule.hf_names_at(layer, expert)
            tensors = [reader.get(n) for n in names]
            for name, tensor in zip(names, tensors):
                if tensor.dtype != dtype:
                    raise ValueError(f"{name} is {tensor.dtype} but config.json says {dtype}; "
                                     "fix the config's dtype")
            totals["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
            totals["tensors"] += len(tensors)
            return layout.hf_to_full(rule, tensors, info.dims, info.padded_vocab_size)

        num_params = sum(1 for _ in skeleton.parameters())
        with progress(total=num_params, desc="HF -> megatron", unit="tensor",
                      enabled=show_progress) as bar:
            save_streaming(skeleton, rules, materialize, staging,
                           on_tensor=lambda _name: bar.update(1))
        copy_hf_side_files(hf_dir, os.path.join(staging, HF_CONFIG_SUBDIR))
    return _summary("HF -> megatron", totals["tensors"], totals["bytes"],
                    time.perf_counter() - start)


def _resolve_config_dir(mcore_dir: str, hf_config_dir: Optional[str]) -> str:
    from rlep_megatron.checkpoint.dist import resolve_mcore_dir

    if not os.path.isdir(mcore_dir):
        raise FileNotFoundError(f"megatron checkpoint directory not found: {mcore_dir}")
    if not os.path.isfile(os.path.join(resolve_mcore_dir(mcore_dir), "metadata.json")):
        raise FileNotFoundError(f"{mcore_dir} has no metadata.json; is it a megatron-core "
                                "dist_checkpointing directory or a training checkpoint?")
    config_dir = hf_config_dir or os.path.join(mcore_dir, HF_CONFIG_SUBDIR)
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise FileNotFoundError(f"no HF config.json in {config_dir}; pass --hf-config-dir with "
                                "the original HF checkpoint's config and tokenizer")
    return config_dir


def convert_mcore_to_hf(mcore_dir: str, out_dir: str, hf_config_dir: Optional[str] = None,
                        max_shard_bytes: int = 5 * 1024 ** 3, show_progress: bool = True) -> str:
    """megatron-core dist checkpoint (or a training checkpoint) -> HF directory; returns a
    summary line. Reads one layer at a time and flushes each safetensors shard when full."""
    from safetensors.torch import save_file

    from rlep_megatron.checkpoint.dist import resolve_mcore_dir
    from rlep_megatron.checkpoint.streaming import iter_checkpoint_params
    from rlep_megatron.metrics import progress

    from rlep_megatron.checkpoint.dist import refuse_adapter_checkpoint

    refuse_adapter_checkpoint(mcore_dir, "--mcore-dir")
    config_dir = _resolve_config_dir(mcore_dir, hf_config_dir)
    hf_config = load_hf_config(config_dir)
    arch = architecture_for(hf_config)
    _single_process_model_parallel()
    start = time.perf_counter()
    with staged_output(out_dir) as staging:
        skeleton, info = _skeleton(hf_config)
        rules = arch.rules(hf_config)
        tied = bool(hf_config.get("tie_word_embeddings"))
        writer = ShardWriter(staging, max_shard_bytes, save_file)
        num_bytes, count = 0, 0
        params = iter_checkpoint_params(skeleton, rules, resolve_mcore_dir(mcore_dir))
        for _name, rule, layer, expert, full in progress(params, total=sum(1 for _ in
                                                                   skeleton.parameters()),
                                                 desc="megatron -> HF", unit="tensor",
                                                 enabled=show_progress):
            if tied and rule.mcore_name == "output_layer.weight":
                continue  # the HF checkpoint of a tied model has no lm_head
            for hf_name, tensor in zip(rule.hf_names_at(layer, expert),
                                       layout.full_to_hf(rule, full, info.dims)):
                writer.add(hf_name, tensor)
                num_bytes += tensor.numel() * tensor.element_size()
                count += 1
            del full
        writer.finish()
        copy_hf_side_files(config_dir, staging)
    return _summary("megatron -> HF", count, num_bytes, time.perf_counter() - start)


class ShardWriter:
    """Writes HF tensors into safetensors shards of at most ``max_shard_bytes``, flushing each
    shard as soon as it is full; names them and writes the index at the end."""

    def __init__(self, directory: str, max_shard_bytes: int, save_file):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.save_file = save_file
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.parts: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.max_shard_bytes:
            self._flush()
        self.current[name] = tensor.contiguous().clone()
        self.current_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        part = f"part-{len(self.parts):05d}.safetensors"
        self.save_file(self.current, os.path.join(self.directory, part), metadata={"format": "pt"})
        self.parts.append((part, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> None:
        if self.current or not self.parts:
            self._flush()
        if len(self.parts) == 1:
            os.replace(os.path.join(self.directory, self.parts[0][0]),
                       os.path.join(self.directory, "model.safetensors"))
            return
        weight_map = {}
        for index, (part, names) in enumerate(self.parts, start=1):
            file_name = f"model-{index:05d}-of-{len(self.parts):05d}.safetensors"
            os.replace(os.path.join(self.directory, part), os.path.join(self.directory, file_name))
            weight_map.update({name: file_name for name in names})
        with open(os.path.join(self.directory, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_bytes},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)


def run_conversion_cli(tool: str, convert: Callable[..., str], *args) -> int:
    """Run a conversion for a command-line tool: print its summary line, or ``tool: error: ...``
    with exit code 2 for bad input; the process group is torn down either way."""
    import sys

    from rlep_megatron import distributed

    distributed.setup_logging()
    try:
        print(convert(*args))
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"{tool}: error: {err}", file=sys.stderr)
        return 2
    finally:
        distributed.destroy()
    return 0
