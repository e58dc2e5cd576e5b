"""Convert an HF checkpoint (safetensors, single or sharded) into a megatron-core
dist_checkpointing (torch_dist) checkpoint that loads at any TP/PP.

    python tools/convert_hf_to_mcore.py --hf-dir D --out-dir O
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, help="HF checkpoint directory")
    parser.add_argument("--out-dir", required=True, help="output directory (must not exist "
                        "or be empty; written atomically)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    from rlep_megatron.checkpoint.convert import convert_hf_to_mcore, run_conversion_cli

    return run_conversion_cli("convert_hf_to_mcore", convert_hf_to_mcore, args.hf_dir,
                              args.out_dir, not args.no_progress)


if __name__ == "__main__":
    sys.exit(main())
