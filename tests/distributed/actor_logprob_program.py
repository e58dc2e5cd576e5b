"""Torchrun program: build the actor from an HF checkpoint at ``--tp/--pp`` and write its
per-token log-probs (and entropy) of a right-padded batch of different lengths to ``--out``.
``--cases FILE`` (a JSON list of argument lists, each with its own ``--hf-dir`` and ``--out``)
runs several such cases one after another in the same launch: the imports and the process group
are paid once, the model-parallel layout is rebuilt for each case."""
from tests import pause_gc_in_program

pause_gc_in_program(__name__)
import argparse
import contextlib

import torch

from rlep_megatron import distributed
from rlep_megatron.actor.expert_load import ExpertLoad
from rlep_megatron.actor.routing import RoutingReplay
from rlep_megatron.actor.forward import pad_sequences, sequence_logprobs
from rlep_megatron.actor.model import build_from_hf
from rlep_megatron.checkpoint.hf_io import load_hf_config
from rlep_megatron.checkpoint.verify import DEFAULT_PROMPTS
from rlep_megatron.config import ParallelConfig
from rlep_megatron.models import layout_limits
from tests.torchrun import case_parser, run_cases


def build_parser() -> argparse.ArgumentParser:
    parser = case_parser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vpp", type=int, default=None)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--cp", type=int, default=1, help="context parallelism")
    parser.add_argument("--mutate-cp-mask", default=None,
                        choices=["own-keys-only", "no-cross-chunk-causality"],
                        help="a deliberate bug the test must catch: the CP attention masks out "
                             "every key held by another CP rank, or sees every key another CP "
                             "rank holds, future ones included")
    parser.add_argument("--forced-routing", default=None,
                        help="torch file {layer: [rows, columns, k]}: replay these experts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--transformer-engine", default="auto", choices=["auto", "required", "off"],
                        help="the layer spec (model.transformer_engine)")
    parser.add_argument("--pack-max-tokens", type=int, default=None,
                        help="sequence packing (THD) with this token budget per micro-batch")
    parser.add_argument("--lora", default=None,
                        help="a PEFT LoRA adapter directory: the actor runs with it attached")
    return parser


def main():
    run_cases(build_parser(), run_case)
    distributed.destroy()


def run_case(args):
    from megatron.core import parallel_state as ps

    hf_config = load_hf_config(args.hf_dir)
    distributed.init_model_parallel(
        ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                       virtual_pipeline_model_parallel_size=args.vpp,
                       expert_model_parallel_size=args.ep, sequence_parallel=args.sp,
                       context_parallel_size=args.cp),
        seed=0, **layout_limits(hf_config))
    if args.mutate_cp_mask:
        from rlep_megatron.models import context_parallel

        mine = context_parallel.chunk_positions
        original = context_parallel.causal_mask

        def mutated(query_positions, key_positions):
            # owned: keys of this rank's chunks (the relative positions of its queries' chunks)
            owned = torch.zeros(len(key_positions), dtype=torch.bool)
            length, cp = len(key_positions), ps.get_context_parallel_world_size()
            owned[mine([0, length], cp, ps.get_context_parallel_rank())] = True
            causal = original(query_positions, key_positions)
            if args.mutate_cp_mask == "own-keys-only":
                return causal & owned.unsqueeze(0)
            return causal | ~owned.unsqueeze(0)  # the cross-chunk causal mask dropped

        context_parallel.causal_mask = mutated
    try:
        compute_and_save(args)
    finally:
        if args.mutate_cp_mask:
            context_parallel.causal_mask = original


def attach_adapter(chunks, info, directory):
    """Give the built chunks the PEFT adapter at ``directory`` (each rank its shards)."""
    from rlep_megatron.lora import adapters, peft_io

    lora = peft_io.lora_config_of(directory)
    adapters.attach(chunks, info, lora, seed=0)
    peft_io.assign(chunks, peft_io.load(directory, lora, info.dims))


def compute_and_save(args):
    from megatron.core import parallel_state as ps

    chunks, info = build_from_hf(args.hf_dir, args.dtype,
                                 transformer_engine=args.transformer_engine)
    if args.lora:
        attach_adapter(chunks, info, args.lora)
    input_ids, lengths = pad_sequences([list(p.encode()) for p in DEFAULT_PROMPTS], pad_id=256)
    replaying = contextlib.nullcontext()
    if args.forced_routing:
        replay = RoutingReplay(chunks)
        forced = torch.load(args.forced_routing)
        replaying = replay.replaying({layer: forced[layer] for layer in replay.layers})
    with ExpertLoad(chunks) as load, replaying:
        if load.routers and not args.forced_routing:
            with load.paused():  # a pass that is not counted (as LoRA's KL reference)
                sequence_logprobs(chunks, info, input_ids[:2], micro_batch_size=2,
                                  lengths=lengths[:2], pack_max_tokens=args.pack_max_tokens)
        result = sequence_logprobs(chunks, info, input_ids, micro_batch_size=2,
                                   with_entropy=True, lengths=lengths,
                                   pack_max_tokens=args.pack_max_tokens)
    # every data-parallel rank computes the same batch here (the trainer gives each its own)
    expert_counts = load.totals() / ps.get_data_parallel_world_size()

    if (result is not None and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0):
        torch.save({"input_ids": input_ids, "lengths": lengths, **result,
                    "expert_counts": expert_counts,
                    "device": str(next(chunks[0].parameters()).device),
                    "transformer_engine": info.use_te}, args.out)


if __name__ == "__main__":
    main()
