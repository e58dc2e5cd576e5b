"""The actor's optimizer: megatron-core DDP wrapping, AdamW (megatron's distributed optimizer,
which shards the Adam state over data-parallel ranks, unless turned off), linear warmup then
constant learning rate, grad-norm clipping, and a step that is skipped (and counted) when the
grad norm is not finite (docs/ALGORITHM.md sections 4, 8).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from rlep_megatron.config import OptimConfig

logger = logging.getLogger(__name__)


def wrap_ddp(chunks: list[torch.nn.Module], use_distributed_optimizer: bool,
             overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
             grad_reduce_in_fp32: bool = True,
             bucket_size: "int | None" = None) -> list[torch.nn.Module]:
    """megatron-core DDP around each chunk (contiguous grad buffers, DP gradient reduction).
    Tied embeddings across pipeline stages and DP reductions are finalised by
    ``finalize_model_grads`` after the backward passes. ``overlap_grad_reduce`` /
    ``overlap_param_gather`` (the latter only with the distributed optimizer) hand megatron's
    schedule the per-chunk sync functions, as Megatron-LM's training loop does; with the
    parameter gather overlapped, call :meth:`ActorOptimizer.gather_params` before reading the
    weights outside a forward pass. ``bucket_size`` (elements; with ``overlap_grad_reduce``)
    replaces megatron's default of max(40M, 1M x data-parallel size). Without data-parallel
    replicas (one rank per model shard, experts included) there is no parameter gather to
    overlap: it is turned off, as megatron's forward pre-hooks would only add work to every
    forward pass. (The gradient reduction's overlap stays as configured: it decides how the
    gradient buffer is cut into buckets, which the distributed optimizer's checkpointed
    state follows.)"""
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)

    if not _data_parallel_replicas() or _has_adapters(chunks):
        # (LoRA: the adapters are read inside their linears' hooks, never called as modules,
        # so megatron's forward pre-hooks would not gather their updated shards; they are small)
        overlap_param_gather = False
    overlap_param_gather = overlap_param_gather and use_distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        use_distributed_optimizer=use_distributed_optimizer, bucket_size=bucket_size)
    wrapped = []
    for index, chunk in enumerate(chunks):
        wrapped.append(DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            disable_bucketing=index > 0))

    def per_chunk(functions):
        return functions if len(functions) > 1 else functions[0]

    config = wrapped[0].config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk([c.no_sync for c in wrapped])
    config.grad_sync_func = per_chunk([c.start_grad_sync for c in wrapped]) \
        if overlap_grad_reduce else None
    config.param_sync_func = None  # the forward pre-hooks gather (align_param_gather off)
    return wrapped


def _has_adapters(chunks: list[torch.nn.Module]) -> bool:
    from rlep_megatron.lora.adapters import chunk_adapters

    return any(chunk_adapters(chunk) is not None for chunk in chunks)


def _data_parallel_replicas() -> bool:
    """Whether gradients are reduced over more than one rank: data (with context) parallel
    ranks, or the expert-data-parallel ranks of a mixture-of-experts model's experts."""
    from megatron.core import parallel_state as ps

    return (ps.get_data_parallel_world_size(with_context_parallel=True) > 1
            or ps.get_expert_data_parallel_world_size() > 1)


@dataclass
class ActorOptimizer:
    """Megatron optimizer + linear warm-up (``OptimConfig.lr_warmup_unit``), then a constant or
    decaying lr (``OptimConfig.lr_decay``); ``step()`` skips non-finite grad norms."""

    optimizer: object
    config: OptimConfig
    num_steps: int = 0
    num_skipped: int = 0
    training_step: int = 0
    """Training (RL) steps completed before the current one; set by the trainer."""
    total_steps: int = 0
    """The run's training steps (``trainer.total_steps``): where a decay of length 0 ends."""

    def current_lr(self) -> float:
        peak = self.decayed_lr()
        warmup = self.config.lr_warmup_steps
        if not warmup:
            return peak
        if self.config.lr_warmup_unit == "training_steps":
            return peak * min(1.0, self.training_step / warmup)
        return peak * min(1.0, (self.num_steps + 1) / warmup)

    def decayed_lr(self) -> float:
        """``optim.lr`` after ``optim.lr_decay`` at the current training step (before the
        warm-up's factor, which is 1 once the decay starts)."""
        cfg = self.config
        if cfg.lr_decay == "constant":
            return cfg.lr
        start = cfg.lr_warmup_steps if cfg.lr_warmup_unit == "training_steps" else 0
        length = cfg.lr_decay_steps or max(self.total_steps - start, 1)
        progress = min(max(self.training_step - start, 0) / length, 1.0)
        if cfg.lr_decay == "linear":
            remaining = 1.0 - progress
        else:
            remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * remaining

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self, chunks: list[torch.nn.Module]) -> None:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> tuple[bool, float]:
        """Apply the accumulated gradients; returns (applied, grad_norm before clipping)."""
        self._set_lr(self.current_lr())
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            self.num_skipped += 1
            logger.warning("non-finite grad norm (%s): optimizer step skipped (%d so far)",
                           grad_norm, self.num_skipped)
            return False, grad_norm
        if self.config.clip_grad > 0:
            self._clip(grad_norm)
        self.optimizer.step_with_ready_grads()
        self.num_steps += 1
        return True, grad_norm

    def _clip(self, grad_norm: float) -> None:
        """Scale every gradient by ``clip_grad / grad_norm`` when the total norm is larger. A
        mixture-of-experts model has a chained optimizer (dense parameters and experts reduce
        over different groups) whose parts clip by the total norm of both, as megatron's
        ``ChainedOptimizer.step`` does."""
        from megatron.core.optimizer import optimizer as mcore_optimizer

        for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = inner.get_parameters()
            if params and not getattr(inner, "is_stub_optimizer", False):
                mcore_optimizer.clip_grad_by_total_norm_fp32(
                    params, max_norm=self.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    def gather_params(self, chunks: list[torch.nn.Module]) -> None:
        """With ``overlap_param_gather`` the updated shards of the other data-parallel ranks
        arrive in the next forward pass; gather them now (synchronously) so that the weights
        are complete for a reader outside the forward (weight sync, checkpoint). A no-op
        without the overlap: the optimizer step already gathered them."""
        for chunk in chunks:
            if getattr(chunk, "ddp_config", None) is not None and chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)

    def offload(self, chunks: list[torch.nn.Module]) -> None:
        """Free GPU memory for the rollout engine: release megatron's gradient buffers (their
        storage; the views stay valid and are zeroed on restore) and move the optimizer's
        tensors (Adam moments, fp32 main weights) to CPU memory. megatron-core's own RL
        offload functions; GPU only, with bfloat16 parameters (see ``OptimConfig``)."""
        for chunk in chunks:
            chunk.offload_grad_buffers()
        self.optimizer.offload_to_cpu()

    def restore(self, chunks: list[torch.nn.Module]) -> None:
        """Undo :meth:`offload` before the next forward/backward."""
        self.optimizer.restore_from_cpu()
        for chunk in chunks:
            chunk.restore_grad_buffers()

    def torch_optimizers(self) -> list:
        """The torch optimizers inside megatron's (chained) optimizer."""
        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [megatron_optimizer.optimizer for megatron_optimizer in chained]

    def create_state(self) -> None:
        """Create Adam's (lazily built) state before loading a checkpoint into it: the
        distributed optimizer's sharded state dict reads the current state's step count. Runs
        one zero-gradient step at learning rate 0, so no parameter moves."""
        for torch_optimizer in self.torch_optimizers():
            if torch_optimizer.state:
                continue
            saved_lr = [group["lr"] for group in torch_optimizer.param_groups]
            for group in torch_optimizer.param_groups:
                group["lr"] = 0.0
                for param in group["params"]:
                    param.grad = torch.zeros_like(param)
            torch_optimizer.step()
            for group, lr in zip(torch_optimizer.param_groups, saved_lr):
                group["lr"] = lr
                for param in group["params"]:
                    param.grad = None

    def load_checkpoint_state(self, state: dict, counters: dict) -> None:
        """Load the optimizer part of a dist checkpoint (after :meth:`create_state`) and this
        object's counters."""
        # with fp32 parameters the distributed optimizer's main parameters are views of the
        # model's (leaves that require grad): copy into them without autograd
        with torch.no_grad():
            self.optimizer.load_state_dict(state)
        self.load_state_dict(counters)
        # Adam's step count must equal the applied steps. megatron's distributed optimizer
        # (without apex / TE) restores it from the state it had before loading, and gives all
        # parameters one shared step tensor, which torch's Adam would advance once per
        # parameter: set each parameter's own count
        for torch_optimizer in self.torch_optimizers():
            for param_state in torch_optimizer.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = torch.tensor(float(self.num_steps),
                                                       dtype=param_state["step"].dtype,
                                                       device=param_state["step"].device)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_skipped": self.num_skipped}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps = int(state["num_steps"])
        self.num_skipped = int(state["num_skipped"])


def build_optimizer(chunks: list[torch.nn.Module], config: OptimConfig,
                    params_dtype: torch.dtype) -> ActorOptimizer:
    """The optimizer for DDP-wrapped chunks (wrap them with ``wrap_ddp(chunks,
    config.use_distributed_optimizer)``)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    use_distributed = config.use_distributed_optimizer
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=config.lr, min_lr=0.0, weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
        clip_grad=config.clip_grad, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed), chunks)
    return ActorOptimizer(optimizer=optimizer, config=config)
