"""HF ``config.json`` -> megatron-core ``TransformerConfig`` + layer spec -> ``GPTModel`` chunks
for this rank, from the architecture modules of :mod:`rlep_megatron.models`.

TransformerEngine's layer spec is used when TE is importable on a GPU, megatron-core's local
spec otherwise. Parameters are bfloat16 on GPU and float32 on CPU unless ``params_dtype`` says
otherwise. The vocabulary is padded to a multiple of the TP size; padded logits are masked by
:mod:`rlep_megatron.actor.logprob`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from rlep_megatron import distributed, platform
from rlep_megatron.models import architecture_for, layout, llama_family, spec_kwargs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ActorModelInfo:
    """What the rest of the actor needs to know about the built model."""

    hf_config: dict
    dims: layout.GPTDims
    padded_vocab_size: int
    params_dtype: torch.dtype
    use_te: bool
    moe_experts: str = "auto"
    """``model.moe_experts``: how the mixture-of-experts layers run their experts."""
    logprob_chunk_tokens: int = 2048
    """Tokens whose logits the log-prob passes compute at a time from the last hidden states
    (recomputed in the backward); 0: the output layer's full logits
    (``model.logprob_chunk_tokens``)."""


def resolve_dtype(name: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if platform.cuda_available() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"model.params_dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def transformer_config(hf_config: dict[str, Any], tensor_model_parallel_size: int,
                       pipeline_model_parallel_size: int, params_dtype: torch.dtype,
                       virtual_pipeline_model_parallel_size: Optional[int] = None,
                       recompute_activations: bool = False, use_te: bool = False,
                       on_meta_device: bool = False, expert_model_parallel_size: int = 1,
                       sequence_parallel: bool = False, context_parallel_size: int = 1,
                       moe_aux_loss_coeff: float = 0.0, moe_z_loss_coeff: float = 0.0,
                       moe_experts: str = "auto"):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    arch = architecture_for(hf_config)
    dims = llama_family.dims_from_config(hf_config)
    on_gpu = platform.cuda_available()
    kwargs: dict[str, Any] = dict(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size,
        num_attention_heads=dims.num_attention_heads, num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim, ffn_hidden_size=dims.ffn_hidden_size,
        normalization="RMSNorm", layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        sequence_parallel=sequence_parallel and tensor_model_parallel_size > 1,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        # each sequence split over CP ranks (models/context_parallel.py); TE's attention
        # exchanges K/V chunks point to point, the local spec all-gathers them
        context_parallel_size=context_parallel_size,
        cp_comm_type="p2p" if context_parallel_size > 1 else None,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # Initialisation must stay on even though HF weights overwrite it: megatron marks
        # tensor-parallel shards (param.tensor_model_parallel) only inside its initialisers, and
        # without the mark the grad norm treats shards of TP ranks > 0 as duplicates.
        # (CPU initialisation passes no explicit device, so a meta-device skeleton stays on
        # the meta device; GPU initialisation names the current CUDA device)
        use_cpu_initialization=not on_gpu or on_meta_device, perform_initialization=True,
        # fused kernels are CUDA-only; on CPU use megatron's plain-torch paths
        # (the local spec's fused softmax needs kernels that only apex / Megatron-LM build).
        # No bias and no dropout leave bias-dropout-add nothing to fuse but the residual add,
        # and megatron's fused one is torch.compile'd: a Triton build on a GPU (a C compiler
        # and Python's headers) and recompiles as the decoding batch shrinks, for nothing
        bias_dropout_fusion=False,
        masked_softmax_fusion=on_gpu and (use_te or platform.fused_softmax_available()),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_backend=AttnBackend.auto if use_te else AttnBackend.local,
        # micro-batches are cut by a token budget, so their shapes differ; pipeline stages
        # exchange shapes before activations
        variable_seq_lengths=True,
        # the all-to-all MoE token dispatcher (megatron refuses variable lengths with its
        # default all-gather one, even for dense models, which never use it)
        moe_token_dispatcher_type="alltoall",
    )
    if recompute_activations:
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    kwargs.update(arch.transformer_kwargs(hf_config))
    if kwargs.get("num_moe_experts"):
        kwargs.update(
            expert_model_parallel_size=expert_model_parallel_size,
            # TransformerEngine's grouped GEMM runs all local experts at once; the local spec
            # keeps megatron's SequentialMLP in its spec, which build_model replaces by the
            # torch grouped GEMM (grouped_experts.py) unless model.moe_experts=sequential
            moe_grouped_gemm=use_te and moe_experts != "sequential",
            # the aux loss and z-loss: off for RL unless the training config asks
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=moe_aux_loss_coeff, moe_z_loss_coeff=moe_z_loss_coeff or None)
    kwargs.update(platform.megatron_config_overrides())
    return TransformerConfig(**kwargs)


def build_model(hf_config: dict[str, Any], params_dtype: torch.dtype,
                recompute_activations: bool = False, on_meta_device: bool = False,
                transformer_engine: str = "auto", moe_aux_loss_coeff: float = 0.0,
                moe_z_loss_coeff: float = 0.0, moe_experts: str = "auto"
                ) -> tuple[list[torch.nn.Module], ActorModelInfo]:
    """GPTModel chunks of this rank (one per virtual pipeline stage), weights uninitialised.

    ``transformer_engine``: ``auto`` | ``required`` | ``off``
    (:func:`platform.use_transformer_engine`). ``moe_aux_loss_coeff`` / ``moe_z_loss_coeff``:
    the routers' load-balancing and z-losses (mixture-of-experts models; 0: off).
    ``moe_experts``: ``auto`` | ``grouped`` | ``sequential`` (``model.moe_experts``).
    ``on_meta_device`` builds them without storage:
    shapes, names and sharding metadata only (the streaming conversion tools work from such a
    skeleton); it takes the local spec, whose checkpoint keys are TransformerEngine's (megatron
    maps the norms' names), and allocates nothing on a GPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    arch = architecture_for(hf_config)
    dims = llama_family.dims_from_config(hf_config)
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    use_te = False if on_meta_device else platform.use_transformer_engine(transformer_engine)
    if not on_meta_device:
        platform.report_layer_spec(use_te)
    config = transformer_config(hf_config, tp, pp, params_dtype, vpp, recompute_activations,
                                use_te, on_meta_device,
                                ps.get_expert_model_parallel_world_size(),
                                distributed.sequence_parallel(),
                                ps.get_context_parallel_world_size(), moe_aux_loss_coeff,
                                moe_z_loss_coeff, moe_experts)
    if config.num_moe_experts:
        platform.megatron_moe_without_te()
        moe_experts = _expert_path(use_te, moe_experts, report=not on_meta_device)
    if use_te and not config.num_moe_experts:
        from megatron.core.models.gpt.gpt_layer_specs import \
            get_gpt_layer_with_transformer_engine_spec
        spec = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs(arch, hf_config))
    else:
        spec = None  # per stage below: megatron's block spec places the dense and MoE layers
    padded = layout.padded_vocab_size(dims.vocab_size, tp)
    chunks = []
    device = torch.device("meta") if on_meta_device else _current_device()
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        with device:
            chunk = GPTModel(
                config=config, vocab_size=padded,
                transformer_layer_spec=spec or _block_spec(config, use_te, stage, moe_experts),
                max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings")),
                position_embedding_type="rope", vp_stage=stage, **arch.model_kwargs(hf_config))
        if not use_te:
            from rlep_megatron.models.attention import use_gated_mlp
            use_gated_mlp(chunk)
        _params_to_dtype(chunk, params_dtype)
        chunks.append(chunk if on_meta_device else chunk.to(device))
    info = ActorModelInfo(hf_config=hf_config, dims=dims, padded_vocab_size=padded,
                          params_dtype=params_dtype, use_te=use_te,
                          moe_experts=moe_experts)
    return chunks, info


_MOE_EXPERTS = ("auto", "grouped", "sequential")


def _expert_path(use_te: bool, moe_experts: str, report: bool) -> str:
    """``model.moe_experts`` as it will run: ``auto`` falls back to ``sequential`` (with a
    warning) where neither TE nor torch's ``grouped_mm`` is there; said in the log once."""
    from rlep_megatron.models.grouped_experts import grouped_mm_available

    if moe_experts not in _MOE_EXPERTS:
        raise ValueError(f"model.moe_experts must be one of {', '.join(_MOE_EXPERTS)}; "
                         f"got {moe_experts!r}")
    if moe_experts == "auto" and not use_te and not grouped_mm_available():
        logger.warning("model.moe_experts=auto: torch %s has no torch.nn.functional.grouped_mm "
                       "(torch >= 2.10) and TransformerEngine is not used, so the experts run "
                       "one after another (megatron's SequentialMLP), much slower on a GPU",
                       torch.__version__)
        moe_experts = "sequential"
    if not report:
        return moe_experts
    if moe_experts == "sequential":
        path = "one after another (megatron's SequentialMLP; model.moe_experts=sequential)"
    elif use_te:
        path = "TransformerEngine's grouped GEMM"
    else:
        path = "torch's grouped GEMM (torch.nn.functional.grouped_mm)"
    logger.info("mixture-of-experts layers run their local experts with %s", path)
    return moe_experts


def _block_spec(config, use_te: bool, vp_stage: Optional[int], moe_experts: str = "auto"):
    """This pipeline stage's layer specs: TransformerEngine's for a mixture-of-experts model
    (dense layers where ``config.moe_layer_freq`` says 0), the local ones
    (:func:`attention.local_block_spec`) for every model without TE, whose experts run on
    torch's grouped GEMM unless ``moe_experts`` is ``sequential``."""
    if not use_te:
        from rlep_megatron.models.attention import local_block_spec
        block = local_block_spec(config, vp_stage)
        if config.num_moe_experts and moe_experts != "sequential":
            from rlep_megatron.models.grouped_experts import use_grouped_experts
            use_grouped_experts(block)
        return block
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    return get_gpt_decoder_block_spec(config, use_transformer_engine=True,
                                      normalization="RMSNorm", vp_stage=vp_stage)


def _params_to_dtype(chunk: torch.nn.Module, params_dtype: torch.dtype) -> None:
    """Every floating-point parameter in ``params_dtype``. The local spec's norms
    (``torch.nn.RMSNorm``) are created in float32 whatever the dtype; in a bf16 model they
    would form a second, float32 gradient buffer, and megatron-core 0.16's distributed
    optimizer then pairs the two buffers' parameters with the wrong optimizer states when it
    saves (``sharded_param_state_dp_reshardable`` asserts on the shapes). TransformerEngine's
    norms and the HF checkpoint keep them in the model dtype too."""
    for param in chunk.parameters():
        if param.is_floating_point() and param.dtype != params_dtype:
            param.data = param.data.to(params_dtype)


def _current_device() -> torch.device:
    if platform.cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def iter_params_with_rules(chunk: torch.nn.Module, rules: list[layout.ParamRule]):
    """``(name, param, rule, global_layer, global_expert)`` for every parameter of a chunk.
    Global layer numbers come from megatron's own ``layer_number`` (1-based), so PP and VPP
    offsets are megatron's; global expert indices from the MoE layer's
    ``local_expert_indices`` (EP offsets are megatron's); ``global_expert`` is None outside
    the experts."""
    by_name = layout.rule_index(rules)
    layers = list(chunk.decoder.layers) if hasattr(chunk, "decoder") else []
    for name, param in chunk.named_parameters():
        if name.startswith("lora."):
            continue  # LoRA adapters (rlep_megatron.lora): no HF tensor of the base model
        template, local = layout.split_layer(layout.canonical_name(name))
        template, local_expert = layout.split_expert(template)
        rule = by_name.get(template)
        if rule is None:
            raise ValueError(f"no HF mapping for megatron parameter {name!r}")
        layer = layers[local] if local is not None else None
        expert = (layer.mlp.local_expert_indices[local_expert]
                  if local_expert is not None else None)
        yield (name, param, rule, layer.layer_number - 1 if layer is not None else None, expert)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (or the chunk itself)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
