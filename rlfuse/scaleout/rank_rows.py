"""Each rank's own rows through a head split over the vocabulary (data parallelism, as FSDP2
shards a head's weight on its rows).

Under a vocabulary split every rank of the group must see the same rows. When each rank holds
its own rows instead (``RankRowsHead``: the hidden states of this rank's batch), the rows are
gathered over the group (``[N_r, H]`` hidden states and ``[N_r]`` targets and mask: never the
head, never logits), the split runs over all of them, and each rank keeps its own rows'
log-probs and entropy. The gradient of every rank's own loss reaches every shard: the
gradients of the kept rows are gathered back (``[N]``-sized) before the split's backward, and
the hidden states' gradient, which the split sums over the group, is each rank's own rows of it.
So each shard's gradient is the sum over the ranks' losses (``MeanOverRanks`` makes it their
mean, as FSDP2 reduces the gradients of its other parameters: ``scaleout.dtensor``).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor


def _sizes(n: int, group, device) -> List[int]:
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.int64, device=device)
             for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return [int(s) for s in sizes]


def _gather(x: Tensor, sizes: List[int], group) -> Tensor:
    """The ranks' ``x [n_r, ...]`` back to back, in rank order."""
    import torch.distributed as dist

    padded = torch.zeros((max(sizes),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes)])


class MeanOverRanks(torch.autograd.Function):
    """Identity forward; the gradient divided by ``ranks`` (a shard's gradient, the sum over
    the ranks' losses, as their mean)."""

    @staticmethod
    def forward(ctx, x: Tensor, ranks: int) -> Tensor:
        ctx.ranks = ranks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad / ctx.ranks, None


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows; backward: this rank's rows of the gradient (which the split
    has already summed over the group: the same on every rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], rank: int, group) -> Tensor:
        ctx.start, ctx.n = sum(sizes[:rank]), sizes[rank]
        return _gather(x, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.start:ctx.start + ctx.n], None, None, None


class _OwnRows(torch.autograd.Function):
    """Forward: this rank's rows of the results of all rows; backward: every rank's gradient
    of its own rows, so that the split's backward sees every rank's loss."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: List[int], rank: int, group) -> Tensor:
        ctx.sizes, ctx.group = sizes, group
        start = sum(sizes[:rank])
        return x[start:start + sizes[rank]].clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad.contiguous(), ctx.sizes, ctx.group), None, None, None


def every_ranks_rows(hidden: Tensor, targets: Tensor, mask: Optional[Tensor], group
                     ) -> Tuple[Tensor, Tensor, Optional[Tensor], Callable]:
    """This rank's rows ``hidden [n, H]``, ``targets [n]`` and ``mask [n]`` (or None) as every
    rank's, back to back in rank order (``[N, ...]``: the hidden states differentiably), and
    ``own(x)``: this rank's rows ``[n]`` of a result ``[N]`` of all of them (differentiably:
    its gradient gathered back from every rank, so that the split's backward sees every rank's
    loss)."""
    import torch.distributed as dist

    sizes, rank = _sizes(targets.shape[0], group, targets.device), dist.get_rank(group)
    whole_mask = None if mask is None else _gather(mask, sizes, group)

    def own(x: Tensor) -> Tensor:
        return _OwnRows.apply(x.reshape(-1), sizes, rank, group)

    return (_GatherRows.apply(hidden, sizes, rank, group), _gather(targets, sizes, group),
            whole_mask, own)
