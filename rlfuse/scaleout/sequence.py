"""Sequence parallelism over a vocabulary split (Megatron's): each rank of the
``vocab_parallel_group`` holds the hidden states of a slice of the rows (``LinearHead(...,
sequence_parallel=True)``: ``hidden [B, S / W, H]``, rank r the rows ``[r S / W, (r + 1) S /
W)`` of every sequence; packed, ``hidden [N / W, H]``, rank r the rows ``[r N / W, (r + 1) N /
W)``), and its shard of the head.

Before anything else runs, the rows are gathered over the group (``rlfuse::gather_rows``: the
hidden states, never the head nor the logits), so that the head is the split head over every
row, as on one process: every rank returns every row's log-probs and entropy, and the same loss.
Its hidden-state gradient is the split's, summed over the group in the compute dtype (fp32 for
bf16 hidden states, rounded once) and kept at each rank's own rows: the kernels' split
reduce-scatters it inside its op (``sum_to_own_rows``: the gathered head is a
``forms.GatheredRowsHead``, which tells the split that only this rank's rows of the gradient are
read), the reference all-reduces it.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor



def _row_counts(x: Tensor, dim: int, group) -> List[int]:
    import torch.distributed as dist

    local = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    counts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, local, group=group)
    return [int(c) for c in torch.cat(counts).tolist()]


@torch.library.custom_op("rlfuse::gather_rows", mutates_args=())
def gather_rows(x: Tensor, dim: int, group_name: str) -> Tensor:
    """Every rank's ``x`` along ``dim``, in rank order; ValueError on every rank when the ranks
    hold different numbers of rows (compared first: one ``[1]`` all-gather and host read)."""
    import torch.distributed as dist

    from .vocab import group_of

    group = group_of(group_name)
    counts = _row_counts(x, dim, group)
    if len(set(counts)) != 1:
        raise ValueError(f"policy.hidden: with sequence_parallel every rank of "
                         f"vocab_parallel_group holds as many rows (dim {dim}); got {counts} "
                         f"over the ranks (Megatron's sequence parallelism: pad the sequence to "
                         f"a multiple of the group size)")
    parts = [torch.empty_like(x) for _ in counts]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


@gather_rows.register_fake
def _(x, dim, group_name):
    import torch.distributed as dist

    from .vocab import group_of

    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(group_of(group_name))
    return x.new_empty(shape)


def _setup(ctx, inputs, output):
    x, dim, group_name = inputs
    ctx.dim, ctx.rows, ctx.group_name = dim, x.shape[dim], group_name


def _backward(ctx, grad):
    # the split has summed the gradient over the group, at least at this rank's rows: those
    import torch.distributed as dist

    from .vocab import group_of

    start = dist.get_rank(group_of(ctx.group_name)) * ctx.rows
    return grad.narrow(ctx.dim, start, ctx.rows).contiguous(), None, None


torch.library.register_autograd("rlfuse::gather_rows", _backward, setup_context=_setup)


def sum_to_own_rows(grad: Tensor, blocks: int, group_name: str, ordered: bool = False) -> None:
    """``grad`` (the rows of a ``forms.GatheredRowsHead``: ``blocks`` blocks of every rank's rows in
    rank order, flattened to ``[N, H]``), summed over the group at this rank's rows and 0 at
    the others, in place: one reduce-scatter (``ordered``: each element in rank order,
    ``vocab.rank_order_reduce_scatter``)."""
    import torch.distributed as dist

    from .vocab import group_of, rank_order_reduce_scatter

    group = group_of(group_name)
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    by_rank = grad.view(blocks, ranks, -1, grad.shape[-1]).transpose(0, 1)
    if ordered:
        own = rank_order_reduce_scatter(by_rank.reshape(ranks, -1), group)
    else:
        own = grad.new_empty(by_rank.shape[1:])
        dist.reduce_scatter_tensor(own.view(-1, grad.shape[-1]),
                                   by_rank.reshape(-1, grad.shape[-1]), group=group)
    grad.zero_()
    by_rank[rank] = own.view(by_rank.shape[1:])
