import json
import os

import pytest

from rlep_megatron.config import load_config
from rlep_megatron.metrics import MetricsWriter, progress, read_metrics

pytestmark = pytest.mark.unit


def test_appends_one_object_per_step_and_mirrors_tensorboard(tmp_path):
    with MetricsWriter(str(tmp_path)) as writer:
        for step in range(3):
            writer.log(step, {"train/pg_loss": 0.5 * step, "rollout/acc_mean": 0.1})
        writer.log(3, {"train/grad_norm": float("nan")})
    lines = open(tmp_path / "metrics.jsonl").read().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    assert json.loads(lines[2])["train/pg_loss"] == 1.0
    assert json.loads(lines[3])["train/grad_norm"] == "nan"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/pg_loss")
    assert [(s.step, s.value) for s in scalars] == [(0, 0.0), (1, 0.5), (2, 1.0)]


def test_interrupted_write_is_dropped_and_logging_continues(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.log(0, {"a": 1})
        writer.log(1, {"a": 2})
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 2, "a": 3')  # a kill in the middle of a record
    assert [r["step"] for r in read_metrics(str(path))] == [0, 1]
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.log(2, {"a": 3})
    assert [r["a"] for r in read_metrics(str(path))] == [1, 2, 3]


def test_truncate_after_resume_step(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        for step in range(5):
            writer.log(step, {"x": step})
        writer.truncate_after(2)
        writer.log(3, {"x": 30})
    assert [(r["step"], r["x"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [
        (0, 0), (1, 1), (2, 2), (3, 30)]


def test_disabled_writer_writes_nothing(tmp_path):
    writer = MetricsWriter(str(tmp_path / "off"), enabled=False)
    writer.log(0, {"x": 1})
    writer.close()
    assert not os.path.exists(tmp_path / "off")


def test_progress_is_silent_off_rank0(capsys):
    assert list(progress(range(3), enabled=False)) == [0, 1, 2]
    assert capsys.readouterr().err == ""


def test_progress_draws_a_bar_on_a_terminal_and_log_lines_elsewhere(capsys, caplog,
                                                                     monkeypatch):
    import logging
    import sys

    # a log file (stderr not a terminal): no bar, no carriage return; the bar's text as log
    # lines (the first draw and the final one; tqdm's 30 s interval spaces the others)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with caplog.at_level(logging.INFO, logger="rlep_megatron.metrics"):
        assert list(progress(range(2), desc="scoring", enabled=True)) == [0, 1]
    assert "\r" not in capsys.readouterr().err
    lines = [r.getMessage() for r in caplog.records if r.name == "rlep_megatron.metrics"]
    assert lines and all("scoring" in line and "\r" not in line for line in lines)
    assert "2/2" in lines[-1]
    # a terminal: tqdm's bar on stderr
    caplog.clear()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert list(progress(range(2), desc="scoring", enabled=True)) == [0, 1]
    assert "scoring" in capsys.readouterr().err
    assert not [r for r in caplog.records if r.name == "rlep_megatron.metrics"]


def test_the_step_line_holds_the_numbers_a_person_watches():
    from rlep_megatron.metrics import format_step_line

    record = {"rollout/reward_mean": 0.4183, "rollout/acc_mean": 0.7109, "replay/fraction": 0.1111,
              "val/tiny_column/mean@8": 0.643, "val/tiny_column/best@8": 0.9,
              "rollout/mismatch_kl_k3": 2.4e-14, "train/grad_norm": 0.4213,
              "timing/step_s": 4.0, "timing/validate_s": 0.8, "timing/train_s": 2.0,
              "timing/train_tokens_per_s": 4620.0, "train/pg_loss": 0.1}
    line = format_step_line(12, 30, record, eta_s=87)
    assert line == ("step 12/30 | reward +0.418 acc 71.1% | replay 11% | val tiny_column "
                    "mean@8 64.3% | mismatch 2.4e-14 | grad 0.421 | 4.8 s, 2,310 tok/s | "
                    "eta 1m27s")
    # with the KL penalty on, its estimate replaces the mismatch; no replay share at M = 0
    record.update({"train/kl_k3": 1.5e-3, "replay/fraction": 0.0})
    line = format_step_line(30, 30, record, eta_s=0)
    assert "kl 1.50e-03" in line and "mismatch" not in line and "replay" not in line
    assert "eta" not in line  # the last step
    # step 0: validation only
    assert format_step_line(0, 30, {"val/gsm8k/mean@4": 0.5, "timing/validate_s": 3.21}) == (
        "step 0/30 | val gsm8k mean@4 50.0% | 3.2 s")


class FakeWandb:
    """Records what the W&B client would be given (the package is optional)."""

    def __init__(self):
        import importlib.machinery

        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], 0
        self.util = type("util", (), {"generate_id": staticmethod(lambda: "run123")})

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished += 1


def test_wandb_gets_the_same_scalars_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    import sys

    from rlep_megatron.metrics import open_wandb_run

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):  # a run, then its resumption
        run = open_wandb_run(str(tmp_path), "proj", "", {"algo": {"kl_coef": 0.0}},
                             entity="team", group="rlep-vs-dapo", tags=["7b", "rlep"])
        with MetricsWriter(str(tmp_path), tensorboard=False, wandb_run=run) as writer:
            writer.log(3, {"train/pg_loss": 0.5, "val/x/mean@4": 1, "note": "text"})
    assert [i["id"] for i in fake.inits] == ["run123", "run123"]
    assert fake.inits[0]["resume"] == "allow" and fake.inits[0]["project"] == "proj"
    assert fake.inits[0]["name"] == tmp_path.name
    assert (fake.inits[0]["entity"], fake.inits[0]["group"], fake.inits[0]["tags"]) == (
        "team", "rlep-vs-dapo", ["7b", "rlep"])
    assert fake.logged[0] == (3, {"train/pg_loss": 0.5, "val/x/mean@4": 1})
    assert fake.finished == 2
    assert [r["train/pg_loss"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [0.5,
                                                                                           0.5]


def test_a_missing_wandb_is_refused_before_any_work(monkeypatch):
    import importlib.util

    from rlep_megatron.metrics import check_loggers

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install wandb"):
        check_loggers(["tensorboard", "wandb"])
    check_loggers(["tensorboard"])
    with pytest.raises(ValueError, match="trainer.loggers"):
        load_config(None, ["trainer.loggers=[tensorboard, neptune]"])
    with pytest.raises(ValueError, match="pip install mlflow"):
        check_loggers(["mlflow"])


class FakeMlflow:
    """Records what the MLflow client would be given (the package is optional)."""

    def __init__(self):
        import importlib.machinery

        self.__spec__ = importlib.machinery.ModuleSpec("mlflow", None)
        self.calls = []

    def set_tracking_uri(self, uri):
        self.calls.append(("uri", uri))

    def set_experiment(self, name):
        self.calls.append(("experiment", name))

    def start_run(self, run_id=None, run_name=None):
        self.calls.append(("start", run_id, run_name))
        return type("Run", (), {"info": type("Info", (), {"run_id": "abc"})})

    def log_dict(self, value, name):
        self.calls.append(("dict", name))

    def log_metrics(self, values, step):
        self.calls.append(("metrics", step, values))

    def end_run(self):
        self.calls.append(("end",))


def test_mlflow_gets_the_scalars_and_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    """Each step's scalars (``@``, which MLflow refuses in a name, as ``_at_``); the run's id
    kept in the output directory, so that a resumed run logs into the same run."""
    import sys

    from rlep_megatron.metrics import open_mlflow_run

    fake = FakeMlflow()
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    for _ in range(2):  # a run, then its resumption
        run = open_mlflow_run(str(tmp_path), "exp", "", "file:/tmp/store", {"algo": {}})
        with MetricsWriter(str(tmp_path), tensorboard=False, mlflow_run=run) as writer:
            writer.log(3, {"train/pg_loss": 0.5, "val/x/mean@4": 1, "note": "text"})
    first, second = fake.calls[:6], fake.calls[6:]
    assert first == [("uri", "file:/tmp/store"), ("experiment", "exp"),
                     ("start", None, tmp_path.name), ("dict", "config.json"),
                     ("metrics", 3, {"train/pg_loss": 0.5, "val/x/mean_at_4": 1.0}), ("end",)]
    assert second == [("uri", "file:/tmp/store"), ("experiment", "exp"), ("start", "abc", None),
                      ("metrics", 3, {"train/pg_loss": 0.5, "val/x/mean_at_4": 1.0}), ("end",)]


def test_an_mlflow_file_store_holds_the_step_metrics(tmp_path, monkeypatch):
    """With the real MLflow (``mlflow-skinny``, offline) and a directory as the store: the run
    directory holds every step's scalars at their steps, and the resumed run appends to the
    same run."""
    from tests import requires

    requires("mlflow")
    from rlep_megatron.metrics import open_mlflow_run

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out, store = tmp_path / "run", tmp_path / "mlruns"
    for steps in ((1, 2), (3,)):  # a run, then its resumption
        run = open_mlflow_run(str(out), "tiny", "", f"file:{store}", {"algo": {"x": 1}})
        with MetricsWriter(str(out), tensorboard=False, mlflow_run=run) as writer:
            for step in steps:
                writer.log(step, {"train/pg_loss": 0.25 * step, "val/t/mean@4": step / 10})
    run_dirs = [p for p in store.glob("*/*") if (p / "metrics").is_dir()]
    assert len(run_dirs) == 1, run_dirs  # one run for the run and its resumption
    assert run_dirs[0].name == (out / "mlflow_run_id.txt").read_text().strip()

    def series(name):  # MLflow's file store: one "<timestamp> <value> <step>" line per step
        lines = (run_dirs[0] / "metrics" / name).read_text().split("\n")
        return [(int(step), float(value)) for _, value, step in
                (line.split() for line in lines if line)]
    assert series("train/pg_loss") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert series("val/t/mean_at_4") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert (run_dirs[0] / "artifacts" / "config.json").is_file()
