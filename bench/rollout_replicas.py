"""Rollout replicas side by side: does a replica wait for another?

    torchrun --nproc-per-node 2 bench/rollout_replicas.py [--repeats 3] [--long-prompt 400]

Two rollout replicas (rollout TP 1 on 2 ranks) sample one batch whose prompts differ a lot in
length: the first ``--long`` prompts have ``--long-prompt`` tokens, the rest
``--short-prompt``. Each replica gets a contiguous share of the batch (as the engine splits
it), so one replica holds the long prompts. For every repeat, rank 0 prints per replica its
prompts, prompt and generated tokens, its own sampling time (its ``llm.generate`` call alone)
and the dummy batches its engine ran (engine steps without requests, which vLLM runs only when
replicas are coupled as one data-parallel world), then the wall time of the whole rollout
phase (``RolloutEngine.generate``: sampling plus the gather of every response to every rank)
and its ratio to the slower replica's own time. Independent replicas: no dummy batches and a
ratio near 1. The tiny model of the project's maker (random weights), so responses run to
``--max-tokens`` or stop at a sampled EOS; works on CPU (gloo) and GPU.
"""
import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--long", type=int, default=4, help="how many prompts are long")
    parser.add_argument("--long-prompt", type=int, default=400)
    parser.add_argument("--short-prompt", type=int, default=10)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from rlep_megatron import distributed
    from rlep_megatron.config import RolloutConfig
    from rlep_megatron.rollout import RolloutEngine
    from rlep_megatron.tiny_model import make_tiny_model

    distributed.init_process_group()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_dir = os.path.join(tempfile.gettempdir(), f"rlep-bench-replicas-{os.getuid()}")
    if rank == 0 and not os.path.isfile(os.path.join(model_dir, "config.json")):
        make_tiny_model(model_dir, seed=0)
    distributed.barrier()
    engine = RolloutEngine(model_dir, RolloutConfig(tensor_model_parallel_size=1), seed=0,
                           max_model_len=args.long_prompt + args.max_tokens + 8)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.long_prompt if i < args.long else args.short_prompt,),
                             generator=generator).tolist() for i in range(args.prompts)]

    # this replica's own sampling time and dummy batches, measured around vLLM itself (the
    # same on any version of the engine)
    own = {"seconds": 0.0, "dummy": 0}
    llm_generate = engine.llm.generate

    def timed_generate(*a, **k):
        started = time.perf_counter()
        try:
            return llm_generate(*a, **k)
        finally:
            own["seconds"] += time.perf_counter() - started

    engine.llm.generate = timed_generate
    core = engine.llm.llm_engine.engine_core
    dummy = core.execute_dummy_batch

    def counted_dummy(*a, **k):
        own["dummy"] += 1
        return dummy(*a, **k)

    core.execute_dummy_batch = counted_dummy

    engine.generate(prompts, n=args.n, max_tokens=args.max_tokens, seed=99)  # warm-up
    rows = []
    for repeat in range(args.repeats):
        own.update(seconds=0.0, dummy=0)
        torch.distributed.barrier()
        started = time.perf_counter()
        groups = engine.generate(prompts, n=args.n, max_tokens=args.max_tokens, seed=repeat)
        phase = time.perf_counter() - started
        try:
            indices = list(engine.share(prompts, args.n, args.max_tokens))
        except TypeError:  # an engine that split by prompt count
            indices = list(engine.share(len(prompts)))
        local = {"replica": engine.dp_rank, "prompts": len(indices),
                 "prompt_tokens": sum(len(prompts[i]) for i in indices),
                 "generated": sum(len(r.token_ids) for i in indices for r in groups[i]),
                 "own_s": own["seconds"], "dummy_batches": own["dummy"]}
        everyone = distributed.all_gather_object(local)
        phases = distributed.all_gather_object(phase)
        assert len(groups) == len(prompts)
        rows.append({"repeat": repeat, "replicas": everyone, "phase_s": max(phases)})
    if rank == 0:
        print(f"# {world} replicas (rollout TP 1), {args.prompts} prompts x {args.n} samples, "
              f"{args.long} of {args.long_prompt} tokens, the rest {args.short_prompt}, "
              f"max {args.max_tokens} new tokens; torch {torch.__version__}")
        print("| repeat | replica | prompts | prompt tokens | generated | own sampling s | "
              "dummy batches | rollout phase s | phase / slower replica |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            slowest = max(r["own_s"] for r in row["replicas"])
            for r in row["replicas"]:
                print(f"| {row['repeat']} | {r['replica']} | {r['prompts']} | "
                      f"{r['prompt_tokens']} | {r['generated']} | {r['own_s']:.3f} | "
                      f"{r['dummy_batches']} | {row['phase_s']:.3f} | "
                      f"{row['phase_s'] / slowest:.3f} |")
        print(json.dumps(rows))
    torch.distributed.barrier()
    engine.shutdown()
    distributed.destroy()


if __name__ == "__main__":
    main()
