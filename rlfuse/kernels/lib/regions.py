"""Trust regions: per-token bounds [l, u] = {r : D(r) <= delta} for GPPO's 5 geometries x 3
topologies, PPO's fixed ``[1 - eps_low, 1 + eps_high]`` (``ppo_clip``) and a fixed range of the
ratio (``ratio_range``: TRL's CISPO cap, verl's unclipped ratio of ``kl_cov``), computed in fp64
inside the kernels, plus an elementwise kernel that exports them (``gppo_bounds``).

``region_bounds`` is the one device function every kernel uses (bounds export, the surrogate
losses from log-probs and from logits). A row kernel (one token per program: the single pass)
computes a token's scalars in every thread of the program, so the two cells whose bounds take a
root find (binary kl and two_sided_log, ~20k instructions) reach it as ``row_region`` arranges:
found once per token by the bounds kernel beforehand and read (``token_bounds``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..._names import MU_MIN as _MU_MIN
from ..._names import REGION_GEOMETRIES, TOPOLOGIES
from ..._types import compute_dtype
from .utils import (constexpr_codes, empty, fp64_args, fp64_values, tl_compute_dtype, token_at,
                    token_tensor)

TV, CHI2, HELLINGER, KL, TWO_SIDED_LOG, PPO_CLIP, RATIO_RANGE = constexpr_codes(
    REGION_GEOMETRIES, "tv", "chi2", "hellinger", "kl", "two_sided_log", "ppo_clip",
    "ratio_range")
MC, ATOMIC, BINARY = constexpr_codes(TOPOLOGIES, "mc", "atomic", "binary")
# A row kernel's GEOMETRY when the bounds are given per token (``row_region``), not a region's
GIVEN = tl.constexpr(len(REGION_GEOMETRIES))
# The cells whose bounds take a root find (``_binary_root_*``)
ROOT_FOUND = (("kl", "binary"), ("two_sided_log", "binary"))


def region_codes(geometry: str, topology: str):
    """The (GEOMETRY, TOPOLOGY) constexpr codes of a region's names."""
    return REGION_GEOMETRIES.index(geometry), TOPOLOGIES.index(topology)


MU_MIN = tl.constexpr(_MU_MIN)  # mu = exp(old_lp) is clamped to [MU_MIN, 1 - MU_MIN]
# Iterations of the safeguarded Newton root find of the binary kl / two_sided_log cells: a step
# that leaves the bracket (closed, so that a converged step p -> p stays) bisects instead.
# Converges to fp64 resolution well within 48 on every case tested (mu in [1e-6, 1 - 1e-6],
# delta in [1e-4, 2]).
ROOT_ITERS = tl.constexpr(48)


@triton.jit
def _binary_excess(log_pi, pi, log_mu, log1m_mu, mu, delta, S1: tl.constexpr, S2: tl.constexpr):
    """D(pi) - delta and pi dD/dpi (= dD/dlog pi) for
    D = S1 mu (log pi - log mu) + S2 (1-mu) (log(1-pi) - log(1-mu)).

    kl: S1 = S2 = -1 on both sides of pi = mu. two_sided_log: |log r| + |log((1-pi)/(1-mu))|,
    i.e. S1 = -1, S2 = +1 below mu and S1 = +1, S2 = -1 above.
    """
    one_m_pi = 1.0 - pi
    d = S1 * mu * (log_pi - log_mu) + S2 * (1.0 - mu) * (tl.log(one_m_pi) - log1m_mu) - delta
    dd = S1 * mu - S2 * (1.0 - mu) * pi / one_m_pi
    return d, dd


@triton.jit
def _binary_root_lower(mu, log_mu, log1m_mu, delta, S2: tl.constexpr):
    """The root of D = delta below pi = mu, in x = log pi (roots reach e^(-delta/mu)).

    Bracket [log mu - (delta + 1)/mu, log mu]: D >= delta + 1 - 1/e > delta at the left end.
    Safeguarded Newton on x; a step that leaves the bracket bisects.
    """
    lo_x = log_mu - (delta + 1.0) / mu   # outside the region: D > delta
    hi_x = log_mu                        # inside: D = 0
    x = 0.5 * (lo_x + hi_x)
    for _ in range(ROOT_ITERS):
        pi = tl.exp(x)
        d, dd = _binary_excess(x, pi, log_mu, log1m_mu, mu, delta, -1.0, S2)
        outside = d > 0
        lo_x = tl.where(outside, x, lo_x)
        hi_x = tl.where(outside, hi_x, x)
        step = x - d / dd
        x = tl.where((step >= lo_x) & (step <= hi_x), step, 0.5 * (lo_x + hi_x))
    return tl.exp(x - log_mu)  # the last iterate: Newton may converge from either side


@triton.jit
def _binary_root_upper(mu, log_mu, log1m_mu, delta, S1: tl.constexpr):
    """The root of D = delta above pi = mu, in pi (bracket [mu, 1]); returns u = pi / mu."""
    lo_p = mu                            # inside: D = 0
    hi_p = tl.zeros_like(mu) + 1.0       # outside: D -> inf
    p = 0.5 * (lo_p + hi_p)
    for _ in range(ROOT_ITERS):
        d, dd = _binary_excess(tl.log(p), p, log_mu, log1m_mu, mu, delta, S1, -1.0)
        outside = d > 0
        hi_p = tl.where(outside, p, hi_p)
        lo_p = tl.where(outside, lo_p, p)
        step = p - d * p / dd
        p = tl.where((step >= lo_p) & (step <= hi_p), step, 0.5 * (lo_p + hi_p))
    return p / mu


@triton.jit
def _cell_width(mu, delta, TOPOLOGY: tl.constexpr):
    """The size the mc and atomic cells are written in: delta (mc), delta / mu (atomic)."""
    w = delta
    if TOPOLOGY == ATOMIC:
        w = delta / mu
    else:
        tl.static_assert(TOPOLOGY == MC)
    return w


@triton.jit
def _lower_bound(mu, delta, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr):
    """l = min {r : D(r) <= delta} (before the clamp at 0), fp64."""
    one = tl.zeros_like(mu) + 1.0
    if GEOMETRY == PPO_CLIP:
        lo = one - delta
    elif GEOMETRY == RATIO_RANGE:
        lo = one * delta
    elif TOPOLOGY == BINARY:
        if GEOMETRY == TV:
            lo = one - delta / mu
        elif GEOMETRY == CHI2:
            lo = one - tl.sqrt(delta * (1.0 - mu) / mu)
        elif GEOMETRY == HELLINGER:  # without trigonometry: c = cos(theta), s = sin(theta)
            c = tl.maximum(1.0 - delta / 2.0, -1.0)
            s = tl.sqrt(tl.maximum(1.0 - c * c, 0.0))
            sin_lo = tl.sqrt(mu) * c - tl.sqrt(1.0 - mu) * s   # sin(alpha - theta)
            lo = tl.where(sin_lo > 0, sin_lo * sin_lo, 0.0) / mu
        elif GEOMETRY == KL:
            lo = _binary_root_lower(mu, tl.log(mu), tl.log(1.0 - mu), delta, -1.0)
        else:
            tl.static_assert(GEOMETRY == TWO_SIDED_LOG)
            lo = _binary_root_lower(mu, tl.log(mu), tl.log(1.0 - mu), delta, 1.0)
    else:
        w = _cell_width(mu, delta, TOPOLOGY)
        if GEOMETRY == TV:
            lo = one - 2.0 * w
        elif GEOMETRY == CHI2:
            lo = one - tl.sqrt(w)
        elif GEOMETRY == HELLINGER:
            lo = tl.maximum(one - tl.sqrt(w), 0.0)
            lo = lo * lo
        elif GEOMETRY == KL:
            lo = tl.exp(-w)
        else:
            tl.static_assert(GEOMETRY == TWO_SIDED_LOG)
            lo = tl.exp(-w)
    return lo


@triton.jit
def _upper_bound(mu, delta, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr):
    """u = max {r : D(r) <= delta}, fp64 (inf for kl mc/atomic)."""
    one = tl.zeros_like(mu) + 1.0
    if GEOMETRY == PPO_CLIP:
        hi = one + delta
    elif GEOMETRY == RATIO_RANGE:
        hi = one * delta
    elif TOPOLOGY == BINARY:
        if GEOMETRY == TV:
            hi = tl.minimum(1.0 / mu, one + delta / mu)
        elif GEOMETRY == CHI2:  # the root passes the domain edge 1/mu when delta is large
            hi = tl.minimum(1.0 / mu, one + tl.sqrt(delta * (1.0 - mu) / mu))
        elif GEOMETRY == HELLINGER:
            c = tl.maximum(1.0 - delta / 2.0, -1.0)
            s = tl.sqrt(tl.maximum(1.0 - c * c, 0.0))
            a = tl.sqrt(mu)
            b = tl.sqrt(1.0 - mu)
            sin_hi = a * c + b * s   # sin(alpha + theta), alpha = asin(sqrt(mu))
            hi = tl.where(b * c - a * s > 0, sin_hi * sin_hi, 1.0) / mu
        elif GEOMETRY == KL:
            hi = _binary_root_upper(mu, tl.log(mu), tl.log(1.0 - mu), delta, -1.0)
        else:
            tl.static_assert(GEOMETRY == TWO_SIDED_LOG)
            hi = _binary_root_upper(mu, tl.log(mu), tl.log(1.0 - mu), delta, 1.0)
    else:
        w = _cell_width(mu, delta, TOPOLOGY)
        if GEOMETRY == TV:
            hi = one + 2.0 * w
        elif GEOMETRY == CHI2:
            hi = one + tl.sqrt(w)
        elif GEOMETRY == HELLINGER:
            hi = (one + tl.sqrt(w)) * (one + tl.sqrt(w))
        elif GEOMETRY == KL:
            hi = one * float("inf")
        else:
            tl.static_assert(GEOMETRY == TWO_SIDED_LOG)
            hi = tl.exp(w)
    return hi


@triton.jit
def region_bounds(old_lp, region, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr):
    """fp64 ``(l, u)`` of the trust region of tokens with behavior log-probs ``old_lp``.

    mc: D = f(r); atomic: D = mu f(r); binary: the f-divergence of Bernoulli(mu) vs
    Bernoulli(mu r). Closed forms as in SPEC 4.2 (w = delta for mc, delta / mu for atomic); the
    binary kl and two_sided_log cells by ``_binary_root_*``. Lower bounds clamp at 0. With
    GEOMETRY == PPO_CLIP: the fixed range [1 - delta_low, 1 + delta_high]; RATIO_RANGE: the range
    [delta_low, delta_high] of the ratio itself. An unknown code fails to compile.
    ``region``: ``region_sizes``, ``(delta_low, delta_high)`` as fp64 pairs, each summed in fp64
    (``utils.fp64_args``: on a GPU a float argument is fp32).
    """
    delta_low, delta_high = fp64_values(region, tl.float64)
    mu = tl.minimum(tl.maximum(tl.exp(old_lp.to(tl.float64)), MU_MIN), 1.0 - MU_MIN)
    lo = _lower_bound(mu, tl.zeros_like(mu) + delta_low, GEOMETRY, TOPOLOGY)
    hi = _upper_bound(mu, tl.zeros_like(mu) + delta_high, GEOMETRY, TOPOLOGY)
    return tl.maximum(lo, 0.0), hi


@triton.jit
def token_bounds(old_lp, region, b, t, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr):
    """``(l, u)`` of token (b, t) in a row kernel: ``region_bounds``, or with GEOMETRY == GIVEN
    read from ``region``, the ``(lo, hi)`` token tensors of ``row_region``."""
    if GEOMETRY == GIVEN:
        lo = tl.load(token_at(region[0], b, t))
        hi = tl.load(token_at(region[1], b, t))
    else:
        lo, hi = region_bounds(old_lp, region, GEOMETRY, TOPOLOGY)
    return lo, hi


@triton.jit
def _gppo_bounds_kernel(
    # pointers
    old_ptr, lo_ptr, hi_ptr,  # [N] in (any float dtype), [N] out
    # sizes
    N,
    # scalars
    region,                   # the region sizes of each side (region_bounds)
    BLOCK: tl.constexpr, GEOMETRY: tl.constexpr, TOPOLOGY: tl.constexpr, ACC: tl.constexpr,
):
    # ACC: the log-probs rounded to it first, as a kernel computing in ACC holds them
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    old = tl.load(old_ptr + offs, mask=inside, other=0.0).to(ACC)
    lo, hi = region_bounds(old, region, GEOMETRY, TOPOLOGY)
    tl.store(lo_ptr + offs, lo.to(lo_ptr.dtype.element_ty), mask=inside)
    tl.store(hi_ptr + offs, hi.to(hi_ptr.dtype.element_ty), mask=inside)


def region_sizes(delta_low: float, delta_high: float) -> tuple:
    """The ``region`` argument of ``region_bounds``: each size as an fp64 ``hi + lo`` pair."""
    return fp64_args((delta_low, delta_high))


def gppo_bounds_fwd(old_lp: torch.Tensor, geometry: str, topology: str, delta_low: float,
                    delta_high: float, acc: Optional[torch.dtype] = None):
    """Launches the bounds kernel on any-shaped ``old_lp``; returns ``(lo, hi)`` of its shape in
    ``acc`` (default: fp32, fp64 for fp64 input), the log-probs rounded to it first."""
    out_dtype = acc or compute_dtype(old_lp.dtype)
    flat = old_lp.reshape(-1)
    lo = empty(flat.shape, dtype=out_dtype, device=old_lp.device)
    hi = empty(flat.shape, dtype=out_dtype, device=old_lp.device)
    n = flat.numel()
    geometry_code, topology_code = region_codes(geometry, topology)
    if n:
        block = 1024
        _gppo_bounds_kernel[(triton.cdiv(n, block),)](
            flat, lo, hi,
            n,
            region_sizes(delta_low, delta_high),
            BLOCK=block, GEOMETRY=geometry_code, TOPOLOGY=topology_code,
            ACC=tl_compute_dtype(out_dtype),
        )
    return lo.view(old_lp.shape), hi.view(old_lp.shape)


def row_region(geometry: str, topology: str, delta_low: float, delta_high: float,
               old_lp: Optional[torch.Tensor], acc: torch.dtype):
    """``(GEOMETRY, TOPOLOGY, region)`` of a row kernel computing in ``acc`` (``token_bounds``).
    A root-found cell's bounds off policy: found by the bounds kernel, once per token of
    ``old_lp [B, T]``, and given. On policy r = 1 identically, and a surrogate compares it with
    bounds l <= 1 <= u (D(1) = 0; the roots keep l = e^(x - log mu) with x <= log mu and
    u = p / mu with p >= mu): [1, 1] (``ppo_clip`` of sizes 0) gives the same value, gradient
    and flags."""
    if (geometry, topology) not in ROOT_FOUND:
        return region_codes(geometry, topology) + (region_sizes(delta_low, delta_high),)
    if old_lp is None:
        return region_codes("ppo_clip", topology) + (region_sizes(0.0, 0.0),)
    lo, hi = gppo_bounds_fwd(old_lp, geometry, topology, delta_low, delta_high, acc)
    return GIVEN, region_codes(geometry, topology)[1], (token_tensor(lo), token_tensor(hi))
