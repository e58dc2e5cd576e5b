"""Build a tiny HF checkpoint (safetensors, config, generation config, own byte-level tokenizer
with a chat template) offline. Same seed -> identical files.

    python tools/make_tiny_model.py --out-dir models/tiny-qwen2 [--seed 0] [--arch qwen2|llama]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlep_megatron.tiny_model import SUPPORTED_ARCHS, make_tiny_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True, help="directory to write (replaced if present)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument("--arch", choices=SUPPORTED_ARCHS, default="qwen2")
    args = parser.parse_args()
    make_tiny_model(args.out_dir, seed=args.seed, arch=args.arch)
    print(f"wrote tiny {args.arch} checkpoint to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
