"""Per-step metrics: ``metrics.jsonl`` (one JSON object per step) mirrored to TensorBoard and/or
Weights & Biases, the one log line per step (:func:`format_step_line`), and rank-0 progress
bars (drawn on a terminal only; a log line every 30 s elsewhere).

Each record is written with a single ``write`` on a file opened with ``O_APPEND`` and flushed to
disk, so a crash or a kill leaves at most one incomplete last line; reopening the file drops that
fragment. ``truncate_after(step)`` removes records past a resumed checkpoint's step so a resumed
run does not duplicate steps.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Iterable, Optional

logger = logging.getLogger(__name__)

METRICS_FILE_NAME = "metrics.jsonl"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Complete records of a metrics file (an incomplete last line is ignored)."""
    records = []
    if not os.path.exists(path):
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            records.append(json.loads(line))
    return records


WANDB_ID_FILE = "wandb_run_id.txt"


MLFLOW_ID_FILE = "mlflow_run_id.txt"


def check_loggers(loggers: Iterable[str]) -> None:
    """Fail before any work when a chosen logger's package is missing."""
    import importlib.util

    for name in ("wandb", "mlflow"):
        if name in loggers and importlib.util.find_spec(name) is None:
            raise ValueError(f"trainer.loggers includes {name} but the {name} package is not "
                             f"installed: pip install {name} (or drop {name} from "
                             "trainer.loggers)")


def _saved_run_id(output_dir: str, file_name: str) -> Optional[str]:
    path = os.path.join(output_dir, file_name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def _save_run_id(output_dir: str, file_name: str, run_id: str) -> None:
    from rlep_megatron.staging import write_file_atomic

    write_file_atomic(os.path.join(output_dir, file_name), run_id + "\n")


def open_wandb_run(output_dir: str, project: str, name: str, config: Optional[dict] = None,
                   entity: str = "", group: str = "", tags: Iterable[str] = ()):
    """A W&B run for ``output_dir``: its id is kept in ``<output_dir>/wandb_run_id.txt``, so a
    resumed training run appends to the same W&B run (steps at or below W&B's last step, redone
    after a resume, are dropped by W&B; ``metrics.jsonl`` holds them)."""
    check_loggers(["wandb"])
    import wandb

    run_id = _saved_run_id(output_dir, WANDB_ID_FILE)
    if run_id is None:
        run_id = wandb.util.generate_id()
        _save_run_id(output_dir, WANDB_ID_FILE, run_id)
    return wandb.init(project=project, name=name or os.path.basename(os.path.abspath(output_dir)),
                      id=run_id, resume="allow", dir=output_dir, config=config,
                      entity=entity or None, group=group or None, tags=list(tags) or None)


class MlflowRun:
    """An MLflow run that :class:`MetricsWriter` logs to: each step's scalars with their step,
    ``@`` (``mean@4``) written ``_at_``, which MLflow's metric names do not allow."""

    def __init__(self, mlflow):
        self._mlflow = mlflow

    @staticmethod
    def metric_name(key: str) -> str:
        return key.replace("@", "_at_")

    def log(self, values: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({self.metric_name(k): float(v) for k, v in values.items()},
                                 step=step)

    def finish(self) -> None:
        self._mlflow.end_run()


def open_mlflow_run(output_dir: str, experiment: str, name: str, tracking_uri: str = "",
                    config: Optional[dict] = None) -> MlflowRun:
    """An MLflow run for ``output_dir``, its id kept in ``<output_dir>/mlflow_run_id.txt`` so
    that a resumed training run logs into the same run; a new run records the config
    (``config.json`` artifact). A directory (``file:./mlruns``, or a path) is MLflow's local
    file store, which works offline and with ``mlflow-skinny``; MLflow 3 refuses it unless
    ``MLFLOW_ALLOW_FILE_STORE`` is set, which naming one here does."""
    check_loggers(["mlflow"])
    if tracking_uri and ("://" not in tracking_uri or tracking_uri.startswith("file:")):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    import mlflow

    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment)
    run_id = _saved_run_id(output_dir, MLFLOW_ID_FILE)
    if run_id is not None:
        mlflow.start_run(run_id=run_id)
    else:
        run = mlflow.start_run(run_name=name or os.path.basename(os.path.abspath(output_dir)))
        _save_run_id(output_dir, MLFLOW_ID_FILE, run.info.run_id)
        if config is not None:
            mlflow.log_dict(config, "config.json")
    return MlflowRun(mlflow)


class MetricsWriter:
    """Appends step records to ``<output_dir>/metrics.jsonl`` and mirrors them to TensorBoard,
    W&B and/or MLflow (rank 0 only)."""

    def __init__(self, output_dir: str, enabled: bool = True, tensorboard: bool = True,
                 fsync: bool = True, wandb_run=None, mlflow_run=None):
        self.path = os.path.join(output_dir, METRICS_FILE_NAME)
        self.enabled = enabled
        self.fsync = fsync
        self._tb = None
        # runs of other trackers: each has log(scalars, step=) and finish()
        self._runs = [run for run in (wandb_run, mlflow_run) if run is not None]
        self._fd: Optional[int] = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._drop_incomplete_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))

    def _drop_incomplete_tail(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                keep = data.rfind(b"\n") + 1
                logger.warning("%s: dropping an incomplete last record (%d bytes) left by an "
                               "interrupted run", self.path, len(data) - keep)
                f.truncate(keep)

    def truncate_after(self, step: int) -> None:
        """Remove records with ``step`` greater than the given one (used on resume)."""
        if not self.enabled:
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", -1) <= step]
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for record in kept:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        os.close(self._fd)
        os.replace(tmp, self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step)}
        record.update({key: _jsonable(value) for key, value in values.items()})
        line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
        written = os.write(self._fd, line)
        if written != len(line):
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        if self.fsync:
            os.fsync(self._fd)
        scalars = {key: value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float))
                   and not isinstance(value, bool)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        for run in self._runs:
            run.log(scalars, step=int(step))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        runs, self._runs = self._runs, []
        for run in runs:
            run.finish()

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()
        return False


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _validation_means(metrics: dict[str, Any]) -> list[str]:
    """``val/<source>/mean@k`` as ``<source> mean@k 61.2%``, in key order."""
    return [f"{key[4:].replace('/', ' ')} {100 * float(metrics[key]):.1f}%"
            for key in sorted(metrics) if key.startswith("val/") and "/mean@" in key]


def format_step_line(step: int, total_steps: int, metrics: dict[str, Any],
                     eta_s: Optional[float] = None) -> str:
    """The one log line of a training step: the few numbers a person watches, from the step's
    ``metrics.jsonl`` record (whose keys stay as they are). Reward and accuracy of the fresh
    rollouts, the replayed share (RLEP runs), validation when the step has it, the KL penalty's
    estimate when it is on (``train/kl_k3``) or else the rollout/actor mismatch
    (``rollout/mismatch_kl_k3``), the gradient norm, the step's seconds (validation and
    checkpoint included) and its trained tokens (prompt + response) per second of the step's
    own phases, and an ETA."""
    parts = [f"step {step}/{total_steps}"]

    def has(key: str) -> bool:
        value = metrics.get(key)
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if has("rollout/reward_mean"):
        parts.append(f"reward {metrics['rollout/reward_mean']:+.3f}"
                     + (f" acc {100 * metrics['rollout/acc_mean']:.1f}%"
                        if has("rollout/acc_mean") else ""))
    if has("replay/fraction") and metrics["replay/fraction"] > 0:
        parts.append(f"replay {100 * metrics['replay/fraction']:.0f}%")
    validation = _validation_means(metrics)
    if validation:
        parts.append("val " + ", ".join(validation))
    if has("train/kl_k3"):
        parts.append(f"kl {metrics['train/kl_k3']:.2e}")
    elif has("rollout/mismatch_kl_k3"):
        parts.append(f"mismatch {metrics['rollout/mismatch_kl_k3']:.1e}")
    if has("train/grad_norm"):
        parts.append(f"grad {metrics['train/grad_norm']:.3g}")
    if has("timing/step_s"):
        seconds = metrics["timing/step_s"] + sum(
            metrics[k] for k in ("timing/validate_s", "timing/checkpoint_s") if has(k))
        text = f"{seconds:.1f} s"
        if (has("timing/train_tokens_per_s") and has("timing/train_s")
                and metrics["timing/step_s"] > 0):
            # the trained sequences' tokens (prompt + response) per second of the whole step
            trained = metrics["timing/train_tokens_per_s"] * metrics["timing/train_s"]
            text += f", {trained / metrics['timing/step_s']:,.0f} tok/s"
        parts.append(text)
    elif has("timing/validate_s"):
        parts.append(f"{metrics['timing/validate_s']:.1f} s")
    if eta_s is not None and step < total_steps:
        parts.append(f"eta {_duration(eta_s)}")
    return " | ".join(parts)


class _LogLines:
    """A file for tqdm off a terminal: each bar it draws becomes one log line (tqdm's
    ``mininterval`` spaces them), so a log file gets no carriage-return debris."""

    def __init__(self, name: str):
        self.log = logging.getLogger(name)

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.log.info("%s", text)

    def flush(self) -> None:
        pass


def progress(iterable: Optional[Iterable] = None, total: Optional[int] = None, desc: str = "",
             unit: str = "it", enabled: Optional[bool] = None):
    """A tqdm bar on rank 0 (rate and ETA) when stderr is a terminal; off a terminal (a log
    file, a batch job) the same bar as a log line at most every 30 s; silent elsewhere."""
    import sys

    from tqdm.auto import tqdm

    if enabled is None:
        from rlep_megatron.distributed import is_rank0

        enabled = is_rank0()
    if sys.stderr.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled,
                    dynamic_ncols=True)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, ncols=100,
                ascii=True, mininterval=30.0, file=_LogLines(__name__))
