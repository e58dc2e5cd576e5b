"""Training checkpoints and exact resume.

Layout under ``<trainer.output_dir>/checkpoints/``::

    step_00000010/
        dist/              megatron-core dist checkpoint: model and optimizer state (torch_dist;
                           the model loads at any TP/PP; the distributed optimizer's state is
                           each rank's shard (megatron's dp_reshardable): any DP, same TP/PP)
        trainer_state.pt   step, prompt sampler, replay sampler, optimizer counters, RNG states
                           (host streams; every rank's CUDA and megatron model-parallel streams)
        config.yaml        the run's settings; a resume with other ones is refused (see
                           checkpoint.resume_with_changes)
        meta.json          written last: step, model fingerprint, parallel layout and layer
                           spec (TransformerEngine or local),
                           "complete": true

A checkpoint is written into ``.step_XXXXXXXX.partial`` and renamed when every part is on disk,
so a process killed mid-save leaves the previous checkpoint as the newest complete one. After a
successful save only the newest ``checkpoint.keep_last`` are kept. ``checkpoint.resume=auto``
loads the newest complete checkpoint, ``never`` starts from the model, any other value is a
checkpoint directory.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch
import yaml

from rlep_megatron import distributed
from rlep_megatron.checkpoint.dist import check_checkpoint_model, model_fingerprint

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{8})$")


def layer_spec_name(use_te: bool) -> str:
    """How ``meta.json`` names the actor's layer spec."""
    return "transformer_engine" if use_te else "local"


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """``(step, path)`` of complete checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_RE.match(name)
        path = os.path.join(root, name)
        meta = os.path.join(path, "meta.json")
        if match and os.path.isfile(meta):
            try:
                with open(meta) as f:
                    if json.load(f).get("complete"):
                        found.append((int(match.group(1)), path))
            except (OSError, json.JSONDecodeError):
                logger.warning("ignoring checkpoint %s: unreadable meta.json", path)
    return sorted(found)


class CheckpointManager:
    def __init__(self, cfg, hf_config: dict):
        self.cfg = cfg
        self.root = os.path.join(cfg.trainer.output_dir, "checkpoints")
        self.hf_config = hf_config
        self.fingerprint = model_fingerprint(hf_config)

    def _resume_path(self) -> Optional[str]:
        mode = self.cfg.checkpoint.resume
        if mode == "never":
            return None
        if mode == "auto":
            found = list_checkpoints(self.root)
            return found[-1][1] if found else None
        if not os.path.isfile(os.path.join(mode, "meta.json")):
            raise FileNotFoundError(f"checkpoint.resume={mode!r} is not a complete checkpoint "
                                    "directory (no meta.json); use auto, never or a "
                                    "checkpoints/step_XXXXXXXX directory")
        return mode

    def check_output_dir(self) -> None:
        """Refuse, before any expensive work, an output dir whose checkpoints belong to another
        model."""
        for _, path in list_checkpoints(self.root):
            try:
                check_checkpoint_model(path, self.hf_config)
            except ValueError as err:
                raise ValueError(f"trainer.output_dir={self.cfg.trainer.output_dir!r} holds "
                                 f"another model's checkpoint: {err}; choose a new "
                                 "output_dir") from None
        path = self._resume_path()
        if path is not None:
            meta = check_checkpoint_model(path, self.hf_config)
            self._check_layout(path, meta)
            self._check_layer_spec(path, meta)
            self._check_config_changes(path)

    def _check_config_changes(self, path: str) -> None:
        """A resume continues the saved run: other settings (lr, batch, pool, seed...) would
        silently make it another one. Refused, listing the keys, unless
        ``checkpoint.resume_with_changes``; nothing in the output directory is touched."""
        from rlep_megatron.config import CONFIG_FILE_NAME, config_changes

        if self.cfg.checkpoint.resume_with_changes:
            return
        saved_path = os.path.join(path, CONFIG_FILE_NAME)
        if not os.path.isfile(saved_path):  # saved by an older version: the run's own copy
            saved_path = os.path.join(os.path.dirname(os.path.dirname(path)), CONFIG_FILE_NAME)
        if not os.path.isfile(saved_path):
            logger.warning("checkpoint %s records no configuration: its settings cannot be "
                           "compared with this run's", path)
            return
        with open(saved_path) as f:
            saved = yaml.safe_load(f) or {}
        changes = config_changes(saved, self.cfg)
        if changes:
            listed = ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)
            raise ValueError(
                f"checkpoint {path} belongs to a run with other settings ({listed}); resuming "
                "it would continue that run with different ones. Start a separate run in a "
                "new trainer.output_dir, or set checkpoint.resume_with_changes=true to resume "
                "with the new values")

    def _check_layer_spec(self, path: str, meta: dict) -> None:
        """The optimizer's flat buffers follow the parameter order, which TransformerEngine's
        and the local spec do not share (TE fuses each norm into the next linear layer):
        refuse resuming across specs, with what to do."""
        from rlep_megatron import platform

        saved = meta.get("layer_spec")
        spec = layer_spec_name(platform.use_transformer_engine(self.cfg.actor_transformer_engine))
        if saved is None:
            logger.warning("checkpoint %s does not record its layer spec (saved by an older "
                           "version); resuming it assumes the %s spec this run builds", path,
                           spec)
        elif saved != spec:
            raise ValueError(
                f"checkpoint {path} was saved with the {saved} layer spec and this run builds "
                f"the {spec} spec (model.transformer_engine); resume with the same spec, or "
                "start a new run from its weights (model.mcore_dir=<the checkpoint>, "
                "checkpoint.resume=never, a new trainer.output_dir) without the optimizer state")

    # ------------------------------------------------------------------ state

    # megatron's "fully_reshardable" format (gathered per parameter, any TP/PP) fails to load
    # with torch's Adam (without apex / TE) in megatron-core 0.16; each rank's shard is kept
    _OPTIMIZER_FORMAT = "dp_reshardable"

    def _layout(self) -> dict:
        parallel = self.cfg.parallel
        return {"tensor_model_parallel_size": parallel.tensor_model_parallel_size,
                "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size":
                    parallel.virtual_pipeline_model_parallel_size,
                "distributed_optimizer": self.cfg.optim.use_distributed_optimizer,
                "optimizer_format": self._OPTIMIZER_FORMAT}

    def _check_layout(self, path: str, meta: dict) -> None:
        """The distributed optimizer's dp_reshardable state is laid out by TP/PP (and the
        replicated optimizer's state differs in kind): refuse a mismatch with what to do."""
        saved, now = meta.get("layout"), self._layout()
        if saved is None or saved == now:
            return
        model_parallel = [k for k in ("tensor_model_parallel_size",
                                      "pipeline_model_parallel_size",
                                      "virtual_pipeline_model_parallel_size")
                          if saved.get(k) != now[k]]
        if saved["distributed_optimizer"] != now["distributed_optimizer"]:
            raise ValueError(f"checkpoint {path} was saved with optim.use_distributed_optimizer="
                             f"{str(saved['distributed_optimizer']).lower()}; resume with the "
                             "same setting")
        if model_parallel and saved["distributed_optimizer"]:
            raise ValueError(
                f"checkpoint {path} holds distributed-optimizer state laid out for "
                f"{ {k: saved.get(k) for k in model_parallel} }, this run uses "
                f"{ {k: now[k] for k in model_parallel} }; resume with that layout (any "
                "data-parallel size works), or start a new run from its weights "
                "(model.mcore_dir=<the checkpoint>, checkpoint.resume=never, a new "
                "trainer.output_dir) without the optimizer state")

    def _sharded_state(self, trainer, is_loading: bool = False) -> dict:
        from rlep_megatron.checkpoint.dist import model_sharded_state_dict

        model = model_sharded_state_dict(trainer.learner.chunks)
        # when loading, megatron first creates the (lazily built) Adam state to load into
        optimizer = trainer.learner.optimizer.optimizer.sharded_state_dict(
            model, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": self._OPTIMIZER_FORMAT})
        return {"model": model, "optimizer": optimizer}

    @staticmethod
    def _trainer_state(trainer) -> dict:
        return {
            "step": trainer.step,
            **trainer.rollout.state_dict(),  # "sampler", "replay_sampler", "pass_rates"
            "optimizer_counters": trainer.learner.optimizer.state_dict(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state()},
        }

    @staticmethod
    def _device_rng_state() -> dict:
        """This rank's device RNG streams: CUDA's default generator (on a GPU) and megatron's
        named model-parallel streams (dropout, initialisation; the CPU shim's tracker on
        CPU). They differ between ranks, so every rank's are kept."""
        from megatron.core import tensor_parallel

        state = {"tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    @staticmethod
    def _restore_device_rng_state(per_rank) -> None:
        from megatron.core import tensor_parallel

        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if not per_rank or len(per_rank) != world:
            logger.info("the checkpoint has no device RNG state for %d ranks: the device RNG "
                        "streams start fresh", world)
            return
        mine = per_rank[rank]
        tensor_parallel.get_cuda_rng_tracker().set_states(mine["tracker"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda"])

    def save(self, trainer) -> str:
        from megatron.core import dist_checkpointing

        from rlep_megatron.checkpoint.dist import keep_save_results_in_process

        name = f"step_{trainer.step:08d}"
        final = os.path.join(self.root, name)
        partial = os.path.join(self.root, f".{name}.partial")
        rank0 = torch.distributed.get_rank() == 0
        if rank0:
            os.makedirs(self.root, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(os.path.join(partial, "dist"))
        distributed.barrier()
        keep_save_results_in_process()
        dist_checkpointing.save(self._sharded_state(trainer), os.path.join(partial, "dist"))
        device_rng = distributed.all_gather_object(
            {key: (value.cpu() if torch.is_tensor(value) else value)
             for key, value in self._device_rng_state().items()})
        distributed.barrier()
        if rank0:
            torch.save({**self._trainer_state(trainer), "device_rng": device_rng},
                       os.path.join(partial, "trainer_state.pt"))
            from rlep_megatron.config import dump_config

            dump_config(self.cfg, partial)  # the settings this checkpoint was trained with
            meta = {"step": trainer.step, "model": self.fingerprint, "layout": self._layout(),
                    "layer_spec": layer_spec_name(trainer.learner.info.use_te),
                    "complete": True}
            with open(os.path.join(partial, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(partial, final)
            for _, old in list_checkpoints(self.root)[:-self.cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            logger.info("saved checkpoint %s", final)
        distributed.barrier()
        return final

    def maybe_resume(self, trainer) -> bool:
        """Load the checkpoint chosen by ``checkpoint.resume`` into the trainer; False when
        starting fresh."""
        from megatron.core import dist_checkpointing

        path = self._resume_path()
        if path is None:
            return False
        trainer.learner.optimizer.create_state()
        from rlep_megatron.checkpoint.dist import drop_unsaved_extra_state, load_model_state_dict

        sharded = drop_unsaved_extra_state(self._sharded_state(trainer, is_loading=True),
                                           os.path.join(path, "dist"))
        state = dist_checkpointing.load(sharded, os.path.join(path, "dist"))

        load_model_state_dict(trainer.learner.chunks, state["model"])
        extra = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        trainer.learner.optimizer.load_checkpoint_state(state["optimizer"],
                                                        extra["optimizer_counters"])
        trainer.step = int(extra["step"])
        trainer.rollout.load_state_dict(extra)
        random.setstate(extra["rng"]["python"])
        np.random.set_state(extra["rng"]["numpy"])
        torch.set_rng_state(extra["rng"]["torch"])
        self._restore_device_rng_state(extra.get("device_rng"))
        logger.info("resumed from %s (step %d)", path, trainer.step)
        return True
