"""The RL loop (docs/ALGORITHM.md section 3), ``rlep train``: the rollout side and the learning
side, connected.

One training step, one named and timed call per phase:

    rollout      the rollout side's scored groups for this step (rollout, replay, reward:
                 :mod:`rlep_megatron.rollout.side`), tagged with the policy versions that
                 sampled them
    advantage    per group over G' (the learning side, :mod:`rlep_megatron.actor.learner`)
    old_logprob  the actor's log-probs of every response before the update
    train        one epoch of mini-batch updates (on GPU the engine sleeps during these two)
    weight_sync  the new weights streamed into the engine: the policy version goes up by one
    validate     every ``trainer.validation_interval_steps``
    checkpoint   every ``checkpoint.save_interval_steps`` and at the end

``trainer.max_staleness`` picks the rollout scheduler when the trainer is built: 0 generates
each step's prompts under the weights that train on them; k >= 1 keeps the prompts of the next
k steps generating on the engine while a step's own finish, so that the engine stays busy
through the long tail, and a token is at most k versions old when trained
(:mod:`rlep_megatron.rollout.scheduler`). Checkpoints are drain points: nothing is in flight
when one is written, so a resume is exact in every mode.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Optional

from rlep_megatron import distributed, faults
from rlep_megatron.config import RunConfig, dump_config
from rlep_megatron.data.batch import StepBatch
from rlep_megatron.rollout.side import REPLAY_KEYS_WITHOUT_REPLAY

logger = logging.getLogger(__name__)


class Timer:
    """``with timer.phase("rollout"): ...`` records ``timing/rollout_s`` (and is where
    ``RLEP_FAULT_INJECT`` strikes, :mod:`rlep_megatron.faults`)."""

    def __init__(self, step: Optional[int] = None):
        self.values: dict[str, float] = {}
        self.step = step  # the training step whose phases these are (metrics.jsonl's number)

    @contextlib.contextmanager
    def phase(self, name: str):
        faults.check(name, distributed.get_rank(), self.step)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.values[f"timing/{name}_s"] = (self.values.get(f"timing/{name}_s", 0.0)
                                               + time.perf_counter() - start)


def _throughput(batch: StepBatch, timings: dict[str, float]) -> dict[str, float]:
    """``timing/<phase>_tokens_per_s``: generated tokens per second of the rollout phase, and
    tokens (prompt + response) of the trained sequences per second of the old-log-prob and
    train phases (each optimizer step passes every sequence once)."""
    tokens = sum(batch.length(s) for s in batch.sequences)
    out = {}
    for phase, count in (("rollout", batch.generated_tokens), ("old_logprob", tokens),
                         ("train", tokens)):
        seconds = timings.get(f"timing/{phase}_s", 0.0)
        if seconds > 0:
            out[f"timing/{phase}_tokens_per_s"] = count / seconds
    return out


def _device_memory() -> dict[str, float]:
    """On a GPU: ``memory/max_allocated_gib``, the most memory torch's allocator held at once
    on this rank since the previous step (what ``rlep plan``'s peaks estimate; a vLLM engine's
    own pool is not in it); the count starts again for the next step. Nothing on the CPU."""
    from rlep_megatron import platform

    if not platform.cuda_available():
        return {}
    import torch

    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    torch.cuda.reset_peak_memory_stats()
    return {"memory/max_allocated_gib": peak}


def build_engine(cfg: RunConfig, learner):
    """The rollout engine of the run (:func:`rlep_megatron.rollout.factory.build_engine`),
    started with dummy weights (the first weight sync fills them)."""
    from rlep_megatron.rollout.factory import build_engine as build

    return build(cfg, dtype=str(learner.info.params_dtype).split(".")[-1],
                 capture_routing=learner.moe and cfg.trainer.max_staleness == 0,
                 eager_for_routing=cfg.algo.routing_replay == "rollout",
                 lora=cfg.lora if cfg.syncs_adapters else None,
                 actor=(learner.chunks, learner.info))


def build_scheduler(cfg: RunConfig, engine, ends_at_checkpoint):
    """The rollout scheduler ``trainer.max_staleness`` names."""
    from rlep_megatron.rollout import scheduler

    if cfg.trainer.max_staleness == 0:
        return scheduler.SynchronousScheduler(engine)
    if cfg.algo.rollout_correction == "off":
        logger.warning("trainer.max_staleness=%d with algo.rollout_correction=off: tokens of "
                       "older versions are trained without importance correction; set "
                       "algo.rollout_correction=truncate or mask (docs/ASYNC.md)",
                       cfg.trainer.max_staleness)
    if cfg.checkpoint.save_interval_steps == 1:
        logger.warning("trainer.max_staleness=%d with checkpoint.save_interval_steps=1: every "
                       "step is a checkpoint's drain point, so nothing is generated ahead and "
                       "the run is synchronous", cfg.trainer.max_staleness)
    return scheduler.AheadScheduler(engine, cfg, ends_at_checkpoint)


class Trainer:
    """The loop between the rollout side and the learning side, plus checkpoints, validation
    and metrics."""

    def __init__(self, cfg: RunConfig):
        from rlep_megatron.actor.learner import LearningSide
        from rlep_megatron.checkpoint.hf_io import load_hf_config
        from rlep_megatron.checkpoint.resume import CheckpointManager
        from rlep_megatron.checks import preflight
        from rlep_megatron.rollout.side import RolloutSide

        self.cfg = cfg
        faults.target()  # a malformed RLEP_FAULT_INJECT fails here, not mid-run
        # loggers, files, layout against the model, resume target; the data, the pool and the
        # batch size against the dataset: before any expensive set-up (what rlep config runs)
        train_rows, self.val_rows, pool = preflight(cfg, "train")
        self.hf_config = load_hf_config(cfg.model.hf_dir)
        if cfg.model.mcore_dir:
            if not os.path.isdir(cfg.model.mcore_dir):
                raise FileNotFoundError(f"model.mcore_dir={cfg.model.mcore_dir!r} does not exist")
            if os.path.isfile(os.path.join(cfg.model.mcore_dir, "meta.json")):
                from rlep_megatron.checkpoint.dist import check_checkpoint_model

                check_checkpoint_model(cfg.model.mcore_dir, self.hf_config)
        self.checkpoints = CheckpointManager(cfg, self.hf_config)
        self.checkpoints.check_output_dir()
        self.learner = LearningSide(cfg, self.hf_config)
        self.engine = build_engine(cfg, self.learner)
        tokenizer = self.engine.get_tokenizer()
        self.learner.connect(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                             else self.engine.eos_token_id, self.engine.routing_unavailable,
                             self.engine.capturing_routing)
        self.engine.plan_weights(self.learner.streamer.plan())  # what the stream will carry
        self.scheduler = build_scheduler(cfg, self.engine, self.ends_at_checkpoint)
        self.rollout = RolloutSide(cfg, self.scheduler, tokenizer, self.engine.eos_token_id,
                                   train_rows, pool)
        self.rollout.likelihood = self.learner.response_logprob_sums  # replay.policy=unlikely
        self.metrics = None
        if distributed.is_rank0():
            self.metrics = self._open_metrics()
        self.step = 0

    def _open_metrics(self):
        from rlep_megatron.metrics import MetricsWriter

        cfg = self.cfg
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        dump_config(cfg, cfg.trainer.output_dir)
        from rlep_megatron.config import config_to_dict
        from rlep_megatron.metrics import open_mlflow_run, open_wandb_run

        t = cfg.trainer
        wandb_run = mlflow_run = None
        if "wandb" in t.loggers:
            wandb_run = open_wandb_run(t.output_dir, t.wandb_project, t.wandb_run_name,
                                       config_to_dict(cfg), entity=t.wandb_entity,
                                       group=t.wandb_group, tags=t.wandb_tags)
        if "mlflow" in t.loggers:
            mlflow_run = open_mlflow_run(t.output_dir, t.mlflow_experiment, t.wandb_run_name,
                                         t.mlflow_tracking_uri, config_to_dict(cfg))
        return MetricsWriter(t.output_dir, tensorboard="tensorboard" in t.loggers,
                             wandb_run=wandb_run, mlflow_run=mlflow_run)

    def ends_at_checkpoint(self, step: int) -> bool:
        """Whether training step ``step`` (0-based) is followed by a checkpoint."""
        save_every, done = self.cfg.checkpoint.save_interval_steps, step + 1
        return bool(save_every and done % save_every == 0) or done == self.cfg.trainer.total_steps

    # ------------------------------------------------------------------ loop

    def train_step(self) -> dict[str, float]:
        timer = Timer(step=self.step + 1)
        step_start = time.perf_counter()
        batch = self.rollout.next_batch(self.step, timer)
        with timer.phase("advantage"):
            self.learner.advantage(batch)
        # a colocated engine's requests step aside and it releases the devices to the update;
        # servers go on generating the next batches meanwhile
        self.scheduler.before_update()
        with self.engine.released():
            train, old_metrics = self.learner.update(batch, timer, self.step)
        with timer.phase("weight_sync"), self.scheduler.weight_update(self.step + 1):
            sync = self.sync_weights(version=self.step + 1)
        metrics = self.step_metrics(batch, train, old_metrics)
        metrics["weight_sync/bytes"] = float(sync["bytes"])
        metrics.update(self.scheduler.tail_metrics())
        self.step += 1
        metrics.update(timer.values)
        metrics["timing/step_s"] = time.perf_counter() - step_start
        metrics.update(_throughput(batch, timer.values))
        metrics.update(_device_memory())
        return metrics

    def step_metrics(self, batch: StepBatch, train: dict, old: dict) -> dict[str, float]:
        m = self.rollout.metrics(batch, self.step)
        m.update(old)
        for key, value in train.items():
            # the router losses are MoE metrics (moe/aux_loss, moe/z_loss), not under train/
            m[key if key.startswith("moe/") else f"train/{key}"] = value
        if self.rollout.replay_sampler is None:
            # no replays configured (M = 0): no means over an empty set; the contract's
            # replay/fraction, replay/num_sequences and replay/reward_mean stay (0 by convention)
            m = {k: v for k, v in m.items()
                 if k in REPLAY_KEYS_WITHOUT_REPLAY or not (k.startswith("replay/")
                                                            or k.endswith("/replay"))}
        return m

    def validate(self) -> dict[str, float]:
        """``val/<data_source>/mean@k`` (and maj/best/pass) on the validation files."""
        from rlep_megatron.evaluate import evaluate_policy

        ecfg = self.cfg.eval
        report = evaluate_policy(self.engine, self.rollout.scorer, self.val_rows,
                                 ecfg.num_samples_per_prompt, ecfg.temperature, ecfg.top_p,
                                 self.cfg.rollout.max_response_tokens,
                                 self.cfg.data.max_prompt_tokens,
                                 seed=self.cfg.trainer.seed + 7_777_777)
        return {f"val/{source}/{name}": float(value) for source, table in report.items()
                for name, value in table.items() if name != "num_questions"}

    def sync_weights(self, version: Optional[int] = None) -> dict[str, float]:
        """The actor's weights into the engine (:mod:`rlep_megatron.weight_sync.lifecycle`);
        ``version``: the policy version they are (the servers label their tokens with it)."""
        from rlep_megatron.weight_sync import sync_weights

        return sync_weights(self.engine, self.learner.streamer, version)

    def with_train_state(self, action, resync: bool = True):
        """``action()`` (a checkpoint save or load) with the train state on the device. With it
        offloaded, it comes back while the engine has released the devices; that release
        discards a sleeping engine's weights: with ``resync`` they are synced again from the
        (unchanged) actor."""
        if not self.learner.train_state_offloaded:
            return action()
        with self.engine.released():
            result = self.learner.with_train_state(action)
        if resync and self.engine.weights_incomplete:
            self.sync_weights()
        return result

    def save_checkpoint(self) -> None:
        """A drain point: nothing is in flight on the engine (the scheduler saw it coming).
        With the train state offloaded, the save brings it back while the engine sleeps."""
        self.with_train_state(lambda: self.checkpoints.save(self))

    def run(self) -> None:
        cfg = self.cfg
        resumed = self.with_train_state(lambda: self.checkpoints.maybe_resume(self),
                                        resync=False)
        if self.metrics is not None:
            # records after the checkpoint (or all of them on a fresh start) are redone
            self.metrics.truncate_after(self.step if resumed else -1)
        self.sync_weights(version=self.step)  # the engine starts with dummy weights
        interval = cfg.trainer.validation_interval_steps
        if (self.val_rows is not None and interval and cfg.trainer.validate_before_train
                and not resumed):
            timer = Timer(step=self.step)
            with timer.phase("validate"):
                values = self.validate()
            self._log(self.step, {**values, **timer.values})
        # the step lines give the progress (step i/N, seconds, ETA): no bar between them
        self._first_step, self._loop_start = self.step, time.perf_counter()
        for _ in range(self.step, cfg.trainer.total_steps):
            metrics = self.train_step()
            timer = Timer(step=self.step)
            if self.val_rows is not None and interval and self.step % interval == 0:
                with timer.phase("validate"):
                    metrics.update(self.validate())
            if self.ends_at_checkpoint(self.step - 1):
                with timer.phase("checkpoint"):
                    self.save_checkpoint()
            metrics.update(timer.values)
            self._log(self.step, metrics)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.log(step, metrics)
            from rlep_megatron.metrics import format_step_line

            total, done = self.cfg.trainer.total_steps, step - getattr(self, "_first_step", step)
            eta = ((time.perf_counter() - self._loop_start) / done * (total - step)
                   if done > 0 else None)
            logger.info("%s", format_step_line(step, total, metrics, eta))

    def close(self, failed: bool = False, process_ending: bool = False) -> None:
        """Release the run's resources. After a failure only this process's own (metrics
        file, scorer workers) and, best effort, what outlives the job (the engine's
        ``abandon``): the other ranks may be anywhere, so no collective is entered (the caller
        then ends the process, see ``cli.main``). ``process_ending``: the process ends right
        after, and the engine's teardown is left to it where it can be."""
        if self.metrics is not None:
            self.metrics.close()
        self.rollout.close()
        if failed:
            self.engine.abandon()
            return
        distributed.barrier()
        self.engine.shutdown(process_ending=process_ending)


def run_train(cfg: RunConfig, process_ending: bool = False) -> str:
    """``rlep train``: returns the output directory. Everything the run writes is complete
    when it returns; ``process_ending`` (a process that ends right after) leaves the engine's
    teardown and the process group to the end of the process."""
    trainer = Trainer(cfg)
    try:
        trainer.run()
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close(process_ending=process_ending)
    if not process_ending:
        distributed.destroy()
    return cfg.trainer.output_dir
