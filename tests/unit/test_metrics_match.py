"""bench/metrics_match.py's comparison: every logged value but timing, step by step, on small
hand-written runs."""
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests import bench_module

pytestmark = pytest.mark.unit

metrics_match = bench_module("metrics_match")


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


STEPS = [{"step": 0, "val/x/mean@8": 0.25, "timing/validate_s": 1.0},
         {"step": 1, "loss": 0.125, "rollout/acc_mean": 0.5, "timing/step_s": 2.0}]


def test_equal_runs_match_whatever_their_timings(tmp_path):
    other = [dict(r) for r in STEPS]
    other[1]["timing/step_s"] = 9.0
    other[1]["timing/new_phase_s"] = 0.1  # a timing key only one side logs is not a difference
    r = metrics_match.compare_metrics(write(tmp_path / "a", STEPS), write(tmp_path / "b", other))
    assert r["compared"] == 5 and r["differ"] == [] and metrics_match.matches(r)


def test_a_changed_value_a_missing_metric_and_a_missing_step_are_reported(tmp_path):
    ref = write(tmp_path / "a", STEPS)
    changed = [dict(r) for r in STEPS]
    changed[1]["loss"] = 0.125 + 2 ** -40  # the last bits
    r = metrics_match.compare_metrics(ref, write(tmp_path / "b", changed))
    assert r["differ"] == [(1, "loss", 0.125, 0.125 + 2 ** -40)] and not metrics_match.matches(r)

    missing = [dict(r) for r in STEPS]
    del missing[1]["rollout/acc_mean"]
    r = metrics_match.compare_metrics(ref, write(tmp_path / "c", missing))
    assert r["one_side"] == {"rollout/acc_mean"} and not metrics_match.matches(r)

    r = metrics_match.compare_metrics(ref, write(tmp_path / "d", STEPS[:1]))
    assert r["records"] == (2, 1) and not metrics_match.matches(r)

    r = metrics_match.compare_metrics(write(tmp_path / "e", []), write(tmp_path / "f", []))
    assert r["compared"] == 0 and not metrics_match.matches(r)  # nothing logged: no match


def test_pools_compare_row_for_row_and_their_stats(tmp_path):
    table = pa.table({"prompt": ["a", "b"], "response": ["1", "2"]})
    changed = pa.table({"prompt": ["a", "b"], "response": ["1", "3"]})
    for name, rows, accuracy in (("a", table, 0.5), ("b", table, 0.5), ("c", changed, 0.5),
                                 ("d", table, 0.25)):
        pq.write_table(rows, tmp_path / f"{name}.parquet")
        (tmp_path / f"{name}.stats.json").write_text(json.dumps({"sample_accuracy": accuracy}))
    a, b, c, d = (str(tmp_path / f"{n}.parquet") for n in "abcd")
    assert metrics_match.compare_pools(a, b) == (2, 2, True)
    assert metrics_match.compare_pools(a, c) == (2, 2, False)
    assert metrics_match.compare_pools(a, d) == (2, 2, False)  # same rows, other stats


def run_main(monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["metrics_match.py", *args])
    with pytest.raises(SystemExit) as stop:
        metrics_match.main()
    return stop.value.code


def test_bad_input_stops_before_any_run_and_a_failed_run_leaves_no_worktree(tmp_path,
                                                                          monkeypatch):
    prepared = tmp_path / "prepared"
    for sub in ("model/config.json", "task/train.parquet", "task/val.parquet"):
        (prepared / sub).parent.mkdir(parents=True, exist_ok=True)
        (prepared / sub).write_text("")
    ran = []
    monkeypatch.setattr(metrics_match, "run_side", lambda *a: ran.append(a))
    assert "not a commit" in run_main(monkeypatch, "--against", "no-such-revision", "--out",
                                      str(tmp_path / "o1"), "--prepared", str(prepared))
    (tmp_path / "o2").mkdir()
    (tmp_path / "o2" / "x").write_text("")
    assert "not an empty directory" in run_main(monkeypatch, "--against", "HEAD", "--out",
                                                str(tmp_path / "o2"), "--prepared", str(prepared))
    assert "lacks model/config.json" in run_main(monkeypatch, "--against", "HEAD", "--out",
                                                 str(tmp_path / "o3"), "--prepared",
                                                 str(tmp_path))
    assert ran == []

    def fail(code, *rest):
        ran.append(code)
        metrics_match._failed("a run failed")

    monkeypatch.setattr(metrics_match, "run_side", fail)
    tree = tmp_path / "o4" / "against"
    assert run_main(monkeypatch, "--against", "HEAD", "--out", str(tmp_path / "o4"),
                    "--prepared", str(prepared)) == 2
    assert ran == [str(tree)]  # the reference side ran in the worktree, then stopped
    listed = subprocess.run(["git", "worktree", "list"], cwd=metrics_match.ROOT,
                            capture_output=True, text=True, check=True).stdout
    assert str(tree) not in listed and not tree.exists()
