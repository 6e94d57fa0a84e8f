"""Scale-out: packed (padding-free) rows, a vocabulary split over a process group, and the
global counts of data parallelism. Plain torch and ``torch.distributed``, shared by the
reference and the fused path.

Vocabulary split (rank r of a group of W holds the ids ``[r V_l, (r + 1) V_l)``): each rank
reduces its shard of a row to four numbers, its max ``m_r``, ``log s_r`` (``lse_r = m_r +
log s_r``), its entropy ``H_r`` and, on the rank that holds the target, ``z_y - m_r``. One
all-gather of these ``[N, 4]`` statistics gives every rank the whole row's

    M = max_r m_r,   log S = log sum_r exp(m_r - M + log s_r),   lse = M + log S
    log p_y = (z_y - m_o) + (m_o - M) - log S              (o: the target's rank)
    H = sum_r pi_r (H_r - log pi_r),   log pi_r = lse_r - lse   (the chain rule of entropy)

and the gradient of rank r's shard needs only ``(M, log S, H)``, the upstream gradients and
its own logits: the backward moves no data between ranks (a ``LinearHead``'s hidden-state
gradient is summed over the group, one all-reduce).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

# Columns of the per-row statistics each rank contributes.
SHARD_COLUMNS = ("target_shift", "max", "log_sum", "entropy")


def packed_index(cu_seqlens: Tensor, prompt_lengths: Tensor, response_length: int) -> Tensor:
    """The ``index`` of packed rows: row ``j`` of sequence ``b`` (``cu_seqlens[b] <= j <
    cu_seqlens[b + 1]``) predicts the token after it, which is response token ``t = j -
    cu_seqlens[b] + 1 - prompt_lengths[b]``; its index is ``b T + t`` for ``0 <= t < T``
    (``T = response_length``, the loss's ``[B, T]`` width), else -1 (prompt rows, the last row
    of a sequence, responses longer than T).

    Args:
        cu_seqlens: ``[B + 1]`` integer, the rows where each sequence starts (0 first, N last),
            as flash-attention's varlen layout has them.
        prompt_lengths: ``[B]`` integer, the prompt tokens of each sequence.
        response_length: T.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [B + 1], got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    B = cu_seqlens.numel() - 1
    if tuple(prompt_lengths.shape) != (B,) or prompt_lengths.is_floating_point():
        raise ValueError(f"prompt_lengths: expected an integer tensor of shape ({B},), got "
                         f"{tuple(prompt_lengths.shape)} {prompt_lengths.dtype}")
    if isinstance(response_length, bool) or not isinstance(response_length, int) \
            or response_length < 0:
        raise ValueError(f"response_length: expected an int >= 0, got {response_length!r}")
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()) or int(cu[0]) != 0:
        raise ValueError("cu_seqlens: expected non-decreasing row offsets starting at 0")
    seq = torch.repeat_interleave(torch.arange(B, device=cu.device), lengths)
    rows = torch.arange(int(cu[-1]), device=cu.device)
    t = rows - cu[:-1][seq] + 1 - prompt_lengths.long().to(cu.device)[seq]
    last = rows == cu[1:][seq] - 1                      # predicts nothing of this sequence
    inside = (t >= 0) & (t < response_length) & ~last
    return torch.where(inside, seq * response_length + t, torch.full_like(t, -1))


def global_counts(mask: Tensor, group=None) -> Tuple[Tensor, Tensor]:
    """``(num_tokens, num_sequences)`` of ``mask [B, T]`` summed over the data-parallel
    ``group`` (default: the whole world) in one all-reduce: what each rank passes to a loss
    so that the micro-batches of all ranks average as one batch. Sequences count when they
    have an actor token."""
    import torch.distributed as dist

    mask = mask.bool()
    counts = torch.stack([mask.sum(), mask.any(-1).sum()]).to(torch.float64)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    return counts[0], counts[1]


def scatter_rows(values: Tensor, index: Tensor, shape: Sequence[int]) -> Tensor:
    """``[B, T]`` (``shape``) from per-row ``values [N]`` placed at ``index`` (rows at -1
    dropped, positions no row fills: 0), differentiable in ``values``."""
    used = index >= 0
    out = values.new_zeros(int(torch.tensor(shape).prod()))
    return out.index_put((index[used],), values[used]).view(*shape)


def combine_shards(stats: Tensor, owner: Tensor, group) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, max, log_sum, entropy)`` ``[N]`` of whole rows from each rank's shard
    statistics ``stats [N, SHARD_COLUMNS]`` (one all-gather); ``owner [N]``: the rank that holds
    each row's target."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats.contiguous(), group=group)
    shift, m, log_s, ent = torch.stack(gathered).unbind(-1)          # [W, N] each
    M = m.max(0).values
    M = torch.where(torch.isfinite(M), M, torch.zeros_like(M))       # every logit -inf
    log_sum = torch.logsumexp(m - M + log_s, 0)
    log_pi = (m - M + log_s) - log_sum
    pi = log_pi.exp()
    entropy = torch.where(pi > 0, pi * (ent - log_pi), torch.zeros_like(pi)).sum(0)
    rows = torch.arange(stats.shape[0], device=stats.device)
    owner = owner.clamp(0, world - 1)
    logp = (shift[owner, rows] + (m[owner, rows] - M)) - log_sum
    return logp, M, log_sum, entropy


def local_targets(targets: Tensor, vocab_local: int, rank: int) -> Tuple[Tensor, Tensor]:
    """``(ids within this rank's shard, or -1 where the target is another rank's; the rank
    that holds each target)``."""
    owner = torch.div(targets, vocab_local, rounding_mode="floor")
    local = torch.where(owner == rank, targets - rank * vocab_local, torch.full_like(targets, -1))
    return local, owner


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


def is_scaled_out(policy) -> bool:
    """A ``Logits`` / ``LinearHead`` with packed rows or a split vocabulary."""
    return getattr(policy, "index", None) is not None or \
        getattr(policy, "vocab_parallel_group", None) is not None


def as_rows(policy):
    """A packed policy as one batch of ``N`` rows (``[1, N, ...]``, targets ``[1, N]``), the
    layout the row machinery works on; other policies unchanged."""
    if policy.index is None:
        return policy
    if hasattr(policy, "logits"):
        return policy._replace(logits=policy.logits.unsqueeze(0),
                               targets=policy.targets.unsqueeze(0), index=None)
    return policy._replace(hidden=policy.hidden.unsqueeze(0), targets=policy.targets.unsqueeze(0),
                           index=None)


def row_mask(policy, mask: Optional[Tensor]) -> Optional[Tensor]:
    """The mask of ``as_rows(policy)``: ``[1, N]`` for packed rows (the rows a loss position
    uses), else ``mask``."""
    if policy.index is None:
        return mask
    from ._contract import packed_rows_mask

    return packed_rows_mask(policy.index, mask).unsqueeze(0)


def to_loss_layout(policy, values: Optional[Tensor], mask: Optional[Tensor]) -> Optional[Tensor]:
    """Per-row ``values [1, N]`` of a packed policy at their loss positions ``[B, T]`` (the
    mask's shape; per row ``[N]`` without a mask); others unchanged."""
    if policy.index is None or values is None or values.numel() == 0:
        return values
    values = values.reshape(-1)
    if mask is None:
        return values
    return scatter_rows(values, policy.index, mask.shape)
