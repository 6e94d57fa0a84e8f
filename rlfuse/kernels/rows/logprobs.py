"""Per-token log-probs (and entropy) from logits: the forward and backward kernels of
``token_logprobs``, over the row helpers of ``row_functions``.

One program handles one row of ``[B, S, V]`` logits. The forward reads an actor row once (online
logsumexp) and saves the fp32 row max ``m`` and ``log s`` (``lse = m + log s``); the backward
reads the row once more and writes ``dlogits`` once (rows outside the window, and masked rows,
get a row of zeros, never read).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..._types import compute_dtype
from ..lib.head_functions import HeadParams
from ..lib.row_functions import (COMPILER_STAGES, ORDER_BACKWARD, at, load_target_logit,
                                 program_row, row_logsumexp, row_write_dlogits, row_write_zeros,
                                 target_column, target_logprob)
from ..lib.utils import (constexpr_codes, empty, fp64_values, mask_args, tl_compute_dtype,
                         vocab_launch_config)

# Columns of the per-row statistics the forward saves for the backward (lse = m + log s).
STAT_COLUMNS = ("max", "log_sum")
STAT_MAX, STAT_LOG_SUM = constexpr_codes(STAT_COLUMNS, *STAT_COLUMNS)
N_STAT_COLS = tl.constexpr(len(STAT_COLUMNS))

@triton.jit
def _token_logprobs_fwd_kernel(
    # pointers
    logits_ptr, targets_ptr, mask_ptr,  # [B, T, V], [B, T], [B, T] (uint8) or None
    logp_ptr, stats_ptr, entropy_ptr,   # [B*T], [B*T, 2] (m, log s), [B*T] (if WITH_ENTROPY)
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    # sizes
    T, V,
    # scalars
    head,                               # head.HeadParams.kernel_args
    BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):
    row, b, t, y, _, is_actor = program_row(tl.program_id(0), targets_ptr, mask_ptr, T, T, 0,
                                            stride_yb, stride_yt, stride_mb, stride_mt, HAS_MASK)
    inv_temp, cap, cap_in = fp64_values(head, ACC)
    logp = tl.zeros((), ACC)
    m = tl.zeros((), ACC)
    log_s = tl.zeros((), ACC)
    entropy = tl.zeros((), ACC)
    if is_actor:
        row_ptr = logits_ptr + at(b, stride_lb, t, stride_lt)
        m, log_s, entropy = row_logsumexp(row_ptr, V, inv_temp, cap, cap_in, BLOCK_V,
                                          WITH_ENTROPY, SOFTCAP, ACC, False, COMPILER_STAGES)
        x_y = load_target_logit(row_ptr, target_column(y, V), cap, cap_in, SOFTCAP, ACC)
        logp = target_logprob(x_y, inv_temp, m, log_s)
    tl.store(logp_ptr + row, logp)
    tl.store(stats_ptr + N_STAT_COLS * row + STAT_MAX, m)
    tl.store(stats_ptr + N_STAT_COLS * row + STAT_LOG_SUM, log_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, entropy)


@triton.jit
def _token_logprobs_bwd_kernel(
    # pointers
    logits_ptr, targets_ptr, mask_ptr,  # [B, S, V], [B, T], [B, T] (uint8) or None
    stats_ptr, entropy_ptr,             # saved by the forward: [B*T, 2], [B*T] (if WITH_ENTROPY)
    dlogp_ptr, dentropy_ptr,            # [B*T] upstream gradients; dentropy only if WITH_ENTROPY
    dlogits_ptr,                        # [B, S, V] output (may alias logits)
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_db, stride_dt,
    # sizes
    T, S, offset, V,
    # scalars
    head,                               # head.HeadParams.kernel_args
    BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr, ACC: tl.constexpr,
):
    # One program per row of the whole [B, S] logits: rows outside the window get zeros.
    row, b, s, y, _, is_actor = program_row(tl.program_id(0), targets_ptr, mask_ptr, T, S,
                                            offset, stride_yb, stride_yt, stride_mb, stride_mt,
                                            HAS_MASK)
    drow_ptr = dlogits_ptr + at(b, stride_db, s, stride_dt)
    if is_actor:
        inv_temp, cap, cap_in = fp64_values(head, ACC)
        g = tl.load(dlogp_ptr + row).to(ACC)
        h = tl.zeros((), ACC)
        entropy = tl.zeros((), ACC)
        if WITH_ENTROPY:
            h = tl.load(dentropy_ptr + row).to(ACC)
            entropy = tl.load(entropy_ptr + row).to(ACC)
        m = tl.load(stats_ptr + N_STAT_COLS * row + STAT_MAX).to(ACC)
        log_s = tl.load(stats_ptr + N_STAT_COLS * row + STAT_LOG_SUM).to(ACC)
        row_write_dlogits(logits_ptr + at(b, stride_lb, s, stride_lt), drow_ptr, V, y, inv_temp,
                          cap, cap_in, m, log_s, entropy, g, h, BLOCK_V, WITH_ENTROPY, SOFTCAP,
                          ACC, False, COMPILER_STAGES, ORDER_BACKWARD)
    else:
        row_write_zeros(drow_ptr, V, BLOCK_V, False)


def token_logprobs_fwd(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
                       head: HeadParams, with_entropy: bool, offset: int = 0):
    """Launches the forward on the rows ``[offset, offset + T)`` of ``logits [B, S, V]``
    (``stride(-1) == 1``), which predict ``targets [B, T]``; ``mask [B, T]`` bool or None;
    ``head``: the temperature (and a head's logit scale and softcap).
    Returns ``(logp [B, T], stats [B*T, 2], entropy [B, T] or None)`` (``stats``: the row max
    and log-sum of each row, what the backward needs) in the compute dtype (fp32, or fp64 for
    fp64 logits)."""
    B, T = targets.shape
    logits = logits[:, offset:offset + T]     # the window: a view, read in place
    V = logits.shape[2]
    acc = compute_dtype(logits.dtype)
    logp = empty((B, T), dtype=acc, device=logits.device)
    stats = empty((B * T, len(STAT_COLUMNS)), dtype=acc, device=logits.device)
    entropy = empty((B, T), dtype=acc, device=logits.device) if with_entropy else None
    if B * T == 0:
        return logp, stats, entropy
    block_v, num_warps = vocab_launch_config(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    scalars, softcapped = head.kernel_args()
    _token_logprobs_fwd_kernel[(B * T,)](
        logits, targets, mask_u8,
        logp, stats, entropy,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt,
        T, V,
        scalars,
        BLOCK_V=block_v, HAS_MASK=mask is not None, WITH_ENTROPY=with_entropy,
        SOFTCAP=softcapped, ACC=tl_compute_dtype(logits.dtype), num_warps=num_warps,
    )
    return logp, stats, entropy


def token_logprobs_bwd(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
                       head: HeadParams, stats: torch.Tensor, entropy: Optional[torch.Tensor],
                       dlogp: torch.Tensor, dentropy: Optional[torch.Tensor],
                       dlogits: Optional[torch.Tensor] = None, offset: int = 0) -> torch.Tensor:
    """Launches the backward over the whole ``logits [B, S, V]``, whose rows
    ``[offset, offset + T)`` predict ``targets [B, T]`` (the others get zeros); ``dlogp`` /
    ``dentropy`` are ``[B, T]`` (``dentropy`` None when the entropy gets no gradient). Writes
    into ``dlogits`` when given (it may be ``logits`` itself), else into a new tensor of the
    logits' dtype and shape."""
    B, S, V = logits.shape
    T = targets.shape[1]
    if dlogits is None:
        dlogits = empty((B, S, V), dtype=logits.dtype, device=logits.device)
    if B * S == 0:
        return dlogits
    with_entropy = dentropy is not None
    block_v, num_warps = vocab_launch_config(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    scalars, softcapped = head.kernel_args()
    _token_logprobs_bwd_kernel[(B * S,)](
        logits, targets, mask_u8,
        stats, entropy if with_entropy else None,
        dlogp.contiguous(), dentropy.contiguous() if with_entropy else None,
        dlogits,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt, dlogits.stride(0), dlogits.stride(1),
        T, S, offset, V,
        scalars,
        BLOCK_V=block_v, HAS_MASK=mask is not None, WITH_ENTROPY=with_entropy,
        SOFTCAP=softcapped, ACC=tl_compute_dtype(logits.dtype), num_warps=num_warps,
    )
    return dlogits
