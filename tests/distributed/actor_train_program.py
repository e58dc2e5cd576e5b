"""Torchrun program: one RLEP train step of the actor from an HF checkpoint at ``--tp/--pp``
(DP = world / (TP x PP)) on a fixed global batch; writes the updated weights (HF names, full
tensors) and the step metrics to ``--out``. ``--cases FILE`` (a JSON list of argument lists,
each with its own ``--hf-dir`` and ``--out``) takes several such steps one after another in one
launch, each from a freshly built model in its own layout."""
from tests import pause_gc_in_program

pause_gc_in_program(__name__)
import argparse
import contextlib
import dataclasses
import os

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlep_megatron import distributed
from rlep_megatron.actor.forward import pad_sequences, sequence_logprobs
from rlep_megatron.actor.model import build_from_hf
from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
from rlep_megatron.actor.packing import balanced_partition
from rlep_megatron.actor.routing import RoutingReplay
from rlep_megatron.actor.train_step import TrainBatch, train_mini_batch
from rlep_megatron.config import AlgoConfig, OptimConfig, ParallelConfig
from rlep_megatron.weight_sync.streamer import WeightStreamer
from tests.torchrun import case_parser, run_cases

NUM_SEQUENCES = 8


class ScalarReads(TorchDispatchMode):
    """Counts tensor-to-Python scalar reads (``float()``, ``int()``, ``.item()``: on a GPU each
    waits for the device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_schedule_reads():
    """Counts the scalar reads inside megatron's forward-backward schedule (the micro-batches'
    forward, loss and backward), not the batch planning around it."""
    from megatron.core import pipeline_parallel

    original, counter = pipeline_parallel.get_forward_backward_func, ScalarReads()

    def counted(*args, **kwargs):
        schedule = original(*args, **kwargs)

        def run(**schedule_kwargs):
            with counter:
                return schedule(**schedule_kwargs)
        return run

    pipeline_parallel.get_forward_backward_func = counted
    try:
        yield counter
    finally:
        pipeline_parallel.get_forward_backward_func = original


def global_batch():
    """Prompts + responses of different lengths; advantages of both signs; two replays."""
    generator = torch.Generator().manual_seed(3)
    sequences, prompt_lengths = [], []
    for i in range(NUM_SEQUENCES):
        prompt = torch.randint(0, 256, (int(torch.randint(3, 7, (1,), generator=generator)),),
                               generator=generator).tolist()
        response = torch.randint(0, 256, (int(torch.randint(2, 12, (1,), generator=generator)),),
                                 generator=generator).tolist()
        sequences.append(prompt + response)
        prompt_lengths.append(len(prompt))
    input_ids, lengths = pad_sequences(sequences, pad_id=256)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    response_mask = ((positions >= torch.tensor(prompt_lengths)[:, None])
                     & (positions < lengths[:, None])).float()
    advantages = torch.randn(NUM_SEQUENCES, generator=generator) * 2
    is_replay = torch.tensor([i % 4 == 3 for i in range(NUM_SEQUENCES)])
    noise = torch.randn(input_ids.shape, generator=generator) * 0.3
    return input_ids, response_mask, advantages, is_replay, noise


def adam_state_numel(optimizer) -> int:
    """Elements of Adam's exp_avg held by this rank (sharded by the distributed optimizer)."""
    return sum(int(state["exp_avg"].numel()) for o in optimizer.torch_optimizers()
               for state in o.state.values() if "exp_avg" in state)


def build_parser() -> argparse.ArgumentParser:
    parser = case_parser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages")
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism (MoE models)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--cp", type=int, default=1, help="context parallelism")
    parser.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    parser.add_argument("--moe-z-loss-coeff", type=float, default=0.0)
    parser.add_argument("--routing-replay", action="store_true",
                        help="record the old-log-prob pass's experts and replay them in the step")
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    parser.add_argument("--micro-batch-max-tokens", type=int, default=40)
    parser.add_argument("--distributed-optimizer", action="store_true",
                        help="megatron's distributed optimizer (optimizer state sharded over DP)")
    parser.add_argument("--adam-eps", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--packing", action="store_true",
                        help="sequence packing for the old log-probs and the step, and the "
                             "token-balanced split over data-parallel ranks")
    parser.add_argument("--logprob-chunk", type=int, default=None,
                        help="model.logprob_chunk_tokens (0: full logits)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--moe-experts", default="auto",
                        choices=["auto", "grouped", "sequential"],
                        help="how MoE layers run their experts (model.moe_experts)")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="optim.overlap_param_gather (with --distributed-optimizer): the "
                             "updated shards are gathered in the next forward's pre-hooks")
    parser.add_argument("--train-steps", type=int, default=1,
                        help="training steps, each ending with the weights gathered")
    parser.add_argument("--mini-batches", type=int, default=1,
                        help="optimizer steps per training step (the batch split in order)")
    parser.add_argument("--transformer-engine", default="auto", choices=["auto", "required", "off"],
                        help="the layer spec (model.transformer_engine)")
    parser.add_argument("--lora", default=None,
                        help="a PEFT LoRA adapter directory: the base is frozen and the step "
                             "trains the adapter")
    parser.add_argument("--reference", action="store_true",
                        help="with --lora: the KL term's reference (the initial adapters on the "
                             "actor's base) built before the step, its log-probs taken after it")
    parser.add_argument("--save-checkpoint", action="store_true",
                        help="after the steps, the model's sharded state saved as a training "
                             "checkpoint's dist/ beside its config.yaml, at <--out>.checkpoint")
    return parser


def main():
    run_cases(build_parser(), run_case)
    distributed.destroy()


def run_case(args):
    ctx = distributed.init_model_parallel(
        ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                       virtual_pipeline_model_parallel_size=args.vpp,
                       expert_model_parallel_size=args.ep, sequence_parallel=args.sp,
                       context_parallel_size=args.cp),
        seed=0)
    chunks, info = build_from_hf(args.hf_dir, args.dtype, recompute_activations=args.recompute,
                                 transformer_engine=args.transformer_engine,
                                 moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                                 moe_z_loss_coeff=args.moe_z_loss_coeff,
                                 moe_experts=args.moe_experts)
    base_before = None
    if args.lora:
        from tests.distributed.actor_logprob_program import attach_adapter

        attach_adapter(chunks, info, args.lora)
        base_before = base_weights(chunks)
    reference = None
    if args.reference:  # as the learner builds it: after the adapters, before DDP
        from rlep_megatron.actor.reference import InitialAdapters

        reference = InitialAdapters(chunks, info)
    experts_modules = sorted({type(module).__name__ for chunk in chunks
                              for name, module in chunk.named_modules()
                              if name.endswith("mlp.experts")})
    if args.logprob_chunk is not None:
        info = dataclasses.replace(info, logprob_chunk_tokens=args.logprob_chunk)
    # adam_eps well above float noise: Adam's first step ~ lr * g / (|g| + eps) would otherwise
    # amplify 1e-9 differences in near-zero gradients to O(lr)
    # (the comparison with the transformers reference takes a realistic eps and a weight decay
    # large enough to show on the 0.02-scale matrices; see test_actor_train_step)
    optim_cfg = OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=args.weight_decay,
                            clip_grad=1.0, adam_eps=args.adam_eps,
                            use_distributed_optimizer=args.distributed_optimizer)
    # forward pre-hooks of the experts' linears (where megatron's DDP gathers a module's updated
    # shards with the parameter gather overlapped): how often they ran, whichever experts run
    prehook_calls = [0]

    def count_call(module, inputs):
        prehook_calls[0] += 1
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if ".local_experts." in name and name.endswith(("linear_fc1", "linear_fc2")):
                module.register_forward_pre_hook(count_call)
    chunks = wrap_ddp(chunks, optim_cfg.use_distributed_optimizer,
                      overlap_param_gather=args.overlap_param_gather)
    optimizer = build_optimizer(chunks, optim_cfg, info.params_dtype)

    input_ids, response_mask, advantages, is_replay, noise = global_batch()
    # old log-probs: the current policy's, perturbed so ratios leave the clip range
    lengths = (response_mask * torch.arange(input_ids.shape[1])).max(dim=1).values + 1
    packing = ({"lengths": lengths, "pack_max_tokens": args.micro_batch_max_tokens}
               if args.packing else {})
    replay = RoutingReplay(chunks) if args.routing_replay else None
    recording = (replay.recording(*input_ids.shape) if replay else contextlib.nullcontext())
    with recording as routing:
        old = sequence_logprobs(chunks, info, input_ids, micro_batch_size=NUM_SEQUENCES,
                                **packing)
    from megatron.core import parallel_state as ps

    old_logp = torch.zeros(input_ids.shape) if old is None else old["logp"]
    old_logp = distributed.broadcast(old_logp, src=ps.get_pipeline_model_parallel_last_rank(),
                                     group=ps.get_pipeline_model_parallel_group()).cpu()
    clean_old_logp = old_logp.clone()
    old_logp = old_logp + noise
    dp, dp_rank = ctx.data_parallel_size, ctx.data_parallel_rank
    if args.packing:
        rows = torch.tensor(balanced_partition(lengths.tolist(), dp)[dp_rank])
    else:
        rows = torch.arange(dp_rank * NUM_SEQUENCES // dp, (dp_rank + 1) * NUM_SEQUENCES // dp)
    steps_metrics = []
    with counting_schedule_reads() as reads:
        for _ in range(args.train_steps):
            for part in rows.tensor_split(args.mini_batches):
                batch = TrainBatch(input_ids[part], response_mask[part], old_logp[part],
                                   advantages[part], is_replay[part],
                                   routing=None if routing is None else
                                   {layer: experts[part] for layer, experts in routing.items()})
                steps_metrics.append(train_mini_batch(
                    chunks, optimizer, info, batch, AlgoConfig(), args.micro_batch_max_tokens,
                    sequence_packing=args.packing, routing_replay=replay))
            optimizer.gather_params(chunks)  # as the learner does at the end of a step
    metrics = steps_metrics[0] if len(steps_metrics) == 1 else steps_metrics
    # every rank receives every HF tensor from the weight-sync stream
    merged = {name: tensor.clone()
              for name, tensor in WeightStreamer(chunks, info, 64 * 1024).iter_tensors()}
    lora = {}
    if reference is not None:
        from rlep_megatron.lora import peft_io

        trained = peft_io.full_tensors(chunks)
        ref_logp = reference.logprobs(input_ids, NUM_SEQUENCES, 1.0, **packing)
        ref_logp = distributed.broadcast(
            torch.zeros(input_ids.shape) if ref_logp is None else ref_logp,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group()).cpu()
        restored = all(torch.equal(trained[name], tensor)
                       for name, tensor in peft_io.full_tensors(chunks).items())
        new = sequence_logprobs(chunks, info, input_ids, micro_batch_size=NUM_SEQUENCES,
                                **packing)
        new_logp = distributed.broadcast(
            torch.zeros(input_ids.shape) if new is None else new["logp"],
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group()).cpu()
        lora.update(ref_logp=ref_logp, new_logp=new_logp, restored_after_reference=restored)
    if args.save_checkpoint:
        lora["checkpoint"] = save_checkpoint(chunks, args)
    if args.lora:
        from rlep_megatron.lora import peft_io

        after = base_weights(chunks)
        unchanged = all(torch.equal(after[name], tensor) for name, tensor in base_before.items())
        lora = {**lora, "adapter": peft_io.full_tensors(chunks),
                "base_unchanged": all(distributed.all_gather_object(unchanged)),
                "trainable": sorted(name for chunk in chunks
                                    for name, p in chunk.named_parameters() if p.requires_grad)}
    if torch.distributed.get_rank() == 0:
        inner = getattr(optimizer.optimizer, "chained_optimizers", [optimizer.optimizer])
        torch.save({"weights": merged, "metrics": metrics, "old_logp": old_logp,
                    "clean_old_logp": clean_old_logp, "lengths": lengths,
                    "optimizers": [type(o).__name__ for o in inner],
                    "adam_state_numel": adam_state_numel(optimizer),
                    "schedule_scalar_reads": reads.count,
                    "device": str(next(chunks[0].parameters()).device),
                    "transformer_engine": info.use_te,
                    "experts_modules": experts_modules,
                    "expert_prehook_calls": prehook_calls[0], **lora}, args.out)


def save_checkpoint(chunks, args) -> str:
    """The model's state as the trainer's checkpoints hold it (``dist/`` through the same
    sharded state dict, ``config.yaml`` naming the base and the adapter's ``lora`` section)."""
    from megatron.core import dist_checkpointing

    from rlep_megatron.checkpoint.dist import (keep_save_results_in_process,
                                               model_sharded_state_dict)
    from rlep_megatron.config import ModelConfig, RunConfig, dump_config
    from rlep_megatron.lora import peft_io

    directory = f"{args.out}.checkpoint"
    rank0 = torch.distributed.get_rank() == 0
    if rank0:
        os.makedirs(os.path.join(directory, "dist"))
    distributed.barrier()
    keep_save_results_in_process()
    dist_checkpointing.save({"model": model_sharded_state_dict(chunks)},
                            os.path.join(directory, "dist"))
    if rank0:
        lora = peft_io.lora_config_of(args.lora) if args.lora else None
        dump_config(RunConfig(model=ModelConfig(hf_dir=args.hf_dir),
                              **({"lora": lora} if lora else {})), directory)
    distributed.barrier()
    return directory


def base_weights(chunks) -> dict[str, torch.Tensor]:
    """Copies of this rank's base (non-adapter) parameters."""
    from rlep_megatron.lora.adapters import is_adapter_parameter
    from rlep_megatron.models.megatron import unwrap

    return {f"{index}.{name}": param.detach().clone() for index, chunk in enumerate(chunks)
            for name, param in unwrap(chunk).named_parameters()
            if not is_adapter_parameter(name)}


if __name__ == "__main__":
    main()
