"""Torchrun function: one RLEP loss step on a fixed batch lowers the log-prob of the tokens of
negative-advantage responses and raises that of positive ones, fresh and replayed alike (rows 2
and 3 are replays)."""
import json

import torch

from rlep_megatron import distributed
from rlep_megatron.actor.forward import pad_sequences
from rlep_megatron.actor.model import build_from_hf
from rlep_megatron.actor.optimizer import build_optimizer, wrap_ddp
from rlep_megatron.actor.train_step import TrainBatch, train_mini_batch
from rlep_megatron.config import AlgoConfig, OptimConfig, ParallelConfig
from rlep_megatron.actor.forward import actor_logprobs_everywhere


def main(hf_dir: str, out: str, tp: int = 1, pp: int = 1) -> None:
    distributed.init_model_parallel(
        ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
    chunks, info = build_from_hf(hf_dir, "float32")
    cfg = OptimConfig(lr=1e-3, lr_warmup_steps=0, weight_decay=0.0)
    chunks = wrap_ddp(chunks, cfg.use_distributed_optimizer)
    optimizer = build_optimizer(chunks, cfg, torch.float32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(4)]
    responses = [torch.randint(0, 256, (10,), generator=g).tolist() for _ in range(4)]
    sequences = [p + r for p, r in zip(prompts, responses)]
    ids, lengths = pad_sequences(sequences, pad_id=256)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    mask = ((positions >= 6) & (positions < lengths[:, None])).float()
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    before = actor_logprobs_everywhere(chunks, info, sequences, 256)
    metrics = train_mini_batch(chunks, optimizer, info,
                               TrainBatch(ids, mask, before.clone(), advantages,
                                          torch.tensor([False, False, True, True])),
                               AlgoConfig(), 4096)
    after = actor_logprobs_everywhere(chunks, info, sequences, 256)
    change = ((after - before) * mask).sum(dim=1) / mask.sum(dim=1)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"change": change.tolist(), "applied": metrics["step_applied"]}, f)
    distributed.destroy()
