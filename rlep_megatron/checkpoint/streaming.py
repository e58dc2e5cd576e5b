"""Tensor-by-tensor reading and writing of megatron-core ``dist_checkpointing`` (torch_dist)
model checkpoints, so that conversion never holds the whole model.

Both directions start from a *skeleton*: the TP=1 x PP=1 ``GPTModel`` built on the meta device,
whose ``sharded_state_dict()`` gives every checkpoint key, shape and sharding without storage.

* Writing (:func:`save_streaming`) goes through megatron's own ``dist_checkpointing.save`` (same
  ``metadata.json``, ``common.pt``, keys, global shapes and chunking as a normal save), with a
  save strategy whose planner produces each chunk's data only when the writer asks for it; every
  chunk goes to its own file, so the writer drops it right after writing.
* Reading (:func:`iter_checkpoint_params`) asks torch.distributed.checkpoint for one transformer
  layer's regions of the stacked global tensors (or one non-layer tensor) at a time, so it
  reads checkpoints saved at any TP/PP, training checkpoints included.

Peak memory is therefore about one layer's tensors plus the tensor being re-laid out.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Callable, Iterator, Optional

import torch

from rlep_megatron.models import layout

Materialize = Callable[[layout.ParamRule, Optional[int], Optional[int]], torch.Tensor]
"""``(rule, global layer, global expert) -> unsharded megatron tensor`` of one parameter."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One parameter of the skeleton: its rule, global layer (and expert) and sharded
    state-dict entry. A routed expert's matrix is one slice of a checkpoint tensor stacked
    over the layer's experts (leading axis: the global expert index)."""

    name: str
    rule: layout.ParamRule
    layer: Optional[int]
    expert: Optional[int]
    sharded: object  # ShardedTensor or ShardedTensorFactory with meta data


def skeleton_entries(skeleton: torch.nn.Module, rules: list[layout.ParamRule],
                     sharded: Optional[dict] = None) -> list[_Entry]:
    """Every parameter of a TP=1 x PP=1 meta-device model with its sharded entry, in model
    order."""
    from rlep_megatron.models.megatron import iter_params_with_rules

    sharded = skeleton.sharded_state_dict() if sharded is None else sharded
    entries = []
    for name, _param, rule, layer, expert in iter_params_with_rules(skeleton, rules):
        if name not in sharded:
            raise KeyError(f"{name} has no entry in the model's sharded state dict")
        entries.append(_Entry(name, rule, layer, expert, sharded[name]))
    return entries


# ------------------------------------------------------------------------------ writing

def _chunk_of(full: torch.Tensor, offsets, sizes) -> torch.Tensor:
    """The part of a parameter's unsharded tensor that a checkpoint chunk holds (chunk offsets
    and sizes may carry leading stacking axes, e.g. the layer axis)."""
    extra = len(sizes) - full.dim()
    index = tuple(slice(o, o + s) for o, s in zip(offsets[extra:], sizes[extra:]))
    return full[index].reshape(tuple(sizes)).contiguous()


def _stack_index(entry: _Entry) -> tuple[Optional[int], Optional[int]]:
    """Where a parameter sits among the parameters that share its checkpoint tensor:
    ``(layer, expert)``. A homogeneous model's layers are stacked in one tensor per parameter
    (megatron's key has no layer number; leading axis: the layer); a model with dense and MoE
    layers has one tensor per layer. A layer's routed experts are stacked (next axis)."""
    per_layer_key = layout.split_layer(entry.sharded.key)[1] is not None
    return (None if per_layer_key else entry.layer, entry.expert)


def save_streaming(skeleton: torch.nn.Module, rules: list[layout.ParamRule],
                   materialize: Materialize, out_dir: str,
                   on_tensor: Optional[Callable[[str], None]] = None) -> None:
    """Write a dist checkpoint of ``skeleton``'s parameters; each parameter's data comes from
    ``materialize`` when the writer reaches it. ``on_tensor(name)`` is called once per parameter
    (progress)."""
    from megatron.core import dist_checkpointing

    sharded = skeleton.sharded_state_dict()
    entries = skeleton_entries(skeleton, rules, sharded)
    by_key: dict = {}
    for entry in entries:
        by_key.setdefault(entry.sharded.key, {})[_stack_index(entry)] = entry
    cache: dict = {}

    def chunk_data(key: str, offsets, sizes) -> torch.Tensor:
        if key not in by_key:
            raise KeyError(f"checkpoint tensor {key!r} is not a model parameter")
        stacked = by_key[key]
        # leading offsets: the layer (layers stacked in one tensor), then the expert
        layer_axis = any(layer is not None for layer, _ in stacked)
        expert_axis = any(expert is not None for _, expert in stacked)
        entry = stacked[(offsets[0] if layer_axis else None,
                         offsets[int(layer_axis)] if expert_axis else None)]
        if cache.get("id") != entry.name:
            # chunks of one parameter (gate and up of linear_fc1) are written one after the
            # other: keep the last parameter's tensor for the next chunk
            cache.clear()
            cache.update(id=entry.name, full=materialize(entry.rule, entry.layer, entry.expert))
            if on_tensor is not None:
                on_tensor(entry.name)
        return _chunk_of(cache["full"], offsets, sizes)

    # the whole state dict, so the non-tensor entries (layers' ``_extra_state``) are there too
    dist_checkpointing.save(sharded, out_dir, sharded_strategy=_lazy_save_strategy(chunk_data))
    cache.clear()


def _lazy_save_strategy(chunk_data: Callable):
    """megatron's torch_dist save strategy, with chunk data produced on demand."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            return chunk_data(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))

    class LazyStrategy(TorchDistSaveShardedStrategy):
        def async_save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state = mcore_to_pyt_state_dict(state, False)

            def write():
                # one file per chunk: the writer keeps every tensor of a file until the file
                # is closed
                writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=False,
                                              thread_count=1)
                dcp.save(pyt_state, storage_writer=writer,
                         planner=LazyPlanner(flatten_state_dict=False,
                                             dedup_replicated_tensors=False))

            return AsyncRequest(write, (), [])

    return LazyStrategy("torch_dist", 1, thread_count=1)


# ------------------------------------------------------------------------------ reading

def _read_boxes(mcore_dir: str, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
                storage: dict) -> dict[str, torch.Tensor]:
    """``{key: (offsets, sizes)}`` regions of the checkpoint's global tensors -> tensors.

    A region may span several saved chunks (a checkpoint written at TP > 1) and may reach past
    a saved tensor's end (a vocabulary padded for a smaller TP size); such rows stay zero."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    out, items = {}, []
    for key, (offsets, sizes) in boxes.items():
        saved = storage[key]
        out[key] = torch.zeros(sizes, dtype=saved.properties.dtype)
        clipped = tuple(max(0, min(size, total - offset))
                        for offset, size, total in zip(offsets, sizes, saved.size))
        if 0 in clipped:
            continue
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(clipped))
        items += create_read_items_for_chunk_list(key, saved, [chunk])

    class RegionPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return out[index.fqn]

    dcp.load({}, storage_reader=dcp.FileSystemReader(mcore_dir), planner=RegionPlanner(),
             no_dist=True)
    return out


def iter_checkpoint_params(skeleton: torch.nn.Module, rules: list[layout.ParamRule],
                           mcore_dir: str) -> Iterator[tuple[str, layout.ParamRule,
                                                             Optional[int], Optional[int],
                                                             torch.Tensor]]:
    """``(name, rule, global layer, global expert, unsharded tensor)`` for every parameter of
    the skeleton,
    read from a dist checkpoint (saved at any TP/PP) one layer, or one non-layer tensor, at a
    time. Other entries of the checkpoint (a training checkpoint's optimizer state) are not
    read."""
    from torch.distributed import checkpoint as dcp

    storage = dcp.FileSystemReader(mcore_dir).read_metadata().state_dict_metadata
    params = dict(skeleton.named_parameters())
    groups: dict = defaultdict(list)
    for entry in skeleton_entries(skeleton, rules):
        if entry.sharded.key not in storage:
            raise KeyError(f"{mcore_dir} has no tensor {entry.sharded.key!r} (for {entry.name}); "
                           "is it a checkpoint of this model?")
        groups[("layer", entry.layer) if entry.layer is not None else ("tensor", entry.name)
               ].append(entry)
    for entries in groups.values():
        boxes = {}
        for entry in entries:
            shape = tuple(params[entry.name].shape)
            saved = tuple(storage[entry.sharded.key].size)
            layer, expert = _stack_index(entry)
            lead = (layer,) if layer is not None else ()
            # the layer's experts stacked: read them all at once
            box = (lead + (0,) * (len(saved) - len(lead)),
                   (1,) * len(lead) + (saved[len(lead):] if expert is not None else shape))
            boxes[entry.sharded.key] = box
        loaded = _read_boxes(mcore_dir, boxes, storage)
        for entry in entries:
            layer, expert = _stack_index(entry)
            tensor = loaded[entry.sharded.key]
            if layer is not None:
                tensor = tensor[0]
            if expert is not None:
                tensor = tensor[expert]
            yield (entry.name, entry.rule, entry.layer, entry.expert,
                   tensor.reshape(params[entry.name].shape))
        del loaded
