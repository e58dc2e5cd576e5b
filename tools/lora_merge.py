"""Merge a PEFT LoRA adapter into its HF base checkpoint: a plain HF checkpoint of the adapted
model (each adapted weight W + alpha / r x B A), for engines and tools without LoRA.

    python tools/lora_merge.py --adapter ADAPTER --hf-dir BASE --out-dir MERGED
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapter", required=True, help="a PEFT LoRA adapter directory")
    parser.add_argument("--hf-dir", required=True, help="the HF checkpoint it was trained on")
    parser.add_argument("--out-dir", required=True, help="HF output directory (written "
                        "atomically; refused if it exists and is not empty)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="start a new safetensors shard above this size")
    args = parser.parse_args(argv)
    from rlep_megatron.checkpoint.convert import run_conversion_cli
    from rlep_megatron.lora.convert import merge_adapter

    return run_conversion_cli("lora_merge", merge_adapter, args.adapter, args.hf_dir,
                              args.out_dir, int(args.max_shard_gb * 1024 ** 3))


if __name__ == "__main__":
    sys.exit(main())
