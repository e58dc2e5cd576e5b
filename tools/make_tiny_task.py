"""Write a tiny task in the DAPO schema (train.parquet, val.parquet, and the warm-start corpus
train_solutions.jsonl; see rlep_megatron/tiny_task.py). Same arguments -> same files.

    python tools/make_tiny_task.py --out-dir outputs/tiny/task [--kind arith|column|max] \\
        [--seed 0] [--num-train 800] [--num-rl-train 128] [--num-val 64] [--max-operand 20] \\
        [--num-slips-easy 1 --num-slips-hard 2] [--stepwise-fraction 0.25]

The demo's task (``rlep_megatron.demo.TASK``) is
``--kind column --num-train 3000 --num-rl-train 128 --num-val 64 --max-operand 99
--num-slips-easy 1 --num-slips-hard 2 --stepwise-fraction 0.25``.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rlep_megatron.tiny_task import TASK_KINDS, make_tiny_task  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-train", type=int, default=800,
                        help="questions of the warm-start corpus")
    parser.add_argument("--num-rl-train", type=int, default=None,
                        help="RL training questions of their own, apart from the corpus' "
                             "(default: the corpus' questions)")
    parser.add_argument("--num-val", type=int, default=64)
    parser.add_argument("--max-operand", type=int, default=20,
                        help="arith / column operands 0..N")
    parser.add_argument("--kind", choices=sorted(TASK_KINDS), default="arith")
    parser.add_argument("--num-slips-easy", type=int, default=0,
                        help="slipped (wrong) solutions per easy question in the corpus")
    parser.add_argument("--num-slips-hard", type=int, default=0,
                        help="slipped (wrong) solutions per hard question in the corpus")
    parser.add_argument("--stepwise-fraction", type=float, default=0.0,
                        help="column: share of corpus questions solved column by column "
                             "(always right) instead of directly (with the slips)")
    args = parser.parse_args()
    paths = make_tiny_task(args.out_dir, args.seed, args.num_train, args.num_val,
                           args.max_operand, kind=args.kind,
                           num_slips_easy=args.num_slips_easy,
                           num_slips_hard=args.num_slips_hard,
                           num_rl_train=args.num_rl_train,
                           stepwise_fraction=args.stepwise_fraction)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
