"""Run the megatron model (from a converted checkpoint, at a chosen TP/PP) and HF transformers
on the same prompts; report the maximum absolute difference of per-token log-probs and exit
non-zero above a tolerance.

    torchrun --nproc-per-node N tools/verify_conversion.py --hf-dir D --mcore-dir O --tp T --pp P
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="the HF checkpoint (reference)")
    parser.add_argument("--mcore-dir", default=None,
                        help="megatron dist checkpoint to check (default: load --hf-dir)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size (mixture-of-experts models)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="max |delta logprob| allowed (default 1e-4 fp32, 5e-2 bf16/fp16)")
    args = parser.parse_args()

    from rlep_megatron import distributed
    from rlep_megatron.actor.forward import pad_sequences, sequence_logprobs
    from rlep_megatron.models import layout_limits, num_experts
    from rlep_megatron.models.megatron import build_model
    from rlep_megatron.actor.model import load_hf_weights
    from rlep_megatron.checkpoint.dist import load_mcore_weights
    from rlep_megatron.checkpoint.convert import hf_dtype
    from rlep_megatron.checkpoint.hf_io import load_hf_config
    from rlep_megatron.checkpoint.verify import (DEFAULT_PROMPTS, hf_token_logprobs,
                                                 max_abs_logprob_diff)
    from rlep_megatron.config import ParallelConfig

    distributed.setup_logging()
    try:
        hf_config = load_hf_config(args.hf_dir)
        distributed.init_model_parallel(
            ParallelConfig(tensor_model_parallel_size=args.tp,
                           pipeline_model_parallel_size=args.pp,
                           expert_model_parallel_size=args.ep,
                           # megatron's MoE layer needs it at TP > 1
                           sequence_parallel=args.tp > 1 and num_experts(hf_config) > 0),
            seed=0, **layout_limits(hf_config))
        dtype = hf_dtype(hf_config)
        chunks, info = build_model(hf_config, dtype)
        if args.mcore_dir:
            load_mcore_weights(chunks, args.mcore_dir)
        else:
            load_hf_weights(chunks, args.hf_dir, info)
    except (ValueError, FileNotFoundError) as err:
        print(f"verify_conversion: error: {err}", file=sys.stderr)
        distributed.destroy()
        return 2
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.hf_dir, local_files_only=True)
    sequences = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in DEFAULT_PROMPTS]
    input_ids, lengths = pad_sequences(sequences, pad_id=tokenizer.pad_token_id or 0)
    result = sequence_logprobs(chunks, info, input_ids, micro_batch_size=2)
    diff = torch.full((1,), -1.0, dtype=torch.float64)
    if result is not None and ps.get_tensor_model_parallel_rank() == 0:
        reference = hf_token_logprobs(args.hf_dir, input_ids, lengths, dtype)
        diff[0] = max_abs_logprob_diff(result["logp"], reference, lengths)
    torch.distributed.all_reduce(diff, op=torch.distributed.ReduceOp.MAX)
    tolerance = args.tolerance or (1e-4 if dtype == torch.float32 else 5e-2)
    ok = diff.item() <= tolerance
    if torch.distributed.get_rank() == 0:
        print(f"verify_conversion: TP={args.tp} PP={args.pp} EP={args.ep} max |delta logprob| = "
              f"{diff.item():.3e} (tolerance {tolerance:.1e}): {'OK' if ok else 'FAIL'}")
    distributed.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
