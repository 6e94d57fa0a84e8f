"""The surrogate losses' kernels (GPPO, GR-OPD, the PPO family): a per-token objective
(``objectives.token_objective``) over each token's trust region (``regions.region_bounds``).

Per actor token, with r = exp(lp - old_lp), advantage A, the objective J and its derivative
dJ/dlp, and an optional per-token multiplier w: loss = -sum_bt M w J row_scale[b], where the
row weight ``row_scale[b]`` (the aggregation: 1/N_tok, 1/(T_b N_seq), ...) is computed once on
the host and used by the forward and the backward alike. On policy (no old log-probs) old = lp,
r = 1. GSPO's sequence-level ratio (from log-probs only: it needs every log-prob of a row
first) replaces r by s_b = exp(mean over the row's actor tokens of lp - old).

Three kernels: forward and backward from log-probs ``[B, T]``, and the single pass from logits
that computes each row's logsumexp, its log-prob, the objective and writes ``dlogits`` at once
(one read and one write of the logits, plus a re-read of the row that L2 may serve: its launch
configuration is ``single_pass.SinglePassConfig``); the single pass's backward scales those
``dlogits`` by the upstream gradient (``surrogate_logits_bwd``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._types import compute_dtype
from . import single_pass
from .objectives import (N_SUM_COLS, SUM_CLIP_HIGH, SUM_CLIP_LOW, SUM_COLUMNS, SUM_DUAL_CLIP,
                         SUM_LOSS, SUM_NEG_LOG_RATIO, SUM_OVERFLOW, SUM_RATIO, objective_args,
                         token_objective)
from .regions import region_bounds
from .rows import (at, load_target_logit, program_token, row_logsumexp, row_write_dlogits,
                   row_write_zeros, target_column, target_logprob)
from .utils import (empty, mask_args, ones_if_none, time_block, tl_compute_dtype, token_strides,
                    vocab_launch_config)


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
    low_hi, low_lo, high_hi, high_lo,   # region sizes (regions.region_bounds)
    p0, p1, p2, p3,                     # the objective's parameters
    BLOCK_T: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, HAS_OLD: tl.constexpr, SEQUENCE: tl.constexpr,
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
        j, dj, low, high, dual, bad = token_objective(log_ratio, adv, lo, hi, p0, p1, p2, p3,
                                                      OBJECTIVE)
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
    low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3,
    BLOCK_T: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, HAS_OLD: tl.constexpr, SEQUENCE: tl.constexpr,
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
        _, dj, _, _, _, _ = token_objective(lp - old, adv, lo, hi, p0, p1, p2, p3, OBJECTIVE)
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
    inv_temp, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3,
    BLOCK_V: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, WRITE_DLOGITS: tl.constexpr,
    HAS_OLD: tl.constexpr, EVICT: tl.constexpr, NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
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
        j, dj, low, high, dual, bad = token_objective(log_ratio, adv, lo, hi, p0, p1, p2, p3,
                                                      OBJECTIVE)
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
    inv_temp, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3,
    BLOCK_V: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, WRITE_DLOGITS: tl.constexpr,
    HAS_OLD: tl.constexpr,
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
                inv_temp, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3,
                BLOCK_V, OBJECTIVE, GEOMETRY, TOPOLOGY, ACC, WRITE_DLOGITS, HAS_OLD, EVICT,
                NUM_STAGES, ORDER)
    else:
        _surrogate_logits_row(
            tl.program_id(0), logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr,
            row_scale_ptr, dlogits_ptr, sums_ptr,
            stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_ob,
            stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_db, stride_dt,
            T, S, offset, V,
            inv_temp, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3,
            BLOCK_V, OBJECTIVE, GEOMETRY, TOPOLOGY, ACC, WRITE_DLOGITS, HAS_OLD, EVICT,
            NUM_STAGES, ORDER)


@triton.jit
def _scale_rows_kernel(
    # pointers
    x_ptr, mask_ptr, scale_ptr,  # [B, S, V] in and out, [B, T] uint8, 0-dim
    # strides
    stride_xb, stride_xt, stride_mb, stride_mt,
    # sizes
    T, S, offset, V,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):
    # The single pass's backward: x[b, s] *= scale at actor rows (the others hold zeros), in the
    # compute dtype; the scale is read on the device, and when it is 1 no row is read or written.
    _, b, s, _, _, is_actor = program_token(tl.program_id(0), mask_ptr, T, S, offset, stride_mb,
                                            stride_mt, True)
    scale = tl.load(scale_ptr).to(ACC)
    if (scale != 1.0) & is_actor:
        row_ptr = x_ptr + at(b, stride_xb, s, stride_xt)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + cols, mask=cols < V).to(ACC)
            tl.store(row_ptr + cols, (x * scale).to(x_ptr.dtype.element_ty), mask=cols < V)


def surrogate_fwd(lp, old_lp, adv, mask, weights, row_scale, objective, *,
                  sequence: bool = False):
    """``(sums [B, N_SUM_COLS], seq_grad [B] or None)`` (compute dtype) from learner log-probs
    ``lp [B, T]``; ``old_lp`` None: on policy; ``objective``: an ``rlfuse._args.Objective``;
    ``sequence``: GSPO's sequence-level ratio."""
    B, T = lp.shape
    acc = compute_dtype(lp.dtype)
    sums = empty((B, len(SUM_COLUMNS)), dtype=acc, device=lp.device)
    seq_grad = empty((B,), dtype=acc, device=lp.device) if sequence else None
    if B == 0:
        return sums, seq_grad
    (objective_code, geometry_code, topology_code), scalars = objective_args(objective)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_fwd_kernel[(B,)](
        lp, old_lp, adv, mask_u8,
        ones_if_none(weights, row_scale), row_scale,
        sums, seq_grad,
        lp.stride(0), lp.stride(1), *token_strides(old_lp), *token_strides(adv), stride_mb,
        stride_mt, *token_strides(weights),
        T,
        *scalars,
        BLOCK_T=time_block(T), OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        SEQUENCE=sequence,
    )
    return sums, seq_grad


def surrogate_bwd(lp, old_lp, adv, mask, weights, row_scale, seq_grad, grad, objective):
    """``dlp [B, T]`` (dtype of ``lp``) for the upstream gradient ``grad`` (0-dim);
    ``seq_grad``: the forward's per-row coefficient of a sequence-level ratio, else None."""
    B, T = lp.shape
    dlp = empty((B, T), dtype=lp.dtype, device=lp.device)
    if B * T == 0:
        return dlp
    (objective_code, geometry_code, topology_code), scalars = objective_args(objective)
    block_t = time_block(T)
    n_t_blocks = triton.cdiv(T, block_t)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_bwd_kernel[(B * n_t_blocks,)](
        lp, old_lp, adv, mask_u8, ones_if_none(weights, row_scale), row_scale,
        seq_grad, grad,
        dlp,
        lp.stride(0), lp.stride(1), *token_strides(old_lp), *token_strides(adv), stride_mb,
        stride_mt, *token_strides(weights),
        T, n_t_blocks,
        *scalars,
        BLOCK_T=block_t, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        SEQUENCE=seq_grad is not None,
    )
    return dlp


def surrogate_logits_fwd(logits, targets, mask, old_lp, adv, weights, row_scale, objective, *,
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
    (objective_code, geometry_code, topology_code), scalars = objective_args(objective)
    config = single_pass.current()
    block_v, num_warps = config.block_and_warps(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_logits_kernel[(config.programs(B * S, logits.device),)](
        logits, targets, mask_u8,
        old_lp, adv, ones_if_none(weights, row_scale),
        row_scale,
        dlogits,
        sums,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt, *token_strides(old_lp), *token_strides(adv),
        *token_strides(weights),
        *((dlogits.stride(0), dlogits.stride(1)) if write_dlogits else (0, 0)),
        T, S, offset, V, B * S,
        1.0 / temperature, *scalars,
        BLOCK_V=block_v, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(logits.dtype), WRITE_DLOGITS=write_dlogits,
        HAS_OLD=old_lp is not None,
        PERSISTENT=config.persistent, EVICT=config.evict, NUM_STAGES=config.stages_code,
        ORDER=config.order_code, num_warps=num_warps, maxnreg=config.maxnreg(num_warps),
    )
    return dlogits, sums


def surrogate_logits_bwd(dlogits: torch.Tensor, mask: torch.Tensor, grad: torch.Tensor,
                         offset: int = 0) -> None:
    """The single pass's backward: multiplies the actor rows of its ``dlogits [B, S, V]``
    (``stride(-1) == 1``; rows ``[offset, offset + T)`` go with ``mask [B, T]``) by the 0-dim
    upstream ``grad`` in place, without reading it on the host: a gradient of 1 costs no pass
    over ``dlogits``."""
    B, S, V = dlogits.shape
    T = mask.shape[1]
    if B * S == 0:
        return
    block_v, num_warps = vocab_launch_config(V, dlogits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _scale_rows_kernel[(B * S,)](
        dlogits, mask_u8, grad,
        dlogits.stride(0), dlogits.stride(1), stride_mb, stride_mt,
        T, S, offset, V,
        BLOCK_V=block_v, ACC=tl_compute_dtype(dlogits.dtype), num_warps=num_warps,
    )
