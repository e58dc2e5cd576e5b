"""The typed run configuration: one frozen dataclass per component, YAML recipes, CLI overrides.

A recipe is a YAML mapping of sections (``trainer:``, ``rollout:`` ...) to keys. On the command
line, ``section.key=value`` overrides any key; the value is parsed as YAML and coerced to the
field's declared type. Unknown sections or keys, and values of the wrong type, raise
``ValueError`` naming the key (and, for unknown keys, listing the valid ones).

Usage::

    cfg = load_config("examples/tiny_cpu_rlep.yaml", ["trainer.total_steps=4"])
    dump_config(cfg, cfg.trainer.output_dir)   # writes config.yaml next to the run's outputs

Configs are never mutated after construction; derive a new one with ``dataclasses.replace``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml


def resolve_hub_name(name: str) -> str:
    """``name`` when it is a local path (or empty); a Hugging Face hub name (``org/model``) that
    the local HF cache holds -> its snapshot directory there. Nothing is downloaded (every rank
    would download at once): ``hf download org/model`` fills the cache first. A name that is in
    no cache stays as it is, and the check of ``model.hf_dir`` reports it."""
    import os

    if (not name or os.path.exists(name) or name.count("/") != 1
            or name.startswith((".", "/", "~")) or name.endswith("/")):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id=name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, not a valid repo id, no hub client
        return name


@dataclass(frozen=True)
class ModelConfig:
    hf_dir: str = ""
    """HF checkpoint directory (config.json, tokenizer, safetensors) the run starts from, or a
    Hugging Face hub name (``Qwen/Qwen2.5-Math-7B``) already in the local HF cache (``hf
    download`` puts it there; a job never downloads)."""
    mcore_dir: str = ""
    """Optional megatron-core dist checkpoint converted from ``hf_dir``; used instead of the
    safetensors when set (faster start for large models)."""
    params_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype of the actor; ``auto`` is bfloat16 on GPU and float32 on CPU.
    ``float16`` is refused: it needs dynamic loss scaling, which this trainer does not wire."""
    recompute_activations: bool = False
    """Recompute transformer layers in the backward pass (megatron-core full recompute)."""
    logprob_chunk_tokens: int = 2048
    """Tokens whose logits the actor computes at a time for log-probs and entropy (training,
    old log-probs, reference): the output layer is applied chunk by chunk to the last hidden
    states and each chunk's logits are recomputed in the backward, so at most one chunk's
    logits (``chunk x vocab / TP`` floats) and their gradient are alive instead of the whole
    micro-batch's; 0 computes the micro-batch's full logits at once."""
    transformer_engine: Literal["auto", "required", "off"] = "auto"
    """Actor layer implementation: TransformerEngine's spec when it is usable on a GPU
    (``auto``), always (``required``: an error naming the import failure otherwise) or never
    (``off``: megatron-core's local spec). Checkpoints record the spec they were saved with and
    load into either."""
    moe_experts: Literal["auto", "grouped", "sequential"] = "auto"
    """How a mixture-of-experts layer runs its local experts: ``grouped``, all of them in one
    grouped GEMM per projection (TransformerEngine's with its spec, torch's
    ``grouped_mm`` with the local spec); ``sequential``, one after another (megatron's
    ``SequentialMLP``, a Python loop with a host synchronisation per layer); ``auto`` is
    ``grouped``. Both keep the same parameters and checkpoints. Dense models ignore it."""

    def __post_init__(self):
        object.__setattr__(self, "hf_dir", resolve_hub_name(self.hf_dir))
        if self.logprob_chunk_tokens < 0:
            raise ValueError("model.logprob_chunk_tokens must be >= 0 (0: full logits), got "
                             f"{self.logprob_chunk_tokens}")
        if self.params_dtype == "float16":
            # megatron's fp16 optimizer scales the loss, but the scale must be applied in the
            # backward (config.grad_scale_func) and an overflow must skip the step; neither is
            # wired here, so float16 would train with updates of about zero
            raise ValueError("model.params_dtype=float16 is not supported: it needs dynamic "
                             "loss scaling, which this trainer does not wire; use bfloat16 "
                             "(the same memory, no loss scaling needed) or float32")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """Actor tensor-parallel degree; must divide attention heads and query groups."""
    pipeline_model_parallel_size: int = 1
    """Actor pipeline-parallel degree; must divide the number of layers."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline stage (interleaved schedule); null for none. Needs at least
    PP micro-batches per step (micro-batches are re-cut to a multiple of PP)."""
    context_parallel_size: int = 1
    """Context-parallel degree: every sequence of a micro-batch is split over this many ranks
    (megatron's load-balanced layout: 2 x CP chunks, chunk i and 2 CP - 1 - i on rank i; each
    sequence padded to a multiple of 2 x CP tokens), dividing activation memory by CP.
    TransformerEngine's attention on GPU, an all-gather of keys and values on the local spec.
    Combines with TP (+ SP), PP, DP and, for mixture-of-experts models, EP (the expert-parallel
    ranks may be context-parallel peers: CP2 x EP2 runs on 2 ranks)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside tensor-parallel groups (TP > 1): the norms and
    the activations between the tensor-parallel blocks are split along the sequence, which
    divides their memory by TP; each micro-batch is padded to a multiple of TP tokens. Needed
    by mixture-of-experts models at TP > 1."""
    expert_model_parallel_size: int = 1
    """Mixture-of-experts models: ranks the routed experts are split over (must divide the
    experts, and world size / (TP x PP)); tokens reach their experts by all-to-all. Each
    expert's matrices are split over the TP size as well. 1 for dense models."""

    def __post_init__(self):
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "context_parallel_size", "expert_model_parallel_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            raise ValueError("parallel.sequence_parallel=true needs tensor_model_parallel_size "
                             ">= 2 (it splits the sequence across the tensor-parallel ranks)")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or self.pipeline_model_parallel_size < 2):
            raise ValueError(
                f"parallel.virtual_pipeline_model_parallel_size={vpp} needs a value >= 1 and "
                f"pipeline_model_parallel_size >= 2 (got {self.pipeline_model_parallel_size})")


@dataclass(frozen=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Training parquet files in the DAPO schema (docs/ALGORITHM.md section 2)."""
    val_files: list[str] = field(default_factory=list)
    """Validation parquet files; metrics are reported per ``data_source``."""
    train_batch_size: int = 512
    """Prompt rows drawn per training step (before the G rollouts per prompt)."""
    max_prompt_tokens: int = 1024
    """Prompt budget; longer prompts are truncated from the left."""
    shuffle: bool = True
    """Seeded shuffle of the training rows every epoch."""
    drop_last: bool = True
    """Drop the incomplete last batch of an epoch."""
    train_weights: dict[str, float] = field(default_factory=dict)
    """Mixing weights of the training data, keyed by file of ``train_files`` or by
    ``data_source`` (one kind of key, every source given a weight; 0 leaves one out): each row
    of a batch comes from a source drawn with probability weight / sum, as that source's next
    row in its own seeded shuffle (a small source with a large weight repeats). Empty: every
    row once per epoch (``shuffle``, ``drop_last``)."""

    def __post_init__(self):
        if self.train_batch_size < 1:
            raise ValueError(f"data.train_batch_size must be >= 1, got {self.train_batch_size}")
        weights = self.train_weights
        if weights and (any(not math.isfinite(w) or w < 0 for w in weights.values())
                        or sum(weights.values()) <= 0):
            raise ValueError(f"data.train_weights: every weight must be a finite number >= 0, "
                             f"and one > 0; got {weights}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


@dataclass(frozen=True)
class RolloutConfig:
    num_samples_per_prompt: int = 16
    """G: fresh responses generated per prompt."""
    tensor_model_parallel_size: int = 1
    """vLLM tensor-parallel degree, independent of the actor's."""
    temperature: float = 1.0
    """Sampling temperature of the fresh rollouts (> 0; the actor's log-probs use it too)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    max_response_tokens: int = 3072
    """Response budget (new tokens); replayed answers are truncated to it as well."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take for weights and KV cache (GPU only)."""
    enable_sleep_mode: bool = True
    """Release vLLM weights/KV cache during training (GPU only; skipped on CPU)."""
    weight_sync_bucket_bytes: int = 512 * 1024 * 1024
    """Bucket size of the Megatron -> vLLM weight stream."""
    carry_over: Literal["resume", "restart", "keep", "finish"] = "resume"
    """With ``trainer.max_staleness >= 1``, what becomes of a request still generating when the
    weights change. ``resume``: it leaves the engine and comes back with its tokens so far as
    part of its prompt, so the rest is sampled (and its KV cache recomputed) under the new
    weights; the tokens it had keep the version and log-prob that sampled them. ``restart``:
    its tokens are dropped and it starts over under the new weights (less stale data, more
    generation). ``placement: separate`` only: ``keep``, it stays on the server, frozen during
    the update, and goes on with the KV cache the old weights computed; ``finish``, the update
    waits until it has finished under the old weights (no response is cut by an update, so a
    run is reproducible; the trainer waits for the tail). docs/ASYNC.md."""
    placement: Literal["colocated", "separate"] = "colocated"
    """``colocated``: a vLLM engine in every training process, taking turns with the actor on
    the same devices. ``separate``: generation on vLLM servers of their own (the last
    ``rollout.num_ranks`` ranks of the torchrun job start them, or ``rollout.server_urls``
    names running ones); with ``trainer.max_staleness >= 1`` they generate the next batch while
    the trainers train. docs/ASYNC.md."""
    num_ranks: int = 0
    """``placement: separate``: how many ranks of the torchrun job (the last ones) run a vLLM
    server each, on the GPU of their slot (``tensor_model_parallel_size`` 1); the others
    train."""
    server_urls: list[str] = field(default_factory=list)
    """``placement: separate``: running vLLM servers to use instead of rollout ranks (the flags
    they need: docs/ASYNC.md)."""
    server_timeout_s: float = 60.0
    """``placement: separate``: a server that does not answer its health check for this long
    ends the job with an error naming it. A weight transfer to the servers waits at most
    ``max(300, server_timeout_s)`` seconds before it ends the job naming them, and requests
    aborted for an update (``carry_over: resume``, ``restart``) at most ``max(60,
    server_timeout_s)`` seconds to come back."""
    server_log_requests: bool = False
    """``placement: separate``: a server started by a rollout rank logs every request it
    receives in ``<output_dir>/rollout_server_<i>.log`` (vLLM's ``--enable-log-requests``);
    each request's id names the trainer process that sent it (``rlep-<pid>-<n>``)."""
    server_gpu_memory_utilization: float = 0.85
    """``placement: separate``: fraction of GPU memory a rollout server started by a rollout
    rank takes for weights and KV cache. The server owns its GPU, so this is higher than
    ``gpu_memory_utilization``, which leaves room for a colocated actor; the default keeps
    the server's peak, CUDA context included, under 90% of an H100's usable memory (GPU
    only)."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """With LoRA (``lora.rank`` > 0), what each weight sync moves into the engine: ``merged``,
    every weight with its adapter merged in (``W + alpha / rank x B A``) through the full
    weight stream, for any engine and placement; ``adapter``, the adapter's tensors alone: the
    engine (the colocated one, or each rollout server) keeps the base it loaded from
    ``model.hf_dir`` and serves the policy as a vLLM LoRA adapter, a new one per update
    (docs/lora.md)."""
    engine_routing: Literal["auto", "output", "capture"] = "auto"
    """Where the engine's routing comes from when ``algo.routing_replay=rollout`` replays it:
    ``output``, vLLM's own ``routed_experts`` (its V2 model runner, CUDA graphs kept; GPU
    only); ``capture``, a hook on the routers of vLLM's V1 runner (on a GPU without CUDA
    graphs: slower decoding; the only way on CPU); ``auto``: ``output`` on a GPU, ``capture`` on
    CPU. docs/models.md."""
    backend: Literal["vllm", "megatron"] = "vllm"
    """What generates. ``vllm``: a vLLM engine (``placement`` says where), updated by a weight
    stream after every step. ``megatron``: the actor's own megatron-core model with
    megatron-core's static KV cache, in the training processes: no vLLM, no second copy of the
    weights, no weight sync; slower decoding than vLLM (no paged attention, no CUDA graphs).
    For small GPU jobs, debugging, or a machine without vLLM (docs/rollout_backends.md). With
    ``megatron`` the actor's layout is the engine's: pipeline, context, expert and sequence
    parallelism are refused, and ``tensor_model_parallel_size`` is the actor's."""
    megatron_batch_size: int = 64
    """``backend: megatron``: sequences decoded together (of one prompt length); the KV cache
    of a batch holds ``batch x (prompt + max_response_tokens)`` positions per layer."""
    gather_timeout_minutes: float = 180.0
    """How long a replica that finished its share may wait for the slowest one where the
    replicas exchange responses (a gloo group of its own, on the host): above the longest
    rollout a recipe can take. A rank that fails ends the job sooner, through the launcher."""

    def __post_init__(self):
        if self.engine_routing not in ("auto", "output", "capture"):
            raise ValueError("rollout.engine_routing must be auto, output or capture, got "
                             f"{self.engine_routing!r}")
        if self.backend not in ("vllm", "megatron"):
            raise ValueError(f"rollout.backend must be vllm or megatron, got {self.backend!r}")
        if self.megatron_batch_size < 1:
            raise ValueError("rollout.megatron_batch_size must be >= 1, got "
                             f"{self.megatron_batch_size}")
        if self.gather_timeout_minutes <= 0:
            raise ValueError("rollout.gather_timeout_minutes must be > 0, got "
                             f"{self.gather_timeout_minutes}")
        if self.num_samples_per_prompt < 1:
            raise ValueError(
                f"rollout.num_samples_per_prompt must be >= 1, got {self.num_samples_per_prompt}")
        if self.tensor_model_parallel_size < 1:
            raise ValueError("rollout.tensor_model_parallel_size must be >= 1, got "
                             f"{self.tensor_model_parallel_size}")
        if self.temperature <= 0:
            # the actor's log-probs are of logits / temperature: greedy rollouts have none
            raise ValueError(f"rollout.temperature must be > 0 (the actor's log-probs divide "
                             f"the logits by it), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.max_response_tokens < 1:
            raise ValueError(
                f"rollout.max_response_tokens must be >= 1, got {self.max_response_tokens}")
        for key in ("gpu_memory_utilization", "server_gpu_memory_utilization"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"rollout.{key} is a fraction of the GPU's memory in (0, 1], "
                                 f"got {getattr(self, key)}")
        if self.weight_sync_bucket_bytes < 1:
            raise ValueError("rollout.weight_sync_bucket_bytes must be >= 1 (bytes per bucket "
                             f"of the weight stream), got {self.weight_sync_bucket_bytes}")
        if self.carry_over not in ("resume", "restart", "keep", "finish"):
            raise ValueError(f"rollout.carry_over must be resume, restart, keep or finish, got "
                             f"{self.carry_over!r}")
        if self.placement not in ("colocated", "separate"):
            raise ValueError(f"rollout.placement must be colocated or separate, got "
                             f"{self.placement!r}")
        if self.num_ranks < 0 or self.server_timeout_s <= 0:
            raise ValueError("rollout.num_ranks must be >= 0 and rollout.server_timeout_s > 0")
        if self.placement == "separate":
            if self.num_ranks and self.tensor_model_parallel_size != 1:
                raise ValueError("rollout.num_ranks: each rollout rank serves on its own GPU "
                                 "(rollout.tensor_model_parallel_size=1); start "
                                 "tensor-parallel servers yourself and give "
                                 "rollout.server_urls")
            if bool(self.num_ranks) == bool(self.server_urls):
                raise ValueError("rollout.placement=separate needs either rollout.num_ranks "
                                 "(ranks of this job that start vLLM servers) or "
                                 "rollout.server_urls (running servers), not both and not "
                                 "neither")
        elif self.num_ranks or self.server_urls or self.carry_over in ("keep", "finish"):
            raise ValueError("rollout.num_ranks, rollout.server_urls and rollout.carry_over="
                             "keep or finish need rollout.placement=separate")


@dataclass(frozen=True)
class ReplayConfig:
    num_replays_per_prompt: int = 0
    """M: pool answers appended to each group (0 = plain DAPO/GRPO baseline)."""
    pool_files: list[str] = field(default_factory=list)
    """Parquet files with ``reward_model.candidates``; empty = read candidates from the
    training files themselves (RLEP's released file layout)."""
    clip_ratio_high: Optional[float] = None
    """eps_high for replayed responses instead of ``algo.clip_ratio_high``: replays come from
    an older policy, so their importance ratio can be capped separately (a smaller value
    limits how far one step moves towards a replayed answer). Not part of the RLEP paper:
    null (default, the paper's recipe) treats replays like fresh responses."""
    pooled_questions_only: bool = True
    """With M > 0 and ``mode=offline``, train only on the questions that have pool answers,
    as the authors' released RLEP training file does (it keeps the questions with a pool);
    false trains on every training question, replaying where a pool exists. (The online
    modes train on every question: their pool grows during the run.)"""
    mode: Literal["offline", "online", "both"] = "offline"
    """Where replayed answers come from. ``offline`` (the paper): the pool files (or the
    training files' candidates). ``online``: a pool that starts empty and grows from the run's
    own verified answers: after each step, the fresh responses the reward verified correct
    (and that ended by themselves) join their question's pool. ``both``: the offline pool
    plus the online answers. The online part is saved in checkpoints."""
    online_answers_per_question: int = 4
    """K: the online answers kept per question, the most recent ones."""
    online_low_pass_weight: bool = False
    """Online modes: a group gets its replays with probability 1 - (its question's pass rate
    at its previous rollout), so replay goes to the questions the policy still fails (a
    question not rolled out before always gets them)."""
    policy: Literal["uniform", "low_pass", "rescue", "unlikely"] = "uniform"
    """Which groups get replays (docs/ALGORITHM.md, replay policies). ``uniform`` (the paper):
    every group whose question has pool answers. ``low_pass``: a group gets them with
    probability 1 - p, p its question's tracked pass rate (``replay.pass_rate_ema``; a question
    not rolled out before always gets them), in every replay mode. ``rescue``: only the groups
    whose fresh responses all failed (with ``algo.dynamic_sampling`` such a group is kept
    instead of dropped when the pool has an answer). ``unlikely``: every group with a pool, as
    ``uniform``, with the M of its pool answers the current policy finds least likely (the
    lowest mean log-prob per token) among ``replay.unlikely_candidates`` drawn uniformly: one
    more forward pass of the actor per generation round, over those candidates."""
    unlikely_candidates: int = 8
    """``replay.policy=unlikely``: how many of a question's pool answers the policy scores
    per group (drawn uniformly when it has more; 0: all of them). At least M."""
    pass_rate_ema: float = 0.5
    """The per-question pass-rate tracker behind ``replay.policy=low_pass`` and the
    ``replay/pass_rate_hist`` metrics: the weight of the newest step's pass rate in its moving
    average (1: the latest rollout only). Saved in checkpoints."""
    correction: Literal["none", "truncate", "mask"] = "none"
    """How a replayed answer's tokens are weighed against the policy that wrote it, where the
    pool holds that policy's log-probs of them (its optional behaviour columns, written by
    ``rlep collect`` and by online replay): ``none`` (the paper's treatment: weight 1, the
    ratio starts at 1), ``truncate`` (each token weighted by min(p_actor / p_behaviour,
    ``algo.rollout_correction_threshold``)) or ``mask`` (weight p_actor / p_behaviour inside
    [1/threshold, threshold]; tokens, or sequences, outside it leave the loss and its
    normaliser), at ``algo.rollout_correction_level``: the
    rollout correction of fresh tokens applied to replays. Replays without those columns, or
    whose re-tokenised text differs from the tokens sampled, keep weight 1."""

    def __post_init__(self):
        if self.correction not in ("none", "truncate", "mask"):
            raise ValueError(f"replay.correction must be none, truncate or mask, got "
                             f"{self.correction!r}")
        if self.num_replays_per_prompt < 0:
            raise ValueError("replay.num_replays_per_prompt must be >= 0, got "
                             f"{self.num_replays_per_prompt}")
        if self.online_answers_per_question < 1:
            raise ValueError("replay.online_answers_per_question must be >= 1, got "
                             f"{self.online_answers_per_question}")
        if self.mode != "offline" and self.num_replays_per_prompt == 0:
            raise ValueError(f"replay.mode={self.mode} replays nothing with "
                             "replay.num_replays_per_prompt=0; set M > 0")
        if self.mode == "online" and self.pool_files:
            raise ValueError("replay.mode=online starts from an empty pool, but "
                             "replay.pool_files is set: use replay.mode=both to start from it")
        if self.online_low_pass_weight and self.mode == "offline":
            raise ValueError("replay.online_low_pass_weight weights online replay; it needs "
                             "replay.mode=online or both")
        if not 0.0 < self.pass_rate_ema <= 1.0:
            raise ValueError(f"replay.pass_rate_ema must be in (0, 1], got "
                             f"{self.pass_rate_ema}")
        if self.policy != "uniform" and self.num_replays_per_prompt == 0:
            raise ValueError(f"replay.policy={self.policy} decides where replays go, but "
                             "replay.num_replays_per_prompt=0 replays nothing; set M > 0")
        if self.policy != "uniform" and self.online_low_pass_weight:
            raise ValueError(f"replay.online_low_pass_weight is the online modes' own "
                             f"weighting; it cannot combine with replay.policy={self.policy} "
                             "(replay.policy=low_pass generalises it to every replay mode): "
                             "set one of them")
        if self.unlikely_candidates < 0:
            raise ValueError(f"replay.unlikely_candidates must be >= 0 (0: all), got "
                             f"{self.unlikely_candidates}")
        if (self.policy == "unlikely"
                and 0 < self.unlikely_candidates < self.num_replays_per_prompt):
            raise ValueError(f"replay.unlikely_candidates={self.unlikely_candidates} leaves "
                             f"fewer candidates than the M={self.num_replays_per_prompt} "
                             "replays chosen among them; set it to at least M, or 0 for all")
        if self.clip_ratio_high is not None and self.clip_ratio_high < 0:
            raise ValueError(f"replay.clip_ratio_high must be >= 0 or null, got "
                             f"{self.clip_ratio_high}")


@dataclass(frozen=True)
class RewardConfig:
    backend: Literal["local", "ray"] = "local"
    """Scorer pool: local worker processes, or Ray tasks spread over the cluster."""
    num_workers: int = 2
    """Scorer worker processes (local backend) or concurrent tasks (Ray backend)."""
    timeout_s: float = 10.0
    """Hard per-answer timeout; a timed-out answer scores -1."""
    overlong_buffer_tokens: int = 512
    """Overlong shaping buffer (docs/ALGORITHM.md section 5); 0 disables shaping."""
    overlong_penalty_factor: float = 1.0
    """Maximum overlong penalty, reached at ``rollout.max_response_tokens``."""
    function: str = ""
    """Your own reward for every row instead of the rules chosen by ``data_source``:
    ``package.module:function`` or ``path/to/file.py:function``, called like
    ``compute_score(data_source, solution_str, ground_truth)`` and returning a dict with
    ``score`` (optionally ``acc``, ``pred``) or a number (``acc`` = score > 0). It runs once on
    a sample before any model work; at scoring time an exception scores -1. Empty: the
    built-in rules (``rlep_megatron.reward.known_data_sources()``)."""

    def __post_init__(self):
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.overlong_buffer_tokens < 0:
            raise ValueError("reward.overlong_buffer_tokens must be >= 0, got "
                             f"{self.overlong_buffer_tokens}")


@dataclass(frozen=True)
class AlgoConfig:
    loss: Literal["dapo", "gspo", "cispo"] = "dapo"
    """The policy loss (:mod:`rlep_megatron.algo.surrogates`): ``dapo``, the paper's token-level
    clip-higher with dual clip (``clip_ratio_*``); ``gspo``, GSPO's clipped sequence-level ratio
    averaged over sequences (``gspo_clip_ratio_*``); ``cispo``, CISPO's clipped stop-gradient
    importance weight on every token's log-prob (``cispo_clip_ratio_*``)."""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """The advantage estimator over each group of G' responses
    (:mod:`rlep_megatron.algo.advantages`): ``grpo``, (r - mean) / (std + eps), the paper's
    (``advantage_normalize_std`` false: r - mean); ``dr_grpo``, r - mean (Dr. GRPO; pair it with
    ``loss_agg_mode: constant_length``); ``rloo``, r minus the mean of the group's other
    rewards."""
    clip_ratio_low: float = 0.2
    """eps_low of clip-higher (docs/ALGORITHM.md section 4)."""
    clip_ratio_high: float = 0.28
    """eps_high of clip-higher."""
    clip_ratio_c: float = 10.0
    """Dual-clip constant c for negative advantages."""
    loss_agg_mode: Literal["global_token_mean", "reference_micro_batch_mean",
                           "constant_length"] = "global_token_mean"
    """Exact token mean over the mini-batch across micro-batches and DP ranks, the reference
    code's per-micro-batch mean weighted by sequence count, or Dr. GRPO's ``constant_length``:
    the token sum over (sequences x ``loss_constant_length_tokens``). ``gspo`` always averages
    over sequences and takes only the default here."""
    loss_constant_length_tokens: Optional[int] = None
    """The constant length of ``loss_agg_mode: constant_length``; null: the rollout's
    ``max_response_tokens``."""
    gspo_clip_ratio_low: float = 3e-4
    """eps_low of ``loss: gspo`` on the sequence ratio (the GSPO paper's value)."""
    gspo_clip_ratio_high: float = 4e-4
    """eps_high of ``loss: gspo`` on the sequence ratio (the GSPO paper's value)."""
    cispo_clip_ratio_low: Optional[float] = None
    """``loss: cispo``: the importance weight is clipped below at 1 - this; null: no lower
    bound (as MiniMax-M1 ran it)."""
    cispo_clip_ratio_high: float = 0.28
    """``loss: cispo``: the importance weight is clipped above at 1 + this."""
    advantage_eps: float = 1e-6
    """Added to the group std before dividing."""
    advantage_normalize_std: bool = True
    """Divide by the group std (GRPO); false gives the mean-only Dr. GRPO variant."""
    kl_coef: float = 0.0
    """Coefficient of a KL penalty to a frozen reference policy (the run's initial weights,
    kept with the actor's TP/PP layout, its log-probs computed in the old-log-prob pass);
    0 disables it and no reference model is built (the paper's recipes use 0)."""
    kl_estimator: Literal["k1", "k2", "k3", "k3_importance_weighted"] = "k3"
    """Per-token KL estimator of the penalty (Schulman 2020): ``k1`` log r, ``k2`` (log r)^2/2
    (the "mse" of verl), ``k3`` exp(-log r) - 1 + log r (the "low_var_kl" of verl, GRPO's
    choice), with log r = logp - ref_logp; ``k3_importance_weighted``: k3 times pi / pi_old,
    the gradient through both, whose expected gradient is that of KL(pi || pi_ref) also off
    policy (plain k3's is the reverse KL's; :func:`rlep_megatron.algo.kl_penalty`)."""
    kl_clamp: Optional[float] = None
    """Clamp each token's KL estimate to [-kl_clamp, kl_clamp] (null: no clamp); verl clamps
    its low-variance KL at 10."""
    reference_offload: bool = True
    """Keep the reference model's weights in CPU memory between its uses (GPU only; on CPU
    the weights are in CPU memory anyway). On by default: a second copy of the weights on
    the GPU takes what the rollout's KV cache needs (a 7B KL run without it is at or over an
    80 GB GPU); false trades that memory for two host-device copies per step."""
    rollout_correction: Literal["off", "truncate", "mask", "reject"] = "off"
    """Correct for the rollout engine / actor probability gap on fresh tokens
    (:mod:`rlep_megatron.algo.correction`), rho = pi_old / pi_rollout: ``truncate`` weights
    each token's loss by min(rho, C) (truncated importance sampling, Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"); ``mask`` keeps the
    weight rho on tokens or sequences whose rho is inside [1/C, C] and drops the others from
    the loss and its token count (masked importance sampling, Liu et al. 2025, "When speed
    kills stability"; verl's rollout correction); ``reject`` only rejects (weight 1 inside,
    0 outside, rejected tokens still counted in the normaliser). Replays have no engine
    log-probs and are never corrected. Off: the metrics ``rollout/mismatch_kl_*`` still
    measure the gap."""
    rollout_correction_level: Literal["token", "sequence", "geometric"] = "token"
    """Where rho is taken: per ``token``, per ``sequence`` (the product over its tokens, the
    exact sequence-level ratio) or the sequence's ``geometric`` mean (stays near 1 for long
    responses; the "geo-mask" of Liu et al. 2025 with ``mask``)."""
    rollout_correction_threshold: float = 2.0
    """C of the rollout correction (> 1)."""
    routing_replay: Literal["off", "actor", "rollout"] = "off"
    """Mixture-of-experts models: ``actor`` records each token's experts in the old-log-prob
    pass and routes every update of that mini-batch through them (the gate weights still come
    from the live router logits, so the router learns); the updates then change the experts'
    weights but not which experts each token uses (:mod:`rlep_megatron.actor.routing`).
    ``rollout`` routes the old-log-prob pass and every update through the experts the
    inference engine chose for each fresh token (:mod:`rlep_megatron.rollout.routing_capture`,
    read from an engine on vLLM's V1 runner running eagerly: the CPU backend is one, and on a
    GPU the engine is then built as one, without CUDA graphs, so it generates more slowly), and
    the actor's own choice where the engine has none (replayed pool answers, each response's
    last token). ``off``: the routers choose in every pass. Whatever
    the mode, ``rollout/routing_mismatch_frac`` measures how often the actor's own top-k
    differs from the engine's, where the engine's routing is read (on a GPU: with
    ``rollout`` only)."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the load-balancing auxiliary loss (the Switch
    Transformer's ``E x sum_e f_e P_e`` per MoE layer and micro-batch over its real tokens:
    ``f_e`` the fraction of routed copies sent to expert e, ``P_e`` its mean router
    probability), added to the policy loss as its mean over micro-batches; 0 (off, as RL peers
    run) by default. Reported as ``moe/aux_loss`` (unweighted, mean over MoE layers)."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: weight of the router z-loss (mean over real tokens of
    ``logsumexp(router logits)^2``); 0 (off) by default. Reported as ``moe/z_loss``."""
    entropy_coef: float = 0.0
    """Entropy bonus; 0 disables it (recipes use 0)."""
    dynamic_sampling: bool = False
    """Official DAPO dynamic sampling: keep groups whose accuracy std > 0."""
    max_generation_rounds: int = 10
    """Generation rounds allowed per step with dynamic sampling."""
    dynamic_sampling_partial_batch: bool = False
    """When the generation rounds run out before a full batch of groups with signal is kept:
    false stops the run with an error, as the DAPO reference does; true trains on the groups
    kept so far (at least one)."""

    def __post_init__(self):
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"algo.clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ValueError(f"algo.clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if self.clip_ratio_c <= 1:
            raise ValueError(f"algo.clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        if self.max_generation_rounds < 1:
            raise ValueError(
                f"algo.max_generation_rounds must be >= 1, got {self.max_generation_rounds}")
        if self.kl_coef < 0:
            raise ValueError(f"algo.kl_coef must be >= 0, got {self.kl_coef}")
        if self.loss == "gspo" and self.loss_agg_mode != "global_token_mean":
            raise ValueError(f"algo.loss=gspo with algo.loss_agg_mode={self.loss_agg_mode}: GSPO "
                             "averages over sequences by definition; leave loss_agg_mode at "
                             "its default")
        if not 0 <= self.gspo_clip_ratio_low < 1 or self.gspo_clip_ratio_high < 0:
            raise ValueError("algo.gspo_clip_ratio_low must be in [0, 1) and "
                             "algo.gspo_clip_ratio_high >= 0, got "
                             f"{self.gspo_clip_ratio_low} and {self.gspo_clip_ratio_high}")
        if self.cispo_clip_ratio_low is not None and not 0 <= self.cispo_clip_ratio_low <= 1:
            raise ValueError("algo.cispo_clip_ratio_low must be in [0, 1] or null (no lower "
                             f"bound), got {self.cispo_clip_ratio_low}")
        if self.cispo_clip_ratio_high < 0:
            raise ValueError(f"algo.cispo_clip_ratio_high must be >= 0, got "
                             f"{self.cispo_clip_ratio_high}")
        if self.loss_constant_length_tokens is not None and self.loss_constant_length_tokens < 1:
            raise ValueError("algo.loss_constant_length_tokens must be >= 1 or null (the "
                             "rollout's max_response_tokens), got "
                             f"{self.loss_constant_length_tokens}")
        if self.kl_clamp is not None and self.kl_clamp <= 0:
            raise ValueError(f"algo.kl_clamp must be > 0 or null, got {self.kl_clamp}")
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(self, key) < 0:
                raise ValueError(f"algo.{key} must be >= 0 (0: off), got {getattr(self, key)}")
        if self.rollout_correction_threshold <= 1:
            raise ValueError("algo.rollout_correction_threshold must be > 1 (tokens are kept "
                             f"within [1/C, C]), got {self.rollout_correction_threshold}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    lr_warmup_steps: int = 10
    """Linear warm-up length, then ``lr_decay`` (constant by default); counted in
    ``lr_warmup_unit``."""
    lr_warmup_unit: str = "training_steps"
    """``training_steps`` (the reference, docs/ALGORITHM.md section 4): lr = lr x min(1, s / warm-up)
    for training step s = 0, 1, ..., shared by all optimizer steps of that training step, so the
    first training step runs at lr 0 when warm-up > 0 (a quirk of the reference's scheduler,
    reproduced). ``optimizer_steps``: lr x (k + 1) / warm-up for optimizer step k."""
    lr_decay: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: ``constant`` (the reference), or ``linear`` / ``cosine`` decay from
    ``lr`` to ``min_lr`` over ``lr_decay_steps`` training steps, then ``min_lr``. Counted in
    training steps (every optimizer step of a training step shares its lr), from the end of a
    ``training_steps`` warm-up, or from step 0 with an ``optimizer_steps`` one."""
    min_lr: float = 0.0
    """The lr that ``lr_decay`` ends at (0 <= min_lr <= lr)."""
    lr_decay_steps: int = 0
    """Length of the decay in training steps; 0: until ``trainer.total_steps``."""
    clip_grad: float = 1.0
    """Global grad-norm clip; a non-finite norm skips the step."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (megatron-core distributed optimizer)."""
    overlap_grad_reduce: bool = True
    """Reduce (reduce-scatter with the distributed optimizer) each gradient bucket over the
    data-parallel ranks as soon as the last micro-batch's backward has filled it, while the
    backward goes on (megatron-core's ``overlap_grad_reduce``); off: one reduction of every
    bucket after the backward. Same arithmetic either way."""
    overlap_param_gather: bool = True
    """With the distributed optimizer: gather the updated parameter shards bucket by bucket in
    the next forward pass instead of all at once after the optimizer step (megatron-core's
    ``overlap_param_gather``); the trainer gathers whatever is left before anything reads the
    weights outside a forward (weight sync, checkpoints). Same weights either way. Without
    data-parallel replicas there is nothing to gather and it is off."""
    grad_reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """With bfloat16 parameters, the dtype of the gradient buffers and of their data-parallel
    reduction. ``float32`` (the default): sums without rounding to 8 bits, twice the buffer
    memory and traffic of ``bfloat16``; ``bfloat16``: half of both, each reduction rounds to
    8 bits of mantissa (the rounding error grows with the number of ranks). float32
    parameters always reduce in float32."""
    offload_during_rollout: bool = False
    """GPU: from the end of each update until the next old-log-prob pass (weight sync,
    validation, rollout), release megatron's gradient buffers and keep the optimizer state
    (Adam moments, fp32 main weights) in CPU memory, leaving that memory to the rollout
    engine; restored for checkpoints. Needs bfloat16 parameters (the optimizer then holds its
    own fp32 copies; with float32 parameters it would move the model's). No effect on CPU."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_warmup_unit not in ("training_steps", "optimizer_steps"):
            raise ValueError("optim.lr_warmup_unit must be training_steps or optimizer_steps, "
                             f"got {self.lr_warmup_unit!r}")
        if self.lr_decay not in ("constant", "linear", "cosine"):
            raise ValueError(f"optim.lr_decay must be constant, linear or cosine, got "
                             f"{self.lr_decay!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"optim.min_lr must be between 0 and optim.lr ({self.lr}), got "
                             f"{self.min_lr}")
        if self.lr_decay_steps < 0:
            raise ValueError(f"optim.lr_decay_steps must be >= 0 (0: until "
                             f"trainer.total_steps), got {self.lr_decay_steps}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM's LoRA slots come in these ranks (an adapter of a smaller rank fits a larger slot)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """Rank of the low-rank adapters; 0 (the default) trains every weight (full fine-tuning).
    With a rank, the actor's base weights are frozen (no gradients, no optimizer state) and
    only the adapters train (docs/lora.md)."""
    alpha: float = 32.0
    """Scale numerator: each adapter adds ``alpha / rank x B A x`` (PEFT's ``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on an adapter's input during the updates (PEFT's ``lora_dropout``); log-prob
    passes never drop."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """The projections that get adapters, by their HF names: ``q_proj``, ``k_proj``,
    ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, or ``all-linear`` (all of
    them; in a mixture-of-experts model the attention and any dense MLP layers, not the
    experts)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initial A: ``kaiming`` (PEFT's default: Kaiming-uniform) or ``gaussian`` (normal,
    std 1/rank); B starts at zero either way, so step 0 is the base model."""
    lr: Optional[float] = None
    """Learning rate of the adapters (``optim.lr`` when unset); LoRA commonly uses about 10x
    the full-fine-tuning rate."""
    init_from: str = ""
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to
    start from instead of a fresh adapter; its rank, alpha and targets must match this
    section."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def targets(self) -> tuple[str, ...]:
        """The HF projection names that get adapters."""
        if list(self.target_modules) == ["all-linear"]:
            return LORA_TARGETS
        return tuple(self.target_modules)

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0: full fine-tuning), got {self.rank}")
        if not self.enabled:
            return
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.init not in ("kaiming", "gaussian"):
            raise ValueError(f"lora.init must be kaiming or gaussian, got {self.init!r}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lora.lr must be > 0 (or null: optim.lr), got {self.lr}")
        names = list(self.target_modules)
        if not names:
            raise ValueError("lora.target_modules is empty: name the projections that get "
                             f"adapters ({', '.join(LORA_TARGETS)}) or all-linear")
        if "all-linear" in names and len(names) > 1:
            raise ValueError("lora.target_modules: all-linear already names every projection; "
                             "give it alone or list the projections")
        unknown = [n for n in names if n not in LORA_TARGETS and n != "all-linear"]
        if unknown:
            raise ValueError(f"lora.target_modules: unknown module(s) {unknown}; valid: "
                             f"{', '.join(LORA_TARGETS)} or all-linear")
        if len(set(names)) != len(names):
            raise ValueError(f"lora.target_modules names a module twice: {names}")


@dataclass(frozen=True)
class TrainerConfig:
    output_dir: str = "outputs/run"
    """Run directory: metrics.jsonl, config.yaml, checkpoints/, TensorBoard events."""
    total_steps: int = 400
    """Training steps (one step = one batch of prompts)."""
    seed: int = 1
    """Seed of data order, replay draws, sampling and initialisation."""
    mini_batch_size: int = 64
    """Size of one optimizer mini-batch, in units of ``mini_batch_unit``."""
    mini_batch_unit: Literal["prompts", "sequences"] = "prompts"
    """``prompts``: the reference's counting, mini_batch_size x G sequences per optimizer step
    (so RLEP's G' = G + M groups take more optimizer steps); ``sequences``: a fixed number of
    sequences per optimizer step."""
    micro_batch_max_tokens: int = 16384
    """Token budget of one micro-batch per data-parallel rank: the sum of the sequences'
    tokens with ``sequence_packing``, padded length x sequences without."""
    sequence_packing: bool = True
    """Pack sequences into micro-batches (megatron's THD layout: attention within each
    sequence, positions restarting per sequence), token-balanced, instead of padding each
    micro-batch to its longest sequence; the log-probs and the loss are the same within
    float rounding. Sequences are split across data-parallel ranks by token count either way.
    """
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """What every rank runs on (``rlep train``, ``collect``, ``eval``): ``auto`` takes the
    GPUs torch sees and the CPU on a machine without NVIDIA GPUs, and stops with the reason
    when the driver sees GPUs that torch cannot use (no silent CPU fall-back); ``cuda``
    requires a GPU; ``cpu`` runs on the CPU even where GPUs exist."""
    validation_interval_steps: int = 5
    """Validate every N steps (and at step 0); 0 disables validation."""
    validate_before_train: bool = True
    """Validate at step 0, before any training (the baseline of the curves); false skips it
    (a resumed run never repeats it)."""
    log_all_ranks: bool = False
    """Print logs of every rank, not only rank 0 (debugging)."""
    loggers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where each step's metrics go besides ``metrics.jsonl`` (always written): any of
    ``tensorboard`` (``<output_dir>/tensorboard``), ``wandb`` (Weights & Biases, when the
    ``wandb`` package is installed; same keys; ``WANDB_MODE=offline`` works without a
    network) and ``mlflow`` (when the ``mlflow`` package is installed; same keys with ``@``
    written ``_at_``, which MLflow does not accept). A resumed run continues the same W&B or
    MLflow run."""
    wandb_project: str = "rlep"
    """W&B project of the run (with ``wandb`` in ``loggers``)."""
    wandb_run_name: str = ""
    """W&B run name; empty: the output directory's name."""
    wandb_entity: str = ""
    """W&B entity (team or user) of the run; empty: W&B's default for the logged-in user."""
    wandb_group: str = ""
    """W&B group of the run (runs compared together, e.g. the baseline and RLEP)."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags of the run."""
    mlflow_experiment: str = "rlep"
    """MLflow experiment of the run (with ``mlflow`` in ``loggers``); its run is named like the
    W&B run (``wandb_run_name``, else the output directory's name)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking server or store: a URL, ``sqlite:///mlflow.db``, or a directory
    (``file:./mlruns``: the local file store, offline, enough with ``mlflow-skinny``); empty:
    MLflow's own default (``MLFLOW_TRACKING_URI``, else MLflow 3's ``./mlflow.db``, which needs
    the full ``mlflow`` package)."""
    max_staleness: int = 0
    """How many policy versions old a fresh token may be when it is trained. 0: synchronous
    (each step's prompts are generated under the weights that then train on them). k >= 1:
    the prompts of the next k steps generate on the engine alongside a step's own, so that the
    engine is never down to a few long responses; their unfinished requests are carried over
    each weight update (``rollout.carry_over``) and a step waits for its own groups to finish,
    so no token is more than k versions old. Pair k >= 1 with ``algo.rollout_correction``
    (truncate or mask), which weighs every token by the log-prob of the version that sampled
    it. Larger k keeps the engine fuller and the data staler (docs/ASYNC.md)."""

    def __post_init__(self):
        if not self.output_dir:
            raise ValueError("trainer.output_dir must be a non-empty path")
        unknown = sorted(set(self.loggers) - {"tensorboard", "wandb", "mlflow"})
        if unknown:
            raise ValueError(f"trainer.loggers: unknown {unknown}; choose from tensorboard, "
                             "wandb, mlflow (metrics.jsonl is always written)")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"trainer.device must be auto, cuda or cpu, got {self.device!r}")
        if self.total_steps < 0:
            raise ValueError(f"trainer.total_steps must be >= 0, got {self.total_steps}")
        if self.validation_interval_steps < 0:
            raise ValueError("trainer.validation_interval_steps must be >= 0 (0 disables "
                             f"validation), got {self.validation_interval_steps}")
        if self.mini_batch_size < 1:
            raise ValueError(f"trainer.mini_batch_size must be >= 1, got {self.mini_batch_size}")
        if self.micro_batch_max_tokens < 1:
            raise ValueError("trainer.micro_batch_max_tokens must be >= 1, got "
                             f"{self.micro_batch_max_tokens}")
        if self.max_staleness < 0:
            raise ValueError(f"trainer.max_staleness must be >= 0 (0 = synchronous), got "
                             f"{self.max_staleness}")


@dataclass(frozen=True)
class CheckpointConfig:
    save_interval_steps: int = 20
    """Save every N training steps (and at the end); 0 saves only at the end."""
    resume: str = "auto"
    """``auto``: newest complete checkpoint in output_dir if any; ``never``; or a directory."""
    keep_last: int = 3
    """Number of newest checkpoints kept; older ones are deleted after a successful save."""
    resume_with_changes: bool = False
    """Resume a checkpoint whose run had other settings (each checkpoint records its
    config.yaml). Off: such a resume stops before any work and lists the differing keys;
    run length, logging, validation, output and other commands' keys may always change
    (:data:`RESUMABLE_CHANGES`)."""

    def __post_init__(self):
        if self.save_interval_steps < 0:
            raise ValueError("checkpoint.save_interval_steps must be >= 0, got "
                             f"{self.save_interval_steps}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        if not self.resume:
            raise ValueError("checkpoint.resume must be 'auto', 'never' or a directory")


@dataclass(frozen=True)
class EvalConfig:
    checkpoint: str = ""
    """``rlep eval``: checkpoint to evaluate (a ``checkpoints/step_XXXXXXXX`` training checkpoint,
    a run's output directory for its newest one, or an HF directory); empty = ``model.hf_dir``."""
    files: list[str] = field(default_factory=list)
    """``rlep eval``: eval parquet files (DAPO schema, ``reward_model.ground_truth`` required);
    empty = ``data.val_files``."""
    num_samples_per_prompt: int = 32
    """k: samples per validation/eval question (mean@k, maj@k, best@k, pass@k)."""
    temperature: float = 1.0
    """Sampling temperature for validation (0: greedy, with one sample per question)."""
    top_p: float = 1.0
    """Nucleus threshold for validation."""
    output_file: str = ""
    """JSON written by ``rlep eval``; default <output_dir>/eval.json."""

    def __post_init__(self):
        if self.num_samples_per_prompt < 1:
            raise ValueError(
                f"eval.num_samples_per_prompt must be >= 1, got {self.num_samples_per_prompt}")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.num_samples_per_prompt != 1:
            raise ValueError("eval.temperature=0 is greedy decoding, which gives one answer per "
                             "question: set eval.num_samples_per_prompt=1, got "
                             f"{self.num_samples_per_prompt}")


@dataclass(frozen=True)
class CollectConfig:
    checkpoint: str = ""
    """Checkpoint to sample from (a training checkpoint, a run's output directory for its newest
    one, or an HF directory); empty = ``model.hf_dir``."""
    num_samples_per_prompt: int = 64
    """Answers sampled per unique training question (docs/ALGORITHM.md section 1)."""
    temperature: float = 0.7
    """Sampling temperature of collection (> 0)."""
    top_p: float = 0.95
    """Nucleus threshold of collection."""
    min_correct: int = 2
    """Questions with fewer verified-correct samples (duplicates count) are dropped."""
    distinct_texts: bool = False
    """Keep one copy of each correct text per question. Off (the paper): every correct sample
    is a pool answer, so replay draws an answer as often as the model wrote it."""
    output_file: str = ""
    """Pool parquet (RLEP schema); default <output_dir>/pool.parquet."""
    num_shards: int = 8
    """Collection work units; finished shards are not redone after a restart."""
    save_behaviour: bool = True
    """Write each kept answer's sampled tokens, their log-probs under the collecting policy (at
    ``collect.temperature`` / ``top_p``) and the checkpoint's step into the pool's optional
    behaviour columns, the input of ``replay.correction``. They take about twice the space of
    the texts; false writes the texts only (the public RLEP schema)."""

    def __post_init__(self):
        if self.num_samples_per_prompt < 1:
            raise ValueError("collect.num_samples_per_prompt must be >= 1, got "
                             f"{self.num_samples_per_prompt}")
        if self.min_correct < 1:
            raise ValueError(f"collect.min_correct must be >= 1, got {self.min_correct}")
        if self.temperature <= 0:
            raise ValueError(f"collect.temperature must be > 0, got {self.temperature}")
        if self.num_shards < 1:
            raise ValueError(f"collect.num_shards must be >= 1, got {self.num_shards}")


@dataclass(frozen=True)
class RunConfig:
    """The whole run: one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def _check_lora(self) -> None:
        problem = _lora_problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def syncs_adapters(self) -> bool:
        """Whether each weight sync moves the LoRA adapter alone (``rollout.lora_sync=adapter``
        with ``lora.rank`` > 0): the engine keeps its base and serves the adapter."""
        return self.lora.enabled and self.rollout.lora_sync == "adapter"

    @property
    def actor_transformer_engine(self) -> str:
        """``model.transformer_engine`` as the actor is built: ``off`` with LoRA (the adapters
        sit on megatron-core's local linears)."""
        return "off" if self.lora.enabled else self.model.transformer_engine

    def __post_init__(self):
        staleness = self.trainer.max_staleness
        self._check_lora()
        problem = _megatron_backend_problem(self)
        if problem:
            raise ValueError(problem)
        if staleness and self.algo.dynamic_sampling:
            raise ValueError(f"trainer.max_staleness={staleness} with algo.dynamic_sampling: "
                             "a step generated ahead cannot know how many rounds it needs; "
                             "use trainer.max_staleness=0 with dynamic sampling")
        if self.replay.clip_ratio_high is not None and self.algo.loss != "dapo":
            raise ValueError(f"replay.clip_ratio_high with algo.loss={self.algo.loss}: a "
                             "separate eps_high for replays is a token-level clip of the dapo "
                             "loss; set replay.clip_ratio_high=null or use algo.loss=dapo")
        if self.rollout.placement == "separate" and self.algo.routing_replay == "rollout":
            raise ValueError("algo.routing_replay=rollout with rollout.placement=separate: a "
                             "vLLM server returns no routing to replay; use "
                             "algo.routing_replay=actor (or off)")
        if staleness and self.algo.routing_replay == "rollout":
            raise ValueError(f"trainer.max_staleness={staleness} with algo.routing_replay="
                             "rollout: the engine's experts are captured per blocking "
                             "generate call; use algo.routing_replay=actor (or off), or "
                             "trainer.max_staleness=0")


def _megatron_backend_problem(cfg: "RunConfig") -> Optional[str]:
    """What ``rollout.backend=megatron`` cannot run with, or None."""
    rollout, parallel = cfg.rollout, cfg.parallel
    if rollout.backend != "megatron":
        return None
    refused = [f"parallel.{key}={getattr(parallel, key)}" for key in
               ("pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size") if getattr(parallel, key) != 1]
    if parallel.virtual_pipeline_model_parallel_size:
        refused.append("parallel.virtual_pipeline_model_parallel_size="
                       f"{parallel.virtual_pipeline_model_parallel_size}")
    if parallel.sequence_parallel:
        refused.append("parallel.sequence_parallel=true")
    if rollout.placement != "colocated":
        refused.append(f"rollout.placement={rollout.placement}")
    if rollout.tensor_model_parallel_size not in (1, parallel.tensor_model_parallel_size):
        refused.append("rollout.tensor_model_parallel_size="
                       f"{rollout.tensor_model_parallel_size} (the actor's "
                       f"{parallel.tensor_model_parallel_size} is the engine's)")
    if cfg.algo.routing_replay == "rollout":
        refused.append("algo.routing_replay=rollout (no engine routing is recorded; use actor)")
    if rollout.lora_sync == "adapter" and cfg.lora.enabled:
        refused.append("rollout.lora_sync=adapter (the actor's adapters generate as they are; "
                       "use merged)")
    if not refused:
        return None
    return ("rollout.backend=megatron decodes with the actor's model on its tensor- and "
            "data-parallel layout only; refused here: " + ", ".join(refused)
            + ". Use rollout.backend=vllm for these layouts.")


def _lora_problem(cfg: "RunConfig") -> Optional[str]:
    """What makes a run's LoRA settings unusable together with the rest, or None."""
    lora, rollout = cfg.lora, cfg.rollout
    if not lora.enabled:
        if lora.init_from or lora.lr is not None:
            return ("lora.init_from / lora.lr without lora.rank: set lora.rank > 0 to train "
                    "adapters (rank 0 is full fine-tuning)")
        return None
    if cfg.model.transformer_engine == "required":
        return ("lora.rank > 0 with model.transformer_engine=required: the adapters sit on "
                "megatron-core's local linears (TransformerEngine's fuse the layer norm into "
                "the projection); use model.transformer_engine=auto or off")
    if lora.dropout > 0 and cfg.model.recompute_activations:
        return ("lora.dropout > 0 with model.recompute_activations: the recomputed forward "
                "would draw other dropout masks than the one the loss came from; use "
                "lora.dropout=0 or no recompute")
    if rollout.lora_sync != "adapter":
        return None
    if rollout.placement == "separate" and rollout.carry_over == "keep":
        return ("rollout.lora_sync=adapter with rollout.carry_over=keep: a request frozen on a "
                "server during an update would go on with the adapter it started with, its "
                "tokens labelled with the new version; use carry_over resume, restart or "
                "finish, or rollout.lora_sync=merged")
    if cfg.model.mcore_dir:
        return ("rollout.lora_sync=adapter with model.mcore_dir: the engine's base comes from "
                "model.hf_dir and is never streamed, so it must be the actor's; drop "
                "model.mcore_dir or use rollout.lora_sync=merged")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        return (f"lora.rank={lora.rank} with rollout.lora_sync=adapter: vLLM's largest LoRA "
                f"rank is {VLLM_LORA_RANKS[-1]}; use rollout.lora_sync=merged")
    return None


CONFIG_FILE_NAME = "config.yaml"

# keys a resumed run may change without checkpoint.resume_with_changes: how long it runs, what
# and where it logs and writes, how often it validates and saves, where it runs, how many
# scorer workers it uses; and the settings of `rlep eval` / `rlep collect` (whole sections)
RESUMABLE_CHANGES = ("trainer.total_steps", "trainer.validation_interval_steps",
                     "trainer.validate_before_train",
                     "trainer.log_all_ranks", "trainer.loggers", "trainer.wandb_project",
                     "trainer.wandb_entity", "trainer.wandb_group", "trainer.wandb_tags",
                     "trainer.mlflow_experiment", "trainer.mlflow_tracking_uri",
                     "trainer.wandb_run_name", "trainer.output_dir", "trainer.device",
                     "reward.num_workers", "reward.backend", "checkpoint.", "eval.", "collect.",
                     # the same arithmetic, other communication timing
                     "optim.overlap_grad_reduce", "optim.overlap_param_gather")


def config_changes(saved: dict, current: "RunConfig") -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` for every key of ``current`` whose value differs
    from the saved config (a key the saved config lacks counts as its default), except
    :data:`RESUMABLE_CHANGES`."""
    now = config_to_dict(current)
    defaults = config_to_dict(RunConfig())
    changes = []
    for section, values in now.items():
        before_section = saved.get(section) or {}
        for key, value in values.items():
            name = f"{section}.{key}"
            if any(name == k or (k.endswith(".") and name.startswith(k))
                   for k in RESUMABLE_CHANGES):
                continue
            before = before_section.get(key, defaults[section][key])
            if before != value:
                changes.append((name, before, value))
    return changes


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)}


def valid_keys() -> list[str]:
    """All ``section.key`` names, sorted."""
    keys = []
    for section, cls in _section_types().items():
        keys.extend(f"{section}.{f.name}" for f in dataclasses.fields(cls))
    return sorted(keys)


def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass (read from the source)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def config_reference() -> str:
    """Every ``section.key`` with its type, default and documentation, as Markdown
    (``rlep config --reference``)."""
    import textwrap

    sections = _section_types()
    lines = ["# rlep configuration reference", "",
             "Generated from `rlep_megatron/config.py` by `rlep config --reference`. How to set",
             "keys, and the names other trainers use for them: docs/configuration.md.", "",
             "Sections:", ""]
    lines += [f"- [{name}](#{name}): {len(dataclasses.fields(cls))} keys"
              for name, cls in sections.items()]
    lines.append("")
    defaults = config_to_dict(RunConfig())
    for section, cls in sections.items():
        lines += [f"## {section}", ""]
        hints = typing.get_type_hints(cls)
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            kind = str(hints[f.name]).replace("typing.", "")
            if kind.startswith("<class"):
                kind = hints[f.name].__name__
            # wrapped for reading as plain text; a Markdown list item continues when indented
            lines += textwrap.wrap(f"- `{section}.{f.name}` ({kind}, default "
                                   f"`{defaults[section][f.name]!r}`): {docs.get(f.name, '')}",
                                   width=100, subsequent_indent="  ", break_long_words=False,
                                   break_on_hyphens=False)
        lines.append("")
    return "\n".join(lines)


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field annotation, converting only lossless cases
    (int -> float, str of a list element). Raises ValueError naming ``key``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[-1])
    if origin is Literal:
        if isinstance(value, bool) and ("off" if value is False else "on") in args:
            # YAML 1.1 reads a bare off / on (and no / yes) as a boolean
            value = "on" if value else "off"
        if value not in args:
            raise ValueError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping ({{name: value, ...}}), got "
                             f"{type(value).__name__} {value!r}")
        return {_coerce(f"{key} (a key)", k, args[0]): _coerce(f"{key}[{k!r}]", v, args[1])
                for k, v in value.items()}
    if origin is list:
        if isinstance(value, str):
            if "," in value and not os.path.exists(value):
                raise ValueError(f"{key}: {value!r} looks like a comma-separated list; write "
                                 f"a YAML list: {key}=[{value}]")
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):
            # YAML 1.1 reads "3e-6" (no dot) as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if annotation is str:
        if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
            raise ValueError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return str(value)
    raise AssertionError(f"unsupported annotation {annotation} for {key}")


# field names of verl's recipes (the reference implementation's trainer) whose key here has
# another name; fields with the same name are found by name
_PEER_NAMES = {
    "n": "rollout.num_samples_per_prompt",
    "ppo_mini_batch_size": "trainer.mini_batch_size",
    "ppo_max_token_len_per_gpu": "trainer.micro_batch_max_tokens",
    "total_training_steps": "trainer.total_steps",
    "total_epochs": "trainer.total_steps",
    "save_freq": "checkpoint.save_interval_steps",
    "test_freq": "trainer.validation_interval_steps",
    "default_local_dir": "trainer.output_dir",
    "max_prompt_length": "data.max_prompt_tokens",
    "max_response_length": "rollout.max_response_tokens",
    "response_length": "rollout.max_response_tokens",
    "kl_loss_coef": "algo.kl_coef",
    "kl_loss_type": "algo.kl_estimator",
    "entropy_coeff": "algo.entropy_coef",
    "train_files": "data.train_files",
    "val_files": "data.val_files",
    "resume_mode": "checkpoint.resume",
    "warmup_style": "optim.lr_decay",
    "lr_scheduler_type": "optim.lr_decay",
    "min_lr_ratio": "optim.min_lr",
    "max_num_gen_batches": "algo.max_generation_rounds",
    "adv_estimator": "algo.advantage",
    "norm_adv_by_std_in_grpo": "algo.advantage_normalize_std",
}
# verl fields whose own name says too little: matched with their parent's name
_PEER_PATHS = {
    "filter_groups.enable": "algo.dynamic_sampling",
    "filter_groups.max_num_gen_batches": "algo.max_generation_rounds",
    "policy_loss.loss_mode": "algo.loss",
}


def suggest_keys(name: str, limit: int = 3) -> list[str]:
    """The valid ``section.key`` names closest to ``name``: a key of another section with the
    same field name (``trainer.lr`` -> ``optim.lr``), the field name of a section-less or
    verl-style dotted key (``actor_rollout_ref.actor.optim.lr`` -> ``optim.lr``), else the
    nearest spellings."""
    import difflib

    keys = valid_keys()
    parts = name.split(".")
    field_name = parts[-1]
    if ".".join(parts[-2:]) in _PEER_PATHS:
        return [_PEER_PATHS[".".join(parts[-2:])]]
    if field_name in _PEER_NAMES:
        return [_PEER_NAMES[field_name]]
    same_field = [k for k in keys if k.split(".", 1)[1] == field_name]
    if same_field:
        return same_field[:limit]
    if len(parts) >= 2:
        tail = ".".join(parts[-2:])
        close = difflib.get_close_matches(tail, keys, n=limit, cutoff=0.6)
        if close:
            return close
    fields = {k.split(".", 1)[1]: k for k in keys}
    return [fields[f] for f in difflib.get_close_matches(field_name, list(fields), n=limit,
                                                          cutoff=0.6)]


# key names that other trainers use for the size of the job (verl's trainer.n_gpus_per_node
# and trainer.nnodes, NeMo-RL's cluster.gpus_per_node and cluster.num_nodes...): here torchrun
# sets it, so the closest spelling would be a wrong suggestion
_GPU_COUNT_FIELDS = {"n_gpus_per_node", "nnodes", "n_gpus", "num_gpus", "gpus", "gpus_per_node",
                     "num_gpus_per_node", "nproc_per_node", "num_nodes", "nodes", "world_size",
                     "n_nodes", "num_devices", "devices"}


def _gpu_count_message(name: str) -> Optional[str]:
    if name.split(".")[-1].lower() not in _GPU_COUNT_FIELDS:
        return None
    return (f"'{name}' looks like a GPU or node count: rlep has no such key, torchrun sets the "
            "job's size (--nnodes, --nproc-per-node; one process per GPU) and the recipe's "
            "parallel.* sizes split it. `rlep init --nodes N --gpus-per-node G` and `rlep plan "
            "--nodes N --gpus-per-node G` take it; docs/multinode.md has the launch lines")


def _unknown_key_message(name: str) -> str:
    gpu_count = _gpu_count_message(name)
    if gpu_count:
        return gpu_count
    close = suggest_keys(name)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (f"unknown config key '{name}': {hint}(`rlep config --keys` lists every key, "
            "`rlep config --reference` documents them)")


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ValueError(_unknown_key_message(f"{section}.{key}"))
        kwargs[key] = _coerce(f"{section}.{key}", value, hints[key])
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a nested mapping; missing keys take their defaults."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    sections = _section_types()
    built = {}
    for section, values in raw.items():
        if section not in sections:
            import difflib

            close = difflib.get_close_matches(str(section), list(sections), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"unknown config section '{section}': {hint}valid sections: "
                             + ", ".join(sections))
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ValueError(f"config section '{section}' must be a mapping, got {values!r}")
        built[section] = _build_section(section, sections[section], values)
    return RunConfig(**built)


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, YAML-parsed value)."""
    if "=" not in text:
        raise ValueError(f"override '{text}' must look like section.key=value")
    dotted, raw_value = text.split("=", 1)
    if dotted.count(".") != 1:
        if _gpu_count_message(dotted):
            raise ValueError(_gpu_count_message(dotted))
        close = suggest_keys(dotted)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ValueError(f"override key '{dotted}' must look like section.key: {hint}"
                         "(`rlep config --keys` lists every key)")
    section, key = dotted.split(".")
    try:
        value = yaml.safe_load(raw_value) if raw_value != "" else ""
    except yaml.YAMLError as err:
        raise ValueError(f"override {dotted}: cannot parse value {raw_value!r}: {err}") from None
    return section, key, value


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> RunConfig:
    """Load a YAML recipe (or the defaults when ``path`` is None) and apply overrides."""
    raw: dict[str, Any] = {}
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as err:
                raise ValueError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a recipe must be a mapping of sections")
    for text in overrides or []:
        section, key, value = parse_override(text)
        if section not in _section_types():
            raise ValueError(_unknown_key_message(f"{section}.{key}"))
        raw.setdefault(section, {})
        if raw[section] is None:
            raw[section] = {}
        raw[section][key] = value
    return config_from_dict(raw)


def dump_config(cfg: RunConfig, directory: str) -> str:
    """Write ``config.yaml`` into ``directory`` atomically; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CONFIG_FILE_NAME)
    from rlep_megatron.staging import write_file_atomic

    return write_file_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
