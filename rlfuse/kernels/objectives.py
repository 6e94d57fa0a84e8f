"""The per-token objectives of the surrogate losses, as a table of named codes.

Every surrogate kernel (from log-probs, and the single pass from logits) evaluates one token's
objective by ``token_objective``: given the log-ratio ``log r = lp - old_lp``, the advantage
``A``, the token's trust region ``[lo, hi]`` (``regions.region_bounds``, fp64) and the
objective's parameters ``p0..p3`` (runtime floats: a new value does not recompile), it returns

    (J, dJ/dlp, clipped_low, clipped_high, dual_clipped, overflow)

the objective, its derivative with respect to the learner log-prob, and the branch flags the
metrics count. ``OBJECTIVE`` is a code of ``rlfuse._names.OBJECTIVES``; an objective is one
entry here (its function and its branch in ``token_objective``), its reference twin in
``rlfuse.reference.objectives`` and its name in ``rlfuse._names``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._names import OBJECTIVES
from .regions import region_codes, region_sizes
from .utils import constexpr_codes

(CLIP,) = constexpr_codes(OBJECTIVES, "clip")
N_PARAMS = 4    # p0..p3 of every surrogate kernel; an objective uses the first few

# Columns of the surrogate kernels' partial sums (per row from log-probs, per token from
# logits): the loss and what the metrics count.
SUM_COLUMNS = ("loss", "clip_low", "clip_high", "dual_clip", "ratio", "neg_log_ratio",
               "overflow")
SUM_LOSS, SUM_CLIP_LOW, SUM_CLIP_HIGH, SUM_DUAL_CLIP, SUM_RATIO, SUM_NEG_LOG_RATIO, \
    SUM_OVERFLOW = constexpr_codes(SUM_COLUMNS, *SUM_COLUMNS)
N_SUM_COLS = tl.constexpr(len(SUM_COLUMNS))


@triton.jit
def _clip(log_ratio, adv, lo, hi, dual_clip):
    """PPO's clipped surrogate over ``[lo, hi]``, with the dual clip ``c = p0`` (inf: none).

        J = min(r A, clip(r, lo, hi) A)     (A < 0 with a dual clip: max(min(...), c A)),
        dJ/dlp = A r 1[active],
        active = not ((A > 0 and r > hi) or (A < 0 and r < lo) or (A < 0 and r > c))

    decided in log space; only the selected branch is exponentiated, so a clipped token with any
    log-ratio is finite. The bounds are rounded to the compute dtype first, as the reference
    holds them: a bound beyond the dtype's range is inf, so its branch is never the clipped one.
    The dual clip makes the unclipped r A the constant c A (zero gradient) once r > c.
    ``overflow``: the selected J is not finite.
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
def token_objective(log_ratio, adv, lo, hi, p0, p1, p2, p3, OBJECTIVE: tl.constexpr):
    """(J, dJ/dlp, clipped_low, clipped_high, dual_clipped, overflow) of the tokens' objective
    (the module docstring); a code without an entry fails to compile."""
    if OBJECTIVE == CLIP:
        j, dj, low, high, dual, bad = _clip(log_ratio, adv, lo, hi, p0)
    else:
        tl.static_assert(OBJECTIVE == CLIP)
    return j, dj, low, high, dual, bad


def objective_args(objective):
    """The constexpr codes ``(OBJECTIVE, GEOMETRY, TOPOLOGY)`` and the runtime scalars (the
    region's four sizes of ``region_bounds``, then ``p0..p3``) of an ``rlfuse._args.Objective``
    (or a tuple of its fields)."""
    name, geometry, topology, delta_low, delta_high, params = objective
    if len(params) > N_PARAMS:
        raise ValueError(f"objective {name!r}: {len(params)} parameters, the kernels take "
                         f"{N_PARAMS}")
    params = tuple(float(p) for p in params) + (0.0,) * (N_PARAMS - len(params))
    codes = (OBJECTIVES.index(name),) + region_codes(geometry, topology)
    return codes, region_sizes(delta_low, delta_high) + params
