"""Reference per-token objectives of the surrogate losses, one function per name of
``rlfuse._names.OBJECTIVES``: ``OBJECTIVES[name](log_ratio, adv, lo, hi, mask, *params)``
gives each actor token's objective J and which branch it took.

``lo, hi`` are the token's trust region (``regions.region_bounds``, in the compute dtype);
``params`` the objective's own parameters (``rlfuse._args.Objective``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch


class TokenObjective(NamedTuple):
    """Per-token result of an objective (all ``[B, T]``)."""

    value: torch.Tensor          # J, differentiable, 0 off the mask
    ratio_used: torch.Tensor     # bool: J depends on r (its gradient is not 0)
    clipped_low: torch.Tensor    # bool: A < 0 and r < lo
    clipped_high: torch.Tensor   # bool: A > 0 and r > hi
    dual_clipped: torch.Tensor   # bool: A < 0 and r > c (the dual clip)
    overflow: torch.Tensor       # bool: the selected value is not representable


def clip(log_ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
         mask: torch.Tensor, dual_clip: float = math.inf) -> TokenObjective:
    """PPO's clipped surrogate ``J = min(r A, clip(r, lo, hi) A)`` with ``r = exp(log_ratio)``,
    zero off the mask; with a dual clip ``c`` (``A < 0`` only)
    ``J = max(min(r A, clip(r, lo, hi) A), c A)``.

    The branch is decided in log space — ``clipped_high = A > 0 ∧ log r > log hi``,
    ``clipped_low = A < 0 ∧ log r < log lo``, ``dual_clipped = A < 0 ∧ log r > log c``
    (log 0 = −inf, log inf = +inf) — and only the selected branch is evaluated: a clipped token is
    the constant ``bound · A`` (zero gradient) and never exponentiates its log-ratio, so any
    log-ratio is safe there. Elsewhere ``J = r A`` and ``∂J/∂log r = r A``; a token with
    ``A = 0`` is 0 without evaluating r. ``overflow`` marks the tokens whose selected value is not
    representable in the dtype (the unclipped ``r A`` of a negative advantage, or of a positive
    one under an upper bound beyond the dtype's range).
    """
    with torch.no_grad():
        clipped_high = mask & (adv > 0) & (log_ratio > hi.log())
        clipped_low = mask & (adv < 0) & (log_ratio < lo.log())
        dual_clipped = mask & (adv < 0) & ~clipped_low & (log_ratio > math.log(dual_clip))
        ratio_used = mask & ~clipped_high & ~clipped_low & ~dual_clipped & (adv != 0)
        bound = torch.where(clipped_high, hi, torch.where(clipped_low, lo, torch.zeros_like(lo)))
        bound = torch.where(dual_clipped, torch.full_like(lo, dual_clip), bound)
    ratio = torch.exp(torch.where(ratio_used, log_ratio, torch.zeros_like(log_ratio)))
    value = torch.where(ratio_used, ratio * adv, bound * adv)
    overflow = mask & ~torch.isfinite(value.detach())
    return TokenObjective(value, ratio_used, clipped_low, clipped_high, dual_clipped, overflow)


OBJECTIVES = {"clip": clip}
