"""The engine's routing of each response (``algo.routing_replay=rollout``), sent only to the
ranks that train that response.

A routing table is ``[positions, layers, top-k]`` expert ids per response: about 768 bytes per
position at Qwen3-30B-A3B's 48 layers x top-8 in int16. Gathering it with the responses would
give every rank every replica's tables (and make torch's object all-gather allocate the largest
rank's payload times the world size). Instead:

1. Before the responses are gathered, the replica that generated them keeps each table in its
   :data:`HOLD` (on the rank that sends the replica's responses) and the response carries only
   ``(owner rank, key)`` (:func:`hold_for_gather`).
2. Once the old-log-prob pass knows which data-parallel rank trains which sequence (the
   balanced partition, the same on every rank), :func:`deliver` sends each table from its owner
   to the ranks of that data-parallel rank only (one all-to-all over the rollout's gloo group,
   in the narrowest integer type that holds the expert ids): a rank receives its own share of
   the tables, whatever the world size.

Tables that no step trains (dynamic sampling dropped them, validation rollouts) leave the hold
after ``keep`` deliveries (:meth:`RoutingHold.age_out`).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch


class RoutingHold:
    """This rank's routing tables awaiting delivery, by key."""

    def __init__(self):
        self.tables: dict[int, tuple[np.ndarray, int]] = {}  # key -> (table, delivery count)
        self.next_key = 0
        self.deliveries = 0

    def put(self, table: np.ndarray) -> int:
        key = self.next_key
        self.next_key += 1
        self.tables[key] = (table, self.deliveries)
        return key

    def get(self, key: int) -> Optional[np.ndarray]:
        """The table, or ``None`` when it is no longer held."""
        entry = self.tables.get(key)
        return None if entry is None else entry[0]

    def age_out(self, keep: int) -> None:
        """Drop the tables held through more than ``keep`` deliveries."""
        self.deliveries += 1
        self.tables = {key: (table, born) for key, (table, born) in self.tables.items()
                       if self.deliveries - born <= keep}


HOLD = RoutingHold()


def hold_for_gather(local: list, owner: int) -> None:
    """Move the routing tables of ``local`` (lists of responses, this replica's share, about
    to be gathered) into :data:`HOLD`; each response keeps ``routing_key = (owner, key)``."""
    for group in local:
        for response in group:
            if response.routing is not None:
                response.routing_key = (owner, HOLD.put(response.routing))
                response.routing = None


def expert_dtype(num_experts: int) -> np.dtype:
    """The narrowest integer type for expert ids and -1."""
    for dtype in (np.int8, np.int16, np.int32):
        if num_experts <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def deliver(shares: list[list], my_share: int, share_of_rank: list[int], group,
            num_experts: int) -> int:
    """Every sequence of ``shares[my_share]`` gets its routing table (``seq.routing``) from the
    rank that holds it. ``shares[d]``: the sequences data-parallel rank d trains (the same
    lists on every rank); ``share_of_rank[r]``: the data-parallel rank of global rank r of
    ``group``. Sequences whose table is already local (one replica: every rank has it) or
    that have none are left alone. Collective over ``group`` (every rank calls it with the
    same shares); returns the bytes this rank received."""
    world = len(share_of_rank)
    me = torch.distributed.get_rank(group)
    dtype = expert_dtype(num_experts)
    outgoing: list[list[np.ndarray]] = [[] for _ in range(world)]
    wanted: list = []  # this rank's sequences to fill, in the order their owners send them
    lost = 0  # tables of this rank that are no longer held
    for share, seqs in enumerate(shares):
        for seq in seqs:
            key = seq.routing_key
            if seq.routing is not None or key is None:
                continue
            owner, serial = key
            if share == my_share:
                wanted.append((owner, serial, seq))
            if owner == me:
                table = HOLD.get(serial)
                if table is None:
                    lost += 1
                    continue
                for rank in range(world):
                    if share_of_rank[rank] == share:
                        outgoing[rank].append(table)
    # the tables go as one flat byte buffer per destination, each prefixed by its shape
    payloads = [_pack(tables, dtype) for tables in outgoing]
    # a rank that lost tables says so in the size exchange (-1 to every rank), so that every
    # rank raises here rather than some waiting in the exchange that follows
    sizes = torch.tensor([-1 if lost else len(p) for p in payloads], dtype=torch.int64)
    incoming_sizes = torch.empty(world, dtype=torch.int64)
    torch.distributed.all_to_all_single(incoming_sizes, sizes, group=group)
    if (incoming_sizes < 0).any():
        ranks = (incoming_sizes < 0).nonzero().flatten().tolist()
        raise RuntimeError(f"routing tables of rank(s) {ranks} are no longer held (a response "
                           "trained later than the hold keeps tables after its rollout)")
    send = torch.from_numpy(np.concatenate(payloads)) if sizes.sum() else torch.empty(
        0, dtype=torch.uint8)
    received = torch.empty(int(incoming_sizes.sum()), dtype=torch.uint8)
    torch.distributed.all_to_all_single(received, send, incoming_sizes.tolist(),
                                        sizes.tolist(), group=group)
    by_owner: dict[int, list[np.ndarray]] = {}
    offset = 0
    for rank, size in enumerate(incoming_sizes.tolist()):
        by_owner[rank] = _unpack(received[offset:offset + size].numpy(), dtype)
        offset += size
    # each owner sent its tables for a share in the order the shares list them
    taken = {rank: 0 for rank in by_owner}
    for owner, _serial, seq in wanted:
        seq.routing = by_owner[owner][taken[owner]]
        taken[owner] += 1
    return int(received.numel())


def _pack(tables: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    parts = []
    for table in tables:
        header = np.array(table.shape, dtype=np.int32)
        parts += [np.array([header.size], dtype=np.int32).view(np.uint8), header.view(np.uint8),
                  np.ascontiguousarray(table, dtype=dtype).reshape(-1).view(np.uint8)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)


def _unpack(buffer: np.ndarray, dtype: np.dtype) -> list[np.ndarray]:
    tables, offset = [], 0
    while offset < len(buffer):
        ndim = int(buffer[offset:offset + 4].view(np.int32)[0])
        shape = tuple(buffer[offset + 4:offset + 4 + 4 * ndim].view(np.int32).tolist())
        offset += 4 + 4 * ndim
        size = int(np.prod(shape)) * dtype.itemsize
        tables.append(buffer[offset:offset + size].view(dtype).reshape(shape))
        offset += size
    return tables

