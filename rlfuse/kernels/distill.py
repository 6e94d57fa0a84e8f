"""The divergences of distillation (``rlfuse.divergences``) between a student's and a teacher's
rows of logits, one program per position, and the student's gradient.

Forward: each model's row reduced to its (m, log s) (``rows.row_logsumexp``; the student's
entropy beside it), then both rows read once more to sum the divergence from the exact
log-probs ``s_v = (x_v − m_s) / τ_s − log s_s`` and ``t_v``, term by term (no difference of
large sums): the forward KL ``Σ T_v (t_v − s_v)``, the reverse ``Σ S_v (s_v − t_v)``, TRL's
generalized JSD ``β Σ T_v (t_v − μ_v) + (1 − β) Σ S_v (s_v − μ_v)``, ``μ_v = log((1 − β) S_v +
β T_v)``. Backward: both rows read once, the student's gradient written once, for an upstream
gradient g of the position's divergence D, with respect to ``z = x / τ_s``:

    forward KL   g (S_v − T_v)
    reverse KL   g S_v ((s_v − t_v) − D)
    JSD          g (1 − β) S_v ((s_v − μ_v) − KL(S ‖ M))      (KL(S ‖ M): saved by the forward)

(the JSD's term in μ_v cancels: ``∂/∂s_v Σ_u (β T_u (t_u − μ_u) + (1 − β) S_u (s_u − μ_u)) =
(1 − β) S_v (s_v − μ_v)``, then the log-softmax's projection). Rows outside the window and
masked rows get a gradient of zeros, never read.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .rows import COMPILER_STAGES, at, program_token, row_logsumexp, row_write_zeros
from .utils import (constexpr_codes, empty, exp_accurate, fp64_args, fp64_values, mask_args,
                    tl_compute_dtype, vocab_launch_config)

MODES = ("forward_kl", "reverse_kl", "jsd")
FORWARD_KL, REVERSE_KL, JSD = constexpr_codes(MODES, *MODES)
# Columns of the per-position statistics the forward saves for the backward.
DISTILL_STATS = ("student_max", "student_log_sum", "teacher_max", "teacher_log_sum", "aux")
N_STATS = tl.constexpr(len(DISTILL_STATS))


@triton.jit
def _log_probs(row_ptr, cols, V, m, log_s, inv_temp, ACC: tl.constexpr):
    """A block of a row's log-probs ``(x − m) / τ − log s``; -inf past the row."""
    x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(ACC)
    return tl.where(cols < V, (x - m) * inv_temp - log_s, float("-inf"))


@triton.jit
def _mixture(s, t, log_a, log_b):
    """``μ = log(e^(s + log_a) + e^(t + log_b))``, -inf where both are."""
    u, w = s + log_a, t + log_b
    hi = tl.maximum(u, w)
    safe = tl.where(hi == float("-inf"), 0.0, hi)
    return safe + tl.log(exp_accurate(u - safe) + exp_accurate(w - safe))


@triton.jit
def _weighted(p, x):
    """``p x`` where ``p > 0``, else 0 (whatever x is there)."""
    return tl.where(p > 0, p * x, 0.0)


@triton.jit
def _distill_fwd_kernel(student_ptr, teacher_ptr, mask_ptr, value_ptr, entropy_ptr, stats_ptr,
                        stride_sb, stride_st, stride_tb, stride_tt, stride_mb, stride_mt,
                        T, V, scalars,
                        MODE: tl.constexpr, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
                        ACC: tl.constexpr):
    token, b, t, _, _, is_actor = program_token(tl.program_id(0), mask_ptr, T, T, 0, stride_mb,
                                                stride_mt, HAS_MASK)
    inv_s, inv_t, log_a, log_b, beta = fp64_values(scalars, ACC)
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
        m_s, log_s_s, entropy = row_logsumexp(s_row, V, inv_s, 1.0, 1.0, BLOCK_V, True, False,
                                              ACC, False, COMPILER_STAGES)
        m_t, log_s_t, no_entropy = row_logsumexp(t_row, V, inv_t, 1.0, 1.0, BLOCK_V, False,
                                                 False, ACC, False, COMPILER_STAGES)
        acc = tl.zeros((BLOCK_V,), ACC)
        acc_s = tl.zeros((BLOCK_V,), ACC)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            s = _log_probs(s_row, cols, V, m_s, log_s_s, inv_s, ACC)
            lt = _log_probs(t_row, cols, V, m_t, log_s_t, inv_t, ACC)
            if MODE == FORWARD_KL:
                acc += _weighted(exp_accurate(lt), lt - s)
            elif MODE == REVERSE_KL:
                acc += _weighted(exp_accurate(s), s - lt)
            else:
                mu = _mixture(s, lt, log_a, log_b)
                acc += _weighted(exp_accurate(lt), lt - mu)
                acc_s += _weighted(exp_accurate(s), s - mu)
        value = tl.sum(acc, 0)
        aux = value
        if MODE == JSD:
            aux = tl.sum(acc_s, 0)
            value = beta * value + (1.0 - beta) * aux
    tl.store(value_ptr + token, value)
    tl.store(entropy_ptr + token, entropy)
    stats = stats_ptr + N_STATS * token
    tl.store(stats, m_s)
    tl.store(stats + 1, log_s_s)
    tl.store(stats + 2, m_t)
    tl.store(stats + 3, log_s_t)
    tl.store(stats + 4, aux)


@triton.jit
def _distill_bwd_kernel(student_ptr, teacher_ptr, mask_ptr, stats_ptr, dvalue_ptr, dlogits_ptr,
                        stride_sb, stride_st, stride_tb, stride_tt, stride_mb, stride_mt,
                        stride_db, stride_dt, T, S, offset, V, scalars,
                        MODE: tl.constexpr, BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr,
                        ACC: tl.constexpr):
    # One program per row of the student's whole [B, S] logits.
    token, b, s_row_index, t, _, is_actor = program_token(tl.program_id(0), mask_ptr, T, S,
                                                          offset, stride_mb, stride_mt,
                                                          HAS_MASK)
    drow = dlogits_ptr + at(b, stride_db, s_row_index, stride_dt)
    if is_actor:
        inv_s, inv_t, log_a, log_b, beta = fp64_values(scalars, ACC)
        stats = stats_ptr + N_STATS * token
        m_s = tl.load(stats).to(ACC)
        log_s_s = tl.load(stats + 1).to(ACC)
        m_t = tl.load(stats + 2).to(ACC)
        log_s_t = tl.load(stats + 3).to(ACC)
        aux = tl.load(stats + 4).to(ACC)
        g = tl.load(dvalue_ptr + token).to(ACC) * inv_s
        s_row = student_ptr + at(b, stride_sb, s_row_index, stride_st)
        t_row = teacher_ptr + at(b, stride_tb, t, stride_tt)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            s = _log_probs(s_row, cols, V, m_s, log_s_s, inv_s, ACC)
            lt = _log_probs(t_row, cols, V, m_t, log_s_t, inv_t, ACC)
            p = exp_accurate(s)
            if MODE == FORWARD_KL:
                d = p - exp_accurate(lt)
            elif MODE == REVERSE_KL:
                d = _weighted(p, (s - lt) - aux)
            else:
                d = (1.0 - beta) * _weighted(p, (s - _mixture(s, lt, log_a, log_b)) - aux)
            tl.store(drow + cols, (g * d).to(dlogits_ptr.dtype.element_ty), mask=cols < V)
    else:
        row_write_zeros(drow, V, BLOCK_V, False)


def _scalars(temperature: float, teacher_temperature: float, beta: float):
    log_a = math.log1p(-beta) if beta < 1 else -math.inf
    log_b = math.log(beta) if beta > 0 else -math.inf
    return fp64_args((1.0 / temperature, 1.0 / teacher_temperature, log_a, log_b, beta))


def distill_fwd(student: torch.Tensor, teacher: torch.Tensor, mask, temperature: float,
                teacher_temperature: float, mode: str, beta: float):
    """``(value [B, T], student entropy [B, T], stats [B T, DISTILL_STATS])`` of the window rows
    ``student [B, T, V]`` and ``teacher [B, T, V]`` (views, ``stride(-1) == 1``), in the
    student's compute dtype; masked positions 0."""
    B, T, V = student.shape
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    value = empty((B, T), dtype=acc, device=student.device)
    entropy = empty((B, T), dtype=acc, device=student.device)
    stats = empty((B * T, len(DISTILL_STATS)), dtype=acc, device=student.device)
    if B * T == 0:
        return value, entropy, stats
    block_v, num_warps = vocab_launch_config(V, max(student.element_size(),
                                                    teacher.element_size()))
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _distill_fwd_kernel[(B * T,)](
        student, teacher, mask_u8, value, entropy, stats,
        student.stride(0), student.stride(1), teacher.stride(0), teacher.stride(1),
        stride_mb, stride_mt, T, V, _scalars(temperature, teacher_temperature, beta),
        MODE=MODES.index(mode), BLOCK_V=block_v, HAS_MASK=mask is not None,
        ACC=tl_compute_dtype(student.dtype), num_warps=num_warps)
    return value, entropy, stats


def distill_bwd(logits: torch.Tensor, offset: int, teacher: torch.Tensor, mask, stats,
                dvalue: torch.Tensor, temperature: float, teacher_temperature: float, mode: str,
                beta: float) -> torch.Tensor:
    """The gradient of the student's whole ``logits [B, S, V]`` (window rows ``[offset, offset +
    T)``) for ``dvalue [B, T]``: zeros outside the window and at masked positions."""
    B, S, V = logits.shape
    T = dvalue.shape[1]
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    block_v, num_warps = vocab_launch_config(V, max(logits.element_size(),
                                                    teacher.element_size()))
    mask_u8, stride_mb, stride_mt = mask_args(mask)
    _distill_bwd_kernel[(B * S,)](
        logits, teacher, mask_u8, stats, dvalue.contiguous(), dlogits,
        logits.stride(0), logits.stride(1), teacher.stride(0), teacher.stride(1),
        stride_mb, stride_mt, dlogits.stride(0), dlogits.stride(1), T, S, offset, V,
        _scalars(temperature, teacher_temperature, beta), MODE=MODES.index(mode),
        BLOCK_V=block_v, HAS_MASK=mask is not None, ACC=tl_compute_dtype(logits.dtype),
        num_warps=num_warps)
    return dlogits
