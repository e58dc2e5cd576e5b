"""bench/metrics_match.py's comparison: every logged value but timing, step by step, on small
hand-written runs."""
import json

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
    assert r["steps"] == (2, 1) and not metrics_match.matches(r)


def test_pools_compare_row_for_row(tmp_path):
    table = pa.table({"prompt": ["a", "b"], "response": ["1", "2"]})
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(table, tmp_path / "b.parquet")
    changed = pa.table({"prompt": ["a", "b"], "response": ["1", "3"]})
    pq.write_table(changed, tmp_path / "c.parquet")
    a, b, c = (str(tmp_path / f"{n}.parquet") for n in "abc")
    assert metrics_match.compare_pools(a, b) == (2, 2, True)
    assert metrics_match.compare_pools(a, c) == (2, 2, False)
