"""Reference trust regions: per-token bounds ``[l, u] = {r : D(r) <= delta}`` in fp64, for
GPPO's 5 geometries x 3 topologies, PPO's fixed clip range (``ppo_clip``) and a fixed range of
the ratio (``ratio_range``)."""
from __future__ import annotations

import math
from typing import Tuple

import torch

from .._names import MU_MIN
from .._types import compute_dtype

BISECTION_STEPS = 100        # see _binary_root_bounds


def region_bounds(old: torch.Tensor, geometry: str, topology: str,
                  delta: Tuple[float, float]) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``(lo, hi)`` of tokens with behavior log-probs ``old`` (any float dtype): the lower
    bound of the region of size ``delta[0]``, the upper of ``delta[1]``; lower bounds clamped at
    0. ``ppo_clip``: ``[1 - delta[0], 1 + delta[1]]``; ``ratio_range``: ``[delta[0], delta[1]]``."""
    old = old.detach().double()
    if geometry == "ppo_clip":
        return (torch.full_like(old, max(1.0 - delta[0], 0.0)),
                torch.full_like(old, 1.0 + delta[1]))
    if geometry == "ratio_range":
        return torch.full_like(old, delta[0]), torch.full_like(old, delta[1])
    mu = old.exp().clamp(MU_MIN, 1.0 - MU_MIN)
    lo = _bounds_fp64(mu, geometry, topology, delta[0])[0]
    hi = _bounds_fp64(mu, geometry, topology, delta[1])[1]
    return lo.clamp_min(0.0), hi


def gppo_bounds(old_logprobs: torch.Tensor, surrogate) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` of a ``TokenSurrogate``'s region at each token, in fp64 for fp64 log-probs,
    fp32 otherwise."""
    _, geometry, topology, delta_low, delta_high = surrogate[:5]
    lo, hi = region_bounds(old_logprobs, geometry, topology, (delta_low, delta_high))
    out = compute_dtype(old_logprobs.dtype)
    return lo.to(out), hi.to(out)


def _bounds_fp64(mu: torch.Tensor, geometry: str, topology: str,
                 delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    if topology != "binary":
        w = torch.full_like(mu, delta) if topology == "mc" else delta / mu
        if geometry == "tv":
            return 1.0 - 2.0 * w, 1.0 + 2.0 * w
        if geometry == "chi2":
            return 1.0 - w.sqrt(), 1.0 + w.sqrt()
        if geometry == "hellinger":
            return (1.0 - w.sqrt()).clamp_min(0.0).square(), (1.0 + w.sqrt()).square()
        if geometry == "kl":
            return torch.exp(-w), torch.full_like(mu, math.inf)
        return torch.exp(-w), torch.exp(w)                                   # two_sided_log
    if geometry == "tv":
        return 1.0 - delta / mu, torch.minimum(1.0 / mu, 1.0 + delta / mu)
    if geometry == "chi2":
        half = (delta * (1.0 - mu) / mu).sqrt()
        return 1.0 - half, torch.minimum(1.0 / mu, 1.0 + half)
    if geometry == "hellinger":
        # D = 2 − 2 cos(φ − α) with √π = sin φ, √μ = sin α; D ≤ δ  ⇔  |φ − α| ≤ θ = acos(1 − δ/2).
        c = max(-1.0, 1.0 - delta / 2.0)
        s = math.sqrt(max(0.0, 1.0 - c * c))
        a, b = mu.sqrt(), (1.0 - mu).sqrt()
        sin_lo = a * c - b * s                                # sin(α − θ)
        sin_hi = a * c + b * s                                # sin(α + θ)
        pi_lo = torch.where(sin_lo > 0, sin_lo.square(), torch.zeros_like(mu))
        pi_hi = torch.where(b * c - a * s > 0, sin_hi.square(), torch.ones_like(mu))  # cos(α+θ) > 0
        return pi_lo / mu, pi_hi / mu
    return _binary_root_bounds(mu, geometry, delta)


def _binary_root_bounds(mu: torch.Tensor, geometry: str,
                        delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """kl / two_sided_log on the binary topology: solve D = δ on each side of π = μ (r = 1).

    With ``g(x) = −log x`` (kl) or ``|log x|`` (two_sided_log),
    ``D(π) = μ g(π/μ) + (1−μ) g((1−π)/(1−μ))`` is 0 at π = μ, decreasing on (0, μ] and
    increasing on [μ, 1), with D → ∞ at both ends, so each side has exactly one root.

    Lower side: bisection in ``log π`` (roots can be as small as ~e^{−δ/μ}, far below what a
    linear bracket resolves) on ``[log μ − (δ+1)/μ, log μ]``; the left end is outside the region
    because the second term is ≥ (1−μ) log(1−μ) ≥ −1/e there, so D ≥ δ + 1 − 1/e.
    Upper side: bisection in ``π`` on ``[μ, 1]``. 100 halvings shrink a bracket of at most
    3·10⁶ (log space) or 1 (π space) below fp64 resolution.
    """
    log_mu, log1m_mu = mu.log(), torch.log1p(-mu)

    def excess(log_pi: torch.Tensor, log1m_pi: torch.Tensor) -> torch.Tensor:  # D − δ
        x, y = log_pi - log_mu, log1m_pi - log1m_mu          # log r, log((1−π)/(1−μ))
        if geometry == "kl":
            return -mu * x - (1.0 - mu) * y - delta
        return mu * x.abs() + (1.0 - mu) * y.abs() - delta

    inside, outside = log_mu.clone(), log_mu - (delta + 1.0) / mu   # lower side, in log π
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (inside + outside)
        out = excess(mid, torch.log1p(-mid.exp())) > 0
        outside, inside = torch.where(out, mid, outside), torch.where(out, inside, mid)
    lo = torch.exp(inside - log_mu)

    inside, outside = mu.clone(), torch.ones_like(mu)                # upper side, in π
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (inside + outside)
        out = excess(mid.log(), torch.log1p(-mid)) > 0
        outside, inside = torch.where(out, mid, outside), torch.where(out, inside, mid)
    hi = inside / mu
    return lo, hi
