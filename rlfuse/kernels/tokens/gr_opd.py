"""GR-OPD group-relative advantages: one program per group of ``m`` responses.

    r_it = clamp(teacher_lp_it - old_lp_it, -feedback_clip, feedback_clip)
    S_i  = sum_k gamma^(k-1) r_(i,t_k) / sum_k gamma^(k-1)   (t_k: the k-th actor token of row i)
    A_i  = clamp((S_i - mu_g + lam mu_g) / (sigma_g + std_eps), -adv_clip, adv_clip)

with mu_g, sigma_g the mean and population std of S over the group. The actor index k runs
across time blocks: each row carries the count of actor tokens seen so far.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..lib.utils import (constexpr_codes, empty, exp_accurate, fp64_pair, fp64_parts, group_tile,
                         load_tile, mask_args, tl_compute_dtype)

# Columns of the per-group sums: clamped feedback and actor tokens (the feedback_mean metric).
GROUP_COLUMNS = ("feedback", "tokens")
GROUP_FEEDBACK, GROUP_TOKENS = constexpr_codes(GROUP_COLUMNS, *GROUP_COLUMNS)
N_GROUP_COLS = tl.constexpr(len(GROUP_COLUMNS))


@triton.jit
def discount(k, log_gamma, ACC: tl.constexpr):
    """gamma^(k - 1) of the k-th actor token (1-based), to fp32 rounding down to e^-104."""
    return exp_accurate((k - 1).to(ACC) * log_gamma)


@triton.jit
def _gr_opd_adv_kernel(
    # pointers
    old_ptr, teacher_ptr, mask_ptr,  # [B, T], [B, T], [B, T] uint8
    adv_ptr,                         # [B] out
    group_ptr,                       # [G, N_GROUP_COLS] out: sum of clamped feedback, tokens
    # strides
    stride_ob, stride_ot, stride_tb, stride_tt, stride_mb, stride_mt,
    # sizes
    T, m,
    # scalars
    log_gamma_hi, log_gamma_lo, lam_hi, lam_lo, feedback_clip_hi, feedback_clip_lo,
    adv_clip_hi, adv_clip_lo, std_eps_hi, std_eps_lo,    # utils.fp64_pair
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, ACC: tl.constexpr,
):
    log_gamma = fp64_pair(log_gamma_hi, log_gamma_lo, ACC)
    lam = fp64_pair(lam_hi, lam_lo, ACC)
    feedback_clip = fp64_pair(feedback_clip_hi, feedback_clip_lo, ACC)
    adv_clip = fp64_pair(adv_clip_hi, adv_clip_lo, ACC)
    std_eps = fp64_pair(std_eps_hi, std_eps_lo, ACC)
    group = tl.program_id(0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    row_valid = offs_m < m
    rows = group * m + offs_m
    num = tl.zeros([BLOCK_M], ACC)       # sum_k gamma^(k-1) r
    den = tl.zeros([BLOCK_M], ACC)       # sum_k gamma^(k-1)
    feedback = tl.zeros([BLOCK_M], ACC)  # sum_k r
    seen = tl.zeros([BLOCK_M], tl.int32)  # actor tokens of each row before this block
    for start in range(0, T, BLOCK_T):
        cols = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        inside = row_valid[:, None] & (cols < T)[None, :]
        actor = load_tile(mask_ptr, rows, cols, stride_mb, stride_mt, inside, tl.int32) != 0
        old = load_tile(old_ptr, rows, cols, stride_ob, stride_ot, actor, ACC)
        teacher = load_tile(teacher_ptr, rows, cols, stride_tb, stride_tt, actor, ACC)
        r = tl.minimum(tl.maximum(teacher - old, -feedback_clip), feedback_clip)
        k = seen[:, None] + tl.cumsum(actor.to(tl.int32), axis=1)  # 1-based at actor tokens
        w = tl.where(actor, discount(k, log_gamma, ACC), 0.0)
        num += tl.sum(w * r, axis=1)
        den += tl.sum(w, axis=1)
        feedback += tl.sum(r, axis=1)
        seen += tl.sum(actor.to(tl.int32), axis=1)
    score = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    m_f = tl.sum(row_valid.to(ACC), axis=0)
    mean = tl.sum(tl.where(row_valid, score, 0.0), axis=0) / m_f
    centred = tl.where(row_valid, score - mean, 0.0)
    std = tl.sqrt(tl.sum(centred * centred, axis=0) / m_f)
    adv = (centred + lam * mean) / (std + std_eps)
    adv = tl.minimum(tl.maximum(adv, -adv_clip), adv_clip)
    tl.store(adv_ptr + rows, adv, mask=row_valid)
    tl.store(group_ptr + group * N_GROUP_COLS + GROUP_FEEDBACK, tl.sum(feedback, axis=0))
    tl.store(group_ptr + group * N_GROUP_COLS + GROUP_TOKENS, tl.sum(seen, axis=0).to(ACC))


def gr_opd_advantages_fwd(old_lp: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor, *,
                          group_size: int, gamma: float, lam: float, feedback_clip: float,
                          adv_clip: float, std_eps: float, acc: torch.dtype):
    """Returns ``(advantages [B], group_sums [G, N_GROUP_COLS])`` computed in ``acc`` (fp32 or
    fp64)."""
    B, T = old_lp.shape
    G = B // group_size
    adv = empty((B,), dtype=acc, device=old_lp.device)
    group_sums = empty((G, len(GROUP_COLUMNS)), dtype=acc, device=old_lp.device)
    if B == 0:
        return adv, group_sums
    block_m, block_t, num_warps = group_tile(T, group_size)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _gr_opd_adv_kernel[(G,)](
        old_lp, teacher_lp, mask_u8,
        adv, group_sums,
        old_lp.stride(0), old_lp.stride(1), teacher_lp.stride(0), teacher_lp.stride(1),
        stride_mb, stride_mt,
        T, group_size,
        *(part for x in (math.log(gamma), lam, feedback_clip, adv_clip, std_eps)
          for part in fp64_parts(float(x))),
        BLOCK_M=block_m, BLOCK_T=block_t, ACC=tl_compute_dtype(acc), num_warps=num_warps,
    )
    return adv, group_sums
