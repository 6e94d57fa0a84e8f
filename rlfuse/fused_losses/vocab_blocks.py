"""The row statistics of a batch-invariant head (``LinearHead(..., batch_invariant=True)``): each
block of ``VOCAB_BLOCK`` ids of a chunk's logits reduced on its own by the row kernels (the
block as a row), the blocks combined first to last over the global block index
(``kernels.vocab_blocks``). On one rank and over a split vocabulary of any number of ranks (one
all-gather of the chunk's block statistics) a row's log-prob, max, log-sum and entropy are the
same bits, whatever else the batch holds.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .._types import compute_dtype
from ..kernels.head import HeadParams
from ..kernels.logprobs import token_logprobs_fwd
from ..kernels.vocab_blocks import BLOCK_COLUMNS, VOCAB_BLOCK, combine_blocks
from ..scaleout import vocab
from ..shared.head import scaled_logits


def _block_stats(rows: Tensor, head: HeadParams, with_entropy: bool) -> Tensor:
    """``[R, NB, BLOCK_COLUMNS]`` of the blocks of ``rows [R, NB, W]`` (each block a row)."""
    R, NB = rows.shape[:2]
    _, stats, entropy = token_logprobs_fwd(
        rows, torch.zeros((R, NB), dtype=torch.long, device=rows.device), None, head,
        with_entropy)
    entropy = entropy if with_entropy else torch.zeros_like(stats[:, 0]).view(R, NB)
    return torch.cat([stats.view(R, NB, 2), entropy.view(R, NB, 1)], -1)


def _row_blocks(rows: Tensor, head: HeadParams, with_entropy: bool) -> Tensor:
    """``[R, NB, BLOCK_COLUMNS]`` of ``rows [R, V]`` (``stride(-1) == 1``): their whole blocks,
    then the last, partial one if ``V`` is not a multiple of ``VOCAB_BLOCK``."""
    whole = rows.shape[1] - rows.shape[1] % VOCAB_BLOCK
    parts = []
    if whole:
        parts.append(_block_stats(rows[:, :whole].unflatten(1, (-1, VOCAB_BLOCK)), head,
                                  with_entropy))
    if whole < rows.shape[1]:
        parts.append(_block_stats(rows[:, whole:].unsqueeze(1), head, with_entropy))
    return torch.cat(parts, 1)


def _local_blocks(logits: Tensor, head: HeadParams, with_entropy: bool) -> Tensor:
    """``[B T, NB, BLOCK_COLUMNS]`` of ``logits [B, T, V]`` (any batch and time strides, read
    in place)."""
    B, T, V = logits.shape
    if B * T == 0 or B == 1 or logits.stride(0) == T * logits.stride(1):
        return _row_blocks(logits.view(B * T, V), head, with_entropy)
    return torch.cat([_row_blocks(logits[b], head, with_entropy) for b in range(B)])


def logit_at_targets(logits: Tensor, targets: Tensor, head: HeadParams) -> Tensor:
    """The logit of each row's target (``targets [B, T]`` within ``logits [B, T, V]``) in the
    compute dtype, in the units the row kernels keep their statistics in
    (``HeadParams.inv_temp``): the softcapped logit of a head that softcaps, else the matmul's
    own. ``[B T, 1]``."""
    x_y = logits.gather(-1, targets.reshape(*logits.shape[:-1], 1)).view(-1, 1)
    if head.softcap:
        return scaled_logits(x_y, head.logit_scale, head.softcap)
    return x_y.to(compute_dtype(logits.dtype))


def block_row_stats(logits: Tensor, targets: Tensor, mask: Optional[Tensor], head: HeadParams,
                    with_entropy: bool, group_name: str = "") -> Tuple[Tensor, Tensor]:
    """The rows of ``logits [B, T, V_l]`` (a ``LinearHead``'s chunk: ``[C, 1, V_l]``;
    ``group_name``: this rank's shard of a split vocabulary, of whole blocks) for the global
    ``targets [B, T]``: ``(the targets within the shard, -1 where another rank holds them; the
    whole rows' statistics [B T, ROW_STAT_COLUMNS])``, masked rows' log-prob and entropy 0
    (their targets never read), a target outside the vocabulary's log-prob NaN."""
    V_l, vocab_size = logits.shape[-1], logits.shape[-1]
    safe = targets if mask is None else torch.where(mask, targets, torch.zeros_like(targets))
    local = safe
    if group_name:
        if V_l % VOCAB_BLOCK:
            raise ValueError(f"policy.batch_invariant: over a split vocabulary every shard is "
                             f"whole blocks of {VOCAB_BLOCK} ids (Megatron's padding: "
                             f"make_vocab_size_divisible_by=128), got a shard of {V_l}")
        local, owner = vocab.shard_targets(safe, V_l, group_name)
        vocab_size = V_l * vocab.vocab_group_size(vocab.group_of(group_name))
    blocks = _local_blocks(logits, head, with_entropy)
    x_y = logit_at_targets(logits, local.clamp(0, V_l - 1), head).view(-1)
    if group_name:
        import torch.distributed as dist

        group = vocab.group_of(group_name)
        mine = torch.cat([blocks.flatten(1), x_y.unsqueeze(1).to(blocks.dtype)], 1)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine.contiguous(), group=group)
        blocks = torch.cat([p[:, :-1].view(len(x_y), -1, len(BLOCK_COLUMNS)) for p in parts], 1)
        x_y = torch.stack([p[:, -1] for p in parts]).gather(
            0, owner.reshape(1, -1).clamp(0, len(parts) - 1)).view(-1)
    row_max, log_sum, entropy = combine_blocks(blocks, head.inv_temp, with_entropy).unbind(-1)
    logp = (x_y.to(row_max.dtype) - row_max) * head.inv_temp - log_sum
    logp = torch.where(((safe >= 0) & (safe < vocab_size)).view(-1), logp, float("nan"))
    if mask is not None:
        keep = mask.reshape(-1)
        logp, entropy = (torch.where(keep, x, 0.0) for x in (logp, entropy))
    return local, torch.stack([logp, row_max, log_sum, entropy], -1)


def window_block_logprobs(logits: Tensor, targets: Tensor, mask: Optional[Tensor],
                          head: HeadParams, with_entropy: bool, offset: int,
                          group_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp [B T], stats [B T, 2] (max, log-sum), entropy [B T])`` of the rows ``[offset,
    offset + T)`` of ``logits [B, S, V_l]`` for ``targets [B, T]`` (``block_row_stats``; a
    window whose last stride is not 1 is made contiguous first), each its own tensor."""
    window = logits[:, offset:offset + targets.shape[1]]
    if window.stride(-1) != 1:
        window = window.contiguous()
    _, row_stats = block_row_stats(window, targets, mask, head, with_entropy, group_name)
    return tuple(row_stats[:, cols].clone() for cols in (0, slice(1, 3), 3))
