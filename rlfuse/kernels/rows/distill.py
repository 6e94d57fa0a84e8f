"""Distillation's kernels between a student's and a teacher's rows of logits, one program per
position, over the per-position function of a divergence (``DIVERGENCE``, a function of
``divergence_functions``), and the student's gradient.

Forward: each model's row reduced to its (m, log s) (``row_functions.row_logsumexp``; the student's
entropy beside it), then both rows read once more to sum the function's terms from the exact
log-probs ``s_v = (x_v − m_s) / τ_s − log s_s`` and ``t_v``. Backward: both rows read once,
the student's gradient ``g ∂D/∂z_v / τ_s`` written once for an upstream gradient g of the
position's divergence D. The single pass of a loss, whose upstream gradients (each position's
weight in it) are known before the kernels, runs both in one program per row. Rows outside the
window and masked rows get a gradient of zeros, never read.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..lib.row_functions import COMPILER_STAGES, at, program_token, row_logsumexp, row_write_zeros
from ..lib.divergence_functions import divergence_args
from ..lib.head_functions import HeadParams, softcap
from ..lib.utils import empty, fp64_values, mask_args, tl_compute_dtype, vocab_launch_config

# Columns of the per-position statistics the forward saves for the backward.
DISTILL_STATS = ("student_max", "student_log_sum", "teacher_max", "teacher_log_sum", "aux")
N_STATS = tl.constexpr(len(DISTILL_STATS))


@triton.jit
def log_probs_of(x, inside, m, log_s, head, SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """Log-probs ``(x − m) inv_temp − log s`` of logits ``x`` in the compute dtype (through the
    head's softcap with ``SOFTCAP``; ``head``: its ``(inv_temp, cap, cap_in)``,
    ``HeadParams``; ``m``, ``log_s``: their rows' statistics, broadcast to ``x``), -inf where
    not ``inside``, and ``dx/dlogit / (cap cap_in)`` (1 without a softcap)."""
    inv_temp, cap, cap_in = head
    if SOFTCAP:
        x, dx = softcap(x, cap, cap_in, ACC)
        return tl.where(inside, (x - m) * inv_temp - log_s, float("-inf")), dx
    else:
        return tl.where(inside, (x - m) * inv_temp - log_s, float("-inf")), 1.0


@triton.jit
def _log_probs(row_ptr, cols, V, m, log_s, head, SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """``log_probs_of`` a block of a row's logits, -inf past the row."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(ACC)
    return log_probs_of(x, cols < V, m, log_s, head, SOFTCAP, ACC)


@triton.jit
def _divergence_sums(s_row, t_row, V, m_s, log_s_s, m_t, log_s_t, s_head, t_head, div_params,
                     DIVERGENCE: tl.constexpr, BLOCK_V: tl.constexpr, S_SOFTCAP: tl.constexpr,
                     T_SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """``(D, aux)`` of a position: its rows read once more, the terms summed from the rows'
    statistics."""
    acc = tl.zeros((BLOCK_V,), ACC)
    acc_aux = tl.zeros((BLOCK_V,), ACC)
    no_aux = tl.zeros((), ACC)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        s, unused_ds = _log_probs(s_row, cols, V, m_s, log_s_s, s_head, S_SOFTCAP, ACC)
        lt, unused_dt = _log_probs(t_row, cols, V, m_t, log_s_t, t_head, T_SOFTCAP, ACC)
        term, aux_term, unused = DIVERGENCE(s, lt, no_aux, div_params)
        acc += term
        acc_aux += aux_term
    return tl.sum(acc, 0), tl.sum(acc_aux, 0)


@triton.jit
def _write_gradient(s_row, t_row, drow, V, m_s, log_s_s, m_t, log_s_t, aux, g, s_head, t_head,
                    div_params, DIVERGENCE: tl.constexpr, BLOCK_V: tl.constexpr,
                    S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    """The student's gradient ``g ∂D/∂z_v / τ_s`` of a position (times the softcap's
    derivative) written into ``drow``, for an upstream gradient g of its divergence D."""
    # dD/dlogit = dD/dz inv_temp (times the softcap's derivative cap cap_in dx)
    g = g * s_head[0]
    if S_SOFTCAP:
        g = g * s_head[1] * s_head[2]
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        s, ds = _log_probs(s_row, cols, V, m_s, log_s_s, s_head, S_SOFTCAP, ACC)
        lt, unused_dt = _log_probs(t_row, cols, V, m_t, log_s_t, t_head, T_SOFTCAP, ACC)
        unused_term, unused_aux, d = DIVERGENCE(s, lt, aux, div_params)
        tl.store(drow + cols, (g * d * ds).to(drow.dtype.element_ty), mask=cols < V)


@triton.jit
def _row_divergence(s_row, t_row, V, s_head, t_head, div_params, DIVERGENCE: tl.constexpr,
                    BLOCK_V: tl.constexpr, S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
                    ACC: tl.constexpr):
    """``(D, aux, the student's entropy, m_s, log s_s, m_t, log s_t)`` of a position: each row
    reduced to its statistics (one read each), then ``_divergence_sums``."""
    m_s, log_s_s, entropy = row_logsumexp(s_row, V, s_head[0], s_head[1], s_head[2], BLOCK_V,
                                          True, S_SOFTCAP, ACC, False, COMPILER_STAGES)
    m_t, log_s_t, no_entropy = row_logsumexp(t_row, V, t_head[0], t_head[1], t_head[2], BLOCK_V,
                                             False, T_SOFTCAP, ACC, False, COMPILER_STAGES)
    value, aux = _divergence_sums(s_row, t_row, V, m_s, log_s_s, m_t, log_s_t, s_head, t_head,
                                  div_params, DIVERGENCE, BLOCK_V, S_SOFTCAP, T_SOFTCAP, ACC)
    return value, aux, entropy, m_s, log_s_s, m_t, log_s_t


@triton.jit
def _distill_fwd_kernel(student_ptr, teacher_ptr, mask_ptr, value_ptr, entropy_ptr, stats_ptr,
                        stride_sb, stride_st, stride_tb, stride_tt, stride_mb, stride_mt,
                        T, V, s_head_args, t_head_args, hyper,
                        DIVERGENCE: tl.constexpr, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
                        S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, ACC: tl.constexpr,
                        GIVEN_STATS: tl.constexpr = False):
    # GIVEN_STATS: the rows' statistics read from ``stats`` (a split vocabulary's whole rows),
    # the terms of this shard summed into value and aux (no entropy)
    token, b, t, _, _, is_actor = program_token(tl.program_id(0), mask_ptr, T, T, 0, stride_mb,
                                                stride_mt, HAS_MASK)
    s_head = fp64_values(s_head_args, ACC)
    t_head = fp64_values(t_head_args, ACC)
    div_params = fp64_values(hyper, ACC)
    value = tl.zeros((), ACC)
    aux = tl.zeros((), ACC)
    entropy = tl.zeros((), ACC)
    m_s = tl.zeros((), ACC)
    log_s_s = tl.zeros((), ACC)
    m_t = tl.zeros((), ACC)
    log_s_t = tl.zeros((), ACC)
    if is_actor:
        s_row = student_ptr + at(b, stride_sb, t, stride_st)
        t_row = teacher_ptr + at(b, stride_tb, t, stride_tt)
        if GIVEN_STATS:
            given = stats_ptr + N_STATS * token
            m_s = tl.load(given).to(ACC)
            log_s_s = tl.load(given + 1).to(ACC)
            m_t = tl.load(given + 2).to(ACC)
            log_s_t = tl.load(given + 3).to(ACC)
            value, aux = _divergence_sums(s_row, t_row, V, m_s, log_s_s, m_t, log_s_t, s_head,
                                          t_head, div_params, DIVERGENCE, BLOCK_V, S_SOFTCAP,
                                          T_SOFTCAP, ACC)
        else:
            value, aux, entropy, m_s, log_s_s, m_t, log_s_t = _row_divergence(
                s_row, t_row, V, s_head, t_head, div_params, DIVERGENCE, BLOCK_V, S_SOFTCAP,
                T_SOFTCAP, ACC)
    tl.store(value_ptr + token, value)
    stats = stats_ptr + N_STATS * token
    if not GIVEN_STATS:
        tl.store(entropy_ptr + token, entropy)
        tl.store(stats, m_s)
        tl.store(stats + 1, log_s_s)
        tl.store(stats + 2, m_t)
        tl.store(stats + 3, log_s_t)
    tl.store(stats + 4, aux)


@triton.jit
def _distill_bwd_kernel(student_ptr, teacher_ptr, mask_ptr, stats_ptr, dvalue_ptr, dlogits_ptr,
                        stride_sb, stride_st, stride_tb, stride_tt, stride_mb, stride_mt,
                        stride_db, stride_dt, T, S, offset, V, s_head_args, t_head_args,
                        hyper,
                        DIVERGENCE: tl.constexpr, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
                        S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, ACC: tl.constexpr):
    # One program per row of the student's whole [B, S] logits.
    token, b, s_row_index, t, _, is_actor = program_token(tl.program_id(0), mask_ptr, T, S,
                                                          offset, stride_mb, stride_mt,
                                                          HAS_MASK)
    drow = dlogits_ptr + at(b, stride_db, s_row_index, stride_dt)
    if is_actor:
        stats = stats_ptr + N_STATS * token
        _write_gradient(student_ptr + at(b, stride_sb, s_row_index, stride_st),
                        teacher_ptr + at(b, stride_tb, t, stride_tt), drow, V,
                        tl.load(stats).to(ACC), tl.load(stats + 1).to(ACC),
                        tl.load(stats + 2).to(ACC), tl.load(stats + 3).to(ACC),
                        tl.load(stats + 4).to(ACC), tl.load(dvalue_ptr + token).to(ACC),
                        fp64_values(s_head_args, ACC), fp64_values(t_head_args, ACC),
                        fp64_values(hyper, ACC), DIVERGENCE, BLOCK_V, S_SOFTCAP, T_SOFTCAP,
                        ACC)
    else:
        row_write_zeros(drow, V, BLOCK_V, False)


@triton.jit
def _distill_single_pass_kernel(student_ptr, teacher_ptr, mask_ptr, weights_ptr, value_ptr,
                                entropy_ptr, dlogits_ptr, stride_sb, stride_st, stride_tb,
                                stride_tt, stride_mb, stride_mt, stride_wb, stride_wt,
                                stride_db, stride_dt, T, S, offset, V, s_head_args,
                                t_head_args, hyper, DIVERGENCE: tl.constexpr,
                                BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
                                S_SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr,
                                ACC: tl.constexpr):
    # One program per row of the student's whole [B, S] logits: an actor row's statistics and
    # divergence, then its gradient for the upstream gradient of its weight in the loss (the
    # rows read a third and a fourth time, from L2 at best); every other row's gradient 0.
    token, b, s_row_index, t, in_window, is_actor = program_token(
        tl.program_id(0), mask_ptr, T, S, offset, stride_mb, stride_mt, HAS_MASK)
    drow = dlogits_ptr + at(b, stride_db, s_row_index, stride_dt)
    if is_actor:
        s_head = fp64_values(s_head_args, ACC)
        t_head = fp64_values(t_head_args, ACC)
        div_params = fp64_values(hyper, ACC)
        s_row = student_ptr + at(b, stride_sb, s_row_index, stride_st)
        t_row = teacher_ptr + at(b, stride_tb, t, stride_tt)
        value, aux, entropy, m_s, log_s_s, m_t, log_s_t = _row_divergence(
            s_row, t_row, V, s_head, t_head, div_params, DIVERGENCE, BLOCK_V, S_SOFTCAP,
            T_SOFTCAP, ACC)
        tl.store(value_ptr + token, value)
        tl.store(entropy_ptr + token, entropy)
        weight = tl.load(weights_ptr + at(b, stride_wb, t, stride_wt)).to(ACC)
        _write_gradient(s_row, t_row, drow, V, m_s, log_s_s, m_t, log_s_t, aux, weight, s_head,
                        t_head, div_params, DIVERGENCE, BLOCK_V, S_SOFTCAP, T_SOFTCAP, ACC)
    else:
        if in_window:
            tl.store(value_ptr + token, tl.zeros((), value_ptr.dtype.element_ty))
            tl.store(entropy_ptr + token, tl.zeros((), entropy_ptr.dtype.element_ty))
        row_write_zeros(drow, V, BLOCK_V, False)


def _launch(student: torch.Tensor, teacher: torch.Tensor, mask, student_head: HeadParams,
            teacher_head: HeadParams, terms):
    """What every launch of these kernels shares: ``(mask args (pointer, strides), (the
    student's and the teacher's head args, the divergence's parameters), the constexprs and
    warps)``."""
    block_v, num_warps = vocab_launch_config(student.shape[-1], max(student.element_size(),
                                                                    teacher.element_size()))
    function, hyper = divergence_args(terms)
    (s_head, s_softcap), (t_head, t_softcap) = student_head.kernel_args(), \
        teacher_head.kernel_args()
    return mask_args(mask), (s_head, t_head, hyper), dict(
        DIVERGENCE=function, BLOCK_V=block_v, HAS_MASK=mask is not None, S_SOFTCAP=s_softcap,
        T_SOFTCAP=t_softcap, ACC=tl_compute_dtype(student.dtype), num_warps=num_warps)


def _value_and_entropy(student: torch.Tensor, B: int, T: int):
    """The ``[B, T]`` outputs of the divergence and the student's entropy, in its compute
    dtype."""
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    return (empty((B, T), dtype=acc, device=student.device),
            empty((B, T), dtype=acc, device=student.device))


def distill_fwd(student: torch.Tensor, teacher: torch.Tensor, mask, student_head: HeadParams,
                teacher_head: HeadParams, terms, stats: Optional[torch.Tensor] = None):
    """``(value [B, T], student entropy [B, T], stats [B T, DISTILL_STATS])`` of the window rows
    ``student [B, T, V]`` and ``teacher [B, T, V]`` (views, ``stride(-1) == 1``) of the heads
    ``student_head`` and ``teacher_head`` (``HeadParams``; a ``Logits``: its temperature) for a
    divergence's ``terms`` (``rlfuse.divergences.DivergenceTerms`` or its fields), in the
    student's compute dtype; masked positions 0. With ``stats`` (a split vocabulary: its first
    four columns the whole rows' statistics) the terms of these rows' columns only, their aux
    written into its last column; the entropy is not formed (its values unspecified)."""
    B, T, V = student.shape
    value, entropy = _value_and_entropy(student, B, T)
    given = stats is not None
    if not given:
        stats = empty((B * T, len(DISTILL_STATS)), dtype=value.dtype, device=student.device)
    if B * T == 0:
        return value, entropy, stats
    (mask_u8, stride_mb, stride_mt), heads, constexprs = _launch(student, teacher, mask,
                                                                  student_head, teacher_head,
                                                                  terms)
    _distill_fwd_kernel[(B * T,)](
        student, teacher, mask_u8, value, entropy, stats,
        student.stride(0), student.stride(1), teacher.stride(0), teacher.stride(1),
        stride_mb, stride_mt, T, V, *heads, GIVEN_STATS=given, **constexprs)
    return value, entropy, stats


def distill_bwd(logits: torch.Tensor, offset: int, teacher: torch.Tensor, mask, stats,
                dvalue: torch.Tensor, student_head: HeadParams, teacher_head: HeadParams,
                terms, dlogits: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of the student's whole ``logits [B, S, V]`` (window rows ``[offset, offset +
    T)``) for ``dvalue [B, T]``: zeros outside the window and at masked positions; into
    ``dlogits`` when given (``logits`` itself: in place)."""
    B, S, V = logits.shape
    T = dvalue.shape[1]
    if dlogits is None:
        dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    (mask_u8, stride_mb, stride_mt), heads, constexprs = _launch(logits, teacher, mask,
                                                                  student_head, teacher_head,
                                                                  terms)
    _distill_bwd_kernel[(B * S,)](
        logits, teacher, mask_u8, stats, dvalue.contiguous(), dlogits,
        logits.stride(0), logits.stride(1), teacher.stride(0), teacher.stride(1),
        stride_mb, stride_mt, dlogits.stride(0), dlogits.stride(1), T, S, offset, V, *heads,
        **constexprs)
    return dlogits


def distill_single_pass(logits: torch.Tensor, offset: int, teacher: torch.Tensor, mask,
                        weights: torch.Tensor, student_head: HeadParams,
                        teacher_head: HeadParams, terms):
    """``(value [B, T], the student's entropy [B, T], dlogits [B, S, V])`` of ``distill_fwd``
    and ``distill_bwd`` in one launch, the gradient of the loss ``sum weights * value``
    (``weights [B, T]``, each position's upstream gradient): each actor row's statistics,
    divergence and gradient by one program, which reads both rows twice more."""
    B, S, V = logits.shape
    T = weights.shape[1]
    value, entropy = _value_and_entropy(logits, B, T)
    dlogits = empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if B * S == 0:
        return value, entropy, dlogits
    (mask_u8, stride_mb, stride_mt), heads, constexprs = _launch(logits, teacher, mask,
                                                                  student_head, teacher_head,
                                                                  terms)
    _distill_single_pass_kernel[(B * S,)](
        logits, teacher, mask_u8, weights, value, entropy, dlogits,
        logits.stride(0), logits.stride(1), teacher.stride(0), teacher.stride(1),
        stride_mb, stride_mt, weights.stride(0), weights.stride(1), dlogits.stride(0),
        dlogits.stride(1), T, S, offset, V, *heads, **constexprs)
    return value, entropy, dlogits
