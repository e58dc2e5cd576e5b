"""Seeded, resumable prompt sampler sharded over data-parallel ranks.

Every epoch is a permutation of the rows drawn from ``seed + epoch`` (or the identity without
shuffle). A global batch of ``batch_size`` rows is cut from it (the incomplete tail is dropped
with ``drop_last``); data-parallel rank r takes the r-th contiguous slice. ``state_dict()`` after
any batch, restored with ``load_state_dict``, gives the same future batches.
"""
from __future__ import annotations

import numpy as np


class PromptSampler:
    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1):
        if batch_size % data_parallel_size:
            raise ValueError(f"data.train_batch_size={batch_size} is not divisible by the "
                             f"data-parallel size {data_parallel_size}")
        if num_rows < batch_size and drop_last:
            raise ValueError(f"the dataset has {num_rows} rows, fewer than one batch of "
                             f"data.train_batch_size={batch_size}")
        if num_rows == 0:
            raise ValueError("the dataset is empty")
        self.num_rows = num_rows
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.epoch = 0
        self.batch_in_epoch = 0

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_global_batch(self) -> list[int]:
        """Row indices of the next batch across all data-parallel ranks."""
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
        start = self.batch_in_epoch * self.batch_size
        rows = self._order(self.epoch)[start:start + self.batch_size]
        self.batch_in_epoch += 1
        return rows.tolist()

    def shard(self, global_batch: list[int]) -> list[int]:
        """This data-parallel rank's contiguous slice of a global batch."""
        per_rank = -(-len(global_batch) // self.data_parallel_size)
        start = self.data_parallel_rank * per_rank
        return global_batch[start:start + per_rank]

    def next_batch(self) -> list[int]:
        return self.shard(self.next_global_batch())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.seed,
                "num_rows": self.num_rows, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_rows", "batch_size"):
            if state[key] != getattr(self, key):
                hint = (" (an RLEP run with replay.pooled_questions_only trains on the rows "
                        "that have a pool: a checkpoint saved without it, or with another "
                        "pool, resumes only with the setting and pool it was saved with)"
                        if key == "num_rows" else "")
                raise ValueError(f"sampler state was saved with {key}={state[key]}, but this run "
                                 f"has {key}={getattr(self, key)}; resume with the same data, "
                                 f"data.train_batch_size and trainer.seed{hint}")
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
