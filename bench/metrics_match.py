"""Whether this checkout trains as another commit does, value for value: the tiny default's
baseline for a few steps, a pool collected from its checkpoint, and RLEP (``replay.policy``
as the recipe sets it, uniform) on that pool, once with each commit's code on the same
warm-started model; then every metric of every step compared for equality (``timing/*``
aside), and the two pools row for row.

    python bench/metrics_match.py --against b100ab2 --out D [--prepared DIR] [--steps 3]

``--against``: any git revision; its code is checked out into ``D/against`` (a detached git
worktree, removed at the end) and run with this checkout's environment (its installed
packages; PYTHONPATH entries made absolute). Each side is checked to import ``rlep_megatron``
from its own tree; a module the older tree lacks would still be found in this checkout's
editable install. ``--prepared``: a directory from ``rlep demo --prepare-only --out-dir DIR``
(``model/`` and ``task/``); without it the demo's preparation runs into ``D/prepared`` first
(about 5 minutes). Both RLEP runs replay the pool the other commit collected, so a difference
in collection shows once, in the pool rows (its parquet and its ``pool.stats.json``). The table
ends the output. Exit status: 0 when everything is equal, 1 when anything differs, 2 when a
run failed (its log's tail printed). A refactor that should not change numerics passes this
against the commit before it.
"""
import argparse
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare_metrics(ref_path: str, new_path: str) -> dict:
    """Two runs' ``metrics.jsonl`` compared record by record (one per step, and step 0's
    validation): the number of values compared, the differing ones and the keys only one side
    logs. ``timing/*`` is not compared."""
    from rlep_megatron.metrics import read_metrics

    ref, new = read_metrics(ref_path), read_metrics(new_path)
    result = {"records": (len(ref), len(new)), "compared": 0, "differ": [], "one_side": set()}
    for a, b in zip(ref, new):
        step = a.get("step", b.get("step"))
        result["one_side"] |= {k for k in set(a) ^ set(b) if not k.startswith("timing/")}
        for key in sorted(set(a) & set(b)):
            if key.startswith("timing/"):
                continue
            result["compared"] += 1
            if a[key] != b[key]:
                result["differ"].append((step, key, a[key], b[key]))
    return result


def matches(result: dict) -> bool:
    """Equal: as many records, at least one value compared, none differing, none one-sided."""
    return (result["records"][0] == result["records"][1] and result["compared"] > 0
            and not result["differ"] and not result["one_side"])


def compare_pools(ref_path: str, new_path: str) -> tuple[int, int, bool]:
    """Two pools' rows (count, count, equal), and their ``pool.stats.json`` beside them equal
    (the collection's counts over every sample, dropped questions included)."""
    import pyarrow.parquet as pq

    a, b = pq.read_table(ref_path), pq.read_table(new_path)
    stats = []
    for path in (ref_path, new_path):
        stats_path = os.path.splitext(path)[0] + ".stats.json"
        with open(stats_path) as f:
            stats.append(json.load(f))
    return a.num_rows, b.num_rows, a.equals(b) and stats[0] == stats[1]


def _env(code: str) -> dict:
    """This process's environment with ``code`` first on PYTHONPATH (the other entries made
    absolute: each side runs in its own checkout)."""
    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([code] + paths))


def _failed(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(2)


def _check_imports_from(code: str) -> None:
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            "print(u.find_spec('rlep_megatron').origin)"],
                           cwd=code, env=_env(code), capture_output=True, text=True)
    origin = probe.stdout.strip()
    if probe.returncode != 0 or not origin.startswith(os.path.join(code, "")):
        _failed(f"the code of {code} would import rlep_megatron from {origin or probe.stderr}")


def _rlep(code: str, args: list[str], log: str) -> None:
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "rlep_megatron.cli"] + args, cwd=code,
                             env=_env(code), stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        with open(log) as f:
            tail = f.read().splitlines()[-40:]
        _failed("\n".join(tail) + f"\n{' '.join(args[:3])} with the code of {code} failed "
                f"(exit {rc}); its log: {log}")


def run_side(code: str, out: str, prepared: str, steps: int, pool_for_rlep: str) -> None:
    """The baseline, the collection and (on ``pool_for_rlep``) RLEP with the code at ``code``."""
    _check_imports_from(code)
    os.makedirs(out, exist_ok=True)
    common = [f"model.hf_dir={prepared}/model",
              f"data.train_files=[{prepared}/task/train.parquet]",
              f"data.val_files=[{prepared}/task/val.parquet]", f"trainer.total_steps={steps}"]
    base = os.path.join(out, "baseline")
    print(f"{out}: baseline, {steps} steps ...", flush=True)
    _rlep(code, ["train", "--config", "examples/tiny_cpu_baseline.yaml", *common,
                 f"trainer.output_dir={base}"], os.path.join(out, "baseline.log"))
    print(f"{out}: collecting a pool from its checkpoint ...", flush=True)
    _rlep(code, ["collect", "--config", "examples/tiny_cpu_rlep.yaml", *common,
                 f"collect.checkpoint={base}", f"collect.output_file={out}/pool.parquet"],
          os.path.join(out, "collect.log"))
    print(f"{out}: RLEP, {steps} steps ...", flush=True)
    _rlep(code, ["train", "--config", "examples/tiny_cpu_rlep.yaml", *common,
                 f"replay.pool_files=[{pool_for_rlep}]", f"trainer.output_dir={out}/rlep"],
          os.path.join(out, "rlep.log"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="git revision to compare with")
    ap.add_argument("--out", required=True, help="directory for both sides' runs")
    ap.add_argument("--prepared", help="an `rlep demo --prepare-only --out-dir` directory")
    ap.add_argument("--steps", type=int, default=3, help="training steps of each run")
    args = ap.parse_args()
    if args.steps < 1:
        sys.exit(f"--steps must be at least 1, got {args.steps}")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        sys.exit(f"--out {out} exists and is not an empty directory: give a new one")
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.against}^{{commit}}"],
                         cwd=ROOT, capture_output=True, text=True)
    if rev.returncode != 0:
        sys.exit(f"--against {args.against}: not a commit of this repository")
    prepared = os.path.abspath(args.prepared) if args.prepared else os.path.join(out, "prepared")
    if args.prepared:
        for sub in ("model/config.json", "task/train.parquet", "task/val.parquet"):
            if not os.path.exists(os.path.join(prepared, sub)):
                sys.exit(f"--prepared {prepared} lacks {sub}: give a directory made by "
                         "`rlep demo --prepare-only --out-dir DIR`")
    os.makedirs(out, exist_ok=True)
    if not args.prepared:
        print("preparing the tiny default (rlep demo --prepare-only) ...", flush=True)
        _rlep(ROOT, ["demo", "--prepare-only", "--out-dir", prepared],
              os.path.join(out, "prepare.log"))
    tree = os.path.join(out, "against")
    added = subprocess.run(["git", "worktree", "add", "--detach", tree, rev.stdout.strip()],
                           cwd=ROOT, capture_output=True, text=True)
    if added.returncode != 0:
        _failed(f"git worktree add {tree} failed:\n{added.stderr}")
    # a kill by SIGTERM (a scheduler's, a timeout's) still removes the worktree
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        ref_pool = os.path.join(out, "ref", "pool.parquet")
        run_side(tree, os.path.join(out, "ref"), prepared, args.steps, ref_pool)
        run_side(ROOT, os.path.join(out, "new"), prepared, args.steps, ref_pool)
    finally:
        signal.signal(signal.SIGTERM, previous)
        removed = subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=ROOT,
                                 capture_output=True, text=True)
        if removed.returncode != 0:
            print(f"could not remove the worktree {tree} ({removed.stderr.strip()}): run "
                  f"`git worktree remove --force {tree}` or `git worktree prune`",
                  file=sys.stderr)
    from rlep_megatron.demo import machine_description

    ok = True
    kernels = os.environ.get("ATEN_CPU_CAPABILITY")
    print(f"\nthis checkout against {args.against} ({rev.stdout.strip()[:10]}), "
          f"{args.steps} steps, timing/* aside; {machine_description()}"
          + (f", ATEN_CPU_CAPABILITY={kernels}" if kernels else ""))
    print("| run | records (ref, new) | values compared | equal | first differences |")
    print("|---|---|---|---|---|")
    for run in ("baseline", "rlep"):
        r = compare_metrics(os.path.join(out, "ref", run, "metrics.jsonl"),
                            os.path.join(out, "new", run, "metrics.jsonl"))
        ok &= matches(r)
        first = "; ".join(f"step {s} {k}: {a} vs {b}" for s, k, a, b in r["differ"][:3])
        if r["one_side"]:
            first += f" logged by one side only: {', '.join(sorted(r['one_side']))}"
        print(f"| {run} | {r['records'][0]}, {r['records'][1]} | {r['compared']} | "
              f"{'yes' if matches(r) else 'NO'} | {first or '-'} |")
    rows_a, rows_b, same = compare_pools(ref_pool, os.path.join(out, "new", "pool.parquet"))
    ok &= same
    print(f"| pool | {rows_a}, {rows_b} rows | every row, pool.stats.json | "
          f"{'yes' if same else 'NO'} | - |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
