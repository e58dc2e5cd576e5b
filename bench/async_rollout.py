"""Synchronous vs one-step-off rollout, measured in one run on the same model and prompts.

    python bench/async_rollout.py                  # both shapes, 2 repeats of each arm
    python bench/async_rollout.py --shape long --steps 8 --repeats 3

Two shapes, each run as ``rlep train`` on one rank (fp32, tiny Qwen2 or Llama), arms in
alternating order, each arm in a process of its own:

* ``tiny``: the tiny default's shape (16 prompts x G = 8, responses up to 64 tokens, 8
  optimizer steps of 16 sequences), on the tiny model warm-started on the demo's task, whose
  answers end by themselves at uneven lengths;
* ``long``: long, uneven responses (up to 256 tokens): 16 prompts x G = 8, 2 optimizer steps,
  on an untrained tiny Llama whose head gives the end-of-sequence token a small chance per
  token by construction (measured: see the table), so lengths are roughly geometric with a
  long tail to the budget.

Arms:

* ``sync``: ``trainer.max_staleness=0``, the default path (one blocking generate per step);
* ``sync-requests``: the same synchronous schedule through the request-level engine driver
  (``AheadScheduler`` with ``max_staleness=0``), so the long tail's share can be measured;
* ``one-step-off``: ``trainer.max_staleness=1``.

Per arm (steps after the first, which includes start-up effects): seconds per step, generated
tokens per second of wall time (fresh tokens trained / step time), the share of the engine's
time spent with at most a quarter of its peak number of requests running (request-level arms
only), and the staleness histogram of the trained fresh tokens. Ratios are one-step-off over
``sync`` and over ``sync-requests`` of the same repeat; the table gives their mean and range
over repeats. The CPU is printed with it; nothing else should run meanwhile.
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

ARMS = ("sync", "sync-requests", "one-step-off")
COMMON = ["data.train_batch_size=16", "rollout.num_samples_per_prompt=8",
          "trainer.mini_batch_size=2", "replay.num_replays_per_prompt=0",
          "trainer.validation_interval_steps=0", "checkpoint.save_interval_steps=0",
          "trainer.loggers=[]", "reward.num_workers=1", "algo.rollout_correction=truncate"]


def cpu_name() -> str:
    from bench.step_floors import cpu_name as name

    return name()


def uneven_model(out_dir: str, stop_prob: float = 0.0033) -> str:
    """An untrained tiny Llama (untied head) whose end-of-sequence logit is lifted so that,
    with the other logits near 0 (N(0, 0.02) weights), it is sampled with probability about
    ``stop_prob`` per token: its head row for EOS points along the mean final hidden state."""
    import math

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from rlep_megatron.tiny_model import make_tiny_model

    make_tiny_model(out_dir, seed=0, arch="llama")
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (8, 128), generator=generator)
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state.reshape(-1, model.config.hidden_size)
    mean = hidden.mean(dim=0)
    vocab = model.config.vocab_size
    target = math.log(stop_prob * (vocab - 1) / (1 - stop_prob))
    path = os.path.join(out_dir, "model.safetensors")
    weights = load_file(path)
    head = weights["lm_head.weight"].clone()
    head[model.config.eos_token_id] = target * mean / mean.dot(mean)
    weights["lm_head.weight"] = head
    save_file(weights, path, metadata={"format": "pt"})
    return out_dir


def warm_model(out_dir: str, task: dict) -> str:
    from rlep_megatron.tiny_model import make_tiny_model
    from rlep_megatron.tiny_task import warm_start

    make_tiny_model(out_dir, seed=0, arch="qwen2")
    warm_start(out_dir, task["solutions"], steps=1200, lr=3e-3, seed=0, show_progress=False)
    return out_dir


def prepare(shape: str, root: str) -> list[str]:
    """The overrides of a shape (model and data made under ``root``)."""
    from rlep_megatron.tiny_task import make_tiny_task

    task = make_tiny_task(os.path.join(root, "task"), seed=0, num_train=160, num_val=16,
                          max_operand=9, num_slips_easy=1, num_slips_hard=1)
    data = [f"data.train_files=[{task['train']}]", "data.val_files=[]"]
    if shape == "tiny":
        model = warm_model(os.path.join(root, "model"), task)
        return [f"model.hf_dir={model}", *data, "rollout.max_response_tokens=64",
                "reward.overlong_buffer_tokens=8"]
    model = uneven_model(os.path.join(root, "model"))
    return [f"model.hf_dir={model}", *data, "rollout.max_response_tokens=256",
            "reward.overlong_buffer_tokens=0", "trainer.mini_batch_size=8"]


def run_arm(arm: str, overrides: list[str], out_dir: str) -> None:
    """One arm in this process (``--arm``): the trainer, its scheduler swapped for the
    request-level one in ``sync-requests``."""
    from rlep_megatron.config import load_config
    from rlep_megatron.rollout.scheduler import AheadScheduler
    from rlep_megatron.trainer import run_train, Trainer

    staleness = 1 if arm == "one-step-off" else 0
    cfg = load_config(os.path.join(REPO_ROOT, "examples", "tiny_cpu_baseline.yaml"),
                      [*overrides, f"trainer.output_dir={out_dir}",
                       f"trainer.max_staleness={staleness}"])
    if arm != "sync-requests":
        run_train(cfg)
        return
    trainer = Trainer(cfg)
    trainer.scheduler = trainer.rollout.scheduler = AheadScheduler(
        trainer.engine, cfg, trainer.ends_at_checkpoint, max_staleness=0)
    trainer.run()
    trainer.close()


def summarise(out_dir: str) -> dict:
    entries = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))][1:]
    seconds = sum(e["timing/step_s"] for e in entries)
    tokens = sum(e["rollout/response_len_mean"] * e["rollout/num_groups"] * 8 for e in entries)
    tail = [e["rollout/long_tail_time_frac"] for e in entries
            if "rollout/long_tail_time_frac" in e]
    stale = [e.get("rollout/staleness_frac/1", 0.0) for e in entries]
    return {"step_s": seconds / len(entries), "tokens_per_s": tokens / seconds,
            "rollout_s": statistics.fmean(e["timing/rollout_s"] for e in entries),
            "train_s": statistics.fmean(e["timing/old_logprob_s"] + e["timing/train_s"]
                                        for e in entries),
            "response_len": statistics.fmean(e["rollout/response_len_mean"] for e in entries),
            "tail_frac": statistics.fmean(tail) if tail else float("nan"),
            "stale_frac": statistics.fmean(stale)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("tiny", "long", "both"), default="both")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        run_arm(args.arm, args.overrides, args.out_dir)
        return
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO_ROOT)
    rows = []
    for shape in (("tiny", "long") if args.shape == "both" else (args.shape,)):
        root = tempfile.mkdtemp(prefix=f"async_bench_{shape}_")
        overrides = [*COMMON, *prepare(shape, root), f"trainer.total_steps={args.steps}"]
        results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for repeat in range(args.repeats):
            order = ARMS if repeat % 2 == 0 else ARMS[::-1]
            for arm in order:
                out = os.path.join(root, f"{arm}-{repeat}")
                subprocess.run([sys.executable, __file__, "--arm", arm, "--out-dir", out,
                                *overrides], check=True, env=env, cwd=REPO_ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results[arm].append(summarise(out))
                print(f"{shape} {arm} repeat {repeat}: {results[arm][-1]}", flush=True)
        rows.append((shape, results))
    print(f"\n{cpu_name()}; {args.steps} steps per run (the first left out), {args.repeats} "
          "repeats per arm; means over repeats")
    print("| shape | arm | s/step | rollout s | old log-prob + train s | response len | "
          "tokens/s | x sync | x sync-requests | long-tail time | stale tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, results in rows:
        for arm in ARMS:
            runs = results[arm]

            def mean(key):
                return statistics.fmean(r[key] for r in runs)

            ratios = []
            for base in ("sync", "sync-requests"):
                values = [r["tokens_per_s"] / b["tokens_per_s"]
                          for r, b in zip(runs, results[base])]
                ratios.append(f"{statistics.fmean(values):.2f} "
                              f"({min(values):.2f}-{max(values):.2f})")
            tail = mean("tail_frac")
            print(f"| {shape} | {arm} | {mean('step_s'):.2f} | {mean('rollout_s'):.2f} | "
                  f"{mean('train_s'):.2f} | {mean('response_len'):.0f} | "
                  f"{mean('tokens_per_s'):.0f} | {ratios[0]} | {ratios[1]} | "
                  f"{'-' if tail != tail else f'{tail:.0%}'} | {mean('stale_frac'):.0%} |")


if __name__ == "__main__":
    main()
