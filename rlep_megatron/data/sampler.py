"""Seeded, resumable prompt sampler sharded over data-parallel ranks.

Every epoch is a permutation of the rows drawn from ``seed + epoch`` (or the identity without
shuffle). A global batch of ``batch_size`` rows is cut from it (the incomplete tail is dropped
with ``drop_last``); data-parallel rank r takes the r-th contiguous slice. ``state_dict()`` after
any batch, restored with ``load_state_dict``, gives the same future batches.

With ``data.train_weights``, :class:`MixtureSampler` draws each row of a batch from a source
(a training file or a ``data_source``) chosen with probability weight / sum, then takes that
source's next row in its own seeded shuffle; as exactly resumable.
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
        if "sources" in state:
            raise ValueError("the checkpoint's sampler state was saved with data.train_weights "
                             f"({ {name: w for name, (_, w) in state['sources'].items()} }); "
                             "resume with the same weights")
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


class MixtureSampler:
    """Weighted mixing of several sources (``groups``: the row indices of each). Global batch
    ``b`` chooses each row's source with ``default_rng([seed, b])`` (independently, with the
    weights' probabilities); each source keeps its place in its own order, a permutation per
    epoch from ``default_rng([seed, 1 + source, epoch])`` (the identity without shuffle), so a
    small source with a large weight repeats, each epoch in a new order."""

    def __init__(self, groups: list[list[int]], weights: list[float], names: list[str],
                 batch_size: int, seed: int, shuffle: bool = True):
        if len(groups) != len(weights) or not groups:
            raise ValueError("one weight per source")
        self.groups = [np.asarray(g, dtype=np.int64) for g in groups]
        self.names = list(names)
        self.weights = [float(w) for w in weights]
        total = sum(self.weights)
        self.probabilities = np.asarray([w / total for w in self.weights])
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.batch = 0
        self.epochs = [0] * len(groups)
        self.offsets = [0] * len(groups)
        self._orders: dict[int, tuple[int, np.ndarray]] = {}  # source -> (epoch, its order)

    def _order(self, source: int, epoch: int) -> np.ndarray:
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            group = self.groups[source]
            order = (group[np.random.default_rng([self.seed, 1 + source, epoch])
                           .permutation(len(group))] if self.shuffle else group)
            self._orders[source] = cached = (epoch, order)
        return cached[1]

    def next_global_batch(self) -> list[int]:
        choices = np.random.default_rng([self.seed, self.batch]).choice(
            len(self.groups), size=self.batch_size, p=self.probabilities)
        self.batch += 1
        rows = []
        for source in choices.tolist():
            if self.offsets[source] >= len(self.groups[source]):
                self.epochs[source] += 1
                self.offsets[source] = 0
            rows.append(int(self._order(source, self.epochs[source])[self.offsets[source]]))
            self.offsets[source] += 1
        return rows

    def state_dict(self) -> dict:
        return {"batch": self.batch, "epochs": list(self.epochs), "offsets": list(self.offsets),
                "seed": self.seed, "batch_size": self.batch_size,
                "sources": {name: [len(g), w] for name, g, w in
                            zip(self.names, self.groups, self.weights)}}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        if "sources" not in state:
            raise ValueError("the checkpoint's sampler state was saved without "
                             "data.train_weights; resume without them (or start afresh)")
        for key, what in (("seed", "trainer.seed"), ("batch_size", "data.train_batch_size"),
                          ("sources", "data.train_weights and the training files")):
            if state[key] != mine[key]:
                raise ValueError(f"sampler state was saved with {key}={state[key]}, but this "
                                 f"run has {key}={mine[key]}; resume with the same {what}")
        self.batch = int(state["batch"])
        self.epochs = [int(e) for e in state["epochs"]]
        self.offsets = [int(o) for o in state["offsets"]]


def mixture_sources(rows, train_files: list[str], weights: dict[str, float]
                    ) -> tuple[list[str], list[list[int]], list[float]]:
    """``(names, row groups, weights)`` of ``data.train_weights`` over ``rows`` (read from
    ``train_files``): keyed by training file or by ``data_source``, all keys of one kind and
    every source of that kind given a weight (0 leaves a source out). Sources whose weight is
    0 are dropped. Raises ValueError saying what to write."""
    sources = sorted(set(rows.data_source))
    by_file = [key for key in weights if key in train_files]
    by_source = [key for key in weights if key in sources]
    unknown = [key for key in weights if key not in by_file and key not in by_source]
    if unknown:
        raise ValueError(f"data.train_weights: {', '.join(map(repr, unknown))} is neither a "
                         f"file of data.train_files ({', '.join(train_files)}) nor a "
                         f"data_source of theirs ({', '.join(sources)})")
    if by_file and len(by_file) != len(weights):
        raise ValueError("data.train_weights: key every weight by training file or every "
                         "weight by data_source, not both")
    names, column = (list(dict.fromkeys(train_files)), rows.file) if by_file else (
        sources, rows.data_source)
    missing = [name for name in names if name not in weights]
    if missing:
        raise ValueError(f"data.train_weights gives no weight to {', '.join(missing)}; give "
                         "every source a weight (0 leaves it out)")
    groups = {name: [] for name in names}
    for row, name in enumerate(column):
        groups[name].append(row)
    kept = [name for name in names if weights[name] > 0]
    empty = [name for name in kept if not groups[name]]
    if empty:
        raise ValueError(f"data.train_weights: {', '.join(empty)} has no training rows "
                         "(replay.pooled_questions_only keeps only the rows with a pool)")
    return kept, [groups[name] for name in kept], [float(weights[name]) for name in kept]


def make_prompt_sampler(cfg, rows):
    """The training prompt sampler of a run config (``data.*``, ``trainer.seed``) over the
    training rows: :class:`MixtureSampler` with ``data.train_weights``, else
    :class:`PromptSampler`. Raises ValueError on data that cannot make one batch."""
    data = cfg.data
    if data.train_weights:
        names, groups, weights = mixture_sources(rows, data.train_files, data.train_weights)
        return MixtureSampler(groups, weights, names, data.train_batch_size, cfg.trainer.seed,
                              data.shuffle)
    return PromptSampler(len(rows), data.train_batch_size, cfg.trainer.seed, data.shuffle,
                         data.drop_last)

