"""The surrogate losses' kernels (GPPO, GR-OPD, the PPO family): a per-token objective
(``OBJECTIVE``, a function of ``objectives``) over each token's trust region (``regions.region_bounds``).

Per actor token, with r = exp(lp - old_lp), advantage A, the objective J and its derivative
dJ/dlp, and an optional per-token multiplier w: loss = -sum_bt M w J row_scale[b], where the
row weight ``row_scale[b]`` (the aggregation: 1/N_tok, 1/(T_b N_seq), ...) is computed once on
the host and used by the forward and the backward alike. On policy (no old log-probs) old = lp,
r = 1.

Three kernels: forward and backward from log-probs ``[B, T]``, and the single pass from logits
that computes each row's logsumexp, its log-prob, the objective and writes ``dlogits`` at once
(one read and one write of the logits, plus a re-read of the row that L2 may serve: its launch
configuration is ``single_pass.SinglePassConfig``); the single pass's backward scales those
``dlogits`` by the upstream gradient (``scale_rows.scale_rows``). The single pass also carries
the terms: a KL penalty to reference log-probs (``kl.kl_term``: loss += row_scale[b] beta KL,
not multiplied by w) and an entropy bonus (loss -= entropy_scale[b] H, its gradient through
the row's softmax, ``rows.row_write_dlogits``); from log-probs the terms are separate ops.

The ratio of a token (``RATIO``, a code of ``_names.RATIO_MODES``, from log-probs only): its
own; its sequence's s_b, differentiated through the mean (TRL's GSPO); or s_b's log clamped to
at most 10 and passed straight through to each token (verl's GSPO: d log s_bt / d lp_bt = 1).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._names import RATIO_MODES
from .._types import compute_dtype
from . import single_pass
from .kl import NO_KL, kl_codes, kl_term
from .objectives import (N_SUM_COLS, SUM_COLUMNS, SUM_ENTROPY, SUM_FLAG0, SUM_FLAG1, SUM_FLAG2,
                         SUM_KL, SUM_LOSS, SUM_NEG_LOG_RATIO, SUM_OVERFLOW, SUM_RATIO,
                         clamped_log_ratio, objective_args, objective_params)
from .regions import region_bounds
from .rows import (at, head_args, head_scalars, load_target_logit, program_token,
                   row_logsumexp, row_write_dlogits, row_write_zeros, target_column,
                   target_logprob)
from .utils import (constexpr_codes, empty, exp_accurate, mask_args, ones_if_none, time_block,
                    tl_compute_dtype, token_strides)

TOKEN_RATIO, SEQUENCE_RATIO, STRAIGHT_RATIO = constexpr_codes(RATIO_MODES, *RATIO_MODES)
_STRAIGHT_LOG_MAX = tl.constexpr(10.0)    # verl's GSPO clamps log s_bt at 10
# The whole-row statistics of a shard's rows (``row_stats``), gathered over the group.
ROW_STAT_COLUMNS = ("logp", "max", "log_sum", "entropy")
N_ROW_STATS = tl.constexpr(len(ROW_STAT_COLUMNS))


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
    sums_ptr, seq_ptr,                   # [B, N_SUM_COLS] out; [B] out unless TOKEN_RATIO
    # strides
    stride_lb, stride_lt, stride_ob, stride_ot, stride_ab, stride_at, stride_mb, stride_mt,
    stride_wb, stride_wt,
    # sizes
    T,
    # scalars
    low_hi, low_lo, high_hi, high_lo,   # region sizes (regions.region_bounds)
    p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo, p3_hi, p3_lo,   # objectives.objective_params
    clamp,                              # the objective's log-ratio clamp
    BLOCK_T: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, HAS_OLD: tl.constexpr, RATIO: tl.constexpr,
):
    # One row. SEQUENCE_RATIO (TRL's GSPO): every token of the row takes the row's ratio
    # s_b = exp(mean_t (lp - old)), so dL/dlp_bt = -row_scale_b (sum_t' w dJ/dlog s) / T_b, the
    # same for every actor token: kept in seq[b] for the backward. STRAIGHT_RATIO (verl's):
    # log s_bt = min(log s_b, 10) with d log s_bt / d lp_bt = 1 (0 past the clamp): seq[b] keeps
    # log s_b.
    b = tl.program_id(0).to(tl.int64)
    p0, p1, p2, p3 = objective_params(p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo, p3_hi, p3_lo,
                                      ACC)
    if RATIO != TOKEN_RATIO:
        seq_lr, tokens = _sequence_log_ratio(lp_ptr, old_ptr, mask_ptr, b, T, stride_lb,
                                             stride_lt, stride_ob, stride_ot, stride_mb,
                                             stride_mt, BLOCK_T, HAS_OLD, ACC)
    loss = tl.zeros([BLOCK_T], ACC)
    flag0 = tl.zeros([BLOCK_T], ACC)
    flag1 = tl.zeros([BLOCK_T], ACC)
    flag2 = tl.zeros([BLOCK_T], ACC)
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
        if RATIO == SEQUENCE_RATIO:
            log_ratio = tl.zeros_like(lp) + seq_lr
        elif RATIO == STRAIGHT_RATIO:
            log_ratio = tl.zeros_like(lp) + tl.minimum(seq_lr, _STRAIGHT_LOG_MAX)
        j, dj, f0, f1, f2 = OBJECTIVE(log_ratio, lp, old, adv, lo, hi, (p0, p1, p2, p3), clamp)
        bad = ~(tl.abs(j) < float("inf"))
        loss += tl.where(actor, j * w, 0.0)
        seq_grad += tl.where(actor, dj * w, 0.0)
        flag0 += (actor & f0).to(ACC)
        flag1 += (actor & f1).to(ACC)
        flag2 += (actor & f2).to(ACC)
        ratio += tl.where(actor, exp_accurate(log_ratio), 0.0)
        clamped, _ = clamped_log_ratio(lp - old, clamp)
        neg_log_ratio -= clamped
        overflow += (actor & bad).to(ACC)
    row_scale = tl.load(row_scale_ptr + b).to(ACC)
    out = sums_ptr + b * N_SUM_COLS
    tl.store(out + SUM_LOSS, tl.sum(loss, axis=0) * row_scale)
    tl.store(out + SUM_FLAG0, tl.sum(flag0, axis=0))
    tl.store(out + SUM_FLAG1, tl.sum(flag1, axis=0))
    tl.store(out + SUM_FLAG2, tl.sum(flag2, axis=0))
    tl.store(out + SUM_RATIO, tl.sum(ratio, axis=0))
    tl.store(out + SUM_NEG_LOG_RATIO, tl.sum(neg_log_ratio, axis=0))
    tl.store(out + SUM_OVERFLOW, tl.sum(overflow, axis=0))
    tl.store(out + SUM_KL, tl.zeros((), ACC))        # the terms are separate ops here
    tl.store(out + SUM_ENTROPY, tl.zeros((), ACC))
    if RATIO == SEQUENCE_RATIO:
        tl.store(seq_ptr + b, tl.sum(seq_grad, axis=0) * row_scale / tl.maximum(tokens, 1.0))
    elif RATIO == STRAIGHT_RATIO:
        tl.store(seq_ptr + b, seq_lr)


@triton.jit
def _surrogate_bwd_kernel(
    # pointers
    lp_ptr, old_ptr, adv_ptr, mask_ptr, weight_ptr, row_scale_ptr,  # as the forward
    seq_ptr, grad_ptr,                   # [B] from the forward unless TOKEN_RATIO; 0-dim
                                         # upstream
    dlp_ptr,                             # [B, T] out, contiguous
    # strides
    stride_lb, stride_lt, stride_ob, stride_ot, stride_ab, stride_at, stride_mb, stride_mt,
    stride_wb, stride_wt,
    # sizes
    T, n_t_blocks,
    # scalars
    low_hi, low_lo, high_hi, high_lo, p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo, p3_hi, p3_lo,
    clamp,
    BLOCK_T: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, HAS_OLD: tl.constexpr, RATIO: tl.constexpr,
):
    # dL/dlp_bt = -g row_scale[b] M_bt w_bt dJ/dlp_bt (token and straight-through ratios),
    # -g seq[b] M_bt (TRL's sequence ratio)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    cols = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = cols < T
    actor = tl.load(mask_ptr + b * stride_mb + cols * stride_mt, mask=inside, other=0) != 0
    grad = tl.load(grad_ptr).to(ACC)
    if RATIO == SEQUENCE_RATIO:
        dlp = tl.where(actor, -grad * tl.load(seq_ptr + b).to(ACC), 0.0)
    else:
        p0, p1, p2, p3 = objective_params(p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo, p3_hi,
                                          p3_lo, ACC)
        lp = tl.load(lp_ptr + b * stride_lb + cols * stride_lt, mask=actor, other=0.0).to(ACC)
        old, adv, w = _token_inputs(lp, old_ptr, adv_ptr, weight_ptr, b, cols, actor, stride_ob,
                                    stride_ot, stride_ab, stride_at, stride_wb, stride_wt, ACC,
                                    HAS_OLD)
        lo, hi = region_bounds(old, low_hi, low_lo, high_hi, high_lo, GEOMETRY, TOPOLOGY)
        log_ratio = lp - old
        passes = actor
        if RATIO == STRAIGHT_RATIO:
            seq_lr = tl.zeros_like(lp) + tl.load(seq_ptr + b).to(ACC)
            log_ratio = tl.minimum(seq_lr, _STRAIGHT_LOG_MAX)
            passes = actor & (seq_lr <= _STRAIGHT_LOG_MAX)
        _, dj, _, _, _ = OBJECTIVE(log_ratio, lp, old, adv, lo, hi, (p0, p1, p2, p3), clamp)
        scale = -grad * tl.load(row_scale_ptr + b).to(ACC)
        dlp = tl.where(passes, dj * w * scale, 0.0)
    tl.store(dlp_ptr + b * T + cols, dlp.to(dlp_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _surrogate_logits_row(
    row,                                # b S + s
    logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr, row_scale_ptr, ref_ptr,
    kl_scale_ptr, entropy_scale_ptr, row_stats_ptr, dlogits_ptr, sums_ptr,
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    stride_ob, stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_rb, stride_rt,
    stride_db, stride_dt,
    T, S, offset, V,
    inv_temp, cap, cap_in, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3, clamp,
    BLOCK_V: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, WRITE_DLOGITS: tl.constexpr,
    HAS_OLD: tl.constexpr, KL: tl.constexpr, KL_STRAIGHT: tl.constexpr,
    KL_WEIGHTED: tl.constexpr, KL_CLAMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr, ROW_STATS: tl.constexpr, EVICT: tl.constexpr,
    NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
):
    # Row s of the [B, S] logits (rows outside the window [offset, offset + T) only get zeros):
    # lse = m + log s by the online pass (and the entropy H), lp = (z_y - m) - log s, the
    # surrogate and its terms, then dL/dlogits = g (onehot(y) - p) / tau + h dH/dz / tau with
    # g = dL/dlp = -row_scale[b] w dJ/dlp + kl_scale[b] dKL/dlp, h = dL/dH = -entropy_scale[b] (an
    # upstream gradient of 1; the backward rescales otherwise). On policy: old = lp.
    # Little of a row lives through its pass and the fp64 calls of its trust region (ptxas
    # holds a 16-warp program to 40 registers, three to an SM, and spills what does not fit):
    # b, s, t stay int32, the token's inputs and addresses are read and formed after the pass,
    # the sums are stored before the write pass.
    # ROW_STATS (a shard of a split vocabulary): the whole row's (lp, m, log s, H) are given,
    # gathered over the group (``scaleout.vocab``), and the row is read by the write pass alone;
    # its target is -1 where another rank holds it.
    token, b, s, t, in_window, is_actor = program_token(row, mask_ptr, T, S, offset, stride_mb,
                                                        stride_mt, True)
    if is_actor:
        row_ptr = logits_ptr + at(b, stride_lb, s, stride_lt)
        if ROW_STATS:
            stats = row_stats_ptr + token * N_ROW_STATS
            m = tl.load(stats + 1).to(ACC)
            log_s = tl.load(stats + 2).to(ACC)
            entropy = tl.zeros((), ACC)
            if WITH_ENTROPY:
                entropy = tl.load(stats + 3).to(ACC)
        else:
            m, log_s, entropy = row_logsumexp(row_ptr, V, inv_temp, cap, cap_in, BLOCK_V,
                                              WITH_ENTROPY, SOFTCAP, ACC, EVICT, NUM_STAGES)
        # In place the write pass overwrites x[y]: it waits at a barrier for every thread's read
        column = target_column(tl.load(targets_ptr + at(b, stride_yb, t, stride_yt)), V)
        if ROW_STATS:
            lp = tl.load(stats).to(ACC)
        else:
            x_y = load_target_logit(row_ptr, column, cap, cap_in, SOFTCAP, ACC)
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
        j, dj, f0, f1, f2 = OBJECTIVE(log_ratio, lp, old, adv, lo, hi, (p0, p1, p2, p3), clamp)
        bad = ~(tl.abs(j) < float("inf"))
        loss = j * w * row_scale
        g = -row_scale * w * dj
        kl = tl.zeros((), ACC)
        if KL != NO_KL:
            ref = tl.load(ref_ptr + at(b, stride_rb, t, stride_rt)).to(ACC)
            kl, dkl = kl_term(lp, ref, log_ratio, KL, KL_STRAIGHT, KL_WEIGHTED, KL_CLAMP)
            coef = tl.load(kl_scale_ptr + b).to(ACC)
            loss -= coef * kl
            g += coef * dkl
            bad = bad | ~(tl.abs(kl) < float("inf"))
        h = tl.zeros((), ACC)
        if WITH_ENTROPY:
            entropy_scale = tl.load(entropy_scale_ptr + b).to(ACC)
            loss += entropy_scale * entropy
            h = -entropy_scale
        tl.store(out + SUM_LOSS, loss)
        tl.store(out + SUM_FLAG0, f0.to(ACC))
        tl.store(out + SUM_FLAG1, f1.to(ACC))
        tl.store(out + SUM_FLAG2, f2.to(ACC))
        tl.store(out + SUM_RATIO, exp_accurate(log_ratio))
        clamped, _ = clamped_log_ratio(log_ratio, clamp)
        tl.store(out + SUM_NEG_LOG_RATIO, -clamped)
        tl.store(out + SUM_OVERFLOW, bad.to(ACC))
        tl.store(out + SUM_KL, kl)
        tl.store(out + SUM_ENTROPY, entropy)
        if WRITE_DLOGITS:
            tl.debug_barrier()
            row_write_dlogits(row_ptr, drow_ptr, V, column, inv_temp, cap, cap_in, m, log_s,
                              entropy, g, h, BLOCK_V, WITH_ENTROPY, SOFTCAP, ACC, EVICT,
                              NUM_STAGES, ORDER)
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
    ref_ptr, kl_scale_ptr,              # [B, T] reference log-probs and [B] row weights if KL
    entropy_scale_ptr,                  # [B] if WITH_ENTROPY
    row_stats_ptr,                      # [B*T, N_ROW_STATS] if ROW_STATS
    dlogits_ptr,                        # [B, S, V] out (may alias logits)
    sums_ptr,                           # [B*T, N_SUM_COLS] out
    # strides
    stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt,
    stride_ob, stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_rb, stride_rt,
    stride_db, stride_dt,
    # sizes
    T, S, offset, V, n_rows,            # n_rows = B S
    # scalars (rows.head_args, then the objective's)
    inv_temp_hi, inv_temp_lo, cap_hi, cap_lo, cap_in_hi, cap_in_lo,
    low_hi, low_lo, high_hi, high_lo, p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo, p3_hi, p3_lo,
    clamp,
    BLOCK_V: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, WRITE_DLOGITS: tl.constexpr,
    HAS_OLD: tl.constexpr, KL: tl.constexpr, KL_STRAIGHT: tl.constexpr,
    KL_WEIGHTED: tl.constexpr, KL_CLAMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    SOFTCAP: tl.constexpr, ROW_STATS: tl.constexpr,
    # launch configuration (single_pass.SinglePassConfig)
    PERSISTENT: tl.constexpr, EVICT: tl.constexpr, NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
):
    # One program per row; PERSISTENT: a grid capped near the SM count, each program taking the
    # rows pid, pid + programs, ... in turn, so that fewer rows are in flight between the two
    # reads of a row.
    inv_temp, cap, cap_in = head_scalars(inv_temp_hi, inv_temp_lo, cap_hi, cap_lo, cap_in_hi,
                                         cap_in_lo, ACC)
    p0, p1, p2, p3 = objective_params(p0_hi, p0_lo, p1_hi, p1_lo, p2_hi, p2_lo, p3_hi, p3_lo,
                                      ACC)
    if PERSISTENT:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _surrogate_logits_row(
                row, logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr,
                row_scale_ptr, ref_ptr, kl_scale_ptr, entropy_scale_ptr, row_stats_ptr,
                dlogits_ptr, sums_ptr,
                stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_ob,
                stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_rb, stride_rt,
                stride_db, stride_dt,
                T, S, offset, V,
                inv_temp, cap, cap_in, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3, clamp,
                BLOCK_V, OBJECTIVE, GEOMETRY, TOPOLOGY, ACC, WRITE_DLOGITS, HAS_OLD, KL,
                KL_STRAIGHT, KL_WEIGHTED, KL_CLAMP, WITH_ENTROPY, SOFTCAP, ROW_STATS, EVICT,
                NUM_STAGES, ORDER)
    else:
        _surrogate_logits_row(
            tl.program_id(0), logits_ptr, targets_ptr, mask_ptr, old_ptr, adv_ptr, weight_ptr,
            row_scale_ptr, ref_ptr, kl_scale_ptr, entropy_scale_ptr, row_stats_ptr, dlogits_ptr,
            sums_ptr,
            stride_lb, stride_lt, stride_yb, stride_yt, stride_mb, stride_mt, stride_ob,
            stride_ot, stride_ab, stride_at, stride_wb, stride_wt, stride_rb, stride_rt,
            stride_db, stride_dt,
            T, S, offset, V,
            inv_temp, cap, cap_in, low_hi, low_lo, high_hi, high_lo, p0, p1, p2, p3, clamp,
            BLOCK_V, OBJECTIVE, GEOMETRY, TOPOLOGY, ACC, WRITE_DLOGITS, HAS_OLD, KL,
            KL_STRAIGHT, KL_WEIGHTED, KL_CLAMP, WITH_ENTROPY, SOFTCAP, ROW_STATS, EVICT,
            NUM_STAGES, ORDER)


def surrogate_fwd(lp, old_lp, adv, mask, weights, row_scale, objective, *,
                  ratio: str = "token"):
    """``(sums [B, N_SUM_COLS], seq [B] or None)`` (compute dtype) from learner log-probs
    ``lp [B, T]``; ``old_lp`` None: on policy; ``objective``: an
    ``rlfuse.objectives.TokenSurrogate``;
    ``ratio``: a name of ``_names.RATIO_MODES``."""
    B, T = lp.shape
    acc = compute_dtype(lp.dtype)
    sums = empty((B, len(SUM_COLUMNS)), dtype=acc, device=lp.device)
    seq = empty((B,), dtype=acc, device=lp.device) if ratio != "token" else None
    if B == 0:
        return sums, seq
    (objective_code, geometry_code, topology_code), scalars = objective_args(objective)
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _surrogate_fwd_kernel[(B,)](
        lp, old_lp, adv, mask_u8,
        ones_if_none(weights, row_scale), row_scale,
        sums, seq,
        lp.stride(0), lp.stride(1), *token_strides(old_lp), *token_strides(adv), stride_mb,
        stride_mt, *token_strides(weights),
        T,
        *scalars,
        BLOCK_T=time_block(T), OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        RATIO=RATIO_MODES.index(ratio),
    )
    return sums, seq


def surrogate_bwd(lp, old_lp, adv, mask, weights, row_scale, seq, grad, objective, *,
                  ratio: str = "token"):
    """``dlp [B, T]`` (dtype of ``lp``) for the upstream gradient ``grad`` (0-dim); ``seq``:
    what the forward kept of a sequence-level ratio, else None."""
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
        seq, grad,
        dlp,
        lp.stride(0), lp.stride(1), *token_strides(old_lp), *token_strides(adv), stride_mb,
        stride_mt, *token_strides(weights),
        T, n_t_blocks,
        *scalars,
        BLOCK_T=block_t, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        RATIO=RATIO_MODES.index(ratio),
    )
    return dlp


def surrogate_logits_fwd(logits, targets, mask, old_lp, adv, weights, row_scale, objective, *,
                         temperature, write_dlogits=True, dlogits=None, offset=0, ref_lp=None,
                         kl=None, kl_scale=None, entropy_scale=None, logit_scale=1.0,
                         softcap=0.0, row_stats=None):
    """The single pass from ``logits [B, S, V]``, whose rows ``[offset, offset + T)`` predict
    ``targets [B, T]``: returns ``(dlogits, sums [B*T, N_SUM_COLS])`` with ``dlogits`` of the
    whole ``[B, S, V]`` (zero rows outside the window) for an upstream gradient of 1, written
    into ``dlogits`` when given (None without ``write_dlogits``: the loss alone, one read of
    the window). ``old_lp`` None: on policy (old = lp, formed in the kernel). ``kl`` (an
    ``rlfuse.terms.KLTerm``) with ``ref_lp [B, T]`` and its row weights ``kl_scale [B]``: the
    KL penalty; ``entropy_scale [B]``: the entropy bonus's row weights (coefficients included
    in both). ``logit_scale`` and ``softcap`` (0: none): the head's, as in ``rows.head_args``.
    ``row_stats [B*T, ROW_STAT_COLUMNS]``: a shard of a split vocabulary, whose rows' whole
    statistics are given (``targets`` then local to the shard, -1 where another rank holds
    them). Launched in the configuration
    ``single_pass.current()`` (``RLFUSE_SINGLE_PASS``)."""
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
    kl_code, kl_straight, kl_weighted, kl_clamp = kl_codes(kl)
    config = single_pass.current()
    block_v, num_warps = config.block_and_warps(V, logits.element_size())
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    head, softcapped = head_args(temperature, logit_scale, softcap)
    _surrogate_logits_kernel[(config.programs(B * S, logits.device),)](
        logits, targets, mask_u8,
        old_lp, adv, ones_if_none(weights, row_scale),
        row_scale,
        ref_lp, kl_scale, entropy_scale, row_stats,
        dlogits,
        sums,
        logits.stride(0), logits.stride(1), targets.stride(0), targets.stride(1),
        stride_mb, stride_mt, *token_strides(old_lp), *token_strides(adv),
        *token_strides(weights), *token_strides(ref_lp),
        *((dlogits.stride(0), dlogits.stride(1)) if write_dlogits else (0, 0)),
        T, S, offset, V, B * S,
        *head, *scalars,
        BLOCK_V=block_v, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(logits.dtype), WRITE_DLOGITS=write_dlogits,
        HAS_OLD=old_lp is not None, KL=kl_code, KL_STRAIGHT=kl_straight,
        KL_WEIGHTED=kl_weighted, KL_CLAMP=kl_clamp, WITH_ENTROPY=entropy_scale is not None,
        SOFTCAP=softcapped, ROW_STATS=row_stats is not None, PERSISTENT=config.persistent,
        EVICT=config.evict, NUM_STAGES=config.stages_code, ORDER=config.order_code,
        num_warps=num_warps, maxnreg=config.maxnreg(num_warps),
    )
    return dlogits, sums
