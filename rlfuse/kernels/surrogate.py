"""The clipped policy-gradient surrogate shared by GPPO, GR-OPD and the PPO family.

Per actor token, with r = exp(lp - old_lp), advantage A, trust region [l, u]
(``gppo.region_bounds``: a GPPO geometry/topology cell, or PPO's [1 - eps_low, 1 + eps_high]),
optional dual clip c and per-token multiplier w:

    J = w min(r A, clip(r, l, u) A)   (A < 0 with a dual clip: w max(min(...), c A)),
    dJ/dlp = w A r 1[active],
    active = not ((A > 0 and r > u) or (A < 0 and r < l) or (A < 0 and r > c))

decided in log space; only the selected branch is exponentiated. Each token's loss weight
``row_scale[b]`` (the aggregation: 1/N_tok, 1/(T_b N_seq), ...) is computed once on the host and
used by the forward and the backward alike: loss = -sum_bt M J row_scale[b]. On policy (no old
log-probs) old = lp, r = 1. GSPO's sequence-level ratio (from log-probs only: it needs every
log-prob of a row first) replaces r by s_b = exp(mean over the row's actor tokens of lp - old).

Three kernels: forward and backward from log-probs ``[B, T]``, and the single pass from logits
that computes each row's logsumexp, its log-prob, the surrogate and writes ``dlogits`` at once
(one read and one write of the logits, plus a re-read of the row that L2 may serve: its launch
configuration is ``single_pass.SinglePassConfig``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .._types import compute_dtype
from . import single_pass
from .gppo import region_bounds, region_codes, region_sizes
from .logprobs import (at, load_target_logit, mask_args, program_token, row_logsumexp,
                       row_write_dlogits, row_write_zeros, target_column, target_logprob)
from .utils import constexpr_codes, empty, time_block, tl_compute_dtype

# Columns of the per-row (from log-probs) and per-token (from logits) partial sums.
SUM_COLUMNS = ("loss", "clip_low", "clip_high", "dual_clip", "ratio", "neg_log_ratio",
               "overflow")
SUM_LOSS, SUM_CLIP_LOW, SUM_CLIP_HIGH, SUM_DUAL_CLIP, SUM_RATIO, SUM_NEG_LOG_RATIO, \
    SUM_OVERFLOW = constexpr_codes(SUM_COLUMNS, *SUM_COLUMNS)
N_SUM_COLS = tl.constexpr(len(SUM_COLUMNS))


@triton.jit
def clipped_surrogate(log_ratio, adv, lo, hi, dual_clip):
    """(J, dJ/dlp, clipped_low, clipped_high, dual_clipped, overflow) of tokens with the given
    log-ratios, advantages, fp64 bounds and dual clip ``c`` (inf: none).

    The bounds are rounded to the compute dtype first, as the reference holds them: a bound
    beyond the dtype's range is inf, so its branch is never the clipped one. Dual clip: for
    A < 0, J = max(min(r A, clip(r) A), c A), i.e. the unclipped r A becomes the constant c A
    (zero gradient) once r > c. ``overflow``: the selected J is not finite.
    """
    lo = lo.to(log_ratio.dtype)
    hi = hi.to(log_ratio.dtype)
    clipped_high = (adv > 0) & (log_ratio > tl.log(hi))
    clipped_low = (adv < 0) & (log_ratio < tl.log(lo))
    dual = (adv < 0) & ~clipped_low & (log_ratio > tl.log(dual_clip))
    active = (adv != 0) & ~(clipped_high | clipped_low | dual)
    dj = tl.where(active, tl.exp(tl.where(active, log_ratio, 0.0)) * adv, 0.0)
    bound = tl.where(clipped_high, hi, tl.where(clipped_low, lo, tl.where(dual, dual_clip, 0.0)))
    j = tl.where(active, dj, bound * adv)
    overflow = ~(tl.abs(j) < float("inf"))
    return j, dj, clipped_low, clipped_high, dual, overflow


@triton.jit
def _token_inputs(lp, old_ptr, adv_ptr, weight_ptr, b, cols, actor, stride_ob, stride_ot,
                  stride_ab, stride_at, stride_wb, stride_wt, ACC: tl.constexpr,
                  HAS_OLD: tl.constexpr):
    """(old, adv, w) at the tokens ``cols`` of row ``b`` (read at actor tokens only); on
    policy, old = lp."""
    old = lp
    if HAS_OLD:
        old = tl.load(old_ptr + b * stride_ob + cols * stride_ot, mask=actor, other=0.0).to(ACC)
    adv = tl.load(adv_ptr + b * stride_ab + cols * stride_at, mask=actor, other=0.0).to(ACC)
    w = tl.load(weight_ptr + b * stride_wb + cols * stride_wt, mask=actor, other=0.0).to(ACC)
    return old, adv, w


@triton.jit
def _sequence_log_ratio(lp_ptr, old_ptr, mask_ptr, b, T, stride_lb, stride_lt, stride_ob,
                        stride_ot, stride_mb, stride_mt, BLOCK_T: tl.constexpr,
                        HAS_OLD: tl.constexpr, ACC: tl.constexpr):
    """(mean over the row's actor tokens of lp - old, their count) — GSPO's log s_b."""
    total = tl.zeros([BLOCK_T], ACC)
    count = tl.zeros([BLOCK_T], ACC)
    for start in range(0, T, BLOCK_T):
        cols = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=cols < T, other=0) != 0
        if HAS_OLD:
            lp = tl.load(lp_ptr + b * stride_lb + cols * stride_lt, mask=actor, other=0.0)
            old = tl.load(old_ptr + b * stride_ob + cols * stride_ot, mask=actor, other=0.0)
            total += lp.to(ACC) - old.to(ACC)
        count += actor.to(ACC)
    tokens = tl.sum(count, axis=0)
    return tl.sum(total, axis=0) / tl.maximum(tokens, 1.0), tokens


@triton.jit
def _surrogate_fwd_kernel(
    # pointers
    lp_ptr, old_ptr, adv_ptr, mask_ptr,  # [B, T] (adv: [B, T] or [B] with stride_at = 0;
                                         # old: None on policy, old = lp)
    weight_ptr, row_scale_ptr,           # [B, T] per-token multipliers (strides 0: none), [B]
    sums_ptr, seq_grad_ptr,              # [B, N_SUM_COLS] out; [B] out if SEQUENCE
    # strides
    stride_lb, stride_lt, stride_ob, stride_ot, stride_ab, stride_at, stride_mb, stride_mt,
    stride_wb, stride_wt,
    # sizes
    T,
    # scalars
    low_hi, low_lo, high_hi, high_lo, dual_clip,  # region sizes (gppo.region_bounds), c
    BLOCK_T: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
    HAS_OLD: tl.constexpr, SEQUENCE: tl.constexpr,
):
    # One row. SEQUENCE (GSPO): every token of the row takes the row's ratio
    # s_b = exp(mean_t (lp - old)), so dL/dlp_bt = -row_scale_b (sum_t' w dJ/dlog s) / T_b, the
    # same for every actor token: kept in seq_grad[b] for the backward.
    b = tl.program_id(0).to(tl.int64)
    if SEQUENCE:
        seq_lr, tokens = _sequence_log_ratio(lp_ptr, old_ptr, mask_ptr, b, T, stride_lb,
                                             stride_lt, stride_ob, stride_ot, stride_mb,
                                             stride_mt, BLOCK_T, HAS_OLD, ACC)
    loss = tl.zeros([BLOCK_T], ACC)
    clip_low = tl.zeros([BLOCK_T], ACC)
    clip_high = tl.zeros([BLOCK_T], ACC)
    dual_clip_n = tl.zeros([BLOCK_T], ACC)
    ratio = tl.zeros([BLOCK_T], ACC)
    neg_log_ratio = tl.zeros([BLOCK_T], ACC)
    overflow = tl.zeros([BLOCK_T], ACC)
    seq_grad = tl.zeros([BLOCK_T], ACC)
    for start in range(0, T, BLOCK_T):
        cols = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=cols < T, other=0) != 0
        lp = tl.load(lp_ptr + b * stride_lb + cols * stride_lt, mask=actor, other=0.0).to(ACC)
        old, adv, w = _token_inputs(lp, old_ptr, adv_ptr, weight_ptr, b, cols, actor, stride_ob,
                                    stride_ot, stride_ab, stride_at, stride_wb, stride_wt, ACC,
                                    HAS_OLD)
        lo, hi = region_bounds(old, low_hi, low_lo, high_hi, high_lo, GEOMETRY, TOPOLOGY)
        log_ratio = lp - old
        if SEQUENCE:
            log_ratio = tl.zeros_like(lp) + seq_lr
        j, dj, low, high, dual, bad = clipped_surrogate(log_ratio, adv, lo, hi, dual_clip)
        loss += tl.where(actor, j * w, 0.0)
        seq_grad += tl.where(actor, dj * w, 0.0)
        clip_low += (actor & low).to(ACC)
        clip_high += (actor & high).to(ACC)
        dual_clip_n += (actor & dual).to(ACC)
        ratio += tl.where(actor, tl.exp(log_ratio), 0.0)
        neg_log_ratio -= lp - old
        overflow += (actor & bad).to(ACC)
    row_scale = tl.load(row_scale_ptr + b).to(ACC)
    out = sums_ptr + b * N_SUM_COLS
    tl.store(out + SUM_LOSS, tl.sum(loss, axis=0) * row_scale)
    tl.store(out + SUM_CLIP_LOW, tl.sum(clip_low, axis=0))
    tl.store(out + SUM_CLIP_HIGH, tl.sum(clip_high, axis=0))
    tl.store(out + SUM_DUAL_CLIP, tl.sum(dual_clip_n, axis=0))
    tl.store(out + SUM_RATIO, tl.sum(ratio, axis=0))
    tl.store(out + SUM_NEG_LOG_RATIO, tl.sum(neg_log_ratio, axis=0))
    tl.store(out + SUM_OVERFLOW, tl.sum(overflow, axis=0))
    if SEQUENCE:
        tl.store(seq_grad_ptr + b, tl.sum(seq_grad, axis=0) * row_scale / tl.maximum(tokens, 1.0))


@triton.jit
def _surrogate_bwd_kernel(
    # pointers
    lp_ptr, old_ptr, adv_ptr, mask_ptr, weight_ptr, row_scale_ptr,  # as the forward
    seq_grad_ptr, grad_ptr,              # [B] from the forward if SEQUENCE; 0-dim upstream
    dlp_ptr,                             # [B, T] out, contiguous
    # strides
    stride_lb, stride_lt, stride_ob, stride_ot, stride_ab, stride_at, stride_mb, stride_mt,
    stride_wb, stride_wt,
    # sizes
    T, n_t_blocks,
    # scalars
    low_hi, low_lo, high_hi, high_lo, dual_clip,
    BLOCK_T: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
    HAS_OLD: tl.constexpr, SEQUENCE: tl.constexpr,
):
    # dL/dlp_bt = -g row_scale[b] M_bt w_bt dJ/dlp_bt (token level), -g seq_grad[b] M_bt (GSPO)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    cols = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = cols < T
    actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=inside, other=0) != 0
    grad = tl.load(grad_ptr).to(ACC)
    if SEQUENCE:
        dlp = tl.where(actor, -grad * tl.load(seq_grad_ptr + b).to(ACC), 0.0)
    else:
        lp = tl.load(lp_ptr + b * stride_lb + cols * stride_lt, mask=actor, other=0.0).to(ACC)
        old, adv, w = _token_inputs(lp, old_ptr, adv_ptr, weight_ptr, b, cols, actor, stride_ob,
                                    stride_ot, stride_ab, stride_at, stride_wb, stride_wt, ACC,
                                    HAS_OLD)
        lo, hi = region_bounds(old, low_hi, low_lo, high_hi, high_lo, GEOMETRY, TOPOLOGY)
        _, dj, _, _, _, _ = clipped_surrogate(lp - old, adv, lo, hi, dual_clip)
        scale = -grad * tl.load(row_scale_ptr + b).to(ACC)
        dlp = tl.where(actor, dj * w * scale, 0.0)
    tl.store(dlp_ptr + b * T + cols, dlp.to(dlp_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _surrogate_logits_row(
    row,                                # b S + s
    logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr, row_scale_ptr, dlogits_ptr,
    sums_ptr,
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    stride_ob, stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_db, stride_dt,
    T, S, offset, V,
    inv_temp, low_hi, low_lo, high_hi, high_lo, dual_clip,
    BLOCK_V: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
    WRITE_DLOGITS: tl.constexpr, HAS_OLD: tl.constexpr, EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
):
    # Row s of the [B, S] logits (rows outside the window [offset, offset + T) only get zeros):
    # lse = m + log s by the online pass, lp = (z_y - m) - log s, the surrogate, then
    # dL/dlogits = g (onehot(y) - p) / tau with g = dL/dlp = -row_scale[b] w dJ/dlp (for an
    # upstream gradient of 1; the backward rescales otherwise). On policy: old = lp.
    # Little of a row lives through its pass and the fp64 calls of its trust region (ptxas
    # holds a 16-warp program to 40 registers, three to an SM, and spills what does not fit):
    # b, s, t stay int32, the token's inputs and addresses are read and formed after the pass,
    # the sums are stored before the write pass.
    token, b, s, t, in_window, is_actor = program_token(row, mask_ptr, T, S, offset, stride_mb,
                                                        stride_mt, True)
    if is_actor:
        row_ptr = logits_ptr + at(b, stride_lb, s, stride_lt)
        m, log_s, _ = row_logsumexp(row_ptr, V, inv_temp, BLOCK_V, False, ACC, EVICT, NUM_STAGES)
        # In place the write pass overwrites x[y]: it waits at a barrier for every thread's read
        column = target_column(tl.load(targets_ptr + at(b, stride_yb, t, stride_yt)), V)
        x_y = load_target_logit(row_ptr, column, ACC)
        lp = target_logprob(x_y, inv_temp, m, log_s)
        old = lp
        if HAS_OLD:
            old = tl.load(old_ptr + at(b, stride_ob, t, stride_ot)).to(ACC)
        adv = tl.load(adv_ptr + at(b, stride_ab, t, stride_at)).to(ACC)
        w = tl.load(weight_ptr + at(b, stride_wb, t, stride_wt)).to(ACC)
        log_ratio = lp - old
        row_scale = tl.load(row_scale_ptr + b).to(ACC)
        out = sums_ptr + at(b, T * N_SUM_COLS, t, N_SUM_COLS)    # the token b T + t
        if WRITE_DLOGITS:
            drow_ptr = dlogits_ptr + at(b, stride_db, s, stride_dt)
        lo, hi = region_bounds(old, low_hi, low_lo, high_hi, high_lo, GEOMETRY, TOPOLOGY)
        j, dj, low, high, dual, bad = clipped_surrogate(log_ratio, adv, lo, hi, dual_clip)
        tl.store(out + SUM_LOSS, j * w * row_scale)
        tl.store(out + SUM_CLIP_LOW, low.to(ACC))
        tl.store(out + SUM_CLIP_HIGH, high.to(ACC))
        tl.store(out + SUM_DUAL_CLIP, dual.to(ACC))
        tl.store(out + SUM_RATIO, tl.exp(log_ratio))
        tl.store(out + SUM_NEG_LOG_RATIO, -log_ratio)
        tl.store(out + SUM_OVERFLOW, bad.to(ACC))
        if WRITE_DLOGITS:
            tl.debug_barrier()
            row_write_dlogits(row_ptr, drow_ptr, V, column, inv_temp, m, log_s, 0.0,
                              -row_scale * w * dj, 0.0, BLOCK_V, False, ACC, EVICT, NUM_STAGES,
                              ORDER)
    else:
        if WRITE_DLOGITS:
            row_write_zeros(dlogits_ptr + at(b, stride_db, s, stride_dt), V, BLOCK_V, EVICT)
        if in_window:
            for col in tl.static_range(N_SUM_COLS):
                tl.store(sums_ptr + token * N_SUM_COLS + col, tl.zeros((), ACC))


@triton.jit
def _surrogate_logits_kernel(
    # pointers
    logits_ptr, targets_ptr, mask_ptr,  # [B, S, V], [B, T], [B, T] uint8
    old_ptr, adv_ptr, weight_ptr,       # [B, T] (None on policy), [B, T] or [B] (stride_at = 0),
                                        # [B, T] (strides 0: none)
    row_scale_ptr,                      # [B]
    dlogits_ptr,                        # [B, S, V] out (may alias logits)
    sums_ptr,                           # [B*T, N_SUM_COLS] out
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    stride_ob, stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_db, stride_dt,
    # sizes
    T, S, offset, V, n_rows,            # n_rows = B S
    # scalars
    inv_temp, low_hi, low_lo, high_hi, high_lo, dual_clip,
    BLOCK_V: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
    WRITE_DLOGITS: tl.constexpr, HAS_OLD: tl.constexpr,
    # launch configuration (single_pass.SinglePassConfig)
    PERSISTENT: tl.constexpr, EVICT: tl.constexpr, NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
):
    # One program per row; PERSISTENT: a grid capped near the SM count, each program taking the
    # rows pid, pid + programs, ... in turn, so that fewer rows are in flight between the two
    # reads of a row.
    if PERSISTENT:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _surrogate_logits_row(
                row, logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr,
                row_scale_ptr, dlogits_ptr, sums_ptr,
                stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_ob,
                stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_db, stride_dt,
                T, S, offset, V,
                inv_temp, low_hi, low_lo, high_hi, high_lo, dual_clip,
                BLOCK_V, GEOMETRY, TOPOLOGY, ACC, WRITE_DLOGITS, HAS_OLD, EVICT, NUM_STAGES,
                ORDER)
    else:
        _surrogate_logits_row(
            tl.program_id(0), logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr,
            row_scale_ptr, dlogits_ptr, sums_ptr,
            stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_ob,
            stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_db, stride_dt,
            T, S, offset, V,
            inv_temp, low_hi, low_lo, high_hi, high_lo, dual_clip,
            BLOCK_V, GEOMETRY, TOPOLOGY, ACC, WRITE_DLOGITS, HAS_OLD, EVICT, NUM_STAGES, ORDER)


def region_args(region):
    """The (GEOMETRY, TOPOLOGY) codes and the runtime scalars (``region_bounds``' sizes, the dual
    clip) of ``region = (geometry name, topology, delta_low, delta_high, dual_clip)``: a name of
    ``gppo.REGION_GEOMETRIES``, the sizes of the lower and upper sides, and ``c`` (inf: none)."""
    geometry, topology, delta_low, delta_high, dual_clip = region
    return (region_codes(geometry, topology),
            region_sizes((delta_low, delta_high)) + (float(dual_clip),))


def _strides(x: Optional[torch.Tensor]):
    """(stride_b, stride_t) of a per-token [B, T] tensor, a per-row [B] one (broadcast over t)
    or None (0, 0)."""
    if x is None:
        return 0, 0
    return (x.stride(0), 0) if x.dim() == 1 else (x.stride(0), x.stride(1))


def _weights(weights: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The per-token multipliers, or a single 1 read with strides (0, 0)."""
    return like.new_ones(()) if weights is None else weights


def surrogate_fwd(lp, old_lp, adv, mask, weights, row_scale, region, *,
                  sequence: bool = False):
    """``(sums [B, N_SUM_COLS], seq_grad [B] or None)`` (compute dtype) from learner log-probs
    ``lp [B, T]``; ``old_lp`` None: on policy; ``sequence``: GSPO's sequence-level ratio."""
    B, T = lp.shape
    acc = compute_dtype(lp.dtype)
    sums = empty((B, len(SUM_COLUMNS)), dtype=acc, device=lp.device)
    seq_grad = empty((B,), dtype=acc, device=lp.device) if sequence else None
    if B == 0:
        return sums, seq_grad
    (geometry_code, topology_code), scalars = region_args(region)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    w = _weights(weights, row_scale)
    _surrogate_fwd_kernel[(B,)](
        lp, old_lp, adv, mask_u8,
        w, row_scale,
        sums, seq_grad,
        lp.stride(0), lp.stride(1), *_strides(old_lp), *_strides(adv), stride_mb, stride_mt,
        *_strides(weights),
        T,
        *scalars,
        BLOCK_T=time_block(T), GEOMETRY=geometry_code, TOPOLOGY=topology_code,
        ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None, SEQUENCE=sequence,
    )
    return sums, seq_grad


def surrogate_bwd(lp, old_lp, adv, mask, weights, row_scale, seq_grad, grad, region):
    """``dlp [B, T]`` (dtype of ``lp``) for the upstream gradient ``grad`` (0-dim);
    ``seq_grad``: the forward's per-row coefficient of a sequence-level ratio, else None."""
    B, T = lp.shape
    dlp = empty((B, T), dtype=lp.dtype, device=lp.device)
    if B * T == 0:
        return dlp
    (geometry_code, topology_code), scalars = region_args(region)
    block_t = time_block(T)
    n_t_blocks = triton.cdiv(T, block_t)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_bwd_kernel[(B * n_t_blocks,)](
        lp, old_lp, adv, mask_u8, _weights(weights, row_scale), row_scale,
        seq_grad, grad,
        dlp,
        lp.stride(0), lp.stride(1), *_strides(old_lp), *_strides(adv), stride_mb, stride_mt,
        *_strides(weights),
        T, n_t_blocks,
        *scalars,
        BLOCK_T=block_t, GEOMETRY=geometry_code, TOPOLOGY=topology_code,
        ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        SEQUENCE=seq_grad is not None,
    )
    return dlp


def surrogate_logits(logits, targets, mask, old_lp, adv, weights, row_scale, region, *,
                     temperature, write_dlogits=True, dlogits=None, offset=0):
    """The single pass from ``logits [B, S, V]``, whose rows ``[offset, offset + T)`` predict
    ``targets [B, T]``: returns ``(dlogits, sums [B*T, N_SUM_COLS])`` with ``dlogits`` of the
    whole ``[B, S, V]`` (zero rows outside the window) for an upstream gradient of 1, written
    into ``dlogits`` when given (None without ``write_dlogits``: the loss alone, one read of
    the window). ``old_lp`` None: on policy (old = lp, formed in the kernel). Launched in the
    configuration ``single_pass.current()`` (``RLFUSE_SINGLE_PASS``)."""
    B, T = targets.shape
    if not write_dlogits:
        logits, offset = logits[:, offset:offset + T], 0   # only the window is read
    S, V = logits.shape[1:]
    acc = compute_dtype(logits.dtype)
    if dlogits is None and write_dlogits:
        dlogits = empty((B, S, V), dtype=logits.dtype, device=logits.device)
    sums = empty((B * T, len(SUM_COLUMNS)), dtype=acc, device=logits.device)
    if B * S == 0:
        return dlogits, sums
    (geometry_code, topology_code), scalars = region_args(region)
    config = single_pass.current()
    block_v, num_warps = config.block_and_warps(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_logits_kernel[(config.programs(B * S, logits.device),)](
        logits, targets, mask_u8,
        old_lp, adv, _weights(weights, row_scale),
        row_scale,
        dlogits,
        sums,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt, *_strides(old_lp), *_strides(adv), *_strides(weights),
        *((dlogits.stride(0), dlogits.stride(1)) if write_dlogits else (0, 0)),
        T, S, offset, V, B * S,
        1.0 / temperature, *scalars,
        BLOCK_V=block_v, GEOMETRY=geometry_code, TOPOLOGY=topology_code,
        ACC=tl_compute_dtype(logits.dtype), WRITE_DLOGITS=write_dlogits,
        HAS_OLD=old_lp is not None,
        PERSISTENT=config.persistent, EVICT=config.evict, NUM_STAGES=config.stages_code,
        ORDER=config.order_code, num_warps=num_warps, maxnreg=config.maxnreg(num_warps),
    )
    return dlogits, sums
