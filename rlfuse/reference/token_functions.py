"""Reference per-token functions of the surrogate losses, one per ``token`` an objective record
of ``rlfuse.objectives`` names (``token_function``)::

    <token>(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult

each actor token's objective J (to maximise) and the flags its metrics count (the record's
``flags`` names them). ``log_ratio`` is ``lp - old`` (or a sequence's
log-ratio under GSPO), differentiable; ``lo, hi`` the token's trust region
(``regions.region_bounds``, in the compute dtype); ``params`` the objective's own parameters;
``clamp`` the bound of the log-ratio where verl's form exponentiates a clamped one (inf: none).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Tuple

import torch

from .._names import FunctionsByName


class TokenResult(NamedTuple):
    """Per-token result of an objective (all ``[B, T]``)."""

    value: torch.Tensor                     # J, differentiable, 0 off the mask
    flags: Tuple[torch.Tensor, ...]         # bool, one per name of the record's flags
    overflow: torch.Tensor                  # bool: the selected value is not representable


# The per-token functions by name: each is registered where it is defined (``per_token``);
# ``token_function``: the one a record's ``token`` names
TOKEN_FUNCTIONS = FunctionsByName("objective", "per-token", "the reference")
per_token, token_function = TOKEN_FUNCTIONS.register, TOKEN_FUNCTIONS.lookup


def _result(value, mask, *flags) -> TokenResult:
    value = torch.where(mask, value, torch.zeros_like(value))
    return TokenResult(value, tuple(mask & f for f in flags),
                          mask & ~torch.isfinite(value.detach()))


def _clamped(log_ratio: torch.Tensor, clamp: float) -> torch.Tensor:
    return log_ratio.clamp(-clamp, clamp)


@per_token
def clip(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """PPO's clipped surrogate with verl's dual clip ``c`` and TRL's cap of the unclipped ratio
    (``params = (c, cap)``, inf for none), ``r = exp(log_ratio)``::

        J = min(min(r, cap) A, clip(r, lo, hi) A)         (A < 0: max(J, c A))

    The branch is decided in log space and only the selected one is evaluated: a clipped token
    is the constant ``bound A`` (zero gradient) and never exponentiates its log-ratio, so any
    log-ratio is safe there; elsewhere ``J = r A``. For A > 0 the value is ``min(r, hi, cap) A``;
    for A < 0 ``min(c, max(r, lo)) A`` when r <= cap, ``min(c, max(cap, clip(r, lo, hi))) A``
    past the cap. Flags: clipped low (A < 0, min(r, cap) < lo), clipped high (A > 0,
    min(r, cap) > hi), dual-clipped (A < 0, the value before the dual clip beyond c). All of it
    at the log-ratio clamped to +-clamp (verl's), no gradient past the clamp.
    """
    dual_clip, cap = params
    log_ratio = _clamped(log_ratio, clamp)
    with torch.no_grad():
        log_lo, log_hi = lo.log(), hi.log()
        log_cap, log_c = math.log(cap), math.log(dual_clip)
        positive, negative = adv > 0, adv < 0
        pos_active = log_ratio <= torch.minimum(log_hi, torch.full_like(log_hi, log_cap))
        pos_bound = hi.clamp_max(cap)
        capped = log_ratio > log_cap
        in_range = (log_ratio >= log_lo) & (log_ratio <= log_hi)
        neg_active = torch.where(capped, in_range, log_ratio >= log_lo)
        neg_bound = torch.where(capped, torch.where(log_ratio < log_lo, lo, hi).clamp_min(cap),
                                lo)
        log_q = torch.where(neg_active, log_ratio, neg_bound.log())
        dual = negative & (log_q > log_c)
        active = torch.where(positive, pos_active, negative & neg_active & ~dual)
        bound = torch.where(positive, pos_bound,
                            torch.where(dual, torch.full_like(lo, dual_clip), neg_bound))
        capped_ratio = log_ratio.clamp_max(log_cap)
        low = negative & (capped_ratio < log_lo)
        high = positive & (capped_ratio > log_hi)
    ratio = torch.exp(torch.where(active, log_ratio, torch.zeros_like(log_ratio)))
    constant = torch.where(adv != 0, bound * adv, torch.zeros_like(adv))
    return _result(torch.where(active, ratio * adv, constant), mask, low, high, dual)


@per_token
def cispo(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """CISPO: ``J = sg(clip(r, lo, hi)) A lp`` with r of the log-ratio clamped to +-clamp
    (verl: ``[1 - eps_low, 1 + eps_high]``, clamp 20; TRL: ``[0, eps_high]``, no clamp). Flags:
    r outside [lo, hi]; r > hi with A > 0."""
    with torch.no_grad():
        below, above = log_ratio < lo.log(), log_ratio > hi.log()
        coef = torch.where(below, lo, torch.where(above, hi, _clamped(log_ratio, clamp).exp()))
    return _result(coef * adv * lp, mask, below | above, above & (adv > 0))


# Past this argument sigma is 1 in fp64 and its torch gradient 0: SAPO's gate is evaluated on
# the ratio capped there, which keeps an overflowing ratio from turning 0 * inf into NaN.
_SIGMOID_SATURATED = 60.0


@per_token
def sapo(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """SAPO's soft gate ``J = sigma(tau (r - 1)) 4 / tau A``, ``tau = tau_pos`` if A > 0 else
    ``tau_neg`` (``params``), r of the log-ratio clamped to +-clamp (verl: 20; TRL: none)."""
    tau_pos, tau_neg = params
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    log_r = _clamped(log_ratio, clamp)
    log_r = torch.minimum(log_r, torch.log1p(_SIGMOID_SATURATED / tau))
    gate = torch.sigmoid(tau * (torch.exp(log_r) - 1.0))
    return _result(gate * 4.0 / tau * adv, mask)


@per_token
def gpg(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """The policy gradient ``J = A lp`` (verl's ``gpg``, REINFORCE)."""
    return _result(adv * lp, mask)


@per_token
def dro(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """Direct reward optimisation: ``J = lp A - beta (lp - old)^2 / 2`` (``params = (beta,)``)."""
    (beta,) = params
    return _result(lp * adv - 0.5 * beta * log_ratio.square(), mask)


def _dppo(log_ratio, lp, old, adv, mask, params, clamp, keep_pos, keep_neg):
    truncation = params[2]
    with torch.no_grad():
        ratio = _clamped(log_ratio, clamp).exp()
        keep = torch.where(adv > 0, keep_pos, keep_neg)
        coef = torch.where(keep, ratio.clamp_max(truncation), torch.zeros_like(ratio))
    return _result(coef * adv * lp, mask, ~keep, keep & (ratio > truncation))


@per_token
def dppo_tv(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """DPPO with the total variation (verl's ``dppo_tv``): ``J = sg(min(r, c)) A lp`` where the
    move of the probability ``p - mu`` (p = e^lp, mu = e^old) stays within ``delta_high``
    (A > 0) or ``-delta_low`` (A <= 0), else 0; ``params = (delta_low, delta_high, c)``. Flags:
    dropped; kept with r > c."""
    delta_low, delta_high, _ = params
    with torch.no_grad():
        move = lp.detach().exp() - old.exp()
    return _dppo(log_ratio, lp, old, adv, mask, params, clamp, move <= delta_high,
                 move >= -delta_low)


@per_token
def dppo_kl(log_ratio, lp, old, adv, lo, hi, mask, params, clamp) -> TokenResult:
    """DPPO with the binary KL (verl's ``dppo_kl``) ``mu (old - lp) + (1 - mu) log((1 - mu +
    1e-8) / (1 - p + 1e-8))``: A > 0 tokens are kept with KL <= delta_high or p <= mu, the
    others with KL <= delta_low or p >= mu; otherwise as ``dppo_tv``."""
    delta_low, delta_high, _ = params
    with torch.no_grad():
        p, mu = lp.detach().exp(), old.exp()
        kl = mu * (old - lp.detach()) + (1.0 - mu) * torch.log((1.0 - mu + 1e-8) /
                                                               (1.0 - p + 1e-8))
    return _dppo(log_ratio, lp, old, adv, mask, params, clamp, (kl <= delta_high) | (p <= mu),
                 (kl <= delta_low) | (p >= mu))


