"""The per-token functions of the surrogate losses, one per ``token`` an objective record of
``rlfuse.objectives`` names (``token_function``).

Every surrogate kernel (from log-probs, and the single pass from logits) takes the function of
its objective as the constexpr ``OBJECTIVE`` and calls it at each token:

    OBJECTIVE(log_ratio, lp, old, adv, lo, hi, params, clamp) -> (J, dJ/dlp, flag0, flag1, flag2)

given the log-ratio ``log r = lp - old_lp``, the learner and old log-probs, the advantage
``A``, the token's trust region ``[lo, hi]`` (``regions.region_bounds``, fp64), the
function's parameters (a tuple, in the order the record's ``surrogate()`` gives them) and the
clamp ``L`` of the log-ratio where verl's form exponentiates a clamped one (runtime floats: a
new value does not recompile). It returns the objective (to maximise), its derivative with
respect to the learner log-prob, and three per-token flags that the record's metrics count
(``no_flag`` where it sets fewer). Its math in plain torch is ``rlfuse.reference.token_functions``'
function of the same name.

Several objectives are ``sg(c) A lp``, a stopped coefficient times the log-prob (CISPO, GPG,
DPPO): their gradient is ``c A``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..._names import FunctionsByName
from .regions import region_codes, region_sizes
from .utils import constexpr_codes, exp_accurate, fp64_args

# The per-token functions by name: each is registered where it is defined (``per_token``);
# ``token_function``: the one a record's ``token`` names
TOKEN_FUNCTIONS = FunctionsByName("objective", "per-token", "the kernels")
per_token, token_function = TOKEN_FUNCTIONS.register, TOKEN_FUNCTIONS.lookup

# Columns of the surrogate kernels' partial sums (per row from log-probs, per token from
# logits): the loss, the objective's three flags, the ratio, old - lp (clamped to +-L), the
# overflow flag, then the terms of the single pass (the KL penalty's value, the entropy).
SUM_COLUMNS = ("loss", "flag0", "flag1", "flag2", "ratio", "neg_log_ratio", "overflow", "kl",
               "entropy")
SUM_LOSS, SUM_FLAG0, SUM_FLAG1, SUM_FLAG2, SUM_RATIO, SUM_NEG_LOG_RATIO, SUM_OVERFLOW, \
    SUM_KL, SUM_ENTROPY = constexpr_codes(SUM_COLUMNS, *SUM_COLUMNS)
N_SUM_COLS = tl.constexpr(len(SUM_COLUMNS))


@triton.jit
def clamped_log_ratio(log_ratio, clamp):
    """``(the log-ratio clamped to +-clamp, whether it lies within)``: where verl exponentiates
    a clamped log-ratio, a token past the clamp has no gradient."""
    within = (log_ratio >= -clamp) & (log_ratio <= clamp)
    return tl.minimum(tl.maximum(log_ratio, -clamp), clamp), within


@triton.jit
def no_flag(x):
    """A flag no token sets, for a function with fewer than three."""
    return x < float("-inf")


@per_token
@triton.jit
def clip(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """PPO's clipped surrogate over ``[lo, hi]``, with the dual clip ``c = params[0]`` (verl's
    ``clip_ratio_c``) and the cap ``params[1]`` of the unclipped ratio (TRL's ``delta``), inf
    for none:

        J = min(min(r, cap) A, clip(r, lo, hi) A)          (A < 0: max(J, c A) with a dual clip)

    that is ``min(r, hi, cap) A`` for A > 0 and ``min(c, max(r, lo)) A`` for A < 0 when
    r <= cap, ``min(c, max(cap, clip(r, lo, hi))) A`` when r > cap. ``dJ/dlp = r A`` where the
    value is ``r A``, else 0. Decided in log space; only the selected branch is exponentiated, so
    a clipped token with any log-ratio is finite. The bounds are rounded to the compute dtype
    first, as the reference holds them: a bound beyond the dtype's range is inf, so its branch
    is never the clipped one. Flags: clipped low (A < 0 and min(r, cap) < lo), clipped high
    (A > 0 and min(r, cap) > hi), dual-clipped (A < 0 and the value before the dual clip
    exceeds c A's ratio). ``clamp``: the whole of it is taken at the log-ratio clamped to
    +-clamp, with no gradient past the clamp (verl's ``exp(clamp(log r, -20, 20))``; inf: none).
    """
    dtype = log_ratio.dtype
    log_ratio, within_clamp = clamped_log_ratio(log_ratio, clamp)
    lo = lo.to(dtype)
    hi = hi.to(dtype)
    dual_clip = tl.cast(params[0], dtype)
    cap = tl.cast(params[1], dtype)
    log_lo = tl.log(lo)
    log_hi = tl.log(hi)
    log_cap = tl.log(cap)
    positive = adv > 0
    negative = adv < 0
    # A > 0: the ratio unless it exceeds hi or the cap
    pos_active = log_ratio <= tl.minimum(log_hi, log_cap)
    pos_bound = tl.minimum(hi, cap)
    # A < 0: max(min(r, cap), clip(r)) before the dual clip
    capped = log_ratio > log_cap
    in_range = (log_ratio >= log_lo) & (log_ratio <= log_hi)
    neg_active = tl.where(capped, in_range, log_ratio >= log_lo)
    neg_bound = tl.where(capped, tl.maximum(tl.where(log_ratio < log_lo, lo, hi), cap), lo)
    log_q = tl.where(neg_active, log_ratio, tl.log(neg_bound))
    dual = negative & (log_q > tl.log(dual_clip))
    active = tl.where(positive, pos_active, negative & neg_active & ~dual)
    bound = tl.where(positive, pos_bound, tl.where(dual, dual_clip, neg_bound))
    value = exp_accurate(tl.where(active, log_ratio, 0.0)) * adv
    j = tl.where(active, value, tl.where(adv != 0, bound * adv, 0.0))
    dj = tl.where(active & within_clamp, value, 0.0)
    capped_ratio = tl.minimum(log_ratio, log_cap)
    low = negative & (capped_ratio < log_lo)
    high = positive & (capped_ratio > log_hi)
    return j, dj, low, high, dual


@per_token
@triton.jit
def cispo(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """CISPO: ``J = sg(clip(r, lo, hi)) A lp`` (verl: ``[1 - eps_low, 1 + eps_high]``; TRL:
    ``[0, eps_high]``), r of the log-ratio clamped to +-clamp. Flags: clipped (r outside
    [lo, hi], verl's ``pg_clipfrac``), clipped high with A > 0 (TRL's ``cispo_clip_ratio``)."""
    dtype = log_ratio.dtype
    lo = lo.to(dtype)
    hi = hi.to(dtype)
    below = log_ratio < tl.log(lo)
    above = log_ratio > tl.log(hi)
    inside = ~(below | above)
    clamped, _ = clamped_log_ratio(log_ratio, clamp)
    coef = tl.where(below, lo, tl.where(above, hi, exp_accurate(tl.where(inside, clamped, 0.0))))
    dj = coef * adv
    return dj * lp, dj, ~inside, above & (adv > 0), no_flag(log_ratio)


@triton.jit
def _softplus(x):
    """log(1 + e^x) without overflow."""
    return tl.maximum(x, 0.0) + tl.log(1.0 + exp_accurate(-tl.abs(x)))


@per_token
@triton.jit
def sapo(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """SAPO's soft gate: ``J = sigma(tau (r - 1)) 4 / tau A``, ``tau = tau_pos`` if A > 0 else
    ``tau_neg`` (``params``), r of the log-ratio clamped to +-clamp (verl: 20; TRL: none), so that
    ``dJ/dlp = 4 A sigma(x) sigma(-x) r`` inside the clamp (0 outside). ``r sigma(-x)`` is
    formed as ``exp(log r - softplus(x))``: finite for any ratio."""
    dtype = log_ratio.dtype
    tau = tl.where(adv > 0, tl.cast(params[0], dtype), tl.cast(params[1], dtype))
    clamped, inside = clamped_log_ratio(log_ratio, clamp)
    x = tau * (exp_accurate(clamped) - 1.0)
    gate = 1.0 / (1.0 + exp_accurate(-x))
    j = gate * (4.0 / tau) * adv
    dj = tl.where(inside, 4.0 * adv * gate * exp_accurate(clamped - _softplus(x)), 0.0)
    none = no_flag(log_ratio)
    return j, dj, none, none, none


@per_token
@triton.jit
def gpg(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """The policy gradient ``J = A lp``."""
    none = no_flag(log_ratio)
    return adv * lp, adv, none, none, none


@per_token
@triton.jit
def dro(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """Direct reward optimisation: ``J = lp A - beta (lp - old)^2 / 2``, beta = ``params[0]``."""
    beta = tl.cast(params[0], log_ratio.dtype)
    none = no_flag(log_ratio)
    return lp * adv - 0.5 * beta * log_ratio * log_ratio, adv - beta * log_ratio, none, none, none


@triton.jit
def _dppo(log_ratio, lp, old, adv, delta_low, delta_high, truncation, clamp,
          BINARY_KL: tl.constexpr):
    """DPPO (verl's ``dppo_tv`` / ``dppo_kl``): ``J = sg(min(r, c)) A lp`` on the tokens whose
    move stays inside the divergence threshold, 0 on the others; r of the log-ratio clamped to
    +-clamp, c = ``truncation`` (verl's ``clip_ratio_c``). With p = e^lp, mu = e^old: TV keeps
    A > 0 tokens with p - mu <= delta_high and the others with p - mu >= -delta_low; the binary
    KL ``mu (old - lp) + (1 - mu) log((1 - mu + 1e-8) / (1 - p + 1e-8))`` keeps A > 0 tokens
    with KL <= delta_high or p <= mu, the others with KL <= delta_low or p >= mu. Flags:
    dropped (verl's ``pg_clipfrac``), kept and truncated (r > c, verl's
    ``pg_clipfrac_lower``)."""
    dtype = log_ratio.dtype
    clamped, _ = clamped_log_ratio(log_ratio, clamp)
    ratio = exp_accurate(clamped)
    truncation = tl.cast(truncation, dtype)
    p = exp_accurate(lp)
    mu = exp_accurate(old)
    if BINARY_KL:
        kl = mu * (old - lp) + (1.0 - mu) * tl.log((1.0 - mu + 1e-8) / (1.0 - p + 1e-8))
        keep_pos = (kl <= delta_high) | (p <= mu)
        keep_neg = (kl <= delta_low) | (p >= mu)
    else:
        keep_pos = (p - mu) <= delta_high
        keep_neg = (p - mu) >= -delta_low
    keep = tl.where(adv > 0, keep_pos, keep_neg)
    dj = tl.where(keep, tl.minimum(ratio, truncation) * adv, 0.0)
    return dj * lp, dj, ~keep, keep & (ratio > truncation), no_flag(log_ratio)


@per_token
@triton.jit
def dppo_tv(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """DPPO with the total variation (``_dppo``), ``params = (delta_low, delta_high, c)``."""
    return _dppo(log_ratio, lp, old, adv, params[0], params[1], params[2], clamp, False)


@per_token
@triton.jit
def dppo_kl(log_ratio, lp, old, adv, lo, hi, params, clamp):
    """DPPO with the binary KL (``_dppo``), ``params = (delta_low, delta_high, c)``."""
    return _dppo(log_ratio, lp, old, adv, params[0], params[1], params[2], clamp, True)


def objective_args(surrogate):
    """The constexprs ``(OBJECTIVE, GEOMETRY, TOPOLOGY)`` (the per-token function, the region's
    codes) and the runtime scalars ``(region, params, clamp)`` (the region's sizes of
    ``region_bounds``, the function's parameters, each an fp64 pair of ``utils.fp64_args``,
    and the clamp, an integer or inf: exact in fp32) of an
    ``rlfuse.objectives.TokenSurrogate`` (or a tuple of its fields)."""
    name, geometry, topology, delta_low, delta_high, params, clamp = surrogate
    codes = (token_function(name),) + region_codes(geometry, topology)
    return codes, (region_sizes(delta_low, delta_high), fp64_args(params), float(clamp))
