"""The ``rlep`` console script.

Every subcommand takes ``--config FILE.yaml`` plus ``section.key=value`` overrides and runs under
``torchrun`` or alone as one rank. Subcommands:

* ``rlep config [--config F] [overrides...] [--keys | --reference]``: validate a recipe and
  print the resolved configuration as YAML (``--keys`` lists every valid ``section.key``,
  ``--reference`` documents each: type, default, meaning).
* ``rlep plan --config F [--nodes K --gpus-per-node N --gpu-mem-gib G] [--json]``: per-GPU
  memory of the recipe's actor, reference and vLLM engine, and the time per step at an assumed
  MFU, before launch (:mod:`rlep_megatron.plan`).
* ``rlep train --config F [overrides...]``: the RL loop (baseline DAPO/GRPO, or RLEP when
  ``replay.num_replays_per_prompt`` > 0); resumes from ``checkpoint.resume``.
* ``rlep collect --config F [overrides...]``: the experience pool from ``collect.checkpoint``.
* ``rlep eval --config F [overrides...]``: mean/maj/best/pass@k of ``eval.checkpoint``.
* ``rlep init RECIPE --model DIR --train F [--val F] [--nodes K --gpus-per-node N] [--pool P]``:
  a recipe for your own model and data from the shipped templates
  (:mod:`rlep_megatron.recipe_init`).
* ``rlep demo [--out-dir D] [--long] [--hard] [--seeds N] [--arms A,B] [--warm-start-seed S]
  [--jobs J] [--prepare-only]``: the whole RLEP pipeline on the tiny default, baseline vs RLEP over
  several seeds (J training runs at a time).

``init`` and ``plan`` size the job alike: ``--nodes`` x ``--gpus-per-node`` GPUs (1 x 1 by
default). The old ``--gpus`` (GPUs per node in ``init``, all GPUs in ``plan``) is refused with the
new spelling.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import yaml

from rlep_megatron import config as config_lib

logger = logging.getLogger(__name__)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML recipe (see examples/)")
    parser.add_argument("--log-all-ranks", action="store_true",
                        help="print logs of every rank, not only rank 0")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override any config key, e.g. trainer.total_steps=10")


class _RefusedGpus(argparse.Action):
    """``--gpus`` meant GPUs per node in ``rlep init`` and all GPUs in ``rlep plan``: refused,
    naming the spelling both now share."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is gone (it meant GPUs per node in `rlep init` and all "
                     "GPUs in `rlep plan`): give --nodes K --gpus-per-node N, e.g. --nodes 4 "
                     "--gpus-per-node 8 for 32 GPUs")


def _add_job_size(parser: argparse.ArgumentParser) -> None:
    """The job's size, spelled the same in ``rlep init`` and ``rlep plan`` (torchrun's
    ``--nnodes`` x ``--nproc-per-node``)."""
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=1,
                        help="GPUs per node, one process each (default 1); the world size is "
                             "nodes x GPUs per node")
    parser.add_argument("--gpus", action=_RefusedGpus, help=argparse.SUPPRESS)


def _add_verdict_size(parser: argparse.ArgumentParser) -> None:
    """``rlep config``'s optional job size: given, the planner's verdict for it too."""
    parser.add_argument("--nodes", type=int, default=None,
                        help="with --gpus-per-node (or alone): also the planner's verdict for "
                             "that job size (exit 2 when it does not fit)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node of the job (see --nodes)")


def _cmd_config(args: argparse.Namespace) -> int:
    from rlep_megatron.checks import preflight

    if args.keys:
        print("\n".join(config_lib.valid_keys()))
        return 0
    if args.reference:
        print(config_lib.config_reference())
        return 0
    cfg = config_lib.load_config(args.config, args.overrides)
    if not args.no_files:
        preflight(cfg, "config")  # what rlep train checks before it builds anything
    print(yaml.safe_dump(config_lib.config_to_dict(cfg), sort_keys=False), end="")
    if args.nodes is None and args.gpus_per_node is None:
        return 0
    # with the job's size: the planner's verdict too (`rlep plan` prints the whole plan)
    from rlep_megatron import plan

    nodes, per_node = args.nodes or 1, args.gpus_per_node or 1
    result = plan.plan(cfg, plan.load_model_config(cfg, None), nodes * per_node,
                       gpus_per_node=per_node)
    verdict = (f"rlep plan for {nodes} x {per_node} GPU(s), an estimate: "
               f"{'FITS' if result['fits'] else 'DOES NOT FIT'} (train peak "
               f"{result['peak_train_gib']:.1f} GiB, rollout peak "
               f"{result['peak_rollout_gib']:.1f} GiB of {result['gpu_mem_gib']:g})")
    print(verdict, file=sys.stderr)
    if not result["fits"]:
        print(f"rlep config: the recipe does not fit {nodes} x {per_node} GPU(s); `rlep plan "
              f"--config ... --nodes {nodes} --gpus-per-node {per_node}` shows the plan and "
              "the changes that would fit", file=sys.stderr)
        return 2
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from rlep_megatron import plan

    cfg = config_lib.load_config(args.config, args.overrides)
    hf_config = plan.load_model_config(cfg, args.hf_config)
    result = plan.plan(cfg, hf_config, args.nodes * args.gpus_per_node, args.gpu_mem_gib,
                       args.mfu, args.gpu,
                       spec="local" if args.local_spec else "te",
                       gpus_per_node=args.gpus_per_node)
    print(json.dumps(result, indent=1) if args.json else plan.format_plan(result))
    return 0


def _load_for_job(args: argparse.Namespace):
    """The run's config, and the device chosen before anything is built (no silent CPU
    fall-back on a GPU node: :func:`rlep_megatron.platform.choose_device`). Each job checks
    its config against the files it names first thing (:mod:`rlep_megatron.checks`)."""
    from rlep_megatron import platform

    cfg = config_lib.load_config(args.config, args.overrides)
    device = platform.choose_device(cfg.trainer.device)
    logger.info("device: %s (trainer.device=%s)", device, cfg.trainer.device)
    return cfg


def _served_as_rollout_rank(cfg) -> bool:
    """``rollout.placement=separate`` with ``rollout.num_ranks``: the job's last ranks run the
    vLLM servers (until the others are done) instead of the job; True on such a rank."""
    if cfg.rollout.placement != "separate" or not cfg.rollout.num_ranks:
        return False
    from rlep_megatron.distributed import split_rollout_ranks

    index = split_rollout_ranks(cfg.rollout.num_ranks)
    if index is None:
        return False
    from rlep_megatron.rollout.servers.launch import serve_rollout_rank

    serve_rollout_rank(cfg, index)
    return True


def _cmd_train(args: argparse.Namespace) -> int:
    from rlep_megatron.trainer import run_train

    cfg = _load_for_job(args)
    if _served_as_rollout_rank(cfg):
        return 0
    out = run_train(cfg, process_ending=args.process_ends)
    logger.info("training finished: %s", out)
    return 0


def _cmd_collect(args: argparse.Namespace) -> int:
    from rlep_megatron.collect import run_collect

    cfg = _load_for_job(args)
    if _served_as_rollout_rank(cfg):
        return 0
    run_collect(cfg, process_ending=args.process_ends)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rlep_megatron.evaluate import run_eval

    cfg = _load_for_job(args)
    if _served_as_rollout_rank(cfg):
        return 0
    run_eval(cfg, process_ending=args.process_ends)
    return 0


def _cmd_init(args: argparse.Namespace) -> int:
    from rlep_megatron.recipe_init import write_recipe

    write_recipe(args.recipe, args.model, args.train, args.val, gpus=args.gpus_per_node,
                 nodes=args.nodes, pool=args.pool, output_dir=args.output_dir, force=args.force,
                 reward_function=args.reward_function, rollout_nodes=args.rollout_nodes,
                 rollout_servers=tuple(args.rollout_servers))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlep_megatron.demo import run_demo

    out_dir = args.out_dir or ("outputs/tiny_hard" if args.hard else "outputs/tiny")
    run_demo(out_dir, long=args.long, nproc=args.nproc, seeds=args.seeds,
             overrides=args.overrides, warm_start_seed=args.warm_start_seed,
             prepare_only=args.prepare_only, jobs=args.jobs, hard=args.hard,
             arms=[a for a in args.arms.split(",") if a] if args.arms else None)
    return 0


EXAMPLES = """examples:
  rlep demo                                               # the whole pipeline, tiny, on CPU
  rlep config --config examples/rlep.yaml                 # check a recipe, print it resolved
  rlep config --keys                                      # every section.key
  rlep init my.yaml --model models/M --train data/train.parquet --nodes 1 --gpus-per-node 8
  rlep plan --config my.yaml --nodes 1 --gpus-per-node 8       # memory per GPU, before launch
  rlep train --config examples/tiny_cpu_baseline.yaml trainer.total_steps=10
  rlep collect --config examples/tiny_cpu_rlep.yaml collect.checkpoint=RUN_DIR   # newest checkpoint
  rlep eval --config examples/tiny_cpu_rlep.yaml eval.checkpoint=RUN_DIR/checkpoints/step_00000040
  torchrun --nproc-per-node 8 -m rlep_megatron.cli train --config examples/rlep.yaml
"""


def _add_demo_parser(sub) -> None:
    p_demo = sub.add_parser("demo", help="the whole RLEP pipeline on the tiny default (CPU)")
    p_demo.add_argument("--out-dir", default=None,
                        help="work directory (default outputs/tiny, with --hard "
                             "outputs/tiny_hard)")
    p_demo.add_argument("--long", action="store_true",
                        help="a longer budget (more steps and seeds) than the quick default")
    p_demo.add_argument("--seeds", type=int, default=None,
                        help="training seeds per arm (default: 4 quick, 8 with --long)")
    p_demo.add_argument("--hard", action="store_true",
                        help="the hard miniature: a warm start that seldom samples the right "
                             "answer, its pool from a baseline run twice as long as the arms "
                             "(docs/demo.md)")
    p_demo.add_argument("--warm-start-seed", type=int, default=0,
                        help="seed of the tiny model's initial weights and warm start (the "
                             "task stays the same); another seed needs another --out-dir")
    p_demo.add_argument("--arms", default="",
                        help="comma-separated arms (default baseline,rlep): baseline, rlep "
                             "(the paper's protocol: (G + M) / G times the baseline's "
                             "optimizer steps), rlep_equal (replays, as many optimizer steps "
                             "as the baseline), online (online experience replay), "
                             "one_step_off (the baseline with trainer.max_staleness=1), "
                             "separate (the same with a vLLM server of its own, one more "
                             "process), low_pass, rescue and unlikely (rlep with that "
                             "replay.policy), "
                             "gspo, cispo and dr_grpo (the baseline with that loss)")
    p_demo.add_argument("--prepare-only", action="store_true",
                        help="build the task and the warm-started model, then stop (for "
                             "running the phases by hand, docs/quickstart.md)")
    p_demo.add_argument("--nproc", type=int, default=1, help="torchrun ranks per phase")
    p_demo.add_argument("--jobs", type=int, default=None,
                        help="training runs at a time, each with its share of the cores "
                             "(default: one per core, at most 4; 1: one run at a time with "
                             "torch's default threads)")
    p_demo.add_argument("--log-all-ranks", action="store_true")
    p_demo.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="overrides applied to every run of every arm")
    p_demo.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlep", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Megatron-core RL with verifiable rewards and experience replay (RLEP).",
        epilog=EXAMPLES)
    sub = parser.add_subparsers(dest="command", required=True)
    p_config = sub.add_parser("config", help="validate a recipe and print the resolved config")
    _add_common(p_config)
    p_config.add_argument("--keys", action="store_true", help="list every valid section.key")
    p_config.add_argument("--reference", action="store_true",
                          help="print every key with its type, default and documentation")
    p_config.add_argument("--no-files", action="store_true",
                          help="check the recipe alone, not the model and files it names")
    _add_verdict_size(p_config)
    p_config.set_defaults(func=_cmd_config)
    p_plan = sub.add_parser("plan", help="per-GPU memory and step time of a recipe, before "
                            "launch (no GPU needed)")
    _add_common(p_plan)
    _add_job_size(p_plan)
    p_plan.add_argument("--gpu-mem-gib", type=float, default=None,
                        help="usable memory of one GPU in GiB (default: the card's; H100 79.6, "
                             "H200 139)")
    p_plan.add_argument("--gpu", default="h100",
                        help="h100, h200 or a100: peak bf16 FLOP/s and usable memory")
    p_plan.add_argument("--mfu", type=float, default=0.3,
                        help="assumed model FLOPs utilisation for the time per step")
    p_plan.add_argument("--hf-config", default=None,
                        help="the model's config.json (default: model.hf_dir/config.json)")
    p_plan.add_argument("--local-spec", action="store_true",
                        help="activations of megatron-core's local layer spec (CPU, GPUs "
                             "without TransformerEngine) instead of TransformerEngine's")
    p_plan.add_argument("--json", action="store_true",
                        help="one JSON object (keys: docs/memory.md)")
    p_plan.set_defaults(func=_cmd_plan)
    p_train = sub.add_parser("train", help="run RL training (baseline or RLEP)")
    _add_common(p_train)
    p_train.set_defaults(func=_cmd_train)
    p_collect = sub.add_parser("collect", help="collect an experience pool from a checkpoint")
    _add_common(p_collect)
    p_collect.set_defaults(func=_cmd_collect)
    p_eval = sub.add_parser("eval", help="evaluate a checkpoint (mean/maj/best/pass@k)")
    _add_common(p_eval)
    p_eval.set_defaults(func=_cmd_eval)
    p_init = sub.add_parser("init", help="write a recipe for your own model and data from the "
                                         "shipped templates")
    p_init.add_argument("recipe", help="the YAML recipe to write")
    p_init.add_argument("--model", required=True, help="HF model directory (config.json, "
                        "tokenizer, safetensors)")
    p_init.add_argument("--train", nargs="+", required=True, metavar="PARQUET",
                        help="training files (DAPO schema; tools/prepare_data.py makes them)")
    p_init.add_argument("--val", nargs="*", default=[], metavar="PARQUET",
                        help="validation files")
    _add_job_size(p_init)
    p_init.add_argument("--pool", default="", help="an experience pool (`rlep collect`): an "
                        "RLEP recipe with M = 2 replays; without it a baseline (M = 0)")
    p_init.add_argument("--output-dir", default="", help="trainer.output_dir of the recipe "
                        "(default: outputs/<the recipe's file name without .yaml>)")
    p_init.add_argument("--reward-function", default="", metavar="MODULE:FN|FILE.py:FN",
                        help="reward.function of the recipe: your own reward for every row "
                             "(docs/data-and-rewards.md); default: the rules chosen by each "
                             "row's data_source")
    p_init.add_argument("--rollout-nodes", type=int, default=0, metavar="M",
                        help="M more nodes that only generate (rollout.placement=separate, "
                             "one vLLM server per GPU), one step off; --nodes counts the "
                             "training nodes")
    p_init.add_argument("--rollout-servers", nargs="+", default=[], metavar="URL",
                        help="generate on running vLLM servers instead (rollout.server_urls); "
                             "prints the command to start them")
    p_init.add_argument("--force", action="store_true", help="replace an existing recipe file")
    p_init.set_defaults(func=_cmd_init)
    _add_demo_parser(sub)
    return parser


_ENGINE_JOBS = ("train", "collect", "eval")


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand. In a job of several ranks, a failure on any rank ends that process at
    once with its error printed (no clean-up that waits for the other ranks, which may be
    blocked in a collective): torchrun then stops the other ranks, and ranks launched
    otherwise see their peer's connection close and fail the same way. Without ``argv`` (the
    ``rlep`` program itself), a train/collect/eval that finished ends the process at once,
    after its files are written and closed, without returning; with ``argv`` every job
    returns its exit code and releases its engine and process group."""
    # torch, megatron and vLLM are imported by the subcommands, not by this module: processes
    # started with ``spawn`` (the reward scorer's workers) import the main module again, and
    # should not pay for torch
    from rlep_megatron.distributed import setup_logging

    args = build_parser().parse_args(argv)
    # run as a program (console script, python -m): a job that finished ends its process at
    # once, its files written and closed; called with argv (in-process), it releases everything
    args.process_ends = argv is None
    setup_logging(log_all_ranks=getattr(args, "log_all_ranks", False))
    if args.command in _ENGINE_JOBS:
        # no full garbage collections over the import-time heap while the job starts; resumed
        # once the heap is frozen, before the rollout engine is built (platform/heap.py)
        from rlep_megatron.platform.heap import pause_gc_for_startup

        pause_gc_for_startup()
    try:
        code = _run_job(args)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's teardown
        return code
    except BrokenPipeError:
        # the reader of our output stopped early (`rlep plan --json | head`): not an error;
        # stdout goes to /dev/null so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        if args.command in _ENGINE_JOBS:
            from rlep_megatron.platform.heap import resume_gc

            resume_gc()  # a job that ended before its engine was built


def _run_job(args: argparse.Namespace) -> int:
    from rlep_megatron.distributed import exit_now_if_multi_rank, get_rank, in_multi_rank_job
    from rlep_megatron.platform import DeviceError

    try:
        code = args.func(args)
        if code == 0 and args.process_ends and args.command in _ENGINE_JOBS:
            # the engine and the process group were left running: skip vLLM's shutdown and
            # the interpreter's teardown (several full garbage collections over a large heap)
            from rlep_megatron.distributed import end_process

            end_process(0)
        return code
    except (ValueError, FileNotFoundError, FileExistsError, DeviceError) as err:
        # once per process (an error on one rank only must still be seen)
        where = f" (rank {get_rank()})" if in_multi_rank_job() else ""
        print(f"rlep {args.command}{where}: error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        logger.error("rlep %s interrupted on rank %d", args.command, get_rank())
        code = 130
    except Exception:
        if not in_multi_rank_job():
            raise
        logger.exception("rlep %s failed on rank %d", args.command, get_rank())
        code = 1
    exit_now_if_multi_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
