"""Separate rollout placement (one step off) against the colocated synchronous loop, and the
weight-update time of both, measured in one run on the same model, prompts and machine.

    python bench/separate_placement.py                       # 6 steps, 2 repeats per arm
    python bench/separate_placement.py --steps 8 --repeats 3
    python bench/separate_placement.py --weights-only        # only the weight-update table

Throughput, on part 1's ``long`` shape (``bench/async_rollout.py``: 16 prompts x G = 8,
responses up to 256 tokens with a long tail, an untrained tiny Llama), arms in alternating
order, each as an ``rlep train`` of its own:

* ``colocated-sync``: one process with 2 threads, ``trainer.max_staleness=0`` (generation, then
  old log-probs and training, on the same cores in turn);
* ``separate-1off``: ``torchrun --nproc-per-node=2``, 1 thread each: one trainer and one rollout
  rank whose vLLM server generates the next batch while the trainer trains
  (``rollout.placement=separate``, ``trainer.max_staleness=1``).

Per arm (steps after the first): seconds per step, generated tokens per second of wall time
(fresh tokens trained / step time), the trainer's idle share (waiting for its batch: rollout
time / step time) and the rollout side's (colocated: the time it does not generate; separate:
``timing/server_idle_frac``). The ratio is separate over colocated of the same repeat.

Weight updates: the seconds of one sync of the whole model into a colocated engine and into a
separate server (``rlep_gloo``), for the tiny model, a hidden-512 one and the largest that
fits here (``--sizes``), fp32, median of 3 syncs each. The CPU is printed with the tables;
nothing else should run meanwhile.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO_ROOT)

ARMS = ("colocated-sync", "separate-1off")


def run_arm(arm: str, overrides: list[str], out_dir: str, env: dict) -> None:
    config = os.path.join(REPO_ROOT, "examples", "tiny_cpu_baseline.yaml")
    args = ["train", "--config", config, *overrides, f"trainer.output_dir={out_dir}"]
    if arm == "colocated-sync":
        command = [sys.executable, "-m", "rlep_megatron.cli", *args,
                   "trainer.max_staleness=0"]
        env = dict(env, OMP_NUM_THREADS="2")
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node=2", "-m", "rlep_megatron.cli", *args,
                   "trainer.max_staleness=1", "rollout.placement=separate",
                   "rollout.num_ranks=1"]
        env = dict(env, OMP_NUM_THREADS="1")
    os.makedirs(out_dir, exist_ok=True)
    log = os.path.join(out_dir, "run.log")
    with open(log, "w") as f:
        proc = subprocess.run(command, env=env, cwd=REPO_ROOT, stdout=f,
                              stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"{arm} failed ({proc.returncode}); its output: {log}")


def summarise(arm: str, out_dir: str, group: int) -> dict:
    entries = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))][1:]
    seconds = sum(e["timing/step_s"] for e in entries)
    tokens = sum(e["rollout/response_len_mean"] * e["rollout/num_groups"] * group
                 for e in entries)
    trainer_idle = sum(e["timing/rollout_s"] for e in entries) / seconds
    if arm == "colocated-sync":
        rollout_idle = 1.0 - trainer_idle
    else:
        rollout_idle = statistics.fmean(e["timing/server_idle_frac"] for e in entries)
    return {"step_s": seconds / len(entries), "tokens_per_s": tokens / seconds,
            "trainer_idle": trainer_idle, "rollout_idle": rollout_idle,
            "stale_frac": statistics.fmean(e.get("rollout/staleness_frac/1", 0.0)
                                           for e in entries)}


WEIGHTS_PROGRAM = r"""
import json, statistics, sys, time
from rlep_megatron import distributed
from rlep_megatron.actor.model import build_from_hf
from rlep_megatron.checkpoint.hf_io import load_hf_config
from rlep_megatron.config import ParallelConfig, RolloutConfig
from rlep_megatron.models import layout_limits
from rlep_megatron.weight_sync import WeightStreamer, sync_weights
hf, where = sys.argv[1], sys.argv[2]
distributed.init_process_group()
cfg = RolloutConfig(num_samples_per_prompt=1, max_response_tokens=16)
if where == "colocated":
    from rlep_megatron.rollout import RolloutEngine
    engine = RolloutEngine(hf, cfg, dtype="float32", max_model_len=256, load_weights=False)
else:
    from rlep_megatron.rollout.servers.engine import ServerEngine
    from rlep_megatron.rollout.servers.launch import LocalServer
    server = LocalServer(hf, cfg, dtype="float32", max_model_len=256)
    engine = ServerEngine([server.wait_ready()], hf, cfg, watchdog=False)
distributed.init_model_parallel(ParallelConfig(), seed=0, **layout_limits(load_hf_config(hf)))
chunks, info = build_from_hf(hf, "float32")
streamer = WeightStreamer(chunks, info, cfg.weight_sync_bucket_bytes)
engine.plan_weights(streamer.plan())
times = [sync_weights(engine, streamer, i)["seconds"] for i in range(4)][1:]
nbytes = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
print("RESULT", json.dumps({"seconds": statistics.median(times), "bytes": nbytes}))
if where != "colocated":
    server.stop()
distributed.end_process(0)
"""


def sized_model(out_dir: str, hidden: int, layers: int) -> str:
    """A random Qwen2 of ``hidden`` width and ``layers`` layers (the tiny tokenizer)."""
    from rlep_megatron.tiny_model import make_tiny_model

    make_tiny_model(out_dir, seed=0, arch="qwen2")
    if hidden == 0:
        return out_dir
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out_dir)
    heads = max(4, hidden // 64)
    config.update({"hidden_size": hidden, "intermediate_size": 4 * hidden,
                   "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": max(1, heads // 4), "head_dim": hidden // heads})
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def weights_table(sizes: list[str], env: dict) -> list[tuple]:
    rows = []
    for size in sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        model = sized_model(tempfile.mkdtemp(prefix=f"sync_{size}_"), hidden, layers)
        result = {}
        for where in ("colocated", "separate"):
            proc = subprocess.run([sys.executable, "-c", WEIGHTS_PROGRAM, model, where],
                                  env=dict(env, OMP_NUM_THREADS="2"), cwd=REPO_ROOT,
                                  capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                raise SystemExit(f"weight sync {size} {where} failed:\n"
                                 f"{(proc.stdout + proc.stderr)[-3000:]}")
            result[where] = json.loads(line[0][len("RESULT "):])
        rows.append((size, result))
        print(f"weights {size}: {result}", flush=True)
    return rows


def main() -> None:
    from bench.async_rollout import cpu_name, prepare

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", default="0x0,512x8,1024x16,2048x24",
                        help="hidden x layers of each model of the weight-update table "
                             "(0x0: the tiny model)")
    parser.add_argument("--weights-only", action="store_true")
    args = parser.parse_args()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO_ROOT)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    if not args.weights_only:
        root = tempfile.mkdtemp(prefix="separate_bench_")
        overrides = ["data.train_batch_size=16", "rollout.num_samples_per_prompt=8",
                     "replay.num_replays_per_prompt=0", "trainer.validation_interval_steps=0",
                     "checkpoint.save_interval_steps=0", "trainer.loggers=[]",
                     "reward.num_workers=1", "algo.rollout_correction=truncate",
                     *prepare("long", root), f"trainer.total_steps={args.steps}"]
        for repeat in range(args.repeats):
            for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):
                out = os.path.join(root, f"{arm}-{repeat}")
                run_arm(arm, overrides, out, env)
                results[arm].append(summarise(arm, out, 8))
                print(f"{arm} repeat {repeat}: {results[arm][-1]}", flush=True)
    sizes = weights_table(args.sizes.split(","), env)
    print(f"\n{cpu_name()}")
    if not args.weights_only:
        print(f"long shape, {args.steps} steps per run (the first left out), "
              f"{args.repeats} repeats per arm; means over repeats")
        print("| arm | s/step | tokens/s | x colocated-sync | trainer idle | rollout idle | "
              "stale tokens |")
        print("|---|---|---|---|---|---|---|")
        for arm in ARMS:
            runs = results[arm]
            ratios = [r["tokens_per_s"] / b["tokens_per_s"]
                      for r, b in zip(runs, results["colocated-sync"])]

            def mean(key):
                return statistics.fmean(r[key] for r in runs)

            print(f"| {arm} | {mean('step_s'):.2f} | {mean('tokens_per_s'):.0f} | "
                  f"{statistics.fmean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{mean('trainer_idle'):.0%} | {mean('rollout_idle'):.0%} | "
                  f"{mean('stale_frac'):.0%} |")
    print("\n| model (hidden x layers) | fp32 MB | colocated sync s | separate (rlep_gloo) s |")
    print("|---|---|---|---|")
    for size, result in sizes:
        print(f"| {'tiny' if size == '0x0' else size} | "
              f"{result['colocated']['bytes'] / 1e6:.0f} | "
              f"{result['colocated']['seconds']:.3f} | {result['separate']['seconds']:.3f} |")


if __name__ == "__main__":
    main()
