"""The row statistics of a batch-invariant head (``LinearHead(..., batch_invariant=True)``): each
block of ``VOCAB_BLOCK`` ids of a chunk's logits reduced on its own
(``kernels.tiles.tile_stats.block_stats``, or from the head's tiles on the chip:
``kernels.tiles.head_tiles``), the blocks combined first to last over the global block index
(``kernels.tiles.tile_stats``). On one rank and over a split vocabulary of any number of ranks (one
all-gather of the chunk's block statistics) a row's log-prob, max, log-sum and entropy are the
same bits, whatever else the batch holds.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..._types import compute_dtype
from ...kernels.lib.head_functions import HeadParams
from ...kernels.tiles.head_tiles import head_blocks
from ...kernels.tiles.tile_stats import BLOCK_COLUMNS, VOCAB_BLOCK, block_stats, combine_blocks
from ...scaleout import vocab
from ...shared.head import scaled_logits


def in_stat_units(x_y: Tensor, head: HeadParams) -> Tensor:
    """Raw logits ``x_y`` in the compute dtype, in the units the row kernels keep their
    statistics in (``HeadParams.inv_temp``): softcapped for a head that softcaps, else the
    matmul's own."""
    if head.softcap:
        return scaled_logits(x_y, head.logit_scale, head.softcap)
    return x_y.to(compute_dtype(x_y.dtype))


def logit_at_targets(logits: Tensor, targets: Tensor, head: HeadParams) -> Tensor:
    """The logit of each row's target (``targets [B, T]`` within ``logits [B, T, V]``)
    ``in_stat_units``, ``[B T, 1]``."""
    return in_stat_units(logits.gather(-1, targets.reshape(*logits.shape[:-1], 1)).view(-1, 1),
                         head)


def block_row_stats(logits: Tensor, targets: Tensor, mask: Optional[Tensor], head: HeadParams,
                    with_entropy: bool, group_name: str = "") -> Tuple[Tensor, Tensor]:
    """The rows of ``logits [B, T, V_l]`` (a ``LinearHead``'s chunk: ``[C, 1, V_l]``;
    ``group_name``: this rank's shard of a split vocabulary, of whole blocks) for the global
    ``targets [B, T]``: ``(the targets within the shard, -1 where another rank holds them; the
    whole rows' statistics [B T, ROW_STAT_COLUMNS])``, masked rows' log-prob and entropy 0
    (their targets never read), a target outside the vocabulary's log-prob NaN."""
    def blocks_and_targets(local):
        return (block_stats(logits, *head.kernel_args(), with_entropy),
                logit_at_targets(logits, local, head).view(-1))

    return _row_stats(blocks_and_targets, logits.shape[-1], targets, mask, head, with_entropy,
                      group_name)


def head_block_row_stats(h_rows: Tensor, weight: Tensor, bias: Optional[Tensor],
                         targets: Tensor, mask: Optional[Tensor], head: HeadParams,
                         with_entropy: bool, group_name: str = "", fp32: bool = False
                         ) -> Tuple[Tensor, Tensor]:
    """``block_row_stats`` of the logits ``h_rows [C, H] @ weight.T (+ bias)`` as
    ``head_matmuls.chunk_logits(..., batch_invariant=True, fp32=fp32)`` forms them
    (``targets``, ``mask``: ``[C, 1]``), the same bits, from tiles that never leave the chip
    (``kernels.tiles.head_tiles``): no ``[C, V]`` tensor."""
    logits_dtype = compute_dtype(weight.dtype) if fp32 else weight.dtype

    def blocks_and_targets(local):
        blocks, x_y = head_blocks(h_rows, weight, bias, local.reshape(-1), *head.kernel_args(),
                                  with_entropy, logits_dtype)
        return blocks, in_stat_units(x_y, head)

    return _row_stats(blocks_and_targets, weight.shape[0], targets, mask, head, with_entropy,
                      group_name)


def _row_stats(blocks_and_targets, V_l: int, targets: Tensor, mask: Optional[Tensor],
               head: HeadParams, with_entropy: bool, group_name: str) -> Tuple[Tensor, Tensor]:
    """``block_row_stats`` of the rows whose ``blocks_and_targets(local targets in [0,
    V_l))`` are their blocks' statistics and their target logits ``in_stat_units``."""
    vocab_size = V_l
    safe = targets if mask is None else torch.where(mask, targets, torch.zeros_like(targets))
    local = safe
    if group_name:
        if V_l % VOCAB_BLOCK:
            raise ValueError(f"policy.batch_invariant: over a split vocabulary every shard is "
                             f"whole blocks of {VOCAB_BLOCK} ids (Megatron's padding: "
                             f"make_vocab_size_divisible_by=128), got a shard of {V_l}")
        local, owner = vocab.shard_targets(safe, V_l, group_name)
        vocab_size = V_l * vocab.vocab_group_size(vocab.group_of(group_name))
    blocks, x_y = blocks_and_targets(local.clamp(0, V_l - 1))
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
