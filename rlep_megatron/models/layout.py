"""HF <-> megatron-core tensor layouts shared by every Llama-family architecture.

Owns the name tables' machinery and the re-layouts that the conversion tools, the actor's HF
loader and weight sync all use:

* ``qkv``: HF ``q_proj``/``k_proj``/``v_proj`` <-> megatron's fused ``linear_qkv``, laid out per
  query group ``[q heads of group g, k_g, v_g]`` so that tensor parallelism splits whole groups;
* ``gate_up``: HF ``gate_proj``/``up_proj`` <-> ``linear_fc1`` = ``[gate; up]``, and under TP
  each rank holds ``[gate_r; up_r]``;
* ``vocab``: embedding / output rows, padded with zero rows to a multiple of the TP size (padded
  logits are masked in :mod:`rlep_megatron.actor.logprob`, so they get no probability mass);
* ``copy``: same tensor, split along ``tp_dim`` (or replicated when ``tp_dim`` is None).

Shapes: ``full`` tensors are the unsharded (TP=1) megatron tensors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class GPTDims:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """Smallest multiple of the TP size >= the vocabulary (each rank gets an equal slice)."""
    tp = tensor_model_parallel_size
    return -(-vocab_size // tp) * tp


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter and the HF tensors it is made of (``{layer}`` = global index)."""

    mcore_name: str
    hf_names: tuple[str, ...]
    kind: str  # copy | qkv | gate_up | vocab
    tp_dim: Optional[int]

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.mcore_name

    @property
    def per_expert(self) -> bool:
        """A mixture-of-experts expert's matrix (``{expert}`` = global expert index)."""
        return "{expert}" in self.mcore_name

    def hf_names_at(self, layer: Optional[int], expert: Optional[int] = None) -> list[str]:
        """The HF tensor names of this rule at a global layer (and expert)."""
        return [n.format(layer=layer, expert=expert) for n in self.hf_names]


# ------------------------------------------------------------------------------ re-layouts

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: GPTDims) -> torch.Tensor:
    """``q [heads*d, ...]``, ``k/v [groups*d, ...]`` -> ``[(heads + 2 groups) * d, ...]``."""
    g, d, hpg = dims.num_query_groups, dims.head_dim, dims.heads_per_group
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest),
                       v.reshape(g, d, *rest)], dim=1)
    return fused.reshape(g * (hpg + 2) * d, *rest)


def split_qkv(fused: torch.Tensor, dims: GPTDims) -> tuple[torch.Tensor, ...]:
    g, d, hpg = dims.num_query_groups, dims.head_dim, dims.heads_per_group
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return (q.reshape(g * hpg * d, *rest).contiguous(), k.reshape(g * d, *rest).contiguous(),
            v.reshape(g * d, *rest).contiguous())


def hf_to_full(rule: ParamRule, hf_tensors: Sequence[torch.Tensor], dims: GPTDims,
               padded_vocab: int) -> torch.Tensor:
    """HF tensors of one rule -> the unsharded megatron tensor."""
    if rule.kind == "qkv":
        return fuse_qkv(*hf_tensors, dims)
    if rule.kind == "gate_up":
        return torch.cat(list(hf_tensors), dim=0)
    if rule.kind == "vocab":
        (table,) = hf_tensors
        if table.shape[0] > padded_vocab:
            raise ValueError(f"{rule.hf_names[0]} has {table.shape[0]} rows, more than the "
                             f"padded vocabulary {padded_vocab}")
        if table.shape[0] == padded_vocab:
            return table
        pad = table.new_zeros((padded_vocab - table.shape[0],) + tuple(table.shape[1:]))
        return torch.cat([table, pad], dim=0)
    (tensor,) = hf_tensors
    return tensor


def full_to_hf(rule: ParamRule, full: torch.Tensor, dims: GPTDims) -> list[torch.Tensor]:
    """The unsharded megatron tensor -> HF tensors, in ``rule.hf_names`` order."""
    if rule.kind == "qkv":
        return list(split_qkv(full, dims))
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return [gate.contiguous(), up.contiguous()]
    if rule.kind == "vocab":
        return [full[:dims.vocab_size].contiguous()]
    return [full]


def shard(rule: ParamRule, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of an unsharded megatron tensor."""
    if rule.tp_dim is None or tp_size == 1:
        return full
    if rule.kind == "gate_up":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, 0)[tp_rank],
                          torch.chunk(up, tp_size, 0)[tp_rank]], dim=0)
    if full.shape[rule.tp_dim] % tp_size:
        raise ValueError(f"{rule.mcore_name}: dimension {rule.tp_dim} of size "
                         f"{full.shape[rule.tp_dim]} is not divisible by TP size {tp_size}")
    return torch.chunk(full, tp_size, dim=rule.tp_dim)[tp_rank]


def gather(rule: ParamRule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard`: the TP ranks' slices (in rank order) -> unsharded tensor."""
    if rule.tp_dim is None or len(shards) == 1:
        return shards[0]
    if rule.kind == "gate_up":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=rule.tp_dim)


# ------------------------------------------------------------------------------ names

_LAYER_RE = re.compile(r"\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.local_experts\.(\d+)\.")
# TransformerEngine's grouped-GEMM experts: ``mlp.experts.linear_fc1.weight3`` is local expert 3
_GROUPED_RE = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")

# Names that differ when TransformerEngine's layer spec fuses the norms into the linears.
_TE_RENAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def canonical_name(mcore_name: str) -> str:
    """Map a TE-spec parameter name onto the local-spec name used in the rule tables."""
    for local, te in _TE_RENAMES.items():
        if mcore_name.endswith(te):
            return mcore_name[: -len(te)] + local
    grouped = _GROUPED_RE.search(mcore_name)
    if grouped:
        return (mcore_name[: grouped.start()]
                + f".experts.local_experts.{grouped.group(2)}.{grouped.group(1)}.weight")
    return mcore_name


def split_layer(name: str) -> tuple[str, Optional[int]]:
    """``decoder.layers.3.mlp...`` -> (``decoder.layers.{layer}.mlp...``, 3)."""
    match = _LAYER_RE.search(name)
    if not match:
        return name, None
    return name[: match.start()] + ".layers.{layer}." + name[match.end():], int(match.group(1))


def split_expert(name: str) -> tuple[str, Optional[int]]:
    """``...experts.local_experts.5.linear_fc1.weight`` -> (``...local_experts.{expert}...``,
    5): the index local to this expert-parallel rank."""
    match = _EXPERT_RE.search(name)
    if not match:
        return name, None
    return (name[: match.start()] + ".local_experts.{expert}." + name[match.end():],
            int(match.group(1)))


def rule_index(rules: Sequence[ParamRule]) -> dict[str, ParamRule]:
    return {rule.mcore_name: rule for rule in rules}
