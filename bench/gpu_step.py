"""Whole RLEP steps on one GPU with ``rollout.backend=megatron`` (no vLLM needed): the check
``scripts/gpu_check.sh`` runs as its whole-step rows, and a bench of its own.

    python bench/gpu_step.py                                # both shapes, 3 steps each
    python bench/gpu_step.py --shapes tiny-moe --steps 3 --out /tmp/gpu_step

For each shape, random weights in bf16 (``model.params_dtype=bfloat16``):

* ``qwen2-0.5b``: Qwen2.5-0.5B's transformer (hidden 896, 24 layers, 14 query / 2 key-value
  heads, MLP 4864, tied embeddings) with the tiny tokenizer's 320-token vocabulary (0.36B
  parameters: a random model's samples must decode to text, which the tiny tokenizer's
  vocabulary guarantees);
* ``tiny-moe``: the tiny Qwen3-MoE (8 experts, top 2).

The job is the RLEP recipe on the built-in tiny task with a pool of its reference solutions:
replay (M = 1), reward, the actor's old log-probs, training, the train state offloaded during
the rollout and restored for the update (``optim.offload_during_rollout``), a checkpoint after
step ``steps - 1`` and a second ``rlep train`` that resumes from it for the last step. Printed
per shape: the mean seconds of each phase (``timing/*_s``), the largest
``memory/max_allocated_gib`` of the steps that are not a process's first against ``rlep
plan``'s peaks for the same config (the first steps, holding the start-up too, beside it), and
``rollout/logprob_abs_diff`` (the engine's bf16 decoding against the actor's bf16 forward). A
row ends ``OK`` or ``FAILED (why)``; the last line of each shape starts ``gpu_step row:`` (what
gpu_check.sh puts in its table). Each run's whole output is in ``--out``/SHAPE/*.log; a failed
run's last lines are printed too.

Without a GPU the program prepares everything (model, task, pool, ``rlep plan``), then stops at
``rlep train``'s device check (the first CUDA call) and exits 2 saying so: that is what its CPU
test runs."""
import argparse
import json
import math
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = ("qwen2-0.5b", "tiny-moe")
TIMEOUTS = {"qwen2-0.5b": 125.0, "tiny-moe": 60.0}  # seconds, preparation included
# with --total-s, the last shape may also take what the shapes before it left of the total
PHASES = ("rollout", "reward", "old_logprob", "train", "weight_sync", "checkpoint", "step")
# bf16 decoding with a KV cache against the actor's full-sequence forward, mean |difference|
# per token. Measured on CPU in bf16 (Intel Xeon): 9.5e-4 on the tiny Qwen2 and at most 8.3e-4
# on the tiny MoE over 3 steps; a decoding bug that writes each new key one position early
# gave 1.3e-2 on the tiny Qwen2. A random model's near-uniform attention hides such bugs more
# than a trained one's, hence a bound this close; a GPU's own bf16 level is not measured yet.
MAX_LOGPROB_DIFF = 5e-3
FAILED_LINES = 60  # of a failed run's output, printed
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def make_model(shape: str, out: str) -> str:
    from rlep_megatron.tiny_model import TinyModelShape, make_tiny_model

    if shape == "qwen2-0.5b":
        return make_tiny_model(out, seed=0, arch="qwen2", shape=TinyModelShape(
            hidden_size=896, num_layers=24, num_attention_heads=14, num_key_value_heads=2,
            head_dim=64, intermediate_size=4864, max_position_embeddings=4096))
    return make_tiny_model(out, seed=0, arch="qwen3_moe")


def make_task_and_pool(out: str) -> tuple[dict, str]:
    """The tiny task and a pool of each training question's reference solution (twice)."""
    from rlep_megatron.data.schema import read_prompt_file
    from rlep_megatron.replay.writer import pool_rows, write_pool
    from rlep_megatron.tiny_task import make_tiny_task

    task = make_tiny_task(os.path.join(out, "task"), seed=0, num_train=32, num_val=8)
    rows = read_prompt_file(task["train"])
    solutions = {}
    with open(task["solutions"]) as f:
        for line in f:
            item = json.loads(line)
            solutions[item["question"]] = item["solution"]
    candidates = [[solutions[m[0]["content"]]] * 2 for m in rows.messages]
    pool = os.path.join(out, "pool.parquet")
    write_pool(pool_rows(rows, candidates, min_correct=2), pool)
    return task, pool


def overrides(model: str, task: dict, pool: str, run: str, steps: int, device: str
              ) -> list[str]:
    return [f"model.hf_dir={model}", "model.params_dtype=bfloat16",
            f"data.train_files=[{task['train']}]", f"data.val_files=[{task['val']}]",
            "data.train_batch_size=8", f"replay.pool_files=[{pool}]",
            "replay.num_replays_per_prompt=1", "rollout.backend=megatron",
            "rollout.num_samples_per_prompt=8", "rollout.max_response_tokens=64",
            "optim.offload_during_rollout=true", "trainer.validation_interval_steps=0",
            f"trainer.device={device}", f"trainer.output_dir={run}", f"trainer.total_steps={steps}",
            f"checkpoint.save_interval_steps={max(1, steps - 1)}", "checkpoint.resume=auto",
            "checkpoint.keep_last=1"]


def one_line(log: str) -> str:
    """A failed run's last lines, on one line (a row of gpu_check.sh's table)."""
    return " / ".join(line.strip() for line in log.strip().splitlines()[-6:])[-600:]


def failed(name: str, log: str, path: str) -> None:
    """A failed run's last lines on stdout (gpu_check.sh keeps them in its log and prints
    them; a lent machine's files are gone once it is given back), the whole output in
    ``path``."""
    tail = log.strip().splitlines()[-FAILED_LINES:]
    print(f"gpu_step: {name} failed; its last {len(tail)} lines (all of them: {path}):",
          *(f"    {line}" for line in tail), sep="\n", flush=True)


def rlep(args: list[str], timeout_s: float, log_path: str) -> subprocess.CompletedProcess:
    """``rlep`` ``args``; its whole output also written to ``log_path``."""
    command = [sys.executable, "-m", "rlep_megatron.cli", *args]
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                              timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired as error:
        partial = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
                   for b in (error.stdout, error.stderr)]
        with open(log_path, "w") as f:
            f.write("".join(partial))
        failed(f"rlep {args[0]} (over {timeout_s:.0f} s)", "".join(partial), log_path)
        raise
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return proc


def local_spec(device: str) -> bool:
    """Whether ``rlep train`` builds megatron-core's local layer spec here (the actor's own
    choice at ``model.transformer_engine=auto``, or the CPU): ``rlep plan`` must then count that
    spec's activations, which are more than TransformerEngine's."""
    from rlep_megatron.platform import use_transformer_engine

    return device == "cpu" or not use_transformer_engine("auto")


def plan_peaks(config: list[str], timeout_s: float, log_path: str, local: bool) -> dict:
    proc = rlep(["plan", "--json", *(["--local-spec"] if local else []), *config],
                min(120.0, timeout_s), log_path)
    if proc.returncode != 0:
        raise RuntimeError(f"rlep plan failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    result = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"train": result["peak_train_gib"], "rollout": result["peak_rollout_gib"],
            "spec": "local" if local else "te"}


def summarise(shape: str, entries: list[dict], plan: dict, resumed: bool, steps: int) -> str:
    problems = []
    trained = [e for e in entries if "timing/step_s" in e]
    if [e["step"] for e in trained] != list(range(1, steps + 1)):
        problems.append(f"steps {[e['step'] for e in trained]}")
    if not resumed:
        problems.append("the second run did not resume from the checkpoint")
    for e in trained:
        bad = [k for k, v in e.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            problems.append(f"step {e['step']}: not finite: {', '.join(bad[:3])}")
    diffs = [e["rollout/logprob_abs_diff"] for e in trained if "rollout/logprob_abs_diff" in e]
    diff = max(diffs) if diffs else float("nan")
    if not diff <= MAX_LOGPROB_DIFF:
        problems.append(f"rollout/logprob_abs_diff {diff:.3g} > {MAX_LOGPROB_DIFF}")
    replay = [e.get("replay/fraction", 0.0) for e in trained]
    if not all(r > 0 for r in replay):
        problems.append("a step without replays")
    # a step's peak counts from the end of the step before: each process's first step
    # (step 1, and the resumed step) also holds the start-up (the HF load, the checkpoint's
    # load and the optimizer's first state), which rlep plan does not plan for
    def peak(group):
        return max((e.get("memory/max_allocated_gib", float("nan")) for e in group),
                   default=float("nan"))
    steady = [e for e in trained if e["step"] not in (1, steps)]
    memory, start_up = peak(steady), peak([e for e in trained if e["step"] in (1, steps)])
    # the planner's peaks are what a running job may reach (its overhead included): above
    # them, the plan under-counts something
    if math.isfinite(memory) and memory > max(plan["train"], plan["rollout"]):
        problems.append(f"peak {memory:.2f} GiB above the plan's "
                        f"{max(plan['train'], plan['rollout']):.2f}")
    phases = "; ".join(f"{p} {sum(e.get(f'timing/{p}_s', 0.0) for e in trained) / max(1, len(trained)):.2f}"
                       for p in PHASES)
    verdict = "OK" if not problems else "FAILED (" + "; ".join(problems) + ")"
    return (f"gpu_step row: {shape} | {verdict} | {len(trained)} steps, resumed at step "
            f"{steps - 1}; logprob_abs_diff {diff:.2e}; peak {memory:.2f} GiB measured "
            f"(first steps with start-up {start_up:.2f}), plan ({plan['spec']} spec) train "
            f"{plan['train']:.1f} / rollout {plan['rollout']:.1f} GiB; mean s: {phases}")


def run_shape(shape: str, out: str, steps: int, timeout_s: float, device: str
              ) -> tuple[int, str]:
    import shutil

    started = time.perf_counter()
    root = os.path.join(out, shape)
    shutil.rmtree(root, ignore_errors=True)  # a run of before would be resumed
    model = make_model(shape, os.path.join(root, "model"))
    task, pool = make_task_and_pool(root)
    run = os.path.join(root, "run")
    config = ["--config", os.path.join(REPO, "examples", "tiny_cpu_rlep.yaml")]
    def left() -> float:
        return timeout_s - (time.perf_counter() - started)
    plan = plan_peaks(config + overrides(model, task, pool, run, steps, device), left(),
                      os.path.join(root, "plan.log"), local_spec(device))
    print(f"gpu_step: {shape}: prepared in {time.perf_counter() - started:.0f} s; plan peaks "
          f"{plan}", flush=True)
    first_log = os.path.join(root, "first_run.log")
    first = rlep(["train", *config, *overrides(model, task, pool, run, steps - 1, device)],
                 left(), first_log)
    if first.returncode != 0:
        log = first.stdout + first.stderr
        # rlep train's device check (platform.device.DeviceError): no usable GPU here
        refusal = [l for l in log.splitlines() if "To run on the CPU on purpose" in l]
        if refusal and device == "cuda":
            return 2, (f"gpu_step: {shape}: stopped at the first CUDA call (rlep train's "
                       f"device check): {refusal[-1].strip()}")
        failed(f"{shape}: the first rlep train", log, first_log)
        return 1, f"gpu_step row: {shape} | FAILED (first run) | {one_line(log)}"
    second_log = os.path.join(root, "resumed_run.log")
    second = rlep(["train", *config, *overrides(model, task, pool, run, steps, device)],
                  left(), second_log)
    log = second.stdout + second.stderr
    if second.returncode != 0:
        failed(f"{shape}: the resumed rlep train", log, second_log)
        return 1, f"gpu_step row: {shape} | FAILED (resumed run) | {one_line(log)}"
    with open(os.path.join(run, "metrics.jsonl")) as f:
        entries = [json.loads(line) for line in f]
    row = summarise(shape, entries, plan, f"(step {steps - 1})" in log
                    and "resumed from" in log and "step 1/" not in log, steps)
    return (0 if "| OK |" in row else 1), row


def shape_limit(own_s: float, last: bool, total_s: "float | None", elapsed_s: float) -> float:
    """A shape's limit: its own, or for the last shape with ``--total-s`` what the shapes
    before it left of the total, when that is more."""
    if last and total_s is not None:
        return max(own_s, total_s - elapsed_s)
    return own_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=3, help="RL steps per shape (>= 2)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                      "rlep-gpu-step"))
    parser.add_argument("--timeout-s", default=None,
                        help="seconds per shape, preparation included: one value for every "
                             "shape, or one per shape of --shapes (default: "
                             + ", ".join(f"{t:g} for {s}" for s, t in TIMEOUTS.items()) + ")")
    parser.add_argument("--total-s", type=float, default=None,
                        help="seconds for all shapes: the last shape's limit grows to what "
                             "the shapes before it left of this (never below its own)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same job on the CPU (to check this program; slow for "
                             "qwen2-0.5b, and the offload is GPU-only)")
    args = parser.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or args.steps < 2:
        parser.error(f"unknown shape {unknown} (choose from {SHAPES})" if unknown
                     else "--steps must be >= 2 (a checkpoint, then a resumed step)")
    limits = ([TIMEOUTS[s] for s in shapes] if args.timeout_s is None
              else [float(t) for t in args.timeout_s.split(",")])
    if len(limits) == 1:
        limits *= len(shapes)
    if len(limits) != len(shapes):
        parser.error(f"--timeout-s: {len(limits)} values for {len(shapes)} shapes")
    worst = 0
    started = time.perf_counter()
    for index, (shape, limit) in enumerate(zip(shapes, limits)):
        limit = shape_limit(limit, index == len(shapes) - 1, args.total_s,
                            time.perf_counter() - started)
        try:
            code, line = run_shape(shape, args.out, args.steps, limit, args.device)
        except subprocess.TimeoutExpired:
            code, line = 1, f"gpu_step row: {shape} | FAILED (over {limit:.0f} s) |"
        print(line, flush=True)
        if code == 2:
            return 2
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    sys.exit(main())
