"""Build a tiny HF checkpoint (safetensors, config, generation config, own byte-level tokenizer
with a chat template) offline. Same seed -> identical files.

    python tools/make_tiny_model.py --out-dir models/tiny-qwen2 [--seed 0] [--arch qwen2|qwen3|qwen3_moe|llama]
    python tools/make_tiny_model.py --out-dir outputs/tiny/model --task-dir outputs/tiny/task \
        --pretrain-steps 2500     # warm start on the task's train_solutions.jsonl (the demo's)
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
    parser.add_argument("--task-dir", default=None,
                        help="tiny task directory (tools/make_tiny_task.py) for --pretrain-steps")
    parser.add_argument("--pretrain-steps", type=int, default=0,
                        help="supervised warm-start steps on the task's reference solutions")
    parser.add_argument("--pretrain-lr", type=float, default=None,
                        help="peak learning rate of the warm start (warm-up, then cosine "
                             "decay); default: rlep_megatron.tiny_task.warm_start's")
    args = parser.parse_args()
    if args.pretrain_steps and not args.task_dir:
        parser.error("--pretrain-steps needs --task-dir")
    make_tiny_model(args.out_dir, seed=args.seed, arch=args.arch)
    print(f"wrote tiny {args.arch} checkpoint to {args.out_dir}")
    if args.pretrain_steps:
        from rlep_megatron.tiny_task import warm_start

        lr = {} if args.pretrain_lr is None else {"lr": args.pretrain_lr}
        result = warm_start(args.out_dir, os.path.join(args.task_dir, "train_solutions.jsonl"),
                            args.pretrain_steps, seed=args.seed,
                            eval_parquet=os.path.join(args.task_dir, "val.parquet"), **lr)
        print(f"warm start: {args.pretrain_steps} steps, final loss {result['loss']:.3f}, "
              f"greedy accuracy on val.parquet {100 * result['accuracy']:.1f}% "
              f"(recorded in {os.path.join(args.out_dir, 'warm_start.json')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
