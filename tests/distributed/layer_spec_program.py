"""Torchrun functions for tests/distributed/test_layer_specs.py (one rank)."""
import json
import os

import torch

from rlep_megatron import distributed, platform
from rlep_megatron.config import ParallelConfig


def meta_skeleton_on_a_gpu_node(hf_dir: str, out: str) -> None:
    """The conversion tools' skeleton (``build_model(on_meta_device=True)``) on a node where
    CUDA is available (faked) must not touch the GPU: every parameter stays on the meta
    device and TransformerEngine is not asked for."""
    from rlep_megatron.models.megatron import build_model
    from rlep_megatron.checkpoint.hf_io import load_hf_config

    distributed.init_model_parallel(ParallelConfig(), seed=0)
    platform.probe.cuda_available = lambda: True  # a GPU node, faked after gloo is up

    def no_gpu(*args, **kwargs):
        raise AssertionError("the skeleton asked for a CUDA device")

    torch.cuda.current_device = no_gpu
    platform.probe.transformer_engine_status = no_gpu  # the skeleton must not depend on TE
    chunks, info = build_model(load_hf_config(hf_dir), torch.bfloat16, on_meta_device=True)
    devices = sorted({p.device.type for c in chunks for p in c.parameters()})
    with open(out, "w") as f:
        json.dump({"devices": devices, "use_te": info.use_te,
                   "params": sum(1 for c in chunks for _ in c.parameters())}, f)
    distributed.destroy()


def extra_state_is_reconciled(hf_dir: str, work: str, out: str) -> None:
    """A checkpoint without TransformerEngine's ``_extra_state`` objects (the local spec's)
    loads into a model that asks for them (a TE model: simulated by adding such an object to
    the request); one that has them loads them."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from rlep_megatron.actor.model import build_from_hf
    from rlep_megatron.checkpoint.dist import (drop_unsaved_extra_state, load_model_state_dict,
                                               model_sharded_state_dict)

    distributed.init_model_parallel(ParallelConfig(), seed=0)
    chunks, _ = build_from_hf(hf_dir, "float32")
    expected = {k: v.clone() for k, v in chunks[0].state_dict().items()
                if isinstance(v, torch.Tensor)}
    key = "output_layer.te_probe._extra_state"  # a key no local-spec object uses

    def extra(data):
        return ShardedObject(key, data, (1,), (0,), replica_id=0)

    local_dir, te_dir = f"{work}/local", f"{work}/te"
    os.makedirs(local_dir)
    os.makedirs(te_dir)
    dist_checkpointing.save(model_sharded_state_dict(chunks), local_dir)
    dist_checkpointing.save({**model_sharded_state_dict(chunks), "qkv_extra": extra(b"fp8")},
                            te_dir)
    result = {}
    try:  # megatron alone refuses the local checkpoint for the TE-like request
        dist_checkpointing.load({**model_sharded_state_dict(chunks), "qkv_extra": extra(None)},
                                local_dir)
        result["plain_load"] = "loaded"
    except BaseException as err:  # noqa: BLE001 - torch DCP raises a BaseException
        result["plain_load"] = type(err).__name__
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.zero_()
    request = drop_unsaved_extra_state(
        {**model_sharded_state_dict(chunks), "qkv_extra": extra(None)}, local_dir)
    result["dropped"] = "qkv_extra" not in request
    state = dist_checkpointing.load(request, local_dir)
    load_model_state_dict(chunks, state)
    result["weights_equal"] = all(torch.equal(v, expected[k])
                                  for k, v in chunks[0].state_dict().items() if k in expected)
    request = drop_unsaved_extra_state(
        {**model_sharded_state_dict(chunks), "qkv_extra": extra(None)}, te_dir)
    result["kept_value"] = dist_checkpointing.load(request, te_dir)["qkv_extra"].decode()
    # a genuinely missing parameter is an error, not a silently kept initial value
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), local_dir)
    state.pop(next(k for k in state if k.endswith("linear_fc1.weight")))
    try:
        load_model_state_dict(chunks, state)
        result["missing_param"] = "loaded"
    except RuntimeError as err:
        result["missing_param"] = str(err)
    with open(out, "w") as f:
        json.dump(result, f)
    distributed.destroy()


def local_spec_mlp_and_overlap(hf_dir: str, tp: int, out: str) -> None:
    """The local spec's dense MLPs after the build, and whether the DDP wrapper kept the
    requested parameter-gather overlap (on only with data-parallel replicas)."""
    from rlep_megatron.actor.model import build_from_hf
    from rlep_megatron.actor.optimizer import wrap_ddp

    distributed.init_model_parallel(ParallelConfig(tensor_model_parallel_size=tp), seed=0)
    chunks, _ = build_from_hf(hf_dir, "float32")
    mlps = sorted({type(layer.mlp).__name__ for layer in chunks[0].decoder.layers})
    chunks = wrap_ddp(chunks, True, overlap_grad_reduce=True, overlap_param_gather=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump({"mlps": mlps,
                       "overlap_param_gather": chunks[0].ddp_config.overlap_param_gather,
                       "overlap_grad_reduce": chunks[0].ddp_config.overlap_grad_reduce}, f)
    distributed.destroy()
