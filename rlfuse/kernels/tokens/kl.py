"""The KL penalty to reference log-probs: its per-token estimators (``kl_term``, which the
single pass from logits evaluates beside the objective) and an elementwise kernel pair over
``[B, T]`` log-probs (``kl_penalty_fwd`` / ``kl_penalty_bwd``).

With d = lp - ref (verl's ``kl_penalty``, J. Schulman's estimators):

    k1   d                                      d/dlp: 1
    abs  |d|                                    sign(d)
    k2   d^2 / 2                                d
    k3   e^u - u - 1,  u = ref - lp             1 - e^u

verl clamps k3's u to +-20 and its value to +-10 (``CLAMP``; the gradient is 0 past either
clamp); TRL clamps nothing. ``STRAIGHT`` (verl's ``+`` forms): the value of the estimator with
the gradient of k2. ``WEIGHTED`` (TRL's ``use_bias_correction_kl``): the value times the ratio
r = e^(lp - old), differentiated through both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._names import KL_ESTIMATORS
from ..._types import compute_dtype
from ..lib.utils import constexpr_codes, empty, exp_accurate, tl_compute_dtype

K1, ABS, K2, K3 = constexpr_codes(KL_ESTIMATORS, "k1", "abs", "k2", "k3")
NO_KL = tl.constexpr(-1)    # the code of no KL term
_LOG_CLAMP = tl.constexpr(20.0)     # verl's clamps of k3
_VALUE_CLAMP = tl.constexpr(10.0)


@triton.jit
def kl_term(lp, ref, log_ratio, KL: tl.constexpr, STRAIGHT: tl.constexpr,
            WEIGHTED: tl.constexpr, CLAMP: tl.constexpr):
    """(value, d value / d lp) of the estimator ``KL`` (the module docstring) at each token."""
    d = lp - ref
    if KL == K1:
        value = d
        grad = d * 0.0 + 1.0
    elif KL == ABS:
        value = tl.abs(d)
        grad = (tl.where(d > 0, 1.0, 0.0) - tl.where(d < 0, 1.0, 0.0)).to(d.dtype)
    elif KL == K2:
        value = 0.5 * d * d
        grad = d
    else:
        tl.static_assert(KL == K3)
        u = -d
        inside = u == u
        if CLAMP:
            inside = (u >= -_LOG_CLAMP) & (u <= _LOG_CLAMP)
            u = tl.minimum(tl.maximum(u, -_LOG_CLAMP), _LOG_CLAMP)
        e = exp_accurate(u)
        value = e - u - 1.0
        if CLAMP:
            inside = inside & (value >= -_VALUE_CLAMP) & (value <= _VALUE_CLAMP)
            value = tl.minimum(tl.maximum(value, -_VALUE_CLAMP), _VALUE_CLAMP)
        grad = tl.where(inside, 1.0 - e, 0.0)
    if STRAIGHT:
        grad = d
    if WEIGHTED:
        ratio = exp_accurate(log_ratio)
        weighted = tl.where(value == 0, 0.0, value * ratio)
        grad = tl.where(grad == 0, 0.0, grad * ratio) + weighted
        value = weighted
    return value, grad


def kl_codes(kl):
    """The constexprs ``(KL, STRAIGHT, WEIGHTED, CLAMP)`` of an ``rlfuse.terms.KLTerm`` (None:
    no KL term)."""
    if kl is None:
        return NO_KL, False, False, False
    return KL_ESTIMATORS.index(kl.estimator), kl.straight, kl.weighted, kl.clamp


@triton.jit
def _kl_penalty_fwd_kernel(
    lp_ptr, ref_ptr, out_ptr,                           # pointers: [B, T] contiguous
    n,                                                  # size
    BLOCK: tl.constexpr, ACC: tl.constexpr,             # constexprs: the estimator's codes
    KL: tl.constexpr, STRAIGHT: tl.constexpr, CLAMP: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    lp = tl.load(lp_ptr + offs, mask=inside, other=0.0).to(ACC)
    ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(ACC)
    value, _ = kl_term(lp, ref, lp, KL, STRAIGHT, False, CLAMP)
    tl.store(out_ptr + offs, value, mask=inside)


@triton.jit
def _kl_penalty_bwd_kernel(
    lp_ptr, ref_ptr, grad_ptr, dlp_ptr,                 # pointers: [B, T] contiguous
    n,                                                  # size
    BLOCK: tl.constexpr, ACC: tl.constexpr,             # constexprs: the estimator's codes
    KL: tl.constexpr, STRAIGHT: tl.constexpr, CLAMP: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    lp = tl.load(lp_ptr + offs, mask=inside, other=0.0).to(ACC)
    ref = tl.load(ref_ptr + offs, mask=inside, other=0.0).to(ACC)
    upstream = tl.load(grad_ptr + offs, mask=inside, other=0.0).to(ACC)
    _, grad = kl_term(lp, ref, lp, KL, STRAIGHT, False, CLAMP)
    tl.store(dlp_ptr + offs, (upstream * grad).to(dlp_ptr.dtype.element_ty), mask=inside)


_BLOCK = 1024


def kl_penalty_fwd(lp: torch.Tensor, ref: torch.Tensor, estimator: str, *, straight: bool,
                   clamp: bool) -> torch.Tensor:
    """The per-token estimate (compute dtype, the shape of ``lp``) of contiguous ``lp`` and
    ``ref``."""
    acc = compute_dtype(lp.dtype, ref.dtype)
    out = empty(lp.shape, dtype=acc, device=lp.device)
    n = lp.numel()
    if n:
        _kl_penalty_fwd_kernel[(triton.cdiv(n, _BLOCK),)](
            lp, ref, out, n, BLOCK=_BLOCK, ACC=tl_compute_dtype(acc),
            KL=KL_ESTIMATORS.index(estimator), STRAIGHT=straight, CLAMP=clamp)
    return out


def kl_penalty_bwd(lp: torch.Tensor, ref: torch.Tensor, grad: torch.Tensor, estimator: str, *,
                   straight: bool, clamp: bool) -> torch.Tensor:
    """dL/dlp (dtype of ``lp``) for the upstream ``grad`` (contiguous, the shape of ``lp``)."""
    dlp = empty(lp.shape, dtype=lp.dtype, device=lp.device)
    n = lp.numel()
    if n:
        _kl_penalty_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
            lp, ref, grad, dlp, n, BLOCK=_BLOCK, ACC=tl_compute_dtype(compute_dtype(lp.dtype,
                                                                                  ref.dtype)),
            KL=KL_ESTIMATORS.index(estimator), STRAIGHT=straight, CLAMP=clamp)
    return dlp
