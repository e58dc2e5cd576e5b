"""Generation speed of the two rollout backends on CPU: vLLM-CPU (``rollout.backend=vllm``,
colocated) against the actor's own megatron-core model (``rollout.backend=megatron``).

    python bench/rollout_backends.py                     # the tiny default and the mid shape
    python bench/rollout_backends.py --shapes tiny --rounds 3

Shapes (random weights, float32, the tiny tokenizer's 320-token vocabulary):

* ``tiny``: the tiny default model (hidden 128, 4 layers), the demo's model before its warm
  start;
* ``mid``: Qwen2.5-0.5B's transformer (hidden 896, 24 layers, 14 / 2 heads, MLP 4864), 0.36B
  parameters.

The workload is one step's rollout of the tiny recipe: 16 prompts of the tiny task x 8 samples
at temperature 1, up to ``--max-tokens`` (default 64) new tokens each. Each backend runs in a
process of its own (one rank), builds its engine (timed: vLLM starts an engine and loads the
weights; the megatron backend builds the actor, which a training run has anyway), generates
once untimed, then ``--repeats`` times with other seeds, timed; the processes alternate,
``--rounds`` times. Printed: per shape and backend the median engine start, the median seconds
of one rollout, generated tokens per second, and megatron / vLLM of the rollout time, per
round. A training step with vLLM also streams the weights into the engine (``timing/
weight_sync_s``), which the megatron backend does not: not counted here.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

PROMPTS, SAMPLES = 16, 8


def model_dir(shape: str) -> str:
    from rlep_megatron.tiny_model import TinyModelShape, make_tiny_model

    path = os.path.join(tempfile.gettempdir(), f"rlep-bench-backends-{shape}-{os.getuid()}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny_model(path, seed=0, shape=TinyModelShape() if shape == "tiny" else
                        TinyModelShape(hidden_size=896, num_layers=24, num_attention_heads=14,
                                       num_key_value_heads=2, head_dim=64,
                                       intermediate_size=4864))
    return path


def child(backend: str, path: str, max_tokens: int, repeats: int) -> dict:
    import torch

    from rlep_megatron import distributed
    from rlep_megatron.config import RolloutConfig
    from rlep_megatron.data.prompts import tokenize_prompt
    from rlep_megatron.tiny_task import make_tiny_task
    from rlep_megatron.data.schema import read_prompt_file

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29000 + os.getpid() % 1000))
    cfg = RolloutConfig(backend=backend, num_samples_per_prompt=SAMPLES,
                        max_response_tokens=max_tokens)
    started = time.perf_counter()
    if backend == "vllm":
        from rlep_megatron.rollout.colocated.engine import RolloutEngine

        distributed.init_process_group()
        engine = RolloutEngine(path, cfg, dtype="float32", seed=0, max_model_len=512)
    else:
        from rlep_megatron.actor.model import build_from_hf
        from rlep_megatron.checkpoint.hf_io import load_hf_config
        from rlep_megatron.config import ParallelConfig
        from rlep_megatron.models import layout_limits
        from rlep_megatron.rollout.megatron.engine import MegatronEngine

        distributed.init_model_parallel(ParallelConfig(), seed=0,
                                        **layout_limits(load_hf_config(path)))
        chunks, info = build_from_hf(path, "float32")
        engine = MegatronEngine(chunks, info, path, cfg, max_model_len=512, batch_size=64)
    start_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as task_dir:
        task = make_tiny_task(task_dir, seed=0, num_train=PROMPTS, num_val=2)
        rows = read_prompt_file(task["train"])
    tokenizer = engine.get_tokenizer()
    prompts = [tokenize_prompt(tokenizer, rows.messages[r], 128).token_ids
               for r in range(len(rows))]
    engine.generate(prompts, seed=0)  # untimed
    times, tokens = [], []
    for repeat in range(repeats):
        t = time.perf_counter()
        groups = engine.generate(prompts, seed=repeat + 1)
        times.append(time.perf_counter() - t)
        tokens.append(sum(r.length for g in groups for r in g))
    del torch
    return {"start_s": start_s, "times": times, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,mid")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "MODEL_DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1], args.max_tokens,
                                           args.repeats)))
        return
    print("| shape | backend | engine start (s) | one rollout (s) | tokens/s | megatron / vLLM "
          "rollout time |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        path = model_dir(shape)
        results = {"vllm": [], "megatron": []}
        for round_ in range(args.rounds):
            order = ("vllm", "megatron") if round_ % 2 == 0 else ("megatron", "vllm")
            for backend in order:
                proc = subprocess.run([sys.executable, __file__, "--child", backend, path,
                                       "--max-tokens", str(args.max_tokens),
                                       "--repeats", str(args.repeats)],
                                      capture_output=True, text=True, cwd=ROOT)
                line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
                if proc.returncode != 0 or not line:
                    raise SystemExit(f"{shape} {backend} failed:\n{proc.stderr[-3000:]}")
                results[backend].append(json.loads(line[0][7:]))
        ratios = [statistics.median(m["times"]) / statistics.median(v["times"])
                  for m, v in zip(results["megatron"], results["vllm"])]
        for backend, runs in results.items():
            times = [t for r in runs for t in r["times"]]
            tokens = [n for r in runs for n in r["tokens"]]
            print(f"| {shape} | {backend} | {statistics.median(r['start_s'] for r in runs):.1f} "
                  f"| {statistics.median(times):.2f} | {sum(tokens) / sum(times):,.0f} | "
                  + (", ".join(f"{x:.2f}" for x in ratios) if backend == "megatron" else "")
                  + " |", flush=True)


if __name__ == "__main__":
    main()
