"""A row's statistics from those of its fixed vocabulary blocks, combined in one order.

A batch-invariant head (``LinearHead(..., batch_invariant=True)``) reduces each block of
``VOCAB_BLOCK`` ids of a row on its own (the row kernels over the block as a row) and combines
the blocks here, always first to last over the global block index: the same bits whatever the
other rows, and whether the blocks come from one rank or from the shards of a split vocabulary.
With ``m_b``, ``log s_b``, ``H_b`` a block's max (before the temperature), log-sum and entropy:

    M = max_b m_b,   S = sum_b exp((m_b - M) / tau + log s_b),
    H = sum_b pi_b (H_b - log pi_b),   log pi_b = (m_b - M) / tau + log s_b - log S
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import empty, exp_accurate, fp64_args, fp64_values, tl_compute_dtype

# The ids a block holds: Megatron pads a vocabulary to a multiple of 128 per tensor-parallel rank
# (``make_vocab_size_divisible_by``), so every shard of a padded split is whole blocks.
VOCAB_BLOCK = 128
# Block columns: max, log-sum, entropy (the row kernels' statistics and entropy of a block).
BLOCK_COLUMNS = ("max", "log_sum", "entropy")
_ROWS = 64


@triton.jit
def _combine_blocks_kernel(blocks_ptr, out_ptr, R, NB, scalars,
                           WITH_ENTROPY: tl.constexpr, BLOCK_R: tl.constexpr,
                           ACC: tl.constexpr):
    # blocks [R, NB, 3] and out [R, 3] contiguous: one program per BLOCK_R rows, each row's
    # blocks in order (the rows apart: nothing depends on R or on the row's neighbours).
    (inv_temp,) = fp64_values(scalars, ACC)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    row_ptr = blocks_ptr + rows.to(tl.int64) * NB * 3
    M = tl.full([BLOCK_R], float("-inf"), ACC)
    for b in range(NB):
        M = tl.maximum(M, tl.load(row_ptr + b * 3, mask=live, other=0.0).to(ACC))
    M = tl.where(tl.abs(M) < float("inf"), M, 0.0)                # every logit -inf
    S = tl.zeros([BLOCK_R], ACC)
    for b in range(NB):
        m = tl.load(row_ptr + b * 3, mask=live, other=0.0).to(ACC)
        log_s = tl.load(row_ptr + b * 3 + 1, mask=live, other=0.0).to(ACC)
        S += exp_accurate((m - M) * inv_temp + log_s)
    log_S = tl.log(S)
    H = tl.zeros([BLOCK_R], ACC)
    if WITH_ENTROPY:
        for b in range(NB):
            m = tl.load(row_ptr + b * 3, mask=live, other=0.0).to(ACC)
            log_s = tl.load(row_ptr + b * 3 + 1, mask=live, other=0.0).to(ACC)
            h = tl.load(row_ptr + b * 3 + 2, mask=live, other=0.0).to(ACC)
            log_pi = (m - M) * inv_temp + log_s - log_S
            pi = exp_accurate(log_pi)
            H += tl.where(pi > 0, pi * (h - log_pi), 0.0)
    out = out_ptr + rows.to(tl.int64) * 3
    tl.store(out, M, mask=live)
    tl.store(out + 1, log_S, mask=live)
    tl.store(out + 2, H, mask=live)


def combine_blocks(blocks: torch.Tensor, inv_temp: float, with_entropy: bool) -> torch.Tensor:
    """``[R, 3]`` (``BLOCK_COLUMNS``: max, log-sum, entropy, 0 without ``with_entropy``) of
    whole rows from their blocks' ``blocks [R, NB, 3]`` in order (``inv_temp``: what turns the
    statistics' logits into z, ``kernels.head.HeadParams.inv_temp``)."""
    blocks = blocks.contiguous()
    R, NB = blocks.shape[:2]
    out = empty((R, 3), dtype=blocks.dtype, device=blocks.device)
    if R:
        _combine_blocks_kernel[(triton.cdiv(R, _ROWS),)](
            blocks, out, R, NB, fp64_args((inv_temp,)), WITH_ENTROPY=with_entropy,
            BLOCK_R=_ROWS, ACC=tl_compute_dtype(blocks.dtype))
    return out
