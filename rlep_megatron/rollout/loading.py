"""A rollout engine serving a given checkpoint, for ``rlep collect`` and ``rlep eval``.

* an HF directory (has ``config.json``): vLLM loads it directly;
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


def open_engine(cfg, checkpoint: str, max_model_len: int, seed: int):
    """A :class:`RolloutEngine` with the checkpoint's weights (collective)."""
    from rlep_megatron.rollout import RolloutEngine

    kind = checkpoint_kind(checkpoint)
    distributed.init_process_group()
    if kind == "hf":
        return RolloutEngine(checkpoint, cfg.rollout, dtype=_dtype_name(cfg), seed=seed,
                             max_model_len=max_model_len)
    return _engine_from_training_checkpoint(cfg, checkpoint, max_model_len, seed)


@contextlib.contextmanager
def engine_and_scorer(cfg, checkpoint: str, seed: int, release: bool = True):
    """``with engine_and_scorer(cfg, checkpoint, seed) as (engine, scorer):`` the engine of
    :func:`open_engine` (prompt + response budget of ``cfg``) and a scorer pool, for the jobs
    that only sample and score (``rlep collect``, ``rlep eval``). A normal exit shuts both down
    together with the process group (``release=False``: the scorer only, after a barrier; the
    engine and the process group are left to the end of the process, which the CLI ends at
    once); after an exception only this process's scorer workers are stopped: the other ranks
    may be blocked in a collective, so no collective is entered (the CLI then ends the
    process)."""
    from rlep_megatron.reward import make_scorer_pool

    engine = open_engine(cfg, checkpoint, cfg.data.max_prompt_tokens
                         + cfg.rollout.max_response_tokens, seed)
    scorer = make_scorer_pool(cfg.reward.backend, cfg.reward.num_workers, cfg.reward.timeout_s)
    try:
        yield engine, scorer
    except BaseException:
        scorer.close()
        raise
    scorer.close()
    distributed.barrier()
    if release:
        engine.shutdown()
        distributed.destroy()


def _dtype_name(cfg) -> str:
    from rlep_megatron.models.megatron import resolve_dtype

    return str(resolve_dtype(cfg.model.params_dtype)).split(".")[-1]


def _engine_from_training_checkpoint(cfg, checkpoint: str, max_model_len: int, seed: int):
    from rlep_megatron.models.megatron import build_model, resolve_dtype
    from rlep_megatron.checkpoint.dist import load_mcore_weights
    from rlep_megatron.checkpoint.hf_io import load_hf_config
    from rlep_megatron.models import layout_limits
    from rlep_megatron.rollout import RolloutEngine
    from rlep_megatron.weight_sync import WeightStreamer, sync_weights

    if not cfg.model.hf_dir:
        raise ValueError("loading a training checkpoint needs model.hf_dir (the HF directory "
                         "the run started from: config and tokenizer)")
    hf = load_hf_config(cfg.model.hf_dir)
    distributed.init_model_parallel(cfg.parallel, seed=seed, **layout_limits(hf))
    chunks, info = build_model(hf, resolve_dtype(cfg.model.params_dtype),
                               transformer_engine=cfg.model.transformer_engine)
    load_mcore_weights(chunks, checkpoint, hf_config=hf)
    engine = RolloutEngine(cfg.model.hf_dir, cfg.rollout, dtype=_dtype_name(cfg), seed=seed,
                           max_model_len=max_model_len, load_weights=False)
    result = sync_weights(engine, WeightStreamer(chunks, info,
                                                 cfg.rollout.weight_sync_bucket_bytes))
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
