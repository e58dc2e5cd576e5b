"""The local layer spec's modules. Its core attention: megatron-core's ``DotProductAttention``
extended to THD-packed sequences (:mod:`rlep_megatron.actor.packing`) and computed with torch's
fused ``scaled_dot_product_attention``. TransformerEngine's attention takes packed sequences
natively; this is its counterpart on CPU and on GPUs without TE. Also its dense MLP (megatron's,
with a leaner gated activation) and an RMSNorm that works with sequence parallelism."""
from __future__ import annotations

import copy

import torch


def _local_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class PackedLocalAttention(DotProductAttention):
        """megatron-core's local attention, extended to THD-packed inputs and computed with
        torch's fused ``scaled_dot_product_attention`` (causal, no dropout, no softmax offset:
        the actor's settings; anything else goes to megatron's own path).

        Packed ``[t, heads, dim]`` queries/keys/values are laid out as a padded batch of their
        sequences, attended with the causal mask and packed back: each sequence sees only
        itself, exactly as TransformerEngine's THD attention, while the projections, MLPs and
        logits around it run on real tokens only."""

        def __init__(self, config, *args, **kwargs):
            # megatron's local attention refuses context parallelism; this one takes it
            # (:func:`context_parallel.local_cp_attention`): build with a CP-free copy of the
            # config, then keep the real one
            cp_free = copy.copy(config)
            cp_free.context_parallel_size = 1
            super().__init__(cp_free, *args, **kwargs)
            self.config = config

        def _fused(self, query, key, value, causal: bool = True):
            """``[s, b, heads, dim]`` (keys/values with their query groups) -> ``[s, b, h]``.
            With grouped keys/values (GQA), torch's CPU kernel takes the groups as they are
            (``enable_gqa``: the same outputs; in bf16 the keys' and values' gradients can
            differ in the last bit, a group's being summed before rounding); elsewhere each
            group is repeated for its queries first, since which CUDA backends of torch's
            attention accept grouped heads depends on the torch version, and a refusing one
            would fall back to the slow math path."""
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            repeat = q.shape[1] // k.shape[1]
            grouped = repeat > 1 and q.device.type == "cpu"
            if repeat > 1 and not grouped:
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=self.softmax_scale, enable_gqa=grouped)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            mask_type = attn_mask_type or self.attn_mask_type
            # no_mask: megatron's static inference decoding, a new token's query over the
            # whole KV cache (the rows of that batch share their length)
            plain = (attention_mask is None and attention_bias is None
                     and self.softmax_offset is None and self.attention_dropout.p == 0.0
                     and not self.config.apply_query_key_layer_scaling
                     and self.config.window_size is None)
            fused = plain and mask_type == AttnMaskType.causal
            decoding = plain and mask_type == AttnMaskType.no_mask
            if self.config.context_parallel_size > 1:
                if not fused:
                    raise NotImplementedError("context parallelism with the local layer spec "
                                              "needs causal attention without dropout, bias "
                                              "or offset")
                from rlep_megatron.models.context_parallel import local_cp_attention

                return local_cp_attention(self, query, key, value, packed_seq_params)
            if packed_seq_params is None:
                if fused or decoding:
                    return self._fused(query, key, value, causal=fused)
                return super().forward(query, key, value, attention_mask,
                                       attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            if not fused:
                raise NotImplementedError("packed sequences with the local layer spec need "
                                          "causal attention without dropout, bias or offset")
            cu = packed_seq_params.cu_seqlens_q.to(torch.long)
            sizes = cu[1:] - cu[:-1]
            width = int(sizes.max())
            columns = torch.arange(width, device=cu.device)
            valid = columns.unsqueeze(0) < sizes.unsqueeze(1)
            index = torch.where(valid, cu[:-1].unsqueeze(1) + columns,
                                torch.zeros_like(valid, dtype=torch.long))

            def to_padded(x):  # [t, h, d] -> [width, sequences, h, d]
                return x[index].transpose(0, 1)

            out = self._fused(to_padded(query), to_padded(key), to_padded(value))
            return out.transpose(0, 1)[valid]  # [t, h * d]

    return PackedLocalAttention


_PACKED_LOCAL_ATTENTION = None
_GATED_MLP = None


def _gated_mlp_class():
    from megatron.core.transformer.mlp import MLP

    class GatedMLP(MLP):
        """megatron-core's MLP, whose gated activation without biases, clamp or fusion is
        computed as ``act(gate) * linear``: megatron's own adds ``config.glu_linear_offset``
        to the linear half as a separate elementwise pass even when it is 0 (one read and
        write of the widest activation per layer and micro-batch, a few percent of a small
        model's step on CPU). Any other setting runs megatron's forward unchanged. Built
        models get it by :func:`use_gated_mlp` (megatron's layer passes its process groups to
        the ``MLP`` class only, so the spec keeps that)."""

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            config = self.config
            if (per_token_scale is not None or not config.gated_linear_unit
                    or config.add_bias_linear or config.bias_activation_fusion
                    or config.use_te_activation_func or config.glu_linear_offset
                    or config.activation_func_clamp_value is not None):
                return super().forward(hidden_states, per_token_scale, **kwargs)
            intermediate, _ = self.linear_fc1(hidden_states)  # no bias (add_bias_linear off)
            gate, linear = torch.chunk(intermediate, 2, dim=-1)
            return self.linear_fc2(config.activation_func(gate) * linear)

    return GatedMLP


def use_gated_mlp(model: torch.nn.Module) -> None:
    """Give every dense transformer layer's MLP of a built model (megatron's ``MLP`` exactly;
    mixture-of-experts layers and their experts are left alone) :class:`GatedMLP`'s forward."""
    from megatron.core.transformer.mlp import MLP

    global _GATED_MLP
    if _GATED_MLP is None:
        _GATED_MLP = _gated_mlp_class()
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        if type(getattr(layer, "mlp", None)) is MLP:
            layer.mlp.__class__ = _GATED_MLP


def packed_local_attention():
    """:class:`PackedLocalAttention` (built on first use: megatron is imported lazily)."""
    global _PACKED_LOCAL_ATTENTION
    if _PACKED_LOCAL_ATTENTION is None:
        _PACKED_LOCAL_ATTENTION = _local_attention_class()
    return _PACKED_LOCAL_ATTENTION


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm, usable with sequence parallelism. megatron-core's
    ``WrappedTorchNorm`` refuses ``sequence_parallel`` because it does not mark its weight:
    with the sequence split over the TP ranks each rank's norm sees other tokens, and the
    weight's gradient must be summed over TP, which megatron's ``finalize_model_grads`` does
    for parameters marked ``sequence_parallel``. This norm marks it (the per-head q/k norms,
    which megatron already sums over TP, are the same class)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def local_block_spec(config, vp_stage):
    """This pipeline stage's local layer specs (megatron's block spec: dense and MoE layers
    where ``config.moe_layer_freq`` puts them) with the packed attention and the norm above
    (the built model's dense MLPs then take :func:`use_gated_mlp`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization="RMSNorm", vp_stage=vp_stage)
    for layer_spec in block.layer_specs:
        layer = layer_spec.submodules
        attention = layer.self_attention.submodules
        attention.core_attention = packed_local_attention()
        for owner, field in ((layer, "input_layernorm"), (layer, "pre_mlp_layernorm"),
                             (attention, "q_layernorm"), (attention, "k_layernorm")):
            if getattr(owner, field, None) is WrappedTorchNorm:
                setattr(owner, field, SequenceParallelRMSNorm)
    if block.layer_norm is WrappedTorchNorm:
        block.layer_norm = SequenceParallelRMSNorm
    return block
