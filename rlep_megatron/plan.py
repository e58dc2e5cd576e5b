"""``rlep plan``: what one GPU holds for a recipe, before launch.

Parameter, gradient and optimizer bytes are counted on the real actor: the recipe's model built
on the meta device (no storage) for one rank of each pipeline stage, in a simulated process
group of ``--nodes`` x ``--gpus-per-node`` ranks (torch's ``fake`` backend), so every padding,
tied copy and expert split is the one the run will have. Activations follow the per-layer
accounting of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4), written per saved tensor for what this actor runs: no dropout, fused
(flash) attention (no ``s x s`` scores), grouped-query attention, SwiGLU, optional q/k norms and routed experts.
Everything else (logits, reference policy, vLLM) is arithmetic on the recipe, with each
assumption named in the output.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from rlep_megatron.config import RunConfig

GIB = 2 ** 30
OVERHEAD_GIB = 3.0
"""Assumed per-GPU memory outside the counted tensors: the CUDA context (about 0.5-1 GiB with
torch's kernels loaded), NCCL communicators and their buffers (one set per process group), and
the caching allocator's fragmentation."""
USABLE_GIB = {"h100": 79.6, "h200": 139.0, "a100": 79.2}
"""Memory a program can allocate on each card (what ``torch.cuda.mem_get_info`` reports as
total: the 80 GB H100 and A100 and the 141 GB H200, less what the driver reserves); vLLM's
``gpu_memory_utilization`` is a fraction of it."""
PEAK_HEADROOM = 0.9
"""A plan whose peak passes this fraction of the usable memory fits on paper but has no margin
for what the estimate leaves out; :func:`plan` says so."""
VLLM_WORKSPACE_GIB = 2.0
"""Assumed vLLM memory inside its budget besides weights and KV cache (activations of the
largest batch, CUDA graphs, sampler)."""
UNCHUNKED_LOGITS_COPIES = 5.3
"""Peak of the full-logits log-prob + backward in fp32 copies of the logits (measured by
``bench/logprob_memory.py``: 12.5 GB for 2.4 GB of logits)."""
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0}


@dataclasses.dataclass
class StageParams:
    """Parameters held by one rank of a pipeline stage (all its virtual chunks)."""

    layers: int = 0
    """Transformer layers of this rank."""
    has_output_layer: bool = False
    dense_chunks: list = dataclasses.field(default_factory=list)
    """Per model chunk, its parameters replicated over data-parallel ranks, in megatron DDP's
    order: (elements, whether it is a pipeline-shared embedding weight, which DDP puts in a
    bucket of its own)."""
    expert_chunks: list = dataclasses.field(default_factory=list)
    """The same for the routed-expert parameters (replicated over the expert data-parallel
    ranks)."""
    frozen: int = 0
    """Elements of frozen parameters (the base weights under LoRA): held, never in a gradient
    buffer or the optimizer."""
    trainable: int = 0
    """Elements of the parameters that train (all of them without LoRA)."""

    @property
    def dense(self) -> int:
        """Elements of parameters replicated over data-parallel ranks."""
        return sum(numel for chunk in self.dense_chunks for numel, _ in chunk)

    @property
    def expert(self) -> int:
        """Elements of routed-expert parameters."""
        return sum(numel for chunk in self.expert_chunks for numel, _ in chunk)


def ddp_buffer_layout(params: list[tuple[int, bool]], dp: int, distributed_optimizer: bool,
                      bucket_size: Optional[int]) -> tuple[list[tuple[int, int]],
                                                           list[tuple[int, int]]]:
    """Where megatron-core's DDP (0.16, ``_ParamAndGradBuffer``) puts each parameter in one
    gradient buffer: ``(bucket ranges, parameter ranges)`` in elements, parameters in the order
    given (DDP fills the buffer from the last one). With the distributed optimizer every
    parameter starts at a multiple of 64 elements and every bucket ends at a multiple of
    lcm(dp, 128), so that it splits into equal shards; a pipeline-shared embedding weight gets
    a bucket of its own; a bucket closes once it holds ``bucket_size`` elements (None: one
    bucket)."""
    def pad(n: int, divisor: int) -> int:
        return -(-n // divisor) * divisor

    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int]] = [(0, 0)] * len(params)
    bucket_start = start = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        if distributed_optimizer:
            end = pad(end, math.lcm(dp, 128))
        buckets.append((bucket_start, end))
        bucket_start, in_bucket = end, 0
        return end

    for index in reversed(range(len(params))):
        numel, shared = params[index]
        if distributed_optimizer:
            start = pad(start, 64)
        own_bucket = shared and distributed_optimizer
        if own_bucket and in_bucket:
            start = close(start)
        ranges[index] = (start, start + numel)
        in_bucket += 1
        end = start + numel
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(start)
    return buckets, ranges


def optimizer_shard_elements(buckets: list[tuple[int, int]], ranges: list[tuple[int, int]],
                             dp: int) -> list[int]:
    """Per data-parallel rank, the parameter elements whose optimizer state the distributed
    optimizer keeps there: each bucket is cut into ``dp`` equal shards, and a rank holds state
    for the parts of parameters inside its shards (not for padding)."""
    held = [0] * dp
    for bucket_start, bucket_end in buckets:
        size = (bucket_end - bucket_start) // dp
        inside = [(start, end) for start, end in ranges
                  if start < bucket_end and end > bucket_start]
        for rank in range(dp):
            lo = bucket_start + rank * size
            hi = lo + size
            held[rank] += sum(max(0, min(hi, end) - max(lo, start)) for start, end in inside)
    return held


def ddp_bucket_size(cfg: RunConfig, dp: int) -> Optional[int]:
    """megatron-core DDP's bucket size for the first model chunk of the first pipeline stage,
    dense and expert buffers alike: max(40M, 1M x dp) elements, dp the data-parallel size
    without context parallelism, with ``optim.overlap_grad_reduce``; else one bucket (later
    chunks and stages always have one)."""
    return max(40_000_000, 1_000_000 * dp) if cfg.optim.overlap_grad_reduce else None


def buffer_elements(counted: StageParams, cfg: RunConfig, stage: int, dp: int, cp: int,
                    expert_dp: int, bucket_size: Optional[int] = None) -> tuple[int, int]:
    """(gradient-buffer elements, optimizer-state parameter elements) of one rank of the stage:
    every chunk's dense buffer (sharded over the dp x cp ranks) and expert buffer (over the
    ``expert_dp`` ranks) laid out as megatron's DDP lays them out (:func:`ddp_buffer_layout`).
    The state is that of the data-parallel rank holding the most, summed over the chunks (and
    over the dense and expert buffers: the most of each, an upper bound by a few padding
    elements when both are sharded); without the distributed optimizer it covers every
    parameter. ``bucket_size`` replaces :func:`ddp_bucket_size` (tests)."""
    distributed_optimizer = cfg.optim.use_distributed_optimizer
    grads = state = 0
    for params_of_chunks, shards in ((counted.dense_chunks, dp * cp),
                                     (counted.expert_chunks, expert_dp)):
        held = [0] * shards
        for chunk_index, params in enumerate(params_of_chunks):
            if not params:
                continue
            size = None
            if stage == 0 and chunk_index == 0:
                size = bucket_size if bucket_size is not None else ddp_bucket_size(cfg, dp)
            buckets, ranges = ddp_buffer_layout(params, shards, distributed_optimizer, size)
            grads += buckets[-1][1]
            if distributed_optimizer:
                held = [a + b for a, b in zip(held, optimizer_shard_elements(buckets, ranges,
                                                                             shards))]
            else:
                held = [a + sum(numel for numel, _ in params) for a in held]
        state += max(held)
    return grads, state


def stage_params(hf_config: dict, cfg: RunConfig, gpus: int) -> list[StageParams]:
    """One entry per pipeline stage: the parameters of its first rank, counted on the actor
    built on the meta device inside a simulated ``gpus``-rank process group."""
    import torch
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from rlep_megatron import distributed, platform
    from rlep_megatron.models.megatron import build_model, unwrap

    if torch.distributed.is_initialized():
        raise RuntimeError("rlep plan runs alone, not inside a distributed job")
    platform.install_megatron_cpu_shim()
    par = cfg.parallel
    stages = []
    for stage in range(par.pipeline_model_parallel_size):
        rank = stage * (gpus // par.pipeline_model_parallel_size)
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank,
                                             world_size=gpus)
        saved_sp = distributed.sequence_parallel()
        try:
            distributed.initialize_megatron_groups(par, gloo_groups=False)
            if ps.get_pipeline_model_parallel_rank() != stage:
                raise AssertionError(f"rank {rank} is not on pipeline stage {stage}")
            chunks, info = build_model(hf_config, torch.bfloat16, on_meta_device=True)
            if cfg.lora.enabled:
                from rlep_megatron.lora.adapters import attach

                attach(chunks, info, cfg.lora, seed=0)
            counted = StageParams()
            for chunk in chunks:
                gpt = unwrap(chunk)
                counted.layers += len(gpt.decoder.layers)
                counted.has_output_layer |= bool(gpt.post_process)
                dense, expert = [], []
                for param in chunk.parameters():
                    if not param.requires_grad:  # megatron's DDP leaves it out
                        counted.frozen += param.numel()
                        continue
                    counted.trainable += param.numel()
                    entry = (param.numel(), bool(getattr(param, "shared_embedding", False)))
                    (dense if getattr(param, "allreduce", True) else expert).append(entry)
                counted.dense_chunks.append(dense)
                counted.expert_chunks.append(expert)
            stages.append(counted)
        finally:
            distributed.set_sequence_parallel(saved_sp)
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    return stages


def layer_activation_elements(hf_config: dict, tp: int, sequence_parallel: bool,
                              moe_layer: bool, spec: str = "te") -> float:
    """Elements saved for the backward by one transformer layer, per token of a micro-batch,
    on one TP rank (Korthikanti et al.'s terms without dropout masks or attention scores).

    TransformerEngine's spec (``te``), what a GPU run uses:

    * attention: the norm's input and normalised output (``h`` each, split by TP under
      sequence parallelism: TE's fused norm + linear keeps both), Q, K, V after the rotary
      embedding (``q + 2 kv`` / TP), the q/k norms' inputs where the model has them, and the
      attention output, which is also the projection's input (``q`` / TP);
    * dense MLP: the norm's input and output, the gate/up output (``2 f`` / TP, the fused
      SwiGLU's input) and the SwiGLU output (``f`` / TP, the down projection's input);
    * routed experts: the norm's input and output, the router's float32 logits (``E``, two
      16-bit elements each), and per routed copy (top-k) of a token its permuted input and
      expert output (``2 h``) and the experts' gate/up and SwiGLU outputs (``3 f_moe``), over
      TP (tokens are split over the TP ranks by sequence parallelism).

    megatron-core's local spec (``local``, CPU and GPUs without TE) keeps more: each norm its
    input, normalised input and scaled output (``3 h``), K and V repeated to every query head
    (``4 q`` in all), and the unfused SwiGLU the gate/up output, the SiLU output, its input
    and the product (``5 f``)."""
    from rlep_megatron.models import llama_family, num_experts

    if spec not in ("te", "local"):
        raise ValueError(f"spec must be te or local, got {spec!r}")
    local = spec == "local"
    dims = llama_family.dims_from_config(hf_config)
    h = dims.hidden_size
    q = dims.num_attention_heads * dims.head_dim
    kv = dims.num_query_groups * dims.head_dim
    hs = h / tp if sequence_parallel else h
    norm = 3 * hs if local else 2 * hs
    attention = norm + ((4 * q) if local else (2 * q + 2 * kv)) / tp
    if hf_config.get("model_type") in ("qwen3", "qwen3_moe"):
        attention += (q + kv) / tp
    if moe_layer:
        experts = num_experts(hf_config)
        top_k = int(hf_config.get("num_experts_per_tok", 1))
        f_moe = int(hf_config.get("moe_intermediate_size", dims.ffn_hidden_size))
        mlp = norm + 2 * experts / tp + top_k * (2 * h + (5 if local else 3) * f_moe) / tp
    else:
        mlp = norm + (5 if local else 3) * dims.ffn_hidden_size / tp
    return attention + mlp


def _moe_layer_flags(hf_config: dict) -> list[bool]:
    from rlep_megatron.models import num_experts

    layers = int(hf_config["num_hidden_layers"])
    if not num_experts(hf_config):
        return [False] * layers
    dense = set(hf_config.get("mlp_only_layers") or [])
    step = int(hf_config.get("decoder_sparse_step", 1) or 1)
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def activation_bytes(hf_config: dict, cfg: RunConfig, tokens: int, stage: int,
                     dtype_bytes: int, spec: str = "te") -> dict[str, float]:
    """Activation bytes of pipeline stage ``stage`` at the peak of a training step:
    ``in_flight`` micro-batches of ``tokens`` tokens per rank (a micro-batch / CP) (1F1B: PP - stage; interleaved: plus the
    warm-up of the virtual chunks), with and without full recompute."""
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    flags = _moe_layer_flags(hf_config)
    per_stage = len(flags) // pp
    mine = flags[stage * per_stage:(stage + 1) * per_stage]
    per_layer = [layer_activation_elements(hf_config, tp, par.sequence_parallel, moe, spec)
                 * tokens * dtype_bytes for moe in mine]
    hidden = int(hf_config["hidden_size"])
    layer_input = tokens * hidden / (tp if par.sequence_parallel else 1) * dtype_bytes
    vpp = par.virtual_pipeline_model_parallel_size or 1
    in_flight = pp - stage if vpp == 1 else pp - stage + (pp - 1) / vpp
    in_flight = max(1.0, in_flight)
    full = sum(per_layer) * in_flight
    # full recompute: each layer keeps its input; one layer's activations are rebuilt at a time
    recompute = layer_input * len(mine) * in_flight + max(per_layer, default=0.0)
    return {"in_flight_micro_batches": in_flight, "without_recompute": full,
            "with_recompute": recompute}


def logits_bytes(hf_config: dict, cfg: RunConfig, tokens: int, padded_vocab: int,
                 dtype_bytes: int) -> float:
    """The last stage's log-prob step: chunked, the gathered hidden states plus the larger of
    the forward's two float32 chunk buffers and the backward's one with the output weight's
    float32 gradient accumulator (and its 16-bit chunk product); unchunked, the measured peak
    of the full logits (``bench/logprob_memory.py`` measures both)."""
    tp = cfg.parallel.tensor_model_parallel_size
    hidden = int(hf_config["hidden_size"])
    shard = padded_vocab // tp
    chunk = cfg.model.logprob_chunk_tokens
    if chunk:
        one_chunk = min(chunk, tokens) * shard * 4
        weight_grad = shard * hidden * (4 + (dtype_bytes if dtype_bytes != 4 else 0))
        # forward: a chunk's logits and exponentials; backward: one chunk + the accumulator
        return tokens * hidden * dtype_bytes + max(2 * one_chunk, one_chunk + weight_grad)
    return UNCHUNKED_LOGITS_COPIES * tokens * shard * 4


def vllm_bytes(hf_config: dict, cfg: RunConfig, total_params: int, gpu_bytes: float,
               dtype_bytes: int) -> dict[str, float]:
    """The rollout engine on one GPU: its budget (``gpu_memory_utilization`` of the GPU), the
    weights of one rollout-TP shard, and the KV cache left after the assumed workspace."""
    from rlep_megatron.models import llama_family

    dims = llama_family.dims_from_config(hf_config)
    sequence = cfg.data.max_prompt_tokens + cfg.rollout.max_response_tokens
    if cfg.rollout.backend == "megatron":
        # the actor's own weights generate; a batch's KV cache (its kv heads split over the
        # actor's TP ranks) exists while that batch decodes, freed before training
        kv_heads = max(1.0, dims.num_query_groups / cfg.parallel.tensor_model_parallel_size)
        per_token = (2 * int(hf_config["num_hidden_layers"]) * kv_heads * dims.head_dim
                     * dtype_bytes)
        batch = cfg.rollout.megatron_batch_size
        kv_cache = batch * sequence * per_token
        return {"budget": kv_cache, "weights": 0.0, "kv_cache": kv_cache,
                "kv_bytes_per_token": per_token, "kv_tokens": batch * sequence,
                "full_length_sequences": float(batch), "engine": "megatron"}
    rtp = cfg.rollout.tensor_model_parallel_size
    # a server started by a rollout rank owns its GPU and takes its own share of it
    servers_own_gpus = cfg.rollout.placement == "separate" and cfg.rollout.num_ranks > 0
    budget = (cfg.rollout.server_gpu_memory_utilization if servers_own_gpus
              else cfg.rollout.gpu_memory_utilization) * gpu_bytes
    weights = total_params * dtype_bytes / rtp
    kv_heads = max(1.0, dims.num_query_groups / rtp)
    per_token = 2 * int(hf_config["num_hidden_layers"]) * kv_heads * dims.head_dim * dtype_bytes
    kv_cache = budget - weights - VLLM_WORKSPACE_GIB * GIB
    return {"budget": budget, "weights": weights, "kv_cache": kv_cache,
            "kv_bytes_per_token": per_token, "kv_tokens": max(0.0, kv_cache) / per_token,
            "full_length_sequences": max(0.0, kv_cache) / per_token / sequence}


def plan(cfg: RunConfig, hf_config: dict, gpus: int, gpu_mem_gib: Optional[float] = None,
         mfu: float = 0.3, gpu: str = "h100", spec: str = "te",
         gpus_per_node: Optional[int] = None) -> dict[str, Any]:
    """The whole plan as one JSON-able dict (keys documented in docs/memory.md).
    ``gpu_mem_gib``: the usable memory per GPU; ``None``: the card's (:data:`USABLE_GIB`).
    When the plan does not fit, or fits above :data:`PEAK_HEADROOM`, ``fixes`` lists changes
    planned here that bring both peaks under it (``gpus_per_node``: the size of one more
    node, for the "more nodes" fixes)."""
    if cfg.lora.enabled:
        spec = "local"  # the adapters sit on megatron-core's local linears
    result = _plan(cfg, hf_config, gpus, gpu_mem_gib, mfu, gpu, spec)
    if cfg.lora.enabled:  # beside it, the same job without LoRA
        # (the section's other keys off too: lora.lr or init_from without a rank is refused)
        full = _plan(_changed(cfg, {"lora.rank": 0, "lora.lr": None, "lora.init_from": ""}),
                     hf_config, gpus, gpu_mem_gib, mfu, gpu, spec)
        result["full_fine_tuning"] = {key: full[key] for key in (
            "peak_train_gib", "peak_rollout_gib", "fits")}
        result["full_fine_tuning"]["optimizer_gib"] = max(
            s["optimizer_bytes"] for s in full["stages"]) / GIB
    result["fixes"] = []
    if result["peak_fraction"] > PEAK_HEADROOM or not result["fits"]:
        result["fixes"] = checked_fixes(cfg, hf_config, gpus, gpus_per_node or gpus,
                                        result["gpu_mem_gib"], mfu, gpu, spec)
    return result


def _changed(cfg: RunConfig, changes: dict[str, Any]) -> RunConfig:
    from rlep_megatron.config import config_from_dict, config_to_dict

    raw = config_to_dict(cfg)
    for key, value in changes.items():
        section, name = key.split(".")
        raw[section][name] = value
    return config_from_dict(raw)


def checked_fixes(cfg: RunConfig, hf_config: dict, gpus: int, gpus_per_node: int,
                  gpu_mem_gib: float, mfu: float, gpu: str, spec: str) -> list[dict]:
    """Single changes, and pairs of them, each planned in full: those that bring the train
    and rollout peaks under :data:`PEAK_HEADROOM` of ``gpu_mem_gib``, the fewest changes
    first, then the lowest peak (at most 4). A change the layout refuses is left out."""
    par = cfg.parallel
    single: list[tuple[dict[str, Any], int]] = []  # (changes, extra GPUs)
    if cfg.optim.grad_reduce_dtype == "float32" and cfg.model.params_dtype != "float32":
        single.append(({"optim.grad_reduce_dtype": "bfloat16"}, 0))
    if not cfg.optim.offload_during_rollout and cfg.rollout.placement != "separate":
        single.append(({"optim.offload_during_rollout": True}, 0))
    if not cfg.model.recompute_activations:
        single.append(({"model.recompute_activations": True}, 0))
    single.append(({"parallel.pipeline_model_parallel_size":
                    par.pipeline_model_parallel_size * 2}, 0))
    single.append(({}, gpus))  # as many GPUs again: more (expert) data parallelism
    candidates = [(c, g) for c, g in single if c or g]
    candidates += [({**a, **b}, ga + gb) for i, (a, ga) in enumerate(single)
                   for b, gb in single[i + 1:] if not set(a) & set(b)]
    found = []
    for changes, extra in candidates:
        try:
            result = _plan(_changed(cfg, changes), hf_config, gpus + extra, gpu_mem_gib, mfu,
                           gpu, spec)
        except ValueError:  # a layout the model or the GPU count refuses
            continue
        if result["fits"] and result["peak_fraction"] <= PEAK_HEADROOM:
            words = [f"{key}={str(value).lower() if isinstance(value, bool) else value}"
                     for key, value in changes.items()]
            if extra:
                nodes = (gpus + extra) // gpus_per_node
                words.append(f"{gpus + extra} GPUs" + (f" ({nodes} nodes of {gpus_per_node})"
                                                       if (gpus + extra) % gpus_per_node == 0
                                                       else ""))
            found.append({"changes": changes, "gpus": gpus + extra, "text": ", ".join(words),
                          "count": len(words),
                          "peak_train_gib": result["peak_train_gib"],
                          "peak_rollout_gib": result["peak_rollout_gib"],
                          "peak_fraction": result["peak_fraction"]})
    found.sort(key=lambda f: (f["count"], f["peak_fraction"]))
    return found[:4]


def _check_plan_inputs(cfg: RunConfig, hf_config: dict, gpus: int,
                       gpu_mem_gib: Optional[float], mfu: float, gpu: str):
    """The plan's inputs checked; ``(training GPUs, job GPUs, usable GiB, separate)``."""
    from rlep_megatron.distributed import validate_parallel_layout
    from rlep_megatron.models import layout_limits

    if gpu not in PEAK_TFLOPS:
        raise ValueError(f"--gpu must be one of {sorted(PEAK_TFLOPS)}, got {gpu!r}")
    if gpu_mem_gib is None:
        gpu_mem_gib = USABLE_GIB[gpu]
    if gpu_mem_gib <= 0:
        raise ValueError(f"--gpu-mem-gib must be > 0, got {gpu_mem_gib}")
    if not 0 < mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {mfu}")
    par = cfg.parallel
    # rollout.placement=separate: the job's last rollout.num_ranks GPUs serve (one each), the
    # rest train; servers given by URL are outside the job
    separate = cfg.rollout.placement == "separate"
    job_gpus = gpus
    if separate:
        if cfg.rollout.num_ranks >= gpus:
            raise ValueError(f"rollout.num_ranks={cfg.rollout.num_ranks} leaves no training GPU "
                             f"of {gpus}")
        gpus -= cfg.rollout.num_ranks
    validate_parallel_layout(gpus, par, **layout_limits(hf_config))
    if not separate and gpus % cfg.rollout.tensor_model_parallel_size:
        raise ValueError(f"rollout.tensor_model_parallel_size="
                         f"{cfg.rollout.tensor_model_parallel_size} does not divide {gpus} GPUs")
    return gpus, job_gpus, gpu_mem_gib, separate


def _stage_memory(cfg: RunConfig, hf_config: dict, stages, gpus: int, dtype_bytes: int,
                  rollout_budget: float, separate: bool, spec: str) -> list[dict]:
    """Per pipeline stage: its parameters, gradients, optimizer state, activations, logits and
    reference bytes, and its peaks while training and while vLLM generates."""
    from rlep_megatron.models import layout, llama_family

    par = cfg.parallel
    tp, pp, ep = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                  par.expert_model_parallel_size)
    dp = gpus // (tp * pp * par.context_parallel_size)
    expert_dp = gpus // (pp * ep * tp)
    padded_vocab = layout.padded_vocab_size(llama_family.dims_from_config(hf_config).vocab_size,
                                            tp)
    # context parallelism splits every sequence: each rank holds 1 / CP of a micro-batch
    tokens = cfg.trainer.micro_batch_max_tokens / par.context_parallel_size
    # optimizer: fp32 master copy (16-bit models) + Adam's two moments, sharded over
    # (expert) data-parallel ranks by the distributed optimizer
    per_param_state = (4 if dtype_bytes != 4 else 0) + 8
    if dtype_bytes != 4 and cfg.optim.grad_reduce_dtype != "float32":
        per_param_state += 4  # the float32 copy of the 16-bit gradient shard at each step
    # (LoRA's reference, the initial adapters, stays on the device)
    reference = (0.0 if cfg.algo.kl_coef <= 0
                 or (cfg.algo.reference_offload and not cfg.lora.enabled) else 1.0)
    per_stage = []
    # gradient buffers: float32, or the parameters' dtype with optim.grad_reduce_dtype=bfloat16
    grad_bytes = 4 if cfg.optim.grad_reduce_dtype == "float32" else dtype_bytes
    for index, counted in enumerate(stages):
        numel = counted.dense + counted.expert + counted.frozen
        # the distributed optimizer shards the state over the data-parallel ranks (with their
        # context-parallel peers for the dense parameters), bucket by bucket
        grad_elements, state_elements = buffer_elements(
            counted, cfg, index, dp, par.context_parallel_size, expert_dp)
        optim = per_param_state * state_elements
        act = activation_bytes(hf_config, cfg, tokens, index, dtype_bytes, spec)
        chosen = act["with_recompute" if cfg.model.recompute_activations
                     else "without_recompute"]
        logits = (logits_bytes(hf_config, cfg, tokens, padded_vocab, dtype_bytes)
                  if counted.has_output_layer else 0.0)
        # the distributed optimizer moves the weights into a buffer laid out as the gradients'
        grads = grad_elements * grad_bytes
        params = ((grad_elements if cfg.optim.use_distributed_optimizer else counted.trainable)
                  + counted.frozen) * dtype_bytes
        # LoRA's reference: the initial adapters, and the current ones aside during its pass
        ref = reference * (2 * counted.trainable if cfg.lora.enabled else numel) * dtype_bytes
        sleeping = (0.0 if cfg.rollout.enable_sleep_mode or separate
                    or cfg.rollout.backend == "megatron" else rollout_budget)
        train_peak = (params + grads + optim + chosen + logits + ref + sleeping
                      + OVERHEAD_GIB * GIB)
        resident = params + ref + (0.0 if cfg.optim.offload_during_rollout else grads + optim)
        # separate: the rollout GPU holds the server alone (same for every stage)
        rollout_peak = (rollout_budget if separate else resident + rollout_budget
                        ) + OVERHEAD_GIB * GIB
        per_stage.append({
            "stage": index, "layers": counted.layers, "params": numel,
            "trainable_params": counted.trainable,
            "param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optim,
            "activation_bytes": chosen,
            "activation_bytes_without_recompute": act["without_recompute"],
            "activation_bytes_with_recompute": act["with_recompute"],
            "in_flight_micro_batches": act["in_flight_micro_batches"],
            "logits_bytes": logits, "reference_bytes": ref,
            "train_peak_gib": train_peak / GIB, "rollout_peak_gib": rollout_peak / GIB})
    return per_stage


def _plan(cfg: RunConfig, hf_config: dict, gpus: int, gpu_mem_gib: Optional[float],
          mfu: float, gpu: str, spec: str) -> dict[str, Any]:
    from rlep_megatron.models import num_experts

    gpus, job_gpus, gpu_mem_gib, separate = _check_plan_inputs(cfg, hf_config, gpus,
                                                               gpu_mem_gib, mfu, gpu)
    par = cfg.parallel
    gpu_bytes = gpu_mem_gib * GIB
    dtype_bytes = 4 if cfg.model.params_dtype == "float32" else 2
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    dp = gpus // (tp * pp * par.context_parallel_size)
    stages = stage_params(hf_config, cfg, gpus)
    total = _total_params(hf_config, stages, cfg)
    rollout = vllm_bytes(hf_config, cfg, total["total_params"], gpu_bytes, dtype_bytes)
    if separate and cfg.rollout.num_ranks and rollout["kv_cache"] <= 0:
        raise ValueError(
            f"rollout.num_ranks: each rollout rank serves the whole model on one GPU, and "
            f"{total['total_params'] / 1e9:.1f}B parameters take "
            f"{rollout['weights'] / GIB:.1f} GiB, more than its budget of "
            f"{rollout['budget'] / GIB:.1f} GiB (rollout.server_gpu_memory_utilization="
            f"{cfg.rollout.server_gpu_memory_utilization:g} of {gpu_mem_gib:g} GiB, "
            f"{VLLM_WORKSPACE_GIB:g} GiB of it workspace): start tensor-parallel vLLM servers "
            "yourself and give them as rollout.server_urls (docs/ASYNC.md)")
    per_stage = _stage_memory(cfg, hf_config, stages, gpus, dtype_bytes, rollout["budget"],
                              separate, spec)
    worst_train = max(per_stage, key=lambda s: s["train_peak_gib"])
    worst_rollout = max(per_stage, key=lambda s: s["rollout_peak_gib"])
    fits_train = worst_train["train_peak_gib"] <= gpu_mem_gib
    fits_rollout = (worst_rollout["rollout_peak_gib"] <= gpu_mem_gib
                    and rollout["full_length_sequences"] >= 1)
    flops = step_flops(hf_config, cfg, total)
    seconds = flops["total"] / (gpus * PEAK_TFLOPS[gpu] * 1e12 * mfu)
    peak = max(worst_train["train_peak_gib"], worst_rollout["rollout_peak_gib"])
    advice = _advice(cfg, fits_train, fits_rollout, rollout)
    if fits_train and fits_rollout and peak > PEAK_HEADROOM * gpu_mem_gib:
        advice.insert(0, f"the peak is {peak / gpu_mem_gib:.0%} of the usable memory, above "
                         f"{PEAK_HEADROOM:.0%}: little margin for what the estimate leaves "
                         "out" + ("; optim.offload_during_rollout=true frees the gradients "
                                  "and Adam state while vLLM runs"
                                  if not (cfg.optim.offload_during_rollout or separate)
                                  else ""))
    return {
        "gpus": job_gpus, "train_gpus": gpus, "placement": cfg.rollout.placement,
        "rollout_gpus": (cfg.rollout.num_ranks if cfg.rollout.num_ranks
                         else len(cfg.rollout.server_urls)
                         * cfg.rollout.tensor_model_parallel_size) if separate else gpus,
        "gpu_mem_gib": gpu_mem_gib, "data_parallel_size": dp,
        "total_params": total["total_params"], "active_params": total["active_params"],
        "experts": num_experts(hf_config),
        "params_per_gpu": max(s["params"] for s in per_stage),
        "stages": per_stage, "rollout": rollout,
        "peak_train_gib": worst_train["train_peak_gib"],
        "peak_rollout_gib": worst_rollout["rollout_peak_gib"],
        "fits_train": fits_train, "fits_rollout": fits_rollout,
        "fits": fits_train and fits_rollout,
        "peak_fraction": peak / gpu_mem_gib,
        "advice": advice,
        "flops_per_step": flops, "mfu": mfu, "gpu": gpu,
        "seconds_per_step_at_mfu": seconds,
        # dynamic sampling generates again for groups without signal: up to this many rounds
        "max_generation_rounds": (cfg.algo.max_generation_rounds if cfg.algo.dynamic_sampling
                                  else 1),
        "assumptions": {"overhead_gib": OVERHEAD_GIB, "usable_gib": gpu_mem_gib,
                        "vllm_workspace_gib": VLLM_WORKSPACE_GIB,
                        "sequences_at_full_length": True,
                        "layer_spec": spec,
                        "attention": "fused (flash): no s x s scores"},
    }


def _total_params(hf_config: dict, stages: list[StageParams], cfg: RunConfig) -> dict:
    """Whole-model parameter counts (one copy; the vocabulary unpadded) from the HF config,
    and the parameters one token passes through (top-k of the experts)."""
    from rlep_megatron.models import llama_family, num_experts

    dims = llama_family.dims_from_config(hf_config)
    h, v = dims.hidden_size, dims.vocab_size
    q, kv = dims.num_attention_heads * dims.head_dim, dims.num_query_groups * dims.head_dim
    attention = h * (q + 2 * kv) + q * h + 2 * h
    if hf_config.get("attention_bias") or hf_config.get("model_type") == "qwen2":
        attention += q + 2 * kv
    if hf_config.get("model_type") in ("qwen3", "qwen3_moe"):
        attention += 2 * dims.head_dim
    experts = num_experts(hf_config)
    f_moe = int(hf_config.get("moe_intermediate_size", dims.ffn_hidden_size))
    top_k = int(hf_config.get("num_experts_per_tok", 1))
    total = active = 0
    for moe in _moe_layer_flags(hf_config):
        if moe:
            total += attention + h * experts + experts * 3 * h * f_moe
            active += attention + h * experts + top_k * 3 * h * f_moe
        else:
            total += attention + 3 * h * dims.ffn_hidden_size
            active += attention + 3 * h * dims.ffn_hidden_size
    head = 0 if hf_config.get("tie_word_embeddings") else v * h
    embeddings = v * h + head + h
    return {"total_params": total + embeddings, "active_params": active,
            "non_embedding_params": total}


def adapter_params(hf_config: dict, lora) -> int:
    """Parameters of the LoRA adapters a token passes through: ``rank x (in + out)`` for each
    targeted projection of each layer (a mixture-of-experts layer's MLP has none)."""
    from rlep_megatron.lora.targets import MLP_TARGETS, projection_shape
    from rlep_megatron.models import llama_family

    if not lora.enabled:
        return 0
    dims = llama_family.dims_from_config(hf_config)
    count = 0
    for moe in _moe_layer_flags(hf_config):
        for name in lora.targets():
            if not (moe and name in MLP_TARGETS):
                count += lora.rank * sum(projection_shape(name, dims))
    return count


def step_flops(hf_config: dict, cfg: RunConfig, total: dict) -> dict[str, float]:
    """Model FLOPs of one RL step with every sequence at full length (an upper bound): 2 N per
    token forward (N: parameters a token passes through, plus the output layer, plus LoRA's
    adapters) and ``2 x layers x q x L`` per token for causal attention; training is 3
    forwards, the old-log-prob pass (and the reference's) one, the rollout one per token.
    With LoRA the frozen weights get no weight gradient: their training is 2 forwards (the
    forward and the input gradients), attention and the adapters' 3."""
    from rlep_megatron.models import llama_family

    dims = llama_family.dims_from_config(hf_config)
    n = total["active_params"] + dims.vocab_size * dims.hidden_size
    adapters = adapter_params(hf_config, cfg.lora)
    prompt, response = cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens
    length = prompt + response
    q = dims.num_attention_heads * dims.head_dim
    layers = int(hf_config["num_hidden_layers"])
    weights = 2 * n * length  # per sequence forward, through the (base) weights
    rest = 2 * adapters * length + 2 * layers * q * length * length
    per_sequence_forward = weights + rest
    prompts = cfg.data.train_batch_size
    fresh = prompts * cfg.rollout.num_samples_per_prompt
    trained = prompts * (cfg.rollout.num_samples_per_prompt
                         + cfg.replay.num_replays_per_prompt)
    forwards = 1 + (1 if cfg.algo.kl_coef > 0 else 0)
    out = {"rollout": fresh * per_sequence_forward,
           "logprobs": forwards * trained * per_sequence_forward,
           "train": trained * ((2 if cfg.lora.enabled else 3) * weights + 3 * rest)}
    out["total"] = sum(out.values())
    return out


def _advice(cfg: RunConfig, fits_train: bool, fits_rollout: bool, rollout: dict) -> list[str]:
    out = []
    par = cfg.parallel
    if not fits_train:
        if not cfg.model.recompute_activations:
            out.append("model.recompute_activations=true (keeps one input per layer)")
        if par.tensor_model_parallel_size > 1 and not par.sequence_parallel:
            out.append("parallel.sequence_parallel=true (norm/residual activations / TP)")
        out.append(f"trainer.micro_batch_max_tokens below {cfg.trainer.micro_batch_max_tokens}"
                   " (activations and logits scale with it)")
        if not cfg.optim.use_distributed_optimizer:
            out.append("optim.use_distributed_optimizer=true (Adam state / DP)")
        if not cfg.model.logprob_chunk_tokens:
            out.append("model.logprob_chunk_tokens=2048 (one chunk of logits at a time)")
        out.append("parallel.context_parallel_size=2 or more (activations and logits / CP)")
        out.append("a larger parallel.tensor_model_parallel_size or "
                   "pipeline_model_parallel_size (weights, gradients and activations / TP x PP)")
    # servers started by rollout ranks: their own memory key, at rollout TP 1
    ranks = cfg.rollout.placement == "separate" and cfg.rollout.num_ranks > 0
    memory_key = ("rollout.server_gpu_memory_utilization" if ranks
                  else "rollout.gpu_memory_utilization")
    if not fits_rollout:
        if rollout["full_length_sequences"] < 1:
            out.append(f"{memory_key} up, or "
                       + ("tensor-parallel servers of your own as rollout.server_urls"
                          if ranks else "a larger rollout.tensor_model_parallel_size")
                       + ": the KV cache does not hold one full-length sequence")
        else:
            if not cfg.optim.offload_during_rollout and cfg.rollout.placement != "separate":
                out.append("optim.offload_during_rollout=true (gradients and Adam state leave "
                           "the GPU while the rollout runs)")
            out.append("rollout.megatron_batch_size down (a smaller KV cache)"
                       if cfg.rollout.backend == "megatron"
                       else f"{memory_key} down (a smaller KV cache)")
    return out


def format_plan(result: dict) -> str:
    """The human-readable table of :func:`plan`."""
    gib = lambda b: f"{b / GIB:.1f}"  # noqa: E731
    lines = [f"{result['total_params'] / 1e9:.2f}B parameters "
             f"({result['active_params'] / 1e9:.2f}B per token outside the embeddings), "
             f"{result['gpus']} GPUs of {result['gpu_mem_gib']:g} GiB usable, DP "
             f"{result['data_parallel_size']}",
             "",
             "per GPU, GiB | " + " | ".join(f"stage {s['stage']}" for s in result["stages"])]
    rows = [("layers", lambda s: str(s["layers"])),
            ("parameters (elements)", lambda s: f"{s['params'] / 1e9:.3f}B"),
            ("weights", lambda s: gib(s["param_bytes"])),
            ("gradient buffers", lambda s: gib(s["grad_bytes"])),
            ("optimizer state", lambda s: gib(s["optimizer_bytes"])),
            ("activations, no recompute", lambda s: gib(s["activation_bytes_without_recompute"])),
            ("activations, full recompute", lambda s: gib(s["activation_bytes_with_recompute"])),
            ("micro-batches in flight", lambda s: f"{s['in_flight_micro_batches']:g}"),
            ("logits step", lambda s: gib(s["logits_bytes"])),
            ("reference policy", lambda s: gib(s["reference_bytes"])),
            ("TRAIN PEAK", lambda s: f"{s['train_peak_gib']:.1f}")]
    separate = result.get("placement") == "separate"
    if not separate:
        rows.append(("ROLLOUT PEAK", lambda s: f"{s['rollout_peak_gib']:.1f}"))
    for label, cell in rows:
        lines.append(f"{label} | " + " | ".join(cell(s) for s in result["stages"]))
    r = result["rollout"]
    if separate:
        lines[0:1] = [lines[0], f"rollout.placement=separate: {result['train_gpus']} trainer "
                      f"GPU(s) (the table), {result['rollout_gpus']} rollout GPU(s) "
                      f"(vLLM alone, peak {result['peak_rollout_gib']:.1f} GiB each)"]
    if r.get("engine") == "megatron":
        lines += ["", f"rollout.backend=megatron per GPU: the actor's weights, and the KV cache "
                  f"of one batch of {r['full_length_sequences']:.0f} full-length sequences "
                  f"while it decodes, {gib(r['kv_cache'])} GiB ({r['kv_tokens']:.0f} tokens)"]
    else:
        lines += ["", f"vLLM per GPU: budget {gib(r['budget'])} = weights {gib(r['weights'])} + "
                  f"workspace {result['assumptions']['vllm_workspace_gib']:g} + KV cache "
                  f"{gib(r['kv_cache'])} ({r['kv_tokens']:.0f} tokens, "
                  f"{r['full_length_sequences']:.1f} full-length sequences)"]
    f = result["flops_per_step"]
    lines.append(f"FLOPs per RL step (full-length sequences): {f['total']:.3g} (rollout "
                 f"{f['rollout']:.3g}, log-probs {f['logprobs']:.3g}, train {f['train']:.3g});"
                 f" {result['seconds_per_step_at_mfu']:.0f} s at {result['mfu']:.0%} MFU of "
                 f"{result['gpu'].upper()}s")
    rounds = result.get("max_generation_rounds", 1)
    if rounds > 1:
        lines.append(f"  with algo.dynamic_sampling each further generation round adds "
                     f"{f['rollout']:.3g} rollout FLOPs (up to {rounds} rounds: "
                     f"{f['total'] + (rounds - 1) * f['rollout']:.3g} per step); the figures "
                     "above count one round")
    if result.get("full_fine_tuning"):
        full = result["full_fine_tuning"]
        trainable = sum(s["trainable_params"] for s in result["stages"])
        lines.append(f"LoRA: {trainable / 1e6:.1f}M trainable parameters per GPU (the base "
                     f"frozen); full fine-tuning on these GPUs: train peak "
                     f"{full['peak_train_gib']:.1f} GiB, rollout peak "
                     f"{full['peak_rollout_gib']:.1f} GiB, optimizer state "
                     f"{full['optimizer_gib']:.1f} GiB "
                     f"({'fits' if full['fits'] else 'does not fit'})")
    verdict = "FITS" if result["fits"] else "DOES NOT FIT"
    lines += ["", f"verdict (an estimate): {verdict} (train peak {result['peak_train_gib']:.1f} GiB, rollout "
              f"peak {result['peak_rollout_gib']:.1f} GiB of {result['gpu_mem_gib']:g}, "
              f"{result['peak_fraction']:.0%}; {result['assumptions']['overhead_gib']:g} GiB "
              "per GPU for the CUDA context, NCCL and the allocator included)"]
    lines += [f"  try: {advice}" for advice in result["advice"]]
    if result.get("fixes"):
        lines.append(f"  planned changes that bring both peaks under {PEAK_HEADROOM:.0%}:")
        lines += [f"    {fix['text']}: train peak {fix['peak_train_gib']:.1f} GiB, rollout "
                  f"peak {fix['peak_rollout_gib']:.1f} GiB ({fix['peak_fraction']:.0%})"
                  for fix in result["fixes"]]
    elif result["peak_fraction"] > PEAK_HEADROOM:
        lines.append(f"  no single change or pair planned here brings both peaks under "
                     f"{PEAK_HEADROOM:.0%}")
    return "\n".join(lines)


def load_model_config(cfg: RunConfig, hf_config_path: Optional[str]) -> dict:
    """The HF ``config.json`` of the recipe's model (or the one given)."""
    import json
    import os

    path = hf_config_path or os.path.join(cfg.model.hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"no model config at {path}: set model.hf_dir to the HF checkpoint, "
                         "or give its config.json with --hf-config")
    with open(path) as f:
        return json.load(f)
