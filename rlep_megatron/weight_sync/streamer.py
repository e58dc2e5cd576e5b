"""Stream the actor's sharded weights, as full HF-named tensors, to every rank, in buckets.

Any actor TP/PP(/VPP) layout feeds any rollout layout: every rank ends up seeing every HF tensor
once (vLLM's ``load_weights`` keeps its own tensor-parallel slice of each), while holding no
more than its own shard plus one bucket in flight.

Per bucket (a run of whole mapping rules of one pipeline stage, at most ``bucket_bytes`` of HF
tensors unless one rule alone is larger):

1. the owning stage's TP ranks pack their local shards of the bucket's TP-split parameters into
   one flat buffer and all-gather it once over the tensor-parallel group;
2. the owner re-lays the gathered shards out as HF tensors with the conversion tools' mapping
   tables (qkv split, gate/up split, vocabulary padding removed, tied output skipped);
3. a mixture-of-experts model's routed experts are split over the expert-parallel ranks of
   the stage: they all-gather their experts' HF tensors of the bucket in one flat buffer, so
   each has every expert;
4. with PP > 1 the owner packs those tensors into one flat buffer and broadcasts it over the
   pipeline group; the other stages unpack views of the same buffer.

Buffers are fresh per bucket and never reused, so a consumer may keep references to the
tensors it was given (vLLM's layer-wise reload buffers a layer's tensors until it is complete).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from rlep_megatron import distributed
from rlep_megatron.lora.adapters import chunk_adapters
from rlep_megatron.models.megatron import ActorModelInfo, iter_params_with_rules, unwrap
from rlep_megatron.models import architecture_for, layout

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor produced by a rule."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RuleEntry:
    """One megatron parameter of a stage and the HF tensors it becomes."""

    index: int          # position in the owning rank's parameter list
    dtype: str
    local_shape: tuple[int, ...]
    tp_split: bool      # shards differ across TP ranks (gathered) or are replicated
    outputs: tuple[TensorSpec, ...]
    # a routed expert's matrix: EP rank r holds another expert in its place; the outputs of
    # every EP rank, in rank order (``outputs`` is this rank's)
    expert_outputs: tuple[tuple[TensorSpec, ...], ...] = ()

    @property
    def all_outputs(self) -> tuple[TensorSpec, ...]:
        """The HF tensors this entry yields on every rank (every EP rank's expert)."""
        return tuple(o for per_rank in self.expert_outputs for o in per_rank) or self.outputs

    @property
    def nbytes(self) -> int:
        return sum(o.numel for o in self.all_outputs) * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Bucket:
    stage: int
    dtype: str
    entries: tuple[RuleEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def _experts_per_rank(chunk: torch.nn.Module, expert: int) -> int:
    """Routed experts per EP rank in the MoE layer holding global expert ``expert``."""
    for layer in unwrap(chunk).decoder.layers:
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if indices and expert in indices:
            return len(indices)
    raise ValueError(f"expert {expert} is not in this chunk")


def _merge_source(adapters, name: str, layer: Optional[int]) -> Optional[tuple]:
    """``(adapters, global layer, module)`` when LoRA adapters sit on the weight ``name`` (of
    a chunk: ``decoder.layers.<i>.<module>.weight``), else None."""
    if adapters is None or layer is None or not name.endswith(".weight"):
        return None
    module = name.split(".", 3)[3].rsplit(".", 1)[0]
    return (adapters, layer, module) if adapters.of_module(layer, module) else None


def plan_buckets(stage_entries: list[list[RuleEntry]], bucket_bytes: int) -> list[Bucket]:
    """Group each stage's entries, in order, into buckets of one dtype and at most
    ``bucket_bytes`` (a single larger entry gets a bucket of its own). Pure and deterministic,
    so every rank computes the same plan from the same metadata."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    buckets = []
    for stage, entries in enumerate(stage_entries):
        current: list[RuleEntry] = []
        size = 0
        for entry in entries:
            if current and (entry.dtype != current[0].dtype or size + entry.nbytes > bucket_bytes):
                buckets.append(Bucket(stage, current[0].dtype, tuple(current)))
                current, size = [], 0
            current.append(entry)
            size += entry.nbytes
        if current:
            buckets.append(Bucket(stage, current[0].dtype, tuple(current)))
    return buckets


class WeightStreamer:
    """The source side of weight sync for one rank. Build it once after the model (the plan is
    cached; parameters are read afresh on every :meth:`iter_tensors`)."""

    def __init__(self, chunks: list[torch.nn.Module], info: ActorModelInfo,
                 bucket_bytes: int = 512 * 1024 * 1024):
        from megatron.core import parallel_state as ps

        self.info = info
        self.bucket_bytes = int(bucket_bytes)
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._tp_size = ps.get_tensor_model_parallel_world_size()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._pp_size = ps.get_pipeline_model_parallel_world_size()
        self._pp_rank = ps.get_pipeline_model_parallel_rank()
        self._pp_ranks = (torch.distributed.get_process_group_ranks(self._pp_group)
                          if self._pp_size > 1 else [torch.distributed.get_rank()])
        self._ep_group = ps.get_expert_model_parallel_group()
        self._ep_size = ps.get_expert_model_parallel_world_size()
        self._ep_rank = ps.get_expert_model_parallel_rank()
        rules = architecture_for(info.hf_config).rules(info.hf_config)
        tied = bool(info.hf_config.get("tie_word_embeddings"))
        self._params: list[tuple[torch.nn.Parameter, layout.ParamRule, Optional[int]]] = []
        # LoRA (rollout.lora_sync=merged): the adapters merged into the weights they adapt
        self._merge: list[Optional[tuple]] = []
        own: list[RuleEntry] = []
        for chunk in chunks:
            adapters = chunk_adapters(chunk)
            for name, param, rule, layer, expert in iter_params_with_rules(unwrap(chunk),
                                                                            rules):
                if tied and rule.mcore_name == "output_layer.weight":
                    continue  # vLLM ties lm_head to the embedding itself
                # experts' matrices are split over the expert-tensor-parallel group, which is
                # the TP group (megatron's default expert TP size)
                tp_split = rule.tp_dim is not None and self._tp_size > 1
                meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
                full = layout.gather(rule, [meta] * (self._tp_size if tp_split else 1))
                shapes = [tuple(t.shape) for t in layout.full_to_hf(rule, full, info.dims)]

                def specs(expert_index):
                    return tuple(TensorSpec(name, shape) for name, shape in
                                 zip(rule.hf_names_at(layer, expert_index), shapes))

                per_rank: tuple = ()
                if expert is not None and self._ep_size > 1:
                    # megatron places expert e on EP rank e // (experts per rank)
                    local = expert - self._ep_rank * _experts_per_rank(chunk, expert)
                    per_rank = tuple(specs(r * _experts_per_rank(chunk, expert) + local)
                                     for r in range(self._ep_size))
                own.append(RuleEntry(len(self._params), str(param.dtype), tuple(param.shape),
                                     tp_split, specs(expert), per_rank))
                self._params.append((param, rule, layer))
                self._merge.append(_merge_source(adapters, name, layer))
        if self._pp_size > 1:
            self.stage_entries: list[list[RuleEntry]] = distributed.all_gather_object(
                own, group=self._pp_group)
        else:
            self.stage_entries = [own]
        self.buckets = plan_buckets(self.stage_entries, self.bucket_bytes)

    @property
    def names(self) -> list[str]:
        """Every HF tensor name the stream yields, in order."""
        return [o.name for b in self.buckets for e in b.entries for o in e.all_outputs]

    def plan(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(hf_name, dtype, shape)`` of every tensor of the stream, in its order (what a
        receiver that allocates ahead, vLLM's NCCL engine, is told first)."""
        return [(o.name, DTYPES[e.dtype], tuple(o.shape))
                for b in self.buckets for e in b.entries for o in e.all_outputs]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def _device(self) -> torch.device:
        return self._params[0][0].device if self._params else torch.device("cpu")

    def _local(self, index: int) -> torch.Tensor:
        """This rank's shard of parameter ``index`` as the stream carries it: the parameter,
        or with LoRA adapters on it the merged ``W + scale x B A``."""
        param = self._params[index][0].detach()
        merge = self._merge[index]
        if merge is None:
            return param
        adapters, layer, module = merge
        return adapters.merged(layer, module, param)

    def _gather_bucket(self, bucket: Bucket) -> list[torch.Tensor]:
        """The owner stage's HF tensors of a bucket (collective over the TP group)."""
        dtype = DTYPES[bucket.dtype]
        split = [e for e in bucket.entries if e.tp_split]
        gathered: dict[int, list[torch.Tensor]] = {}
        if split:
            sizes = [math.prod(e.local_shape) for e in split]
            source = self._local(split[0].index) if len(split) == 1 else None
            if source is not None and source.is_contiguous():
                flat = source.reshape(-1)  # one tensor (e.g. the embedding): no packing copy
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=self._device())
                for entry, piece in zip(split, torch.split(flat, sizes)):
                    piece.copy_(self._local(entry.index).reshape(-1))
            out = torch.empty(self._tp_size * flat.numel(), dtype=dtype, device=flat.device)
            distributed.all_gather(list(out.chunk(self._tp_size)), flat, group=self._tp_group)
            del flat
            rule = self._params[split[0].index][1]
            if len(split) == 1 and rule.tp_dim == 0 and rule.kind != "gate_up":
                # rank-major shards split along dim 0 already are the full tensor
                full_shape = (self._tp_size * split[0].local_shape[0],) + split[0].local_shape[1:]
                gathered[split[0].index] = [out.view(full_shape)]
            else:
                for rank_buf in out.chunk(self._tp_size):
                    for entry, piece in zip(split, torch.split(rank_buf, sizes)):
                        gathered.setdefault(entry.index, []).append(
                            piece.view(entry.local_shape))
        tensors, experts = [], []
        for entry in bucket.entries:
            param, rule, _ = self._params[entry.index]
            shards = gathered.get(entry.index) or [self._local(entry.index)]
            full = layout.gather(rule, shards)
            hf = layout.full_to_hf(rule, full, self.info.dims)
            tensors.append(hf)
            if entry.expert_outputs:
                experts.extend(hf)
        if experts:
            # every EP rank of the stage holds other experts in the same places: one
            # all-gather of their flat HF tensors gives each rank all of them
            flat = torch.cat([t.reshape(-1) for t in experts])
            out = torch.empty(self._ep_size * flat.numel(), dtype=flat.dtype, device=flat.device)
            distributed.all_gather(list(out.chunk(self._ep_size)), flat, group=self._ep_group)
            del flat
            by_rank = [iter(torch.split(rank_buf, [t.numel() for t in experts]))
                       for rank_buf in out.chunk(self._ep_size)]
            for position, entry in enumerate(bucket.entries):
                if entry.expert_outputs:
                    shapes = [o.shape for o in entry.outputs]
                    tensors[position] = [next(by_rank[r]).view(shape)
                                         for r in range(self._ep_size) for shape in shapes]
        return [t for hf in tensors for t in hf]

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every HF tensor of the model, on every rank, in the
        same order. Collective over the TP, EP and PP groups: every rank must drain it."""
        device = self._device()
        for bucket in self.buckets:
            specs = [o for e in bucket.entries for o in e.all_outputs]
            if self._pp_size == 1:
                for spec, tensor in zip(specs, self._gather_bucket(bucket)):
                    yield spec.name, tensor
                continue
            flat = torch.empty(sum(s.numel for s in specs), dtype=DTYPES[bucket.dtype],
                               device=device)
            pieces = torch.split(flat, [s.numel for s in specs])
            if bucket.stage == self._pp_rank:
                for piece, tensor in zip(pieces, self._gather_bucket(bucket)):
                    piece.copy_(tensor.reshape(-1))
            distributed.broadcast(flat, src=self._pp_ranks[bucket.stage], group=self._pp_group)
            for spec, piece in zip(specs, pieces):
                yield spec.name, piece.view(spec.shape)
