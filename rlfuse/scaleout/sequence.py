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
``GatheredRowsHead``, which tells the split that only this rank's rows of the gradient are
read), the reference all-reduces it.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from .._types import LinearHead


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


class GatheredRowsHead(LinearHead):
    """A sequence-parallel ``LinearHead`` whose hidden states are every rank's rows
    (``gather_rows``): the gradient of its hidden states is read at this rank's rows only."""


def row_blocks(policy) -> int:
    """For a ``GatheredRowsHead`` (as ``gather_sequence`` made it), the number of blocks of
    every rank's rows that its hidden states hold, its sequences (1 packed); 0 for any other
    policy."""
    if not isinstance(policy, GatheredRowsHead):
        return 0
    return 1 if policy.hidden.dim() == 2 else policy.hidden.shape[0]


def sum_to_own_rows(grad: Tensor, blocks: int, group_name: str, ordered: bool = False) -> None:
    """``grad`` (the rows of a ``GatheredRowsHead``: ``blocks`` blocks of every rank's rows in
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


def gather_sequence(policy):
    """A ``LinearHead`` with ``sequence_parallel`` as the split head over every rank's rows, a
    ``GatheredRowsHead`` (its hidden states gathered along the rows: dim 1 of ``[B, S / W,
    H]``, dim 0 of packed ``[N / W, H]``); every other policy unchanged."""
    if not isinstance(policy, LinearHead) or not policy.sequence_parallel:
        return policy
    from .vocab import vocab_group_size

    if policy.vocab_parallel_group is None:
        raise ValueError("policy.sequence_parallel: the rows are split over the "
                         "vocab_parallel_group (Megatron's tensor-parallel group); pass it")
    vocab_group_size(policy.vocab_parallel_group)
    hidden = policy.hidden
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(f"policy.hidden: expected [B, S / W, H] (or packed [N / W, H]) under "
                         f"sequence_parallel, got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else hidden}")
    dim = hidden.dim() - 2
    return GatheredRowsHead(*policy)._replace(
        hidden=gather_rows(hidden, dim, policy.vocab_parallel_group.group_name),
        sequence_parallel=False)
