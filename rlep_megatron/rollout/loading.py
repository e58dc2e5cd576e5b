"""A rollout engine serving a given checkpoint, for ``rlep collect`` and ``rlep eval``, colocated
or on the rollout servers (``rollout.placement``):

* an HF directory (has ``config.json``): a colocated vLLM loads it directly; the servers (started
  with dummy weights of ``model.hf_dir``'s architecture) receive its tensors in one update;
* a training checkpoint (``checkpoints/step_XXXXXXXX``, has ``meta.json`` and ``dist/``): the
  actor is built at ``parallel.*`` from ``model.hf_dir``'s config, its weights are loaded from
  the dist checkpoint (any saved layout) and streamed into an engine started with dummy weights.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os

from rlep_megatron import distributed

logger = logging.getLogger(__name__)


def resolve_checkpoint(path: str) -> str:
    """``path`` itself, or for a run's output directory (``trainer.output_dir``, holding
    ``checkpoints/``) its newest complete checkpoint."""
    from rlep_megatron.checkpoint.resume import list_checkpoints

    root = os.path.join(path, "checkpoints") if path else ""
    if not path or not os.path.isdir(root) or os.path.isfile(os.path.join(path, "config.json")):
        return path
    found = list_checkpoints(root)
    if not found:
        raise FileNotFoundError(f"{path!r} is a run directory without a complete checkpoint "
                                f"under {root}")
    step, newest = found[-1]
    logger.info("using the newest checkpoint of %s: step %d (%s)", path, step, newest)
    return newest


def checkpoint_kind(path: str) -> str:
    """``"hf"`` or ``"training"``; a clear error for anything else."""
    if not path:
        raise ValueError("no checkpoint given")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.isfile(os.path.join(path, "meta.json")) and os.path.isdir(
            os.path.join(path, "dist")):
        return "training"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise ValueError(f"{path!r} is neither an HF checkpoint (config.json) nor a training "
                     "checkpoint (meta.json + dist/, e.g. <output_dir>/checkpoints/step_00000010)")


def open_engine(cfg, checkpoint: str, seed: int):
    """The engine of ``rollout.placement`` (:mod:`rlep_megatron.rollout.factory`) with the
    checkpoint's weights (collective): a colocated engine loads an HF checkpoint itself; the
    servers, which start with dummy weights, receive its tensors through a weight update."""
    from rlep_megatron.rollout.factory import build_engine

    kind = checkpoint_kind(checkpoint)
    distributed.init_process_group()
    if cfg.rollout.backend == "megatron":  # the checkpoint's own model generates
        chunks, info, base = _megatron_model(cfg, checkpoint, kind, seed)
        return build_engine(cfg, model_dir=base, seed=seed, actor=(chunks, info))
    if kind == "training":
        return _engine_from_training_checkpoint(cfg, checkpoint, seed)
    if cfg.rollout.placement != "separate":
        return build_engine(cfg, model_dir=checkpoint, load_weights=True, seed=seed)
    _check_same_architecture(checkpoint, cfg.model.hf_dir)
    engine = build_engine(cfg, seed=seed)
    _load_hf_checkpoint(engine, checkpoint)
    return engine


def _check_same_architecture(checkpoint: str, served: str) -> None:
    """The servers run ``model.hf_dir``'s architecture: a checkpoint of another shape cannot
    be loaded into them."""
    from rlep_megatron.checkpoint.hf_io import load_hf_config

    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size")
    mine, theirs = load_hf_config(checkpoint), load_hf_config(served)
    differ = [k for k in keys if mine.get(k) != theirs.get(k)]
    if differ:
        raise ValueError(f"checkpoint {checkpoint!r} differs from model.hf_dir {served!r} (the "
                         f"architecture the rollout servers run) in {', '.join(differ)}: set "
                         "model.hf_dir to the checkpoint's base model")


def _load_hf_checkpoint(engine, checkpoint: str) -> None:
    """Every tensor of an HF checkpoint into the servers in one weight update; global rank 0
    (the rank that sends) reads the files, the other ranks take part in the update with none."""
    from rlep_megatron.checkpoint.hf_io import SafetensorsReader
    from rlep_megatron.weight_sync import deliver

    reader = SafetensorsReader(checkpoint)
    names = reader.names() if distributed.is_rank0() else []
    engine.plan_weights([(name, *reader.spec(name)) for name in names])
    result = deliver(engine, ((name, reader.get(name)) for name in names))
    logger.info("loaded %s into the rollout servers (%d tensors, %.2f GB)", checkpoint,
                result["tensors"], result["bytes"] / 1e9)


@contextlib.contextmanager
def engine_and_scorer(cfg, checkpoint: str, seed: int, process_ending: bool = False):
    """``with engine_and_scorer(cfg, checkpoint, seed) as (engine, scorer):`` the engine of
    :func:`open_engine` (prompt + response budget of ``cfg``) and a scorer pool, for the jobs
    that only sample and score (``rlep collect``, ``rlep eval``). A normal exit shuts both down
    together with the process group (``process_ending``: the scorer, after a barrier, and
    what of the engine outlives the process (the servers); the rest is left to the end of the
    process, which the CLI ends at once); after an exception only this process's scorer
    workers are stopped and the engine abandoned: the other ranks may be blocked in a
    collective, so no collective is entered (the CLI then ends the process)."""
    from rlep_megatron.reward import make_scorer_pool

    engine = open_engine(cfg, checkpoint, seed)
    scorer = make_scorer_pool(cfg.reward.backend, cfg.reward.num_workers, cfg.reward.timeout_s)
    try:
        yield engine, scorer
    except BaseException:
        scorer.close()
        engine.abandon()
        raise
    scorer.close()
    distributed.barrier()
    engine.shutdown(process_ending=process_ending)
    if not process_ending:
        distributed.destroy()


def checkpoint_lora(checkpoint: str):
    """The LoRA section of the run that wrote a training checkpoint, or None (no LoRA, or a
    converted checkpoint without a run config)."""
    from rlep_megatron.config import CONFIG_FILE_NAME, load_config

    path = os.path.join(checkpoint, CONFIG_FILE_NAME)
    if not os.path.isfile(path):
        return None
    lora = load_config(path).lora
    return lora if lora.enabled else None


def _engine_from_training_checkpoint(cfg, checkpoint: str, seed: int):
    from rlep_megatron.models.megatron import build_model, resolve_dtype
    from rlep_megatron.checkpoint.dist import load_mcore_weights
    from rlep_megatron.checkpoint.hf_io import load_hf_config
    from rlep_megatron.models import layout_limits
    from rlep_megatron.rollout.factory import build_engine
    from rlep_megatron.weight_sync import WeightStreamer, sync_weights

    if not cfg.model.hf_dir:
        raise ValueError("loading a training checkpoint needs model.hf_dir (the HF directory "
                         "the run started from: config and tokenizer)")
    hf = load_hf_config(cfg.model.hf_dir)
    distributed.init_model_parallel(cfg.parallel, seed=seed, **layout_limits(hf))
    lora = checkpoint_lora(checkpoint)
    chunks, info = build_model(hf, resolve_dtype(cfg.model.params_dtype),
                               transformer_engine="off" if lora else
                               cfg.model.transformer_engine)
    if lora is not None:  # the adapters load with the weights; the stream merges them in
        from rlep_megatron.lora.adapters import attach

        attach(chunks, info, lora, seed=0)
    load_mcore_weights(chunks, checkpoint, hf_config=hf)
    engine = build_engine(cfg, seed=seed)
    streamer = WeightStreamer(chunks, info, cfg.rollout.weight_sync_bucket_bytes)
    engine.plan_weights(streamer.plan())
    result = sync_weights(engine, streamer)
    logger.info("loaded %s into the engine (%d tensors, %.2f GB)", checkpoint,
                result["tensors"], result["bytes"] / 1e9)
    del chunks
    # the actor was alive when the heap was frozen (before the engine was built, and by vLLM
    # after): whatever of it sits in reference cycles is freed only by a collection over the
    # unfrozen heap
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return engine


def _megatron_model(cfg, checkpoint: str, kind: str, seed: int):
    """For ``rlep collect`` / ``rlep eval`` with ``rollout.backend=megatron``: this rank's
    ``(chunks, info)`` of ``checkpoint`` (an HF directory, or a training checkpoint with
    ``model.hf_dir`` its base) at the run's ``parallel`` layout, and the directory of its
    tokenizer (collective)."""
    from rlep_megatron.checkpoint.hf_io import load_hf_config
    from rlep_megatron.models import layout_limits
    from rlep_megatron.models.megatron import build_model, resolve_dtype

    base = checkpoint if kind == "hf" else cfg.model.hf_dir
    if not base:
        raise ValueError("loading a training checkpoint needs model.hf_dir (the HF directory "
                         "the run started from: config and tokenizer)")
    hf = load_hf_config(base)
    distributed.init_model_parallel(cfg.parallel, seed=seed, **layout_limits(hf))
    if kind == "hf":
        from rlep_megatron.actor.model import build_from_hf

        chunks, info = build_from_hf(checkpoint, cfg.model.params_dtype,
                                     transformer_engine=cfg.model.transformer_engine,
                                     moe_experts=cfg.model.moe_experts)
        return chunks, info, base
    from rlep_megatron.checkpoint.dist import load_mcore_weights

    lora = checkpoint_lora(checkpoint)
    chunks, info = build_model(hf, resolve_dtype(cfg.model.params_dtype),
                               transformer_engine="off" if lora else cfg.model.transformer_engine,
                               moe_experts=cfg.model.moe_experts)
    if lora is not None:
        from rlep_megatron.lora.adapters import attach

        attach(chunks, info, lora, seed=0)
    load_mcore_weights(chunks, checkpoint, hf_config=hf)
    return chunks, info, base
