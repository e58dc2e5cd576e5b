"""Fixed costs of a job's processes on CPU, each measured both ways in fresh processes that
alternate (``--rounds`` times):

* ``heap``: after the imports of a colocated rank (torch, megatron-core, vLLM's engine, the
  cyclic collector paused as the CLI pauses it), a full collection then ``gc.freeze()`` (before)
  against ``gc.freeze()`` alone (``rlep_megatron.platform.heap.freeze_startup_heap``);
* ``kv_cache``: building vLLM's CPU engine of the tiny Qwen2 (max_model_len 128, fp32) with a
  1 GiB KV cache (before) against one sized to the model
  (``rlep_megatron.platform.vllm_cpu.cpu_kv_cache_bytes``);
* ``launcher``: a 2-rank program (process group, one barrier) started by ``torchrun
  --standalone`` against ``tests.torchrun.run_ranks`` (the test programs' launcher): wall time
  and the CPU time of every process of the launch;
* ``forkserver``: a 2-step ``rlep train`` of the e2e tests' settings on 2 ranks under torchrun
  (``tests.e2e.helpers.run_rlep``), every process a new interpreter (``RLEP_TEST_FORKSERVER=0``)
  against the launcher and ranks forked from the test suite's fork server (tests/forkserver.py,
  started and ready before the first round): wall time and the CPU time of every process of the
  job (the server's reaped children included).

    python bench/startup_costs.py                      # all four, 3 rounds
    python bench/startup_costs.py --only heap kv_cache --rounds 5

Printed: one row per measurement, round and way, then the medians.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

WAYS = {"heap": ("collect+freeze", "freeze"), "kv_cache": ("1 GiB", "sized"),
        "launcher": ("torchrun", "run_ranks"), "forkserver": ("new interpreters", "fork server")}


def child_heap(way: str) -> dict:
    import gc

    gc.disable()
    import torch  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    from vllm import LLM  # noqa: F401

    start = time.perf_counter()
    found = gc.collect() if way == "collect+freeze" else 0
    gc.freeze()
    gc.enable()
    return {"seconds": time.perf_counter() - start, "garbage_found": found}


def child_kv_cache(way: str, model: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from rlep_megatron import platform

    with open(os.path.join(model, "config.json")) as f:
        settings = platform.vllm_cpu_engine_settings(128, json.load(f), 1)
    if way == "1 GiB":
        settings["kv_cache_memory_bytes"] = 2**30
    start = time.perf_counter()
    LLM(model=model, dtype="float32", seed=0, max_model_len=128, **settings)
    return {"seconds": time.perf_counter() - start,
            "kv_cache_mib": settings["kv_cache_memory_bytes"] / 2**20}


PROGRAM = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def launcher(way: str, directory: str) -> dict:
    from tests.torchrun import run_ranks

    script = os.path.join(directory, "barrier.py")
    with open(script, "w") as f:
        f.write(PROGRAM)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    if way == "torchrun":
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node=2", script], env=env, check=True, capture_output=True)
    else:
        run_ranks(script, 2)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": seconds, "cpu_seconds": cpu}


def _reaped_cpu_seconds(pid: int) -> float:
    """The CPU time of the children that process ``pid`` has reaped (``/proc``: cutime +
    cstime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def forkserver_job(way: str, directory: str, model: str, number: int) -> dict:
    from tests import forkserver
    from tests.e2e.helpers import recipe, run_rlep, small_task, train_overrides

    task = small_task(os.path.join(directory, "task"))
    server = forkserver.start_and_wait() if way == "fork server" else None
    os.environ[forkserver.VARIABLE] = server.socket if server else "0"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = _reaped_cpu_seconds(server.pid) if server else 0.0
    start = time.perf_counter()
    run_rlep(["train", "--config", recipe("tiny_cpu_baseline.yaml"),
              *train_overrides(model, task, os.path.join(directory, f"{way}-{number}"), 2)],
             nproc=2)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if server:
        cpu += _reaped_cpu_seconds(server.pid) - reaped
    return {"seconds": seconds, "cpu_seconds": cpu}


def in_child(kind: str, way: str, model: str) -> dict:
    """``child_<kind>(way)`` in a fresh Python process; its result."""
    code = (f"import json, sys; sys.path.insert(0, {ROOT!r}); "
            f"from bench.startup_costs import child_{kind}; "
            f"args = [{way!r}] + ([{model!r}] if {kind!r} == 'kv_cache' else []); "
            f"print('RESULT ' + json.dumps(child_{kind}(*args)), flush=True); "
            f"import os; os._exit(0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} ({way}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(WAYS), default=list(WAYS))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from rlep_megatron.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as directory:
        model = make_tiny_model(os.path.join(directory, "tiny-qwen2"), seed=0, arch="qwen2")
        results = {kind: {way: [] for way in WAYS[kind]} for kind in args.only}
        print("| measurement | round | way | seconds | CPU seconds / other |")
        print("|---|---|---|---|---|")
        for kind in args.only:
            for number in range(args.rounds):
                for way in WAYS[kind]:
                    if kind == "launcher":
                        row = launcher(way, directory)
                    elif kind == "forkserver":
                        row = forkserver_job(way, directory, model, number)
                    else:
                        row = in_child(kind, way, model)
                    results[kind][way].append(row)
                    other = {k: round(v, 2) for k, v in row.items() if k != "seconds"}
                    print(f"| {kind} | {number + 1} | {way} | {row['seconds']:.3f} | {other} |",
                          flush=True)
        print("\nmedians:")
        for kind, ways in results.items():
            for way, rows in ways.items():
                medians = {key: round(statistics.median(r[key] for r in rows), 3)
                           for key in rows[0]}
                print(f"  {kind:9s} {way:16s} {medians}")


if __name__ == "__main__":
    main()
