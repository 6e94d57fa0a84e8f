"""The vocabulary split over a process group (Megatron's convention): rank r of a group of W
holds the ids ``[r V_l, (r + 1) V_l)``.

Each rank reduces its shard of a row to four numbers (``SHARD_COLUMNS``): its max logit
``m_r`` (before the temperature tau, as the row kernels keep it), ``log s_r`` (``lse_r = m_r / tau
+ log s_r``), its entropy ``H_r`` and, on the rank that holds the target, ``(x_y - m_r) / tau``.
One all-gather of these ``[N, 4]`` statistics gives every rank the whole row's

    M = max_r m_r,   log S = log sum_r exp((m_r - M) / tau + log s_r),   lse = M / tau + log S
    log p_y = (x_y - m_o) / tau + (m_o - M) / tau - log S              (o: the target's rank)
    H = sum_r pi_r (H_r - log pi_r),   log pi_r = lse_r - lse   (the chain rule of entropy)

every difference of logits taken before the temperature. Here ``1 / tau`` stands for the factor
that turns the logits the row kernels keep (the raw logits, or a head's softcapped ones) into z:
``kernels.lib.head_functions.HeadParams.inv_temp``, with a head's logit scale folded in when it does
not softcap.

The gradient of rank r's shard needs only ``(M, log S, H)``, the upstream gradients and
its own logits: the backward moves no data between ranks (a ``LinearHead``'s hidden-state
gradient is summed over the group, one all-reduce). The reference instead gathers the shards
into whole rows (``GatherVocab``), the definition.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

# Columns of the per-row statistics each rank contributes.
SHARD_COLUMNS = ("target_shift", "max", "log_sum", "entropy")


def vocab_group_size(group) -> int:
    """The size of a ``vocab_parallel_group``: a process group of an initialised
    ``torch.distributed``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("policy.vocab_parallel_group: torch.distributed is not initialised")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"policy.vocab_parallel_group: expected a torch.distributed "
                        f"ProcessGroup, got {type(group).__name__}")
    return dist.get_world_size(group)


def check_shard_sizes(group, vocab_local: int, device: torch.device) -> None:
    """Every rank of ``group`` holds a shard of ``vocab_local`` ids: compared in one
    collective every rank makes, so that a mismatch raises on every rank instead of hanging
    the others (one host sync: with ``validate`` only)."""
    import torch.distributed as dist

    local = torch.tensor([vocab_local], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, local, group=group)
    sizes = [int(v) for v in torch.cat(sizes).tolist()]
    if len(set(sizes)) != 1:
        raise ValueError(f"policy.vocab_parallel_group: every rank must hold a shard of the "
                         f"same size V_local (Megatron's split: pad the vocabulary to a "
                         f"multiple of the group size); got {sizes} over the ranks")


def local_targets(targets: Tensor, vocab_local: int, rank: int) -> Tuple[Tensor, Tensor]:
    """``(ids within this rank's shard, or -1 where the target is another rank's; the rank
    that holds each target)``."""
    owner = torch.div(targets, vocab_local, rounding_mode="floor")
    local = torch.where(owner == rank, targets - rank * vocab_local, torch.full_like(targets, -1))
    return local, owner


def combine_shards(stats: Tensor, owner: Tensor, inv_temp: float,
                   group) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, max, log_sum, entropy)`` ``[N]`` of whole rows from each rank's shard
    statistics ``stats [N, SHARD_COLUMNS]`` (one all-gather); ``owner [N]``: the rank that holds
    each row's target; ``inv_temp``: what turns the statistics' logits into z (``whole_rows``)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats.contiguous(), group=group)
    shift, m, log_s, ent = torch.stack(gathered).unbind(-1)          # [W, N] each
    M = m.max(0).values
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))       # every logit -inf
    log_mass = (m - M) * inv_temp + log_s                         # log of each shard's sum
    log_sum = torch.logsumexp(log_mass, 0)
    log_pi = log_mass - log_sum
    pi = log_pi.exp()
    entropy = torch.where(pi > 0, pi * (ent - log_pi), torch.zeros_like(pi)).sum(0)
    rows = torch.arange(stats.shape[0], device=stats.device)
    owner = owner.clamp(0, world - 1)
    logp = (shift[owner, rows] + (m[owner, rows] - M) * inv_temp) - log_sum
    return logp, M, log_sum, entropy


def group_of(name: str):
    """The process group of a name (``ProcessGroup.group_name``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def shard_targets(targets: Tensor, vocab_local: int, group_name: str) -> Tuple[Tensor, Tensor]:
    """``local_targets`` for this rank of the group named ``group_name``."""
    import torch.distributed as dist

    return local_targets(targets, vocab_local, dist.get_rank(group_of(group_name)))


def group_sum(x: Tensor, group_name: str, ordered: bool = False) -> None:
    """``x`` summed over the group named ``group_name``, in place (one all-reduce); ``ordered``:
    each element in rank order (``ordered_sum``)."""
    import torch.distributed as dist

    if ordered:
        ordered_sum(x, group_name)
    else:
        dist.all_reduce(x, group=group_of(group_name))


def rank_order_reduce_scatter(parts: Tensor, group) -> Tensor:
    """``parts [W, ...]`` (part ``r`` for rank ``r`` of the ``W`` in ``group``) summed over the
    group at this rank, rank 0's first, then 1's, ...: every element's sum in one order whatever
    the tensor's size or the element's place in it (one all-to-all), where a reduce-scatter's
    or an all-reduce's ring orders it by the element's place."""
    import torch.distributed as dist

    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts.contiguous(), group=group)
    total = received[0].clone()
    for part in received[1:]:
        total += part
    return total


def ordered_sum(x: Tensor, group_name: str) -> None:
    """``x`` (contiguous) summed over the group named ``group_name`` in place, every element in
    rank order (``rank_order_reduce_scatter`` of its ``W`` slices, then one all-gather): a
    batch-invariant head's sums over a split vocabulary."""
    import torch.distributed as dist

    group = group_of(group_name)
    ranks = dist.get_world_size(group)
    flat = x.view(-1)
    width = -(-flat.numel() // ranks)
    parts = flat.new_zeros(ranks * width)
    parts[:flat.numel()] = flat
    mine = rank_order_reduce_scatter(parts.view(ranks, width), group)
    slices = [torch.empty_like(mine) for _ in range(ranks)]
    dist.all_gather(slices, mine, group=group)
    flat.copy_(torch.cat(slices)[:flat.numel()])


def whole_rows(x_y: Tensor, stats: Tensor, entropy: Tensor, targets: Tensor, vocab_local: int,
               mask: Optional[Tensor], inv_temp: float, with_entropy: bool,
               group_name: str) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy or empty, stats [N, 2])`` of the whole rows from this shard's target
    logit ``x_y`` (read where this rank holds the target), its row statistics ``stats [N, 2]``
    (max, log-sum) and entropy (``combine_shards``). ``x_y`` and the max are in the units the
    row kernels keep them in, which ``inv_temp`` turns into ``z``
    (``kernels.lib.head_functions.HeadParams.inv_temp``:
    a head's logit scale folds into it unless the head softcaps)."""
    local, owner = shard_targets(targets, vocab_local, group_name)
    mine = (local >= 0).reshape(-1)
    shift = torch.where(mine, (x_y.reshape(-1) - stats[:, 0]) * inv_temp, 0.0)
    shard_entropy = entropy.reshape(-1) if with_entropy else torch.zeros_like(shift)
    shard = torch.stack([shift, stats[:, 0], stats[:, 1], shard_entropy], -1)
    logp, row_max, log_sum, whole_entropy = combine_shards(shard, owner.reshape(-1), inv_temp,
                                                           group_of(group_name))
    if mask is not None:
        keep = mask.reshape(-1)
        logp, whole_entropy = (torch.where(keep, x, 0.0) for x in (logp, whole_entropy))
    entropy_out = whole_entropy.view(targets.shape) if with_entropy else logp.new_empty(0)
    return logp.view(targets.shape), entropy_out, torch.stack([row_max, log_sum], -1)


class GatherVocab(torch.autograd.Function):
    """The reference's vocabulary split: each rank's ``[..., V_l]`` shard gathered into the
    whole ``[..., W V_l]`` row; the backward keeps this rank's slice of the gradient (every rank
    computes the same loss from the same whole rows, so no gradient crosses ranks)."""

    @staticmethod
    def forward(ctx, shard: Tensor, group) -> Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.width = dist.get_rank(group), shard.shape[-1]
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, shard.contiguous(), group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        lo = ctx.rank * ctx.width
        return grad[..., lo:lo + ctx.width], None


class SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over ``group`` (the hidden states that
    every rank multiplies by its own shard of the head)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
