"""bf16 on one rank with the distributed optimizer (a single-GPU user's defaults): every
parameter in bf16, and the training checkpoint's model + optimizer state saves and loads back
(megatron-core 0.16 mismatched optimizer states when the local spec's norms stayed float32)."""
import json
import os
import types

import pytest
import torch

from tests.torchrun import run_function

pytestmark = pytest.mark.distributed


def save_and_load(hf_dir: str, work: str, out: str) -> None:
    from megatron.core import dist_checkpointing

    from rlep_megatron import distributed
    from rlep_megatron.actor.model import build_from_hf
    from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
    from rlep_megatron.checkpoint.resume import CheckpointManager
    from rlep_megatron.config import OptimConfig, ParallelConfig

    distributed.init_model_parallel(ParallelConfig(), seed=0)
    os.makedirs(work, exist_ok=True)
    manager = CheckpointManager.__new__(CheckpointManager)  # only its state-dict layout

    def build():
        chunks, info = build_from_hf(hf_dir, "bfloat16")
        chunks = wrap_ddp(chunks, use_distributed_optimizer=True)
        optimizer = build_optimizer(chunks, OptimConfig(lr=1e-3, lr_warmup_steps=0),
                                    info.params_dtype)
        return types.SimpleNamespace(chunks=chunks, optimizer=optimizer)

    trainer = build()
    dtypes = sorted({str(p.dtype) for c in trainer.chunks for p in c.parameters()})
    for chunk in trainer.chunks:  # a step with gradients, so Adam's state is not all zeros
        for p in chunk.parameters():
            p.main_grad.normal_()
    trainer.optimizer.step()
    dist_checkpointing.save(manager._sharded_state(types.SimpleNamespace(learner=trainer)), work)
    saved = {k: v.clone() for o in trainer.optimizer.torch_optimizers()
             for i, s in enumerate(o.state.values()) for k, v in
             ((f"{i}.{name}", t) for name, t in s.items() if name != "step")}
    fresh = build()
    fresh.optimizer.create_state()
    state = dist_checkpointing.load(
        manager._sharded_state(types.SimpleNamespace(learner=fresh), is_loading=True), work)
    fresh.optimizer.load_checkpoint_state(state["optimizer"],
                                          trainer.optimizer.state_dict())
    loaded = {k: v for o in fresh.optimizer.torch_optimizers()
              for i, s in enumerate(o.state.values()) for k, v in
              ((f"{i}.{name}", t) for name, t in s.items() if name != "step")}
    with open(out, "w") as f:
        json.dump({"dtypes": dtypes, "states": len(saved),
                   "equal": sorted(saved) == sorted(loaded)
                   and all(torch.equal(saved[k], loaded[k]) for k in saved),
                   "nonzero": any(bool(v.abs().sum() > 0) for v in saved.values())}, f)
    distributed.destroy()


def test_bf16_distributed_optimizer_checkpoint_on_one_rank(tiny_qwen2_dir, tmp_path):
    out = tmp_path / "result.json"
    run_function("tests.distributed.test_bf16_checkpoint:save_and_load", 1,
                 {"hf_dir": tiny_qwen2_dir, "work": str(tmp_path / "ckpt"), "out": str(out)})
    result = json.loads(out.read_text())
    assert result["dtypes"] == ["torch.bfloat16"]
    assert result["states"] > 0 and result["nonzero"] and result["equal"]
