"""Collectives megatron-core uses that gloo lacks or restricts, built from the ones it has."""
from __future__ import annotations

import contextlib
import types

import torch


class GlooDistributed(types.ModuleType):
    """``torch.distributed`` as seen by megatron-core modules on CPU: gloo's list all-gather
    needs equal sizes and gloo has no list reduce-scatter, while megatron's MoE token
    dispatcher gathers and reduce-scatters uneven per-rank token counts over the
    tensor-parallel group (sequence parallelism with experts)."""

    def __init__(self):
        super().__init__("torch.distributed")

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        dist = torch.distributed
        sizes = {t.shape[0] for t in tensor_list} | {tensor.shape[0]}
        if len(sizes) == 1:
            return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        pad = tensor.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))
        padded = [tensor.new_empty((longest,) + tuple(tensor.shape[1:])) for _ in tensor_list]
        dist.all_gather(padded, torch.cat([tensor, pad]).contiguous(), group=group)
        for out, full in zip(tensor_list, padded):
            out.copy_(full[: out.shape[0]])
        return _DoneWork() if async_op else None

    @staticmethod
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        dist = torch.distributed
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM if op is None else op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start: start + input_list[rank].numel()].view_as(output))
        return _DoneWork() if async_op else None


def gloo_reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
    """``reduce_scatter_tensor`` for gloo, which lacks it: all-reduce a copy, keep this rank's
    equal slice. Used by megatron's distributed optimizer to reduce-scatter gradient buckets."""
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    average = op == dist.ReduceOp.AVG
    reduced = input.detach().clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM if average else op, group=group)
    world = dist.get_world_size(group)
    piece = reduced.view(world, -1)[dist.get_rank(group)]
    output.copy_((piece / world if average else piece).view_as(output))
    return _DoneWork() if async_op else None


def gloo_all_gather_into_tensor(output, input, group=None, async_op=False):
    """``all_gather_into_tensor`` through gloo's list all-gather into views of ``output``
    (the distributed optimizer gathers updated parameter shards this way)."""
    import torch.distributed as dist

    views = list(output.view(dist.get_world_size(group), -1).unbind(0))
    dist.all_gather(views, input.detach().reshape(-1).contiguous(), group=group)
    return _DoneWork() if async_op else None


class _DoneWork:
    """The handle of a collective that already completed (gloo collectives above are
    synchronous)."""

    def wait(self, *_args, **_kwargs):
        return True

    def is_completed(self):
        return True


@contextlib.contextmanager
def no_coalescing(*_args, async_ops: bool = False, **_kwargs):
    """``torch.distributed._coalescing_manager`` without coalescing: gloo runs each collective
    as issued. Inside the block every ``all_reduce`` runs synchronously (the overlapped
    gradient reduction asks for asynchronous ones and waits on the block's handle, not on
    theirs), and the handle given for ``async_ops`` is one that has already completed."""
    import torch.distributed as dist

    issue = dist.all_reduce

    def all_reduce_now(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        issue(tensor, op=op, group=group, async_op=False)
        return _DoneWork() if async_op else None

    dist.all_reduce = all_reduce_now
    try:
        yield _DoneWork() if async_ops else None
    finally:
        dist.all_reduce = issue
