"""HF ``config.json`` -> megatron-core ``TransformerConfig`` + layer spec -> ``GPTModel`` chunks
for this rank, and loading HF safetensors into them at any TP/PP layout.

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

from rlep_megatron import platform
from rlep_megatron.checkpoint import architecture_for, layout, llama_family, spec_kwargs
from rlep_megatron.checkpoint.hf_io import SafetensorsReader, load_hf_config

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
                       on_meta_device: bool = False):
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
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # Initialisation must stay on even though HF weights overwrite it: megatron marks
        # tensor-parallel shards (param.tensor_model_parallel) only inside its initialisers, and
        # without the mark the grad norm treats shards of TP ranks > 0 as duplicates.
        # (CPU initialisation passes no explicit device, so a meta-device skeleton stays on
        # the meta device; GPU initialisation names the current CUDA device)
        use_cpu_initialization=not on_gpu or on_meta_device, perform_initialization=True,
        # fused kernels are CUDA-only; on CPU use megatron's plain-torch paths
        # (the local spec's fused softmax needs kernels that only apex / Megatron-LM build)
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu and (use_te or platform.fused_softmax_available()),
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        attention_backend=AttnBackend.auto if use_te else AttnBackend.local,
        # micro-batches are cut by a token budget, so their shapes differ; pipeline stages
        # exchange shapes before activations
        variable_seq_lengths=True,
        # megatron refuses variable lengths with the default MoE dispatcher even for dense
        # models; the dispatcher is unused here
        moe_token_dispatcher_type="alltoall",
    )
    if recompute_activations:
        kwargs.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    kwargs.update(arch.transformer_kwargs(hf_config))
    kwargs.update(platform.megatron_config_overrides())
    return TransformerConfig(**kwargs)


def build_model(hf_config: dict[str, Any], params_dtype: torch.dtype,
                recompute_activations: bool = False, on_meta_device: bool = False,
                transformer_engine: str = "auto"
                ) -> tuple[list[torch.nn.Module], ActorModelInfo]:
    """GPTModel chunks of this rank (one per virtual pipeline stage), weights uninitialised.

    ``transformer_engine``: ``auto`` | ``required`` | ``off``
    (:func:`platform.use_transformer_engine`). ``on_meta_device`` builds them without storage:
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
                                use_te, on_meta_device)
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import \
            get_gpt_layer_with_transformer_engine_spec
        spec = get_gpt_layer_with_transformer_engine_spec(**spec_kwargs(arch, hf_config))
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from rlep_megatron.actor.packing import packed_local_attention
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", **spec_kwargs(arch, hf_config))
        # the local attention with THD-packed sequences (sequence packing, actor/packing.py)
        spec.submodules.self_attention.submodules.core_attention = packed_local_attention()
    padded = layout.padded_vocab_size(dims.vocab_size, tp)
    chunks = []
    device = torch.device("meta") if on_meta_device else _current_device()
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        with device:
            chunk = GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=padded,
                max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings")),
                position_embedding_type="rope", vp_stage=stage, **arch.model_kwargs(hf_config))
        _params_to_dtype(chunk, params_dtype)
        chunks.append(chunk if on_meta_device else chunk.to(device))
    info = ActorModelInfo(hf_config=hf_config, dims=dims, padded_vocab_size=padded,
                          params_dtype=params_dtype, use_te=use_te)
    return chunks, info


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
    """``(param, rule, global_layer)`` for every parameter of a chunk; global layer numbers come
    from megatron's own ``layer_number`` (1-based), so PP and VPP offsets are megatron's."""
    by_name = layout.rule_index(rules)
    layer_numbers = ([layer.layer_number - 1 for layer in chunk.decoder.layers]
                     if hasattr(chunk, "decoder") else [])
    for name, param in chunk.named_parameters():
        template, local = layout.split_layer(layout.canonical_name(name))
        rule = by_name.get(template)
        if rule is None:
            raise ValueError(f"no HF mapping for megatron parameter {name!r}")
        yield name, param, rule, (layer_numbers[local] if local is not None else None)


def load_hf_weights(chunks: list[torch.nn.Module], hf_dir: str, info: ActorModelInfo) -> None:
    """Copy HF safetensors into this rank's shards, one tensor at a time."""
    from megatron.core import parallel_state as ps

    reader = SafetensorsReader(hf_dir)
    rules = architecture_for(info.hf_config).rules(info.hf_config)
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for name, param, rule, layer in iter_params_with_rules(chunk, rules):
            if rule.tp_dim is not None and tp_size > 1 and not getattr(
                    param, "tensor_model_parallel", False):
                raise AssertionError(f"{name} is TP-sharded but not marked tensor_model_parallel")
            hf_names = [n.format(layer=layer) for n in rule.hf_names]
            tensors = [reader.get(n) for n in hf_names]
            full = layout.hf_to_full(rule, tensors, info.dims, info.padded_vocab_size)
            local = layout.shard(rule, full, tp_rank, tp_size)
            if tuple(local.shape) != tuple(param.shape):
                raise ValueError(f"{name}: HF tensors {hf_names} give shape "
                                 f"{tuple(local.shape)} on this rank, the model expects "
                                 f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(local.to(param.dtype))


def build_from_hf(hf_dir: str, params_dtype: str = "auto",
                  recompute_activations: bool = False, transformer_engine: str = "auto"):
    """Build this rank's chunks for an HF checkpoint and load its weights."""
    hf_config = load_hf_config(hf_dir)
    chunks, info = build_model(hf_config, resolve_dtype(params_dtype), recompute_activations,
                               transformer_engine=transformer_engine)
    load_hf_weights(chunks, hf_dir, info)
    return chunks, info


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (or the chunk itself)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """Sharded state of this rank's chunks for ``dist_checkpointing`` (``model0``, ``model1``,
    ... with virtual pipeline stages, as megatron's own training checkpoints)."""
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


EXTRA_STATE = "_extra_state"


def drop_unsaved_extra_state(request: dict, directory: str) -> dict:
    """``request`` (a sharded state dict) without the TransformerEngine ``_extra_state``
    objects that the checkpoint in ``directory`` lacks. TE modules checkpoint such an object
    (their FP8 scaling history); a checkpoint saved with the local spec (a CPU node, the
    conversion tools, ``model.transformer_engine=off``) has none, and megatron would refuse to
    load it into a TE model. The dropped modules keep their initial extra state (no FP8
    history). Parameters are named alike in both specs."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def extra_objects(tree):
        for value in (tree.values() if isinstance(tree, dict) else tree
                      if isinstance(tree, list) else ()):
            if isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE):
                yield value
            elif isinstance(value, (dict, list)):
                yield from extra_objects(value)

    if next(extra_objects(request), None) is None:
        return request
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = {value.key for value in load_sharded_metadata(directory).values()}

    def prune(tree):
        if isinstance(tree, dict):
            return {k: prune(v) for k, v in tree.items()
                    if not (isinstance(v, ShardedObject) and v.key.endswith(EXTRA_STATE)
                            and v.key not in saved)}
        if isinstance(tree, list):
            return [prune(v) for v in tree]
        return tree

    return prune(request)


def load_model_state_dict(chunks: list[torch.nn.Module], state: dict) -> None:
    """Inverse of :func:`model_sharded_state_dict` once ``dist_checkpointing.load`` filled it.
    Only ``_extra_state`` entries may be missing (:func:`drop_unsaved_extra_state`)."""
    parts = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    for chunk, part in zip(chunks, parts):
        result = unwrap(chunk).load_state_dict(part, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                               f"unexpected {list(result.unexpected_keys)[:5]}")


def resolve_mcore_dir(mcore_dir: str) -> str:
    """A dist checkpoint directory; a training checkpoint (``checkpoints/step_XXXXXXXX``, whose
    weights are in ``dist/``) is accepted as well."""
    import os

    if os.path.isfile(os.path.join(mcore_dir, "meta.json")) and os.path.isfile(
            os.path.join(mcore_dir, "dist", "metadata.json")):
        return os.path.join(mcore_dir, "dist")
    return mcore_dir


def load_mcore_weights(chunks: list[torch.nn.Module], path: str,
                       hf_config: Optional[dict] = None) -> None:
    """Load a megatron-core dist checkpoint (any saved layout) into this rank's chunks: a
    converted checkpoint or a training checkpoint (``checkpoints/step_XXXXXXXX``, model part;
    with ``hf_config`` its recorded model is checked against it first). The one loader of
    model weights from a dist checkpoint (training start, ``rlep collect``/``eval``, the
    conversion check)."""
    import os

    from megatron.core import dist_checkpointing

    directory = resolve_mcore_dir(path)
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise FileNotFoundError(f"{path} is neither a megatron-core dist checkpoint nor a "
                                "training checkpoint (no metadata.json)")
    # a training checkpoint nests the model under "model" next to the optimizer; ask for the
    # same nesting so its common (non-tensor) optimizer entries stay out of the model's dict
    training = directory != path
    if training and hf_config is not None:
        from rlep_megatron.checkpoint.resume import check_checkpoint_model

        check_checkpoint_model(path, hf_config)
    request = drop_unsaved_extra_state(model_sharded_state_dict(chunks), directory)
    state = dist_checkpointing.load({"model": request} if training else request, directory)
    load_model_state_dict(chunks, state["model"] if training else state)
