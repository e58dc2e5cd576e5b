"""LoRA adapters on a built actor's megatron-core parallel linears.

Every targeted HF projection of every layer gets ``A [rank, in]`` and ``B [out, rank]``; the
projection's output gains ``alpha / rank x B A x``. The adapters of a chunk live in one module,
``chunk.lora`` (keys by global layer, so pipeline stages hold disjoint keys), and reach their
linears through forward hooks, so megatron's layers and the base weights' names, checkpoints
and conversions are unchanged.

Tensor parallelism follows the linear's own:

- column-parallel (``linear_qkv``, ``linear_fc1``): A is replicated, B is split by output rows
  as the base weight is (``q``/``k``/``v`` by query group, ``gate``/``up`` each by rows). The
  low-rank activation ``h = A x`` enters the tensor-parallel region (its gradient is summed over
  the TP ranks); with sequence parallelism ``h`` is computed on the local sequence chunk and
  all-gathered (its gradient reduce-scattered), and A's gradient, partial per chunk, is summed
  over TP by megatron (A is marked ``sequence_parallel``).
- row-parallel (``linear_proj``, ``linear_fc2``): A is split by input columns, B is replicated;
  ``h`` is summed over TP (reduce-scattered over the sequence with sequence parallelism, B then
  marked ``sequence_parallel``).

The base weights are frozen (``requires_grad`` off before megatron's DDP wraps the chunks), so
they get no gradient buffer and no optimizer state.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterator, Optional

import torch

from rlep_megatron.lora.targets import TARGETS, Target

PREFIX = "lora."  # the adapters' parameter names in a chunk start so


def is_adapter_parameter(name: str) -> bool:
    """Whether a chunk's parameter name (DDP's ``module.`` prefix removed) is an adapter's."""
    return name.startswith(PREFIX)


def initial_adapter(name: str, layer: int, shape: tuple[int, int], rank: int, init: str,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full (unsharded) ``A [rank, in]`` and ``B [out, rank]`` of a fresh adapter, in
    float32, the same on every rank and at every parallel layout: drawn from a generator
    seeded by ``seed``, the layer and the projection. ``kaiming``: PEFT's default,
    Kaiming-uniform with ``a = sqrt(5)`` (uniform in +-1/sqrt(in)); ``gaussian``: normal with
    std 1/rank. B is zero."""
    out_features, in_features = shape
    digest = hashlib.blake2b(f"{seed}:{layer}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2 ** 63)
    if init == "kaiming":
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand(rank, in_features, generator=generator, dtype=torch.float64)
             * 2 - 1) * bound
    else:
        a = torch.randn(rank, in_features, generator=generator, dtype=torch.float64) / rank
    return a.float(), torch.zeros(out_features, rank)


class Projection(torch.nn.Module):
    """One HF projection's adapter on this rank: ``A`` and ``B``, split as the linear's own
    weight is (module docstring)."""

    def __init__(self, target: Target, a_full: torch.Tensor, b_full: torch.Tensor,
                 tp: tuple[int, int], sequence_parallel: bool, dtype: torch.dtype,
                 device: torch.device):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.target = target
        rank, size = tp
        if target.parallel == "column":
            a, b, split, axis = a_full, b_full.chunk(size, dim=0)[rank], "B", 0
        else:
            a, b, split, axis = a_full.chunk(size, dim=1)[rank], b_full, "A", 1
        self.A = torch.nn.Parameter(a.contiguous().to(device=device, dtype=dtype))
        self.B = torch.nn.Parameter(b.contiguous().to(device=device, dtype=dtype))
        self.split, self.axis = split, axis
        set_tensor_model_parallel_attributes(getattr(self, split), size > 1, axis, 1)
        if sequence_parallel and size > 1:
            # the replicated factor's gradient is partial per sequence chunk: summed over TP
            getattr(self, "B" if split == "A" else "A").sequence_parallel = True


def _layer_parts(dims, tp_size: int, module: str) -> list[tuple[str, int]]:
    """``(part, rows on this rank)`` of a fused column-parallel linear, in the order of its
    local output rows per block: ``linear_qkv`` per local query group ``[q, k, v]``,
    ``linear_fc1`` ``[gate, up]``."""
    if module.endswith("linear_qkv"):
        return [("q", dims.heads_per_group * dims.head_dim), ("k", dims.head_dim),
                ("v", dims.head_dim)]
    return [("gate", dims.ffn_hidden_size // tp_size), ("up", dims.ffn_hidden_size // tp_size)]


def arrange(pieces: dict[str, torch.Tensor], module: str, dims, tp_size: int,
            dim: int) -> torch.Tensor:
    """A fused column-parallel linear's local rows (along ``dim``) from the per-projection
    pieces present (``part -> tensor``; an absent part is zeros): ``linear_qkv`` interleaves
    them per local query group, ``linear_fc1`` stacks ``[gate; up]``."""
    parts = _layer_parts(dims, tp_size, module)
    some = next(iter(pieces.values()))
    dim = dim % some.dim()
    groups = dims.num_query_groups // tp_size if module.endswith("linear_qkv") else 1
    blocks = []
    for part, rows in parts:
        piece = pieces.get(part)
        if piece is None:
            shape = list(some.shape)
            shape[dim] = groups * rows
            piece = some.new_zeros(shape)
        shape = list(piece.shape)
        blocks.append(piece.reshape(shape[:dim] + [groups, rows] + shape[dim + 1:]))
    fused = torch.cat(blocks, dim=dim + 1)
    shape = list(fused.shape)
    return fused.reshape(shape[:dim] + [shape[dim] * shape[dim + 1]] + shape[dim + 2:])


class Adapters(torch.nn.Module):
    """Every adapter of one chunk (``chunk.lora``): ``layers[global layer][hf projection]``."""

    def __init__(self, scale: float, dropout: float, dims, tp: tuple[int, int],
                 sequence_parallel: bool):
        super().__init__()
        self.layers = torch.nn.ModuleDict()
        self.scale, self.dims, self.tp = scale, dims, tp
        self.sequence_parallel = sequence_parallel and tp[1] > 1
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None

    def projections(self) -> Iterator[tuple[int, str, Projection]]:
        for layer, projections in self.layers.items():
            for name, projection in projections.items():
                yield int(layer), name, projection

    def of_module(self, layer: int, module: str) -> list[Projection]:
        projections = self.layers[str(layer)] if str(layer) in self.layers else {}
        return [p for p in projections.values() if p.target.module == module]

    # ------------------------------------------------------------------ forward

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        # dropout in the passes that train (the log-prob passes run without gradients)
        if self.dropout is not None and torch.is_grad_enabled():
            return self.dropout(x)
        return x

    def delta(self, layer: int, module: str, x: torch.Tensor) -> Optional[torch.Tensor]:
        """What the adapters of ``module`` in ``layer`` add to its output for input ``x``."""
        from megatron.core import tensor_parallel as mp

        projections = self.of_module(layer, module)
        if not projections:
            return None
        tp_size = self.tp[1]
        if projections[0].target.parallel == "row":
            (projection,) = projections
            h = torch.matmul(self._input(x), projection.A.t())
            if self.sequence_parallel:
                h = mp.reduce_scatter_to_sequence_parallel_region(h)
            elif tp_size > 1:
                h = mp.reduce_from_tensor_model_parallel_region(h)
            return torch.matmul(h, projection.B.t()) * self.scale
        pieces = {}
        for projection in projections:
            h = torch.matmul(self._input(x), projection.A.t())
            if self.sequence_parallel:
                h = mp.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
            elif tp_size > 1:
                h = mp.copy_to_tensor_model_parallel_region(h)
            pieces[projection.target.part] = torch.matmul(h, projection.B.t()) * self.scale
        return arrange(pieces, module, self.dims, tp_size, dim=-1)

    # ------------------------------------------------------------------ merged weights

    def merged(self, layer: int, module: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (this rank's shard of ``module``'s base weight) plus its adapters'
        ``scale x B A``, in the shard's layout (what weight sync streams for
        ``rollout.lora_sync=merged``)."""
        projections = self.of_module(layer, module)
        if not projections:
            return weight
        with torch.no_grad():
            if projections[0].target.parallel == "row":
                (projection,) = projections
                delta = projection.B.float() @ projection.A.float()
            else:
                delta = arrange({p.target.part: p.B.float() @ p.A.float() for p in projections},
                                module, self.dims, self.tp[1], dim=0)
            return (weight.float() + self.scale * delta).to(weight.dtype)

    # ------------------------------------------------------------------ checkpoints

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Checkpoint entries: the split factor of each adapter sharded along its TP axis, the
        other replicated (keys by global layer: no pipeline offset applies)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axes = {f"layers.{layer}.{name}.{p.split}": p.axis
                for layer, name, p in self.projections() if self.tp[1] > 1}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, ())


def _global_layers(chunk) -> list:
    return list(chunk.decoder.layers) if hasattr(chunk, "decoder") else []


def attach(chunks: list[torch.nn.Module], info, lora, seed: int) -> list[Adapters]:
    """Freeze every base weight of the (unwrapped) chunks and give each targeted projection
    of each layer a fresh adapter (``lora``: the run's
    :class:`~rlep_megatron.config.LoraConfig`). Mixture-of-experts layers get adapters on
    their attention only."""
    from megatron.core import parallel_state as ps

    from rlep_megatron.lora.targets import projection_shape

    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    attached = []
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        config = chunk.config
        adapters = Adapters(lora.alpha / lora.rank, lora.dropout, info.dims, tp,
                            bool(config.sequence_parallel))
        device = next(chunk.parameters()).device
        for layer in _global_layers(chunk):
            index = layer.layer_number - 1
            dense = hasattr(layer.mlp, "linear_fc1")
            own = torch.nn.ModuleDict()
            for name in lora.targets():
                target = TARGETS[name]
                if target.module.startswith("mlp.") and not dense:
                    continue  # a mixture-of-experts layer: the experts get no adapters
                shape = projection_shape(name, info.dims)
                if device.type == "meta":  # (rlep plan: shapes only)
                    a, b = (torch.empty(lora.rank, shape[1], device=device),
                            torch.empty(shape[0], lora.rank, device=device))
                else:
                    a, b = initial_adapter(name, index, shape, lora.rank, lora.init, seed)
                own[name] = Projection(target, a, b, tp, adapters.sequence_parallel,
                                       info.params_dtype, device)
            adapters.layers[str(index)] = own
        chunk.lora = adapters
        _hook_linears(chunk, adapters)
        if getattr(chunk, "pre_process", False):
            chunk.embedding.register_forward_hook(_track_gradients)
        attached.append(adapters)
    return attached


def _hook_linears(chunk, adapters: Adapters) -> None:
    modules = {t.module for t in TARGETS.values()}
    for layer in _global_layers(chunk):
        index = layer.layer_number - 1
        for module in sorted(modules):
            if not adapters.of_module(index, module):
                continue
            linear = layer.get_submodule(module)
            linear.register_forward_hook(_output_hook(adapters, index, module))


def _track_gradients(embedding, args, output):
    """The frozen embedding's output, marked to need gradients in a pass that trains: the
    adapters' gradients must flow through layers whose inputs would otherwise need none
    (megatron's full recompute runs a layer only when its input does)."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return output


def _output_hook(adapters: Adapters, layer: int, module: str):
    def hook(linear, args, output):
        delta = adapters.delta(layer, module, args[0])
        out, bias = output
        return out + delta.to(out.dtype), bias

    return hook


def chunk_adapters(chunk) -> Optional[Adapters]:
    """The adapters attached to a chunk (DDP-wrapped or not), or None."""
    from rlep_megatron.models.megatron import unwrap

    return getattr(unwrap(chunk), "lora", None)
