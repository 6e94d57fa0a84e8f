"""GGPO group kernel (forward) and its token-gradient kernel (backward), on [B, T] log-probs.

Forward: one program per group of ``m`` sequences. It sums the masked learner and reference
log-probs of each sequence (and, with a clip radius, the clamped per-token log-ratios), then
forms the centred, max-subtracted log-mean-exp of the group in registers:

    z_i = (r_i - mean_g r) / beta - (X_i - mean_g X),   X_i = s_i - s_i^ref   (or sum_t M d_it)
    J_g / beta = logsumexp_i z_i - log m,   q = softmax(z),   c_i = (m q_i - 1) / sqrt(m - 1)

(z_i = (R_i - mean R) / beta written without multiplying by beta and dividing again, so a small
beta cannot overflow). It writes c_i per sequence and one row of partial sums per group; the
launcher adds the rows up.

Backward: dL/dlp_it = -c_i M_it g / T_tok for the upstream gradient g.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..._types import compute_dtype
from ..lib.utils import (constexpr_codes, empty, exp_accurate, fp64_pair, fp64_parts, group_tile,
                         load_tile, mask_args, time_block, tl_compute_dtype)

# Columns of the per-group partial sums written by the forward kernel.
GROUP_COLUMNS = ("gap", "loss", "q_max", "tokens", "clipped", "log_ratio")
GROUP_GAP, GROUP_LOSS, GROUP_QMAX, GROUP_TOKENS, GROUP_CLIPPED, GROUP_LOGRATIO = \
    constexpr_codes(GROUP_COLUMNS, *GROUP_COLUMNS)
N_GROUP_COLS = tl.constexpr(len(GROUP_COLUMNS))


@triton.jit
def _centred_lme(r, x, row_valid, m, beta):
    """(logsumexp(z) - log m, softmax(z)) of z = (r - mean r) / beta - (x - mean x) over the
    m valid rows of a group (m given as a float of the compute dtype)."""
    r_mean = tl.sum(tl.where(row_valid, r, 0.0), axis=0) / m
    x_mean = tl.sum(tl.where(row_valid, x, 0.0), axis=0) / m
    z = tl.where(row_valid, (r - r_mean) / beta - (x - x_mean), float("-inf"))
    z_max = tl.max(z, axis=0)
    e = exp_accurate(z - z_max)
    total = tl.sum(e, axis=0)
    return z_max + tl.log(total) - tl.log(m), e / total


@triton.jit
def _ggpo_fwd_kernel(
    # pointers
    lp_ptr, ref_ptr, mask_ptr, rewards_ptr,  # [B, T], [B, T], [B, T] uint8, [B]
    coef_ptr,                                # [B] out: c_i of the update (c~_i when clipping)
    group_ptr,                               # [G, N_GROUP_COLS] out: partial sums per group
    # strides
    stride_lb, stride_lt, stride_rb, stride_rt, stride_mb, stride_mt, stride_rw,
    # sizes
    T, m,
    # scalars
    beta_hi, beta_lo, clip_hi, clip_lo,   # beta and the clip radius (utils.fp64_pair)
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, HAS_CLIP: tl.constexpr, ACC: tl.constexpr,
):
    beta = fp64_pair(beta_hi, beta_lo, ACC)
    clip_radius = fp64_pair(clip_hi, clip_lo, ACC)
    group = tl.program_id(0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    row_valid = offs_m < m
    rows = group * m + offs_m
    s = tl.zeros([BLOCK_M], ACC)        # sum_t M lp
    s_ref = tl.zeros([BLOCK_M], ACC)    # sum_t M ref_lp
    s_clip = tl.zeros([BLOCK_M], ACC)   # sum_t M clamp(lp - ref_lp, -rho, rho)
    tokens = tl.zeros([BLOCK_M], tl.int32)
    clipped = tl.zeros([BLOCK_M], tl.int32)
    for start in range(0, T, BLOCK_T):
        cols = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        inside = row_valid[:, None] & (cols < T)[None, :]
        actor = load_tile(mask_ptr, rows, cols, stride_mb, stride_mt, inside, tl.int32) != 0
        lp = load_tile(lp_ptr, rows, cols, stride_lb, stride_lt, actor, ACC)
        ref = load_tile(ref_ptr, rows, cols, stride_rb, stride_rt, actor, ACC)
        s += tl.sum(lp, axis=1)
        s_ref += tl.sum(ref, axis=1)
        tokens += tl.sum(actor.to(tl.int32), axis=1)
        if HAS_CLIP:
            diff = lp - ref
            s_clip += tl.sum(tl.minimum(tl.maximum(diff, -clip_radius), clip_radius), axis=1)
            clipped += tl.sum((actor & (tl.abs(diff) > clip_radius)).to(tl.int32), axis=1)

    # Each row sum the loop carries is used once after it (the where: an exact copy, rows past
    # m are 0): Triton 3.2-3.6's thread-locality pass asserts on a loop result with several
    # uses once a group is large.
    s = tl.where(row_valid, s, 0.0)
    s_clip = tl.where(row_valid, s_clip, 0.0)
    r = tl.load(rewards_ptr + rows * stride_rw, mask=row_valid, other=0.0).to(ACC)
    m_f = tl.sum(row_valid.to(ACC), axis=0)  # m in the compute dtype
    log_ratio = s - s_ref
    gap, q = _centred_lme(r, log_ratio, row_valid, m_f, beta)
    if HAS_CLIP:
        _, q = _centred_lme(r, s_clip, row_valid, m_f, beta)
    coef = (m_f * q - 1.0) / tl.sqrt(m_f - 1.0)
    tl.store(coef_ptr + rows, coef, mask=row_valid)
    if HAS_CLIP:
        # L_clip = -(1/T_tok) sum_i c~_i s_i, with c~ detached
        loss_part = -tl.sum(tl.where(row_valid, coef * s, 0.0), axis=0)
    else:
        # L = m sum_g J_g / (beta sqrt(m - 1) T_tok)
        loss_part = gap * m_f / tl.sqrt(m_f - 1.0)
    out = group_ptr + group * N_GROUP_COLS
    tl.store(out + GROUP_GAP, gap)
    tl.store(out + GROUP_LOSS, loss_part)
    tl.store(out + GROUP_QMAX, tl.max(tl.where(row_valid, q, 0.0), axis=0))
    tl.store(out + GROUP_TOKENS, tl.sum(tokens, axis=0).to(ACC))
    tl.store(out + GROUP_CLIPPED, tl.sum(clipped, axis=0).to(ACC))
    tl.store(out + GROUP_LOGRATIO, tl.sum(tl.where(row_valid, log_ratio, 0.0), axis=0))


@triton.jit
def _ggpo_bwd_kernel(
    # pointers
    coef_ptr, mask_ptr, grad_ptr, num_tokens_ptr,  # [B], [B, T] uint8, 0-dim, 0-dim
    dlp_ptr,                                       # [B, T] out, contiguous
    # strides
    stride_mb, stride_mt,
    # sizes
    T, n_t_blocks,
    BLOCK_T: tl.constexpr, ACC: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    cols = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = cols < T
    actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=inside, other=0) != 0
    scale = -tl.load(coef_ptr + b).to(ACC) * tl.load(grad_ptr).to(ACC) \
        / tl.load(num_tokens_ptr).to(ACC)
    dlp = tl.where(actor, scale, 0.0)
    tl.store(dlp_ptr + b * T + cols, dlp.to(dlp_ptr.dtype.element_ty), mask=inside)


def ggpo_fwd(lp: torch.Tensor, ref_lp: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor,
             group_size: int, beta: float, clip_radius: Optional[float]):
    """Returns ``(coef [B], group_sums [G, N_GROUP_COLS])`` in the compute dtype."""
    B, T = lp.shape
    acc = compute_dtype(lp.dtype)
    G = B // group_size
    coef = empty((B,), dtype=acc, device=lp.device)
    group_sums = empty((G, len(GROUP_COLUMNS)), dtype=acc, device=lp.device)
    if G == 0:
        return coef, group_sums
    block_m, block_t, num_warps = group_tile(T, group_size)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _ggpo_fwd_kernel[(G,)](
        lp, ref_lp, mask_u8, rewards,
        coef, group_sums,
        lp.stride(0), lp.stride(1), ref_lp.stride(0), ref_lp.stride(1), stride_mb, stride_mt,
        rewards.stride(0),
        T, group_size,
        *fp64_parts(float(beta)), *fp64_parts(math.inf if clip_radius is None else
                                              float(clip_radius)),
        BLOCK_M=block_m, BLOCK_T=block_t, HAS_CLIP=clip_radius is not None,
        ACC=tl_compute_dtype(lp.dtype), num_warps=num_warps,
    )
    return coef, group_sums


def ggpo_bwd(coef: torch.Tensor, mask: torch.Tensor, grad: torch.Tensor, num_tokens: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """``dlp [B, T]`` of ``dtype`` from the forward's ``coef``, the upstream gradient ``grad``
    and the token normaliser (both 0-dim tensors, read on the device: no host sync)."""
    B, T = mask.shape
    dlp = empty((B, T), dtype=dtype, device=mask.device)
    if B * T == 0:
        return dlp
    block_t = time_block(T)
    n_t_blocks = triton.cdiv(T, block_t)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _ggpo_bwd_kernel[(B * n_t_blocks,)](
        coef, mask_u8, grad, num_tokens,
        dlp,
        stride_mb, stride_mt,
        T, n_t_blocks,
        BLOCK_T=block_t, ACC=tl_compute_dtype(coef.dtype),
    )
    return dlp
