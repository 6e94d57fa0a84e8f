"""The clipped policy-gradient surrogate shared by GPPO and GR-OPD.

Per actor token, with r = exp(lp - old_lp), advantage A and trust region [l, u]
(``gppo.region_bounds``: a GPPO geometry/topology cell, or PPO's [1 - eps, 1 + eps]):

    J = min(r A, clip(r, l, u) A),   dJ/dlp = A r 1[active],
    active = not ((A > 0 and r > u) or (A < 0 and r < l))

decided in log space; only the selected branch is exponentiated. Each token's loss weight
``row_scale[b]`` (the aggregation: 1/N_tok, 1/(T_b N_seq), ...) is computed once on the host and
used by the forward and the backward alike: loss = -sum_bt M J row_scale[b].

Three kernels: forward and backward from log-probs ``[B, T]``, and the single pass from logits
that computes each row's logsumexp, its log-prob, the surrogate and writes ``dlogits`` at once
(one read and one write of the logits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._types import compute_dtype
from .gppo import region_bounds, region_codes
from .logprobs import (load_target_logit, mask_args, program_row, row_logsumexp,
                       row_write_dlogits, row_write_zeros)
from .utils import (constexpr_codes, empty, fp64_parts, time_block, tl_compute_dtype,
                    vocab_launch_config)

# Columns of the per-row (from log-probs) and per-token (from logits) partial sums.
SUM_COLUMNS = ("loss", "clip_low", "clip_high", "ratio", "neg_log_ratio", "overflow")
SUM_LOSS, SUM_CLIP_LOW, SUM_CLIP_HIGH, SUM_RATIO, SUM_NEG_LOG_RATIO, SUM_OVERFLOW = \
    constexpr_codes(SUM_COLUMNS, *SUM_COLUMNS)
N_SUM_COLS = tl.constexpr(len(SUM_COLUMNS))


@triton.jit
def clipped_surrogate(log_ratio, adv, lo, hi):
    """(J, dJ/dlp, clipped_low, clipped_high, overflow) of tokens with the given log-ratios,
    advantages and fp64 bounds.

    The bounds are rounded to the compute dtype first, as the reference holds them: a bound
    beyond the dtype's range is inf, so its branch is never the clipped one. ``overflow``: the
    selected J is not finite (r A of the unclipped branch, or a clipped bound times A).
    """
    lo = lo.to(log_ratio.dtype)
    hi = hi.to(log_ratio.dtype)
    clipped_high = (adv > 0) & (log_ratio > tl.log(hi))
    clipped_low = (adv < 0) & (log_ratio < tl.log(lo))
    active = (adv != 0) & ~(clipped_high | clipped_low)
    dj = tl.where(active, tl.exp(tl.where(active, log_ratio, 0.0)) * adv, 0.0)
    bound = tl.where(clipped_high, hi, tl.where(clipped_low, lo, 0.0))
    j = tl.where(active, dj, bound * adv)
    overflow = ~(tl.abs(j) < float("inf"))
    return j, dj, clipped_low, clipped_high, overflow


@triton.jit
def _surrogate_fwd_kernel(
    # pointers
    lp_ptr, old_ptr, adv_ptr, mask_ptr,  # [B, T] (adv: [B, T] or [B] with stride_at = 0)
    row_scale_ptr,                       # [B] loss weight of each row's tokens
    sums_ptr,                            # [B, N_SUM_COLS] out
    # strides
    stride_lb, stride_lt, stride_ob, stride_ot, stride_ab, stride_at, stride_mb, stride_mt,
    # sizes
    T,
    # scalars
    delta_hi, delta_lo,  # the region size delta = hi + lo in fp64
    BLOCK_T: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    loss = tl.zeros([BLOCK_T], ACC)
    clip_low = tl.zeros([BLOCK_T], ACC)
    clip_high = tl.zeros([BLOCK_T], ACC)
    ratio = tl.zeros([BLOCK_T], ACC)
    neg_log_ratio = tl.zeros([BLOCK_T], ACC)
    overflow = tl.zeros([BLOCK_T], ACC)
    for start in range(0, T, BLOCK_T):
        cols = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=cols < T, other=0) != 0
        lp = tl.load(lp_ptr + b * stride_lb + cols * stride_lt, mask=actor, other=0.0).to(ACC)
        old = tl.load(old_ptr + b * stride_ob + cols * stride_ot, mask=actor, other=0.0).to(ACC)
        adv = tl.load(adv_ptr + b * stride_ab + cols * stride_at, mask=actor, other=0.0).to(ACC)
        lo, hi = region_bounds(old, delta_hi, delta_lo, GEOMETRY, TOPOLOGY)
        log_ratio = lp - old
        j, _, low, high, bad = clipped_surrogate(log_ratio, adv, lo, hi)
        loss += tl.where(actor, j, 0.0)
        clip_low += (actor & low).to(ACC)
        clip_high += (actor & high).to(ACC)
        ratio += tl.where(actor, tl.exp(log_ratio), 0.0)
        neg_log_ratio -= log_ratio
        overflow += (actor & bad).to(ACC)
    out = sums_ptr + b * N_SUM_COLS
    tl.store(out + SUM_LOSS, tl.sum(loss, axis=0) * tl.load(row_scale_ptr + b).to(ACC))
    tl.store(out + SUM_CLIP_LOW, tl.sum(clip_low, axis=0))
    tl.store(out + SUM_CLIP_HIGH, tl.sum(clip_high, axis=0))
    tl.store(out + SUM_RATIO, tl.sum(ratio, axis=0))
    tl.store(out + SUM_NEG_LOG_RATIO, tl.sum(neg_log_ratio, axis=0))
    tl.store(out + SUM_OVERFLOW, tl.sum(overflow, axis=0))


@triton.jit
def _surrogate_bwd_kernel(
    # pointers
    lp_ptr, old_ptr, adv_ptr, mask_ptr, row_scale_ptr, grad_ptr,  # as the forward; grad 0-dim
    dlp_ptr,                                                      # [B, T] out, contiguous
    # strides
    stride_lb, stride_lt, stride_ob, stride_ot, stride_ab, stride_at, stride_mb, stride_mt,
    # sizes
    T, n_t_blocks,
    # scalars
    delta_hi, delta_lo,  # the region size delta = hi + lo in fp64
    BLOCK_T: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
):
    # dL/dlp_bt = -g row_scale[b] M_bt dJ/dlp_bt
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    cols = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = cols < T
    actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=inside, other=0) != 0
    lp = tl.load(lp_ptr + b * stride_lb + cols * stride_lt, mask=actor, other=0.0).to(ACC)
    old = tl.load(old_ptr + b * stride_ob + cols * stride_ot, mask=actor, other=0.0).to(ACC)
    adv = tl.load(adv_ptr + b * stride_ab + cols * stride_at, mask=actor, other=0.0).to(ACC)
    lo, hi = region_bounds(old, delta_hi, delta_lo, GEOMETRY, TOPOLOGY)
    _, dj, _, _, _ = clipped_surrogate(lp - old, adv, lo, hi)
    scale = -tl.load(grad_ptr).to(ACC) * tl.load(row_scale_ptr + b).to(ACC)
    dlp = tl.where(actor, dj * scale, 0.0)
    tl.store(dlp_ptr + b * T + cols, dlp.to(dlp_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _surrogate_logits_kernel(
    # pointers
    logits_ptr, targets_ptr, mask_ptr,  # [B, S, V], [B, T], [B, T] uint8
    old_ptr, adv_ptr, row_scale_ptr,    # [B, T], [B, T] or [B] (stride_at = 0), [B]
    dlogits_ptr,                        # [B, S, V] out (may alias logits)
    sums_ptr,                           # [B*T, N_SUM_COLS] out
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    stride_ob, stride_ot, stride_ab, stride_at, stride_db, stride_dt,
    # sizes
    T, S, offset, V,
    # scalars
    inv_temp, delta_hi, delta_lo,
    BLOCK_V: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
    WRITE_DLOGITS: tl.constexpr,
):
    # One row s of the [B, S] logits (rows outside the window [offset, offset + T) only get
    # zeros): lse = m + log s by the online pass, lp = (z_y - m) - log s, the surrogate, then
    # dL/dlogits = g (onehot(y) - p) / tau with g = dL/dlp = -row_scale[b] dJ/dlp (for an upstream
    # gradient of 1; the backward rescales otherwise).
    token, b, s, y, in_window, is_actor = program_row(targets_ptr, mask_ptr, T, S, offset,
                                                      stride_yb, stride_yt, stride_mb, stride_mt,
                                                      True)
    t = token - b * T
    out = sums_ptr + token * N_SUM_COLS
    if is_actor:
        row_ptr = logits_ptr + b * stride_lb + s * stride_lt
        # z[y] is read before the logsumexp pass, whose block reductions (barriers) order it
        # before any thread's dlogits store: in place, the write pass overwrites z[y].
        z_y = load_target_logit(row_ptr, y, V, inv_temp, ACC)
        m, log_s, _ = row_logsumexp(row_ptr, V, inv_temp, BLOCK_V, False, ACC)
        lp = (z_y - m) - log_s
        old = tl.load(old_ptr + b * stride_ob + t * stride_ot).to(ACC)
        adv = tl.load(adv_ptr + b * stride_ab + t * stride_at).to(ACC)
        lo, hi = region_bounds(old, delta_hi, delta_lo, GEOMETRY, TOPOLOGY)
        log_ratio = lp - old
        j, dj, low, high, bad = clipped_surrogate(log_ratio, adv, lo, hi)
        row_scale = tl.load(row_scale_ptr + b).to(ACC)
        if WRITE_DLOGITS:
            row_write_dlogits(row_ptr, dlogits_ptr + b * stride_db + s * stride_dt, V, y,
                              inv_temp, m, log_s, 0.0, -row_scale * dj, 0.0, BLOCK_V, False,
                              ACC)
        tl.store(out + SUM_LOSS, j * row_scale)
        tl.store(out + SUM_CLIP_LOW, low.to(ACC))
        tl.store(out + SUM_CLIP_HIGH, high.to(ACC))
        tl.store(out + SUM_RATIO, tl.exp(log_ratio))
        tl.store(out + SUM_NEG_LOG_RATIO, -log_ratio)
        tl.store(out + SUM_OVERFLOW, bad.to(ACC))
    else:
        if WRITE_DLOGITS:
            row_write_zeros(dlogits_ptr + b * stride_db + s * stride_dt, V, BLOCK_V)
        if in_window:
            for col in tl.static_range(N_SUM_COLS):
                tl.store(out + col, tl.zeros((), ACC))


def _adv_strides(adv: torch.Tensor):
    """(stride_b, stride_t) of advantages given per sequence [B] or per token [B, T]."""
    return (adv.stride(0), 0) if adv.dim() == 1 else (adv.stride(0), adv.stride(1))


def surrogate_fwd(lp, old_lp, adv, mask, row_scale, *, geometry, topology, delta):
    """Per-row sums ``[B, N_SUM_COLS]`` (compute dtype) from learner log-probs ``lp [B, T]``;
    ``geometry``: a name of ``gppo.REGION_GEOMETRIES``."""
    B, T = lp.shape
    geometry_code, topology_code = region_codes(geometry, topology)
    acc = compute_dtype(lp.dtype)
    sums = empty((B, len(SUM_COLUMNS)), dtype=acc, device=lp.device)
    if B == 0:
        return sums
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_fwd_kernel[(B,)](
        lp, old_lp, adv, mask_u8,
        row_scale,
        sums,
        lp.stride(0), lp.stride(1), old_lp.stride(0), old_lp.stride(1), *_adv_strides(adv),
        stride_mb, stride_mt,
        T,
        *fp64_parts(float(delta)),
        BLOCK_T=time_block(T), GEOMETRY=geometry_code, TOPOLOGY=topology_code,
        ACC=tl_compute_dtype(lp.dtype),
    )
    return sums


def surrogate_bwd(lp, old_lp, adv, mask, row_scale, grad, *, geometry, topology, delta):
    """``dlp [B, T]`` (dtype of ``lp``) for the upstream gradient ``grad`` (0-dim)."""
    B, T = lp.shape
    geometry_code, topology_code = region_codes(geometry, topology)
    dlp = empty((B, T), dtype=lp.dtype, device=lp.device)
    if B * T == 0:
        return dlp
    block_t = time_block(T)
    n_t_blocks = triton.cdiv(T, block_t)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_bwd_kernel[(B * n_t_blocks,)](
        lp, old_lp, adv, mask_u8, row_scale, grad,
        dlp,
        lp.stride(0), lp.stride(1), old_lp.stride(0), old_lp.stride(1), *_adv_strides(adv),
        stride_mb, stride_mt,
        T, n_t_blocks,
        *fp64_parts(float(delta)),
        BLOCK_T=block_t, GEOMETRY=geometry_code, TOPOLOGY=topology_code,
        ACC=tl_compute_dtype(lp.dtype),
    )
    return dlp


def surrogate_logits(logits, targets, mask, old_lp, adv, row_scale, *, temperature,
                     geometry, topology, delta, write_dlogits=True, dlogits=None, offset=0):
    """The single pass from ``logits [B, S, V]``, whose rows ``[offset, offset + T)`` predict
    ``targets [B, T]``: returns ``(dlogits, sums [B*T, N_SUM_COLS])`` with ``dlogits`` of the
    whole ``[B, S, V]`` (zero rows outside the window) for an upstream gradient of 1, written
    into ``dlogits`` when given (None without ``write_dlogits``: the loss alone, one read of
    the window)."""
    B, T = targets.shape
    if not write_dlogits:
        logits, offset = logits[:, offset:offset + T], 0   # only the window is read
    S, V = logits.shape[1:]
    geometry_code, topology_code = region_codes(geometry, topology)
    acc = compute_dtype(logits.dtype)
    if dlogits is None and write_dlogits:
        dlogits = empty((B, S, V), dtype=logits.dtype, device=logits.device)
    sums = empty((B * T, len(SUM_COLUMNS)), dtype=acc, device=logits.device)
    if B * S == 0:
        return dlogits, sums
    block_v, num_warps = vocab_launch_config(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_logits_kernel[(B * S,)](
        logits, targets, mask_u8,
        old_lp, adv, row_scale,
        dlogits,
        sums,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt, old_lp.stride(0), old_lp.stride(1), *_adv_strides(adv),
        *((dlogits.stride(0), dlogits.stride(1)) if write_dlogits else (0, 0)),
        T, S, offset, V,
        1.0 / temperature, *fp64_parts(float(delta)),
        BLOCK_V=block_v, GEOMETRY=geometry_code, TOPOLOGY=topology_code,
        ACC=tl_compute_dtype(logits.dtype), WRITE_DLOGITS=write_dlogits, num_warps=num_warps,
    )
    return dlogits, sums
