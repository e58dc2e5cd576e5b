"""The model part of megatron-core dist checkpoints: this rank's sharded state, loading it back
(a converted checkpoint or a training checkpoint's model, at any saved layout) and the
TransformerEngine extra state a local-spec checkpoint lacks; the check that a training
checkpoint was saved for the model being built."""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from rlep_megatron.models.megatron import unwrap

_FINGERPRINT_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size",
                     "tie_word_embeddings")


def model_fingerprint(hf_config: dict) -> dict:
    """The shape-defining fields of an HF config: checkpoints of another model are refused."""
    return {key: hf_config.get(key) for key in _FINGERPRINT_KEYS}


def check_checkpoint_model(path: str, hf_config: dict) -> dict:
    """A training checkpoint's meta.json, after checking that it was saved for the model of
    ``hf_config`` (``model.hf_dir``); the error names the fields that differ. The one
    fingerprint check of a training checkpoint."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    ours, theirs = model_fingerprint(hf_config), meta.get("model") or {}
    if theirs != ours:
        diff = {k: theirs.get(k) for k in ours if theirs.get(k) != ours[k]}
        raise ValueError(
            f"checkpoint {path} is of another model than model.hf_dir (differs in "
            f"{sorted(diff)}: {diff} vs { {k: ours[k] for k in diff} })")
    return meta


def model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict:
    """Sharded state of this rank's chunks for ``dist_checkpointing`` (``model0``, ``model1``,
    ... with virtual pipeline stages, as megatron's own training checkpoints)."""
    if len(chunks) == 1:
        return unwrap(chunks[0]).sharded_state_dict()
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(chunks)}


EXTRA_STATE = "_extra_state"


def drop_unsaved_extra_state(request: dict, directory: str) -> dict:
    """``request`` (a sharded state dict) without the TransformerEngine ``_extra_state``
    objects that the checkpoint in ``directory`` lacks. TE modules checkpoint such an object
    (their FP8 scaling history); a checkpoint saved with the local spec (a CPU node, the
    conversion tools, ``model.transformer_engine=off``) has none, and megatron would refuse to
    load it into a TE model. The dropped modules keep their initial extra state (no FP8
    history). Parameters are named alike in both specs."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    def extra_objects(tree):
        for value in (tree.values() if isinstance(tree, dict) else tree
                      if isinstance(tree, list) else ()):
            if isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE):
                yield value
            elif isinstance(value, (dict, list)):
                yield from extra_objects(value)

    if next(extra_objects(request), None) is None:
        return request
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    saved = {value.key for value in load_sharded_metadata(directory).values()}

    def prune(tree):
        if isinstance(tree, dict):
            return {k: prune(v) for k, v in tree.items()
                    if not (isinstance(v, ShardedObject) and v.key.endswith(EXTRA_STATE)
                            and v.key not in saved)}
        if isinstance(tree, list):
            return [prune(v) for v in tree]
        return tree

    return prune(request)


def load_model_state_dict(chunks: list[torch.nn.Module], state: dict) -> None:
    """Inverse of :func:`model_sharded_state_dict` once ``dist_checkpointing.load`` filled it.
    Only ``_extra_state`` entries may be missing (:func:`drop_unsaved_extra_state`)."""
    parts = [state] if len(chunks) == 1 else [state[f"model{i}"] for i in range(len(chunks))]
    for chunk, part in zip(chunks, parts):
        result = unwrap(chunk).load_state_dict(part, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                               f"unexpected {list(result.unexpected_keys)[:5]}")


def resolve_mcore_dir(mcore_dir: str) -> str:
    """A dist checkpoint directory; a training checkpoint (``checkpoints/step_XXXXXXXX``, whose
    weights are in ``dist/``) is accepted as well."""
    if os.path.isfile(os.path.join(mcore_dir, "meta.json")) and os.path.isfile(
            os.path.join(mcore_dir, "dist", "metadata.json")):
        return os.path.join(mcore_dir, "dist")
    return mcore_dir


def load_mcore_weights(chunks: list[torch.nn.Module], path: str,
                       hf_config: Optional[dict] = None) -> None:
    """Load a megatron-core dist checkpoint (any saved layout) into this rank's chunks: a
    converted checkpoint or a training checkpoint (``checkpoints/step_XXXXXXXX``, model part;
    with ``hf_config`` its recorded model is checked against it first). The one loader of
    model weights from a dist checkpoint (training start, ``rlep collect``/``eval``, the
    conversion check)."""
    from megatron.core import dist_checkpointing

    directory = resolve_mcore_dir(path)
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise FileNotFoundError(f"{path} is neither a megatron-core dist checkpoint nor a "
                                "training checkpoint (no metadata.json)")
    # a training checkpoint nests the model under "model" next to the optimizer; ask for the
    # same nesting so its common (non-tensor) optimizer entries stay out of the model's dict
    training = directory != path
    if training and hf_config is not None:
        check_checkpoint_model(path, hf_config)
    request = drop_unsaved_extra_state(model_sharded_state_dict(chunks), directory)
    state = dist_checkpointing.load({"model": request} if training else request, directory)
    load_model_state_dict(chunks, state["model"] if training else state)


def keep_save_results_in_process() -> None:
    """Give megatron's checkpoint writer an in-process queue for its write results. Its default
    is a queue served by a ``multiprocessing`` manager started with ``spawn``: a fresh Python
    process that imports this program again (about 3 s on the first save of every job, and a
    process left running until the job ends). That queue exists for megatron's asynchronous
    saves, whose writer runs in another process; the trainer saves synchronously (the writer's
    results are put and read back in this process), where a plain queue holds them the same
    way. Idempotent; a queue megatron already made is kept."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


ADAPTER_PREFIX = "lora.layers."  # the LoRA adapters' keys (rlep_megatron.lora)


def checkpoint_has_adapter(path: str) -> bool:
    """Whether a dist checkpoint (or a training checkpoint) holds LoRA adapters."""
    from torch.distributed.checkpoint import FileSystemReader

    directory = resolve_mcore_dir(path)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return False
    metadata = FileSystemReader(directory).read_metadata().state_dict_metadata
    return any(key.startswith(ADAPTER_PREFIX) for key in metadata)


def refuse_adapter_checkpoint(path: str, what: str) -> None:
    """Refuse to read a LoRA run's checkpoint as plain weights (its adapters would be
    dropped), saying what to do instead."""
    if checkpoint_has_adapter(path):
        raise ValueError(
            f"{what}={path} is a checkpoint of a LoRA run: read as plain weights it would give "
            "the frozen base without its adapters. Export the adapter (tools/lora_export.py) "
            "and merge it into the base (tools/lora_merge.py), or start from the adapter "
            "(lora.init_from)")
