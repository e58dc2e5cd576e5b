"""Write the tiny default task: integer addition/subtraction questions in the DAPO schema
(train.parquet, val.parquet, train_solutions.jsonl). Same seed -> same files.

    python tools/make_tiny_task.py --out-dir outputs/tiny/task [--seed 0] [--num-train 2000]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlep_megatron.tiny_task import make_tiny_task  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=800)
    parser.add_argument("--num-val", type=int, default=64)
    parser.add_argument("--max-operand", type=int, default=20)
    args = parser.parse_args()
    paths = make_tiny_task(args.out_dir, args.seed, args.num_train, args.num_val,
                           args.max_operand)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
