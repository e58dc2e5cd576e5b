"""Torchrun program for the planner's tests (``rlep plan``), one case from the command line or
several with ``--cases FILE`` (:class:`tests.torchrun.Cases`), two modes:

* ``--state``: build the actor at ``--tp/--pp/--ep/--cp`` from ``--hf-dir``'s config.json
  (random weights),
  wrap it in megatron's DDP with the distributed optimizer (``--bucket-size``: gradient buckets
  of that many elements), take one optimizer step, and write each
  rank's pipeline stage and what it really holds: parameter elements (replicated / expert),
  gradient-buffer and parameter-buffer elements, and optimizer-state elements (Adam moments and float32 main
  copies), from the tensors themselves.
* ``--activations TOKENS``: one rank; the bytes of every tensor autograd saves for the backward
  in one forward pass of a TOKENS-token sequence (``saved_tensors_hooks``, each storage counted
  once, parameters excluded).
"""
from tests import pause_gc_in_program

pause_gc_in_program(__name__)
import json
import os

import torch

from rlep_megatron import distributed
from rlep_megatron.config import OptimConfig, ParallelConfig
from rlep_megatron.models import layout_limits
from rlep_megatron.models.megatron import build_model, unwrap
from tests.torchrun import case_parser, run_cases


def state_counts(chunks, optimizer) -> dict:
    from megatron.core import parallel_state as ps

    dense = expert = 0
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "allreduce", True):
                dense += param.numel()
            else:
                expert += param.numel()
    grads = sum(buffer.grad_data.numel() for chunk in chunks
                for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers))
    state = 0
    for inner in optimizer.torch_optimizers():
        for values in inner.state.values():
            state += sum(int(v.numel()) for k, v in values.items()
                         if torch.is_tensor(v) and v.dim() > 0)
    # float32 main copies of 16-bit parameters (none when the model is float32)
    main = sum(int(p.numel()) for inner in optimizer.torch_optimizers()
               for group in inner.param_groups for p in group["params"]
               if p.dtype == torch.float32) if chunks_dtype(chunks) != torch.float32 else 0
    # with the distributed optimizer the weights live in DDP's padded parameter buffers
    weights = sum(buffer.param_data.numel() for chunk in chunks
                  for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers)
                  if buffer.param_data is not None)
    return {"stage": ps.get_pipeline_model_parallel_rank(), "dense": dense, "expert": expert,
            "grad_elements": grads, "param_buffer_elements": weights,
            "optimizer_elements": state + main}


def chunks_dtype(chunks):
    return next(chunks[0].parameters()).dtype


def main():
    parser = case_parser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--sp", action="store_true")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--state", action="store_true")
    parser.add_argument("--bucket-size", type=int, default=None,
                        help="gradient buckets of this many elements (overlapped reduction)")
    parser.add_argument("--activations", type=int, default=0)
    run_cases(parser, run_case)
    distributed.destroy()


def run_case(args):
    with open(os.path.join(args.hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    distributed.init_model_parallel(
        ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                       expert_model_parallel_size=args.ep, sequence_parallel=args.sp,
                       context_parallel_size=args.cp),
        seed=0, **layout_limits(hf_config))
    chunks, _ = build_model(hf_config, torch.float32, transformer_engine="off")
    for chunk in chunks:
        for param in chunk.parameters():
            torch.nn.init.normal_(param, std=0.02)
    if args.state:
        from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp

        optim_cfg = OptimConfig(lr=1e-3, lr_warmup_steps=0, use_distributed_optimizer=True)
        chunks = wrap_ddp(chunks, True, overlap_grad_reduce=args.bucket_size is not None,
                          bucket_size=args.bucket_size)
        optimizer = build_optimizer(chunks, optim_cfg, torch.float32)
        optimizer.create_state()  # Adam's state exists after a first step
        counts = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(counts, state_counts(chunks, optimizer))
        if torch.distributed.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(counts, f)
    if args.activations:
        saved = {}
        params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        ids = torch.randint(0, int(hf_config["vocab_size"]), (1, args.activations))
        positions = torch.arange(args.activations).unsqueeze(0)
        model = unwrap(chunks[0])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(ids, positions, attention_mask=None)  # the logits themselves are not saved
        with open(args.out, "w") as f:
            json.dump({"saved_bytes": sum(saved.values()),
                       "layers": len(model.decoder.layers)}, f)


if __name__ == "__main__":
    main()
