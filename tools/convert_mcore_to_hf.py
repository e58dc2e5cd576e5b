"""Convert a megatron-core dist_checkpointing checkpoint back to an HF directory (safetensors,
sharded with an index above --max-shard-gb, config and tokenizer files copied).

    python tools/convert_mcore_to_hf.py --mcore-dir O --out-dir H [--hf-config-dir D]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mcore-dir", required=True, help="megatron-core checkpoint directory")
    parser.add_argument("--out-dir", required=True, help="HF output directory (written "
                        "atomically)")
    parser.add_argument("--hf-config-dir", default=None,
                        help="directory with the HF config.json and tokenizer (default: the "
                             "copy stored in <mcore-dir>/hf_config)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="start a new safetensors shard above this size")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    from rlep_megatron.checkpoint.convert import convert_mcore_to_hf, run_conversion_cli

    return run_conversion_cli("convert_mcore_to_hf", convert_mcore_to_hf, args.mcore_dir,
                              args.out_dir, args.hf_config_dir,
                              int(args.max_shard_gb * 1024 ** 3), not args.no_progress)


if __name__ == "__main__":
    sys.exit(main())
