"""The surrogate losses' kernels (GPPO, GR-OPD, the PPO family): a per-token objective
(``OBJECTIVE``, a function of ``token_functions``) over each token's trust region
(``regions.region_bounds``).

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
the row's softmax, ``row_functions.row_write_dlogits``); from log-probs the terms are separate ops.

The ratio of a token (``RATIO``, a code of ``_names.RATIO_MODES``, from log-probs only): its
own; its sequence's s_b, differentiated through the mean (TRL's GSPO); or s_b's log clamped to
at most 10 and passed straight through to each token (verl's GSPO: d log s_bt / d lp_bt = 1).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._names import RATIO_MODES
from ..._types import compute_dtype
from . import single_pass
from ..tokens.kl import NO_KL, kl_codes, kl_term
from ..lib.token_functions import (N_SUM_COLS, SUM_COLUMNS, SUM_ENTROPY, SUM_FLAG0, SUM_FLAG1,
                                   SUM_FLAG2, SUM_KL, SUM_LOSS, SUM_NEG_LOG_RATIO, SUM_OVERFLOW,
                                   SUM_RATIO, clamped_log_ratio, objective_args)
from ..lib.regions import region_bounds, row_region, token_bounds
from ..lib.head_functions import HeadParams
from ..lib.row_functions import (at, load_target_logit, program_token, row_logsumexp,
                                 row_write_dlogits, row_write_zeros, target_column, target_logprob)
from ..lib.utils import (Flags, constexpr_codes, empty, exp_accurate, fp64_values, mask_args,
                         ones_if_none, time_block, tl_compute_dtype, token_at, token_tensor)

TOKEN_RATIO, SEQUENCE_RATIO, STRAIGHT_RATIO = constexpr_codes(RATIO_MODES, *RATIO_MODES)
_STRAIGHT_LOG_MAX = tl.constexpr(10.0)    # verl's GSPO clamps log s_bt at 10
FWD_BLOCK_T = 128    # tokens of a program of the forward from log-probs
# The whole-row statistics of a shard's rows (``row_stats``), gathered over the group.
ROW_STAT_COLUMNS = ("logp", "max", "log_sum", "entropy")
N_ROW_STATS = tl.constexpr(len(ROW_STAT_COLUMNS))
# The single pass's FLAGS: dlogits written, old log-probs given, the KL term's options
# (``kl.kl_codes``), the entropy bonus, a softcap, a shard's given row statistics, a persistent
# grid (``single_pass.SinglePassConfig``)
SINGLE_PASS_FLAGS = Flags("WRITE_DLOGITS", "HAS_OLD", "KL_STRAIGHT", "KL_WEIGHTED", "KL_CLAMP",
                          "WITH_ENTROPY", "SOFTCAP", "ROW_STATS", "PERSISTENT")
(_WRITE_DLOGITS, _HAS_OLD, _KL_STRAIGHT, _KL_WEIGHTED, _KL_CLAMP, _WITH_ENTROPY, _SOFTCAP,
 _ROW_STATS, _PERSISTENT) = SINGLE_PASS_FLAGS.bits()


@triton.jit
def _token_inputs(lp, old, adv, weights, b, cols, actor, ACC: tl.constexpr,
                  HAS_OLD: tl.constexpr):
    """(old, adv, w) at the tokens ``cols`` of row ``b`` (``utils.token_tensor``s, read at
    actor tokens only); on policy, old = lp."""
    old_lp = lp
    if HAS_OLD:
        old_lp = tl.load(token_at(old, b, cols), mask=actor, other=0.0).to(ACC)
    a = tl.load(token_at(adv, b, cols), mask=actor, other=0.0).to(ACC)
    w = tl.load(token_at(weights, b, cols), mask=actor, other=0.0).to(ACC)
    return old_lp, a, w


@triton.jit
def _sequence_log_ratio(lp, old, mask, b, T, BLOCK_T: tl.constexpr, HAS_OLD: tl.constexpr,
                        ACC: tl.constexpr):
    """(mean over the row's actor tokens of lp - old, their count) — GSPO's log s_b."""
    total = tl.zeros([BLOCK_T], ACC)
    count = tl.zeros([BLOCK_T], ACC)
    for start in range(0, T, BLOCK_T):
        cols = (start + tl.arange(0, BLOCK_T)).to(tl.int64)
        actor = tl.load(token_at(mask, b, cols), mask=cols < T, other=0) != 0
        if HAS_OLD:
            lp_t = tl.load(token_at(lp, b, cols), mask=actor, other=0.0)
            old_t = tl.load(token_at(old, b, cols), mask=actor, other=0.0)
            total += lp_t.to(ACC) - old_t.to(ACC)
        count += actor.to(ACC)
    tokens = tl.sum(count, axis=0)
    return tl.sum(total, axis=0) / tl.maximum(tokens, 1.0), tokens


@triton.jit
def _surrogate_fwd_kernel(
    # tensors: (pointer, stride_b, stride_t) (utils.token_tensor)
    lp, old, adv, mask, weights,        # [B, T] (old: None on policy, old = lp; adv: [B, T] or
                                        # [B]; weights: strides 0 for none)
    row_scale_ptr,                      # [B]
    sums_ptr, seq_ptr,                  # [B * n_t_blocks, N_SUM_COLS] out; [B * n_t_blocks] out
                                        # unless TOKEN_RATIO
    # sizes
    T, n_t_blocks,
    # scalars (token_functions.objective_args; not ``params``: Triton's launcher has a local of that
    # name)
    region, hyper, clamp,
    BLOCK_T: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, HAS_OLD: tl.constexpr, RATIO: tl.constexpr,
):
    # One block of BLOCK_T tokens of row b: its sums (the launcher adds a row's blocks in
    # order). SEQUENCE_RATIO (TRL's GSPO): every token of the row takes the row's ratio
    # s_b = exp(mean_t (lp - old)), read by each block from the whole row, so dL/dlp_bt =
    # -row_scale_b (sum_t' w dJ/dlog s) / T_b, the same for every actor token: each block keeps
    # its share of it for the backward. STRAIGHT_RATIO (verl's): log s_bt = min(log s_b, 10)
    # with d log s_bt / d lp_bt = 1 (0 past the clamp): each block keeps log s_b.
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    hyper = fp64_values(hyper, ACC)
    if RATIO != TOKEN_RATIO:
        seq_lr, tokens = _sequence_log_ratio(lp, old, mask, b, T, BLOCK_T, HAS_OLD, ACC)
    cols = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    actor = tl.load(token_at(mask, b, cols), mask=cols < T, other=0) != 0
    lp_t = tl.load(token_at(lp, b, cols), mask=actor, other=0.0).to(ACC)
    old_t, adv_t, w = _token_inputs(lp_t, old, adv, weights, b, cols, actor, ACC, HAS_OLD)
    lo, hi = region_bounds(old_t, region, GEOMETRY, TOPOLOGY)
    log_ratio = lp_t - old_t
    if RATIO == SEQUENCE_RATIO:
        log_ratio = tl.zeros_like(lp_t) + seq_lr
    elif RATIO == STRAIGHT_RATIO:
        log_ratio = tl.zeros_like(lp_t) + tl.minimum(seq_lr, _STRAIGHT_LOG_MAX)
    j, dj, f0, f1, f2 = OBJECTIVE(log_ratio, lp_t, old_t, adv_t, lo, hi, hyper, clamp)
    bad = ~(tl.abs(j) < float("inf"))
    clamped, _ = clamped_log_ratio(lp_t - old_t, clamp)
    row_scale = tl.load(row_scale_ptr + b).to(ACC)
    out = sums_ptr + pid * N_SUM_COLS
    tl.store(out + SUM_LOSS, tl.sum(tl.where(actor, j * w, 0.0), axis=0) * row_scale)
    tl.store(out + SUM_FLAG0, tl.sum((actor & f0).to(ACC), axis=0))
    tl.store(out + SUM_FLAG1, tl.sum((actor & f1).to(ACC), axis=0))
    tl.store(out + SUM_FLAG2, tl.sum((actor & f2).to(ACC), axis=0))
    tl.store(out + SUM_RATIO, tl.sum(tl.where(actor, exp_accurate(log_ratio), 0.0), axis=0))
    tl.store(out + SUM_NEG_LOG_RATIO, -tl.sum(clamped, axis=0))
    tl.store(out + SUM_OVERFLOW, tl.sum((actor & bad).to(ACC), axis=0))
    tl.store(out + SUM_KL, tl.zeros((), ACC))        # the terms are separate ops here
    tl.store(out + SUM_ENTROPY, tl.zeros((), ACC))
    if RATIO == SEQUENCE_RATIO:
        seq_grad = tl.sum(tl.where(actor, dj * w, 0.0), axis=0)
        tl.store(seq_ptr + pid, seq_grad * row_scale / tl.maximum(tokens, 1.0))
    elif RATIO == STRAIGHT_RATIO:
        tl.store(seq_ptr + pid, seq_lr)


@triton.jit
def _surrogate_bwd_kernel(
    # tensors: as the forward
    lp, old, adv, mask, weights, row_scale_ptr,
    seq_ptr, grad_ptr,                   # [B] from the forward unless TOKEN_RATIO; 0-dim
                                         # upstream
    dlp_ptr,                             # [B, T] out, contiguous
    # sizes
    T, n_t_blocks,
    # scalars
    region, hyper, clamp,
    BLOCK_T: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, HAS_OLD: tl.constexpr, RATIO: tl.constexpr,
):
    # dL/dlp_bt = -g row_scale[b] M_bt w_bt dJ/dlp_bt (token and straight-through ratios),
    # -g seq[b] M_bt (TRL's sequence ratio)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // n_t_blocks
    cols = (pid % n_t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    inside = cols < T
    actor = tl.load(token_at(mask, b, cols), mask=inside, other=0) != 0
    grad = tl.load(grad_ptr).to(ACC)
    if RATIO == SEQUENCE_RATIO:
        dlp = tl.where(actor, -grad * tl.load(seq_ptr + b).to(ACC), 0.0)
    else:
        hyper = fp64_values(hyper, ACC)
        lp_t = tl.load(token_at(lp, b, cols), mask=actor, other=0.0).to(ACC)
        old_t, adv_t, w = _token_inputs(lp_t, old, adv, weights, b, cols, actor, ACC, HAS_OLD)
        lo, hi = region_bounds(old_t, region, GEOMETRY, TOPOLOGY)
        log_ratio = lp_t - old_t
        passes = actor
        if RATIO == STRAIGHT_RATIO:
            seq_lr = tl.zeros_like(lp_t) + tl.load(seq_ptr + b).to(ACC)
            log_ratio = tl.minimum(seq_lr, _STRAIGHT_LOG_MAX)
            passes = actor & (seq_lr <= _STRAIGHT_LOG_MAX)
        _, dj, _, _, _ = OBJECTIVE(log_ratio, lp_t, old_t, adv_t, lo, hi, hyper, clamp)
        scale = -grad * tl.load(row_scale_ptr + b).to(ACC)
        dlp = tl.where(passes, dj * w * scale, 0.0)
    tl.store(dlp_ptr + b * T + cols, dlp.to(dlp_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _surrogate_logits_row(
    row,                                # b S + s
    logits, targets, mask, old, adv, weights, ref, row_weights, row_stats_ptr, dlogits,
    sums_ptr,
    T, S, offset, V,
    head, region, hyper, clamp,         # in the compute dtype (head and hyper: their values)
    BLOCK_V: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, KL: tl.constexpr, FLAGS: tl.constexpr,
    EVICT: tl.constexpr, NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
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
    WRITE_DLOGITS: tl.constexpr = (_WRITE_DLOGITS & FLAGS) != 0
    HAS_OLD: tl.constexpr = (_HAS_OLD & FLAGS) != 0
    WITH_ENTROPY: tl.constexpr = (_WITH_ENTROPY & FLAGS) != 0
    SOFTCAP: tl.constexpr = (_SOFTCAP & FLAGS) != 0
    ROW_STATS: tl.constexpr = (_ROW_STATS & FLAGS) != 0
    inv_temp, cap, cap_in = head
    token, b, s, t, in_window, is_actor = program_token(row, mask[0], T, S, offset, mask[1],
                                                        mask[2], True)
    if is_actor:
        row_ptr = token_at(logits, b, s)
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
        column = target_column(tl.load(token_at(targets, b, t)), V)
        if ROW_STATS:
            lp = tl.load(stats).to(ACC)
        else:
            x_y = load_target_logit(row_ptr, column, cap, cap_in, SOFTCAP, ACC)
            lp = target_logprob(x_y, inv_temp, m, log_s)
        old_lp = lp
        if HAS_OLD:
            old_lp = tl.load(token_at(old, b, t)).to(ACC)
        a = tl.load(token_at(adv, b, t)).to(ACC)
        w = tl.load(token_at(weights, b, t)).to(ACC)
        log_ratio = lp - old_lp
        row_scale = tl.load(row_weights[0] + b).to(ACC)
        out = sums_ptr + at(b, T * N_SUM_COLS, t, N_SUM_COLS)    # the token b T + t
        if WRITE_DLOGITS:
            drow_ptr = token_at(dlogits, b, s)
        lo, hi = token_bounds(old_lp, region, b, t, GEOMETRY, TOPOLOGY)
        j, dj, f0, f1, f2 = OBJECTIVE(log_ratio, lp, old_lp, a, lo, hi, hyper, clamp)
        bad = ~(tl.abs(j) < float("inf"))
        loss = j * w * row_scale
        g = -row_scale * w * dj
        kl = tl.zeros((), ACC)
        if KL != NO_KL:
            ref_lp = tl.load(token_at(ref, b, t)).to(ACC)
            kl, dkl = kl_term(lp, ref_lp, log_ratio, KL, (_KL_STRAIGHT & FLAGS) != 0,
                              (_KL_WEIGHTED & FLAGS) != 0, (_KL_CLAMP & FLAGS) != 0)
            coef = tl.load(row_weights[1] + b).to(ACC)
            loss -= coef * kl
            g += coef * dkl
            bad = bad | ~(tl.abs(kl) < float("inf"))
        h = tl.zeros((), ACC)
        if WITH_ENTROPY:
            entropy_scale = tl.load(row_weights[2] + b).to(ACC)
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
            row_write_zeros(token_at(dlogits, b, s), V, BLOCK_V, EVICT)
        if in_window:
            for col in tl.static_range(N_SUM_COLS):
                tl.store(sums_ptr + token * N_SUM_COLS + col, tl.zeros((), ACC))


@triton.jit
def _surrogate_logits_kernel(
    # tensors: (pointer, stride_b, stride_t) (utils.token_tensor)
    logits, targets, mask,              # [B, S, V], [B, T], [B, T] uint8
    old, adv, weights,                  # [B, T] (None on policy), [B, T] or [B] (stride_t 0),
                                        # [B, T] (strides 0: none)
    ref,                                # [B, T] reference log-probs if KL
    row_weights,                        # pointers to the [B] row weights of the objective, of
                                        # the KL term (if KL) and of the entropy (if WITH_ENTROPY;
                                        # None otherwise: indexed, never unpacked, for Triton 3.3)
    row_stats_ptr,                      # [B*T, N_ROW_STATS] if ROW_STATS
    dlogits,                            # [B, S, V] out (may alias logits)
    sums_ptr,                           # [B*T, N_SUM_COLS] out
    # sizes
    T, S, offset, V, n_rows,            # n_rows = B S
    # scalars (head.HeadParams, token_functions.objective_args; region: regions.row_region's,
    # the region's sizes or, with GEOMETRY == regions.GIVEN, the [B, T] bounds)
    head, region, hyper, clamp,
    # constexprs: the objective's codes, the KL estimator's (kl.NO_KL: none), the flags
    # (SINGLE_PASS_FLAGS), the launch configuration (single_pass.SinglePassConfig)
    BLOCK_V: tl.constexpr, OBJECTIVE: tl.constexpr, GEOMETRY: tl.constexpr,
    TOPOLOGY: tl.constexpr, ACC: tl.constexpr, KL: tl.constexpr, FLAGS: tl.constexpr,
    EVICT: tl.constexpr, NUM_STAGES: tl.constexpr, ORDER: tl.constexpr,
):
    # One program per row; PERSISTENT: a grid sized from the L2 or the SM count, each program
    # taking the rows pid, pid + programs, ... in turn, so that fewer rows are in flight between
    # the two reads of a row.
    head = fp64_values(head, ACC)
    hyper = fp64_values(hyper, ACC)
    if _PERSISTENT & FLAGS:
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            _surrogate_logits_row(
                row, logits, targets, mask, old, adv, weights, ref, row_weights, row_stats_ptr,
                dlogits, sums_ptr, T, S, offset, V, head, region, hyper, clamp,
                BLOCK_V, OBJECTIVE, GEOMETRY, TOPOLOGY, ACC, KL, FLAGS, EVICT, NUM_STAGES,
                ORDER)
    else:
        _surrogate_logits_row(
            tl.program_id(0), logits, targets, mask, old, adv, weights, ref, row_weights,
            row_stats_ptr, dlogits, sums_ptr, T, S, offset, V, head, region, hyper, clamp,
            BLOCK_V, OBJECTIVE, GEOMETRY, TOPOLOGY, ACC, KL, FLAGS, EVICT, NUM_STAGES, ORDER)



def surrogate_fwd(lp, old_lp, adv, mask, weights, row_scale, objective, *,
                  ratio: str = "token"):
    """``(sums [B, N_SUM_COLS], seq [B] or None)`` (compute dtype) from learner log-probs
    ``lp [B, T]``; ``old_lp`` None: on policy; ``objective``: an
    ``rlfuse.objectives.TokenSurrogate``;
    ``ratio``: a name of ``_names.RATIO_MODES``. One program per block of ``FWD_BLOCK_T``
    tokens (a grid over the rows' blocks, not over the rows), whose sums are added in order."""
    B, T = lp.shape
    acc = compute_dtype(lp.dtype)
    if B * T == 0:
        sums = empty((B, len(SUM_COLUMNS)), dtype=acc, device=lp.device)
        return sums.zero_(), (empty((B,), dtype=acc, device=lp.device).zero_()
                              if ratio != "token" else None)
    block_t = min(time_block(T), FWD_BLOCK_T)
    n_t_blocks = triton.cdiv(T, block_t)
    sums = empty((B, n_t_blocks, len(SUM_COLUMNS)), dtype=acc, device=lp.device)
    seq = empty((B, n_t_blocks), dtype=acc, device=lp.device) if ratio != "token" else None
    (objective_code, geometry_code, topology_code), scalars = objective_args(objective)
    _surrogate_fwd_kernel[(B * n_t_blocks,)](
        token_tensor(lp), token_tensor(old_lp), token_tensor(adv), mask_args(mask),
        ones_if_none(weights, row_scale), row_scale,
        sums, seq,
        T, n_t_blocks,
        *scalars,
        BLOCK_T=block_t, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        RATIO=RATIO_MODES.index(ratio),
    )
    if seq is not None:   # a row's share of its gradient, or its log s_b in every block
        seq = seq.sum(1) if ratio == "sequence" else seq[:, 0].contiguous()
    return sums.sum(1), seq


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
    _surrogate_bwd_kernel[(B * n_t_blocks,)](
        token_tensor(lp), token_tensor(old_lp), token_tensor(adv), mask_args(mask),
        ones_if_none(weights, row_scale), row_scale,
        seq, grad,
        dlp,
        T, n_t_blocks,
        *scalars,
        BLOCK_T=block_t, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(lp.dtype), HAS_OLD=old_lp is not None,
        RATIO=RATIO_MODES.index(ratio),
    )
    return dlp


def surrogate_logits_fwd(logits, targets, mask, old_lp, adv, weights, row_scale, objective, *,
                         head: HeadParams, write_dlogits=True, dlogits=None, offset=0,
                         ref_lp=None, kl=None, kl_scale=None, entropy_scale=None,
                         row_stats=None):
    """The single pass from ``logits [B, S, V]``, whose rows ``[offset, offset + T)`` predict
    ``targets [B, T]``: returns ``(dlogits, sums [B*T, N_SUM_COLS])`` with ``dlogits`` of the
    whole ``[B, S, V]`` (zero rows outside the window) for an upstream gradient of 1, written
    into ``dlogits`` when given (None without ``write_dlogits``: the loss alone, one read of
    the window). ``old_lp`` None: on policy (old = lp, formed in the kernel). ``kl`` (an
    ``rlfuse.terms.KLTerm``) with ``ref_lp [B, T]`` and its row weights ``kl_scale [B]``: the
    KL penalty; ``entropy_scale [B]``: the entropy bonus's row weights (coefficients included
    in both). ``head``: the temperature (and a head's logit scale and softcap).
    ``row_stats [B*T, ROW_STAT_COLUMNS]``: a shard of a split vocabulary, whose rows' whole
    statistics are given (``targets`` then local to the shard, -1 where another rank holds
    them). Launched in the configuration ``single_pass.current()`` (``RLFUSE_SINGLE_PASS``)."""
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
    (objective_code, _, _), (_, hyper, clamp) = objective_args(objective)
    # the region's codes and argument as a row kernel takes them
    geometry_code, topology_code, region = row_region(*objective[1:5], old_lp, acc)
    kl_code, kl_straight, kl_weighted, kl_clamp = kl_codes(kl)
    config = single_pass.current()
    block_v, num_warps = config.block_and_warps(V, logits.element_size())
    head_args, softcapped = head.kernel_args()
    programs, maxnreg = config.grid(B * S, V * logits.element_size(), num_warps, logits.device)
    _surrogate_logits_kernel[(programs,)](
        token_tensor(logits), token_tensor(targets), mask_args(mask),
        token_tensor(old_lp), token_tensor(adv), ones_if_none(weights, row_scale),
        token_tensor(ref_lp),
        (row_scale, kl_scale, entropy_scale),
        row_stats,
        token_tensor(dlogits if write_dlogits else None),
        sums,
        T, S, offset, V, B * S,
        head_args, region, hyper, clamp,
        BLOCK_V=block_v, OBJECTIVE=objective_code, GEOMETRY=geometry_code,
        TOPOLOGY=topology_code, ACC=tl_compute_dtype(logits.dtype), KL=kl_code,
        FLAGS=SINGLE_PASS_FLAGS.word(
            WRITE_DLOGITS=write_dlogits, HAS_OLD=old_lp is not None, KL_STRAIGHT=kl_straight,
            KL_WEIGHTED=kl_weighted, KL_CLAMP=kl_clamp, WITH_ENTROPY=entropy_scale is not None,
            SOFTCAP=softcapped, ROW_STATS=row_stats is not None, PERSISTENT=config.persistent),
        EVICT=config.evict, NUM_STAGES=config.stages_code, ORDER=config.order_code,
        num_warps=num_warps, maxnreg=maxnreg,
    )
    return dlogits, sums
