"""Reference GPPO: the clipped surrogate over the proximal region of an f-divergence.

Also home of the math GR-OPD shares with GPPO: the PPO-style clipped surrogate decided in
log-ratio space (:func:`clipped_surrogate`) and verl's loss aggregations (:func:`aggregate`).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from .._contract import (MU_MIN, aggregation_weights, check_bounds_args,
                         check_group_advantages_args, check_gppo_args, masked_mean, per_token,
                         raise_on_overflow)
from .._types import LossOutput, compute_dtype
from .logprobs import learner_logprobs

BISECTION_STEPS = 100        # see _binary_root_bounds


# --------------------------------------------------------------------------------------------
# Trust-region bounds
# --------------------------------------------------------------------------------------------

def gppo_bounds(old_logprobs: torch.Tensor, *, geometry: str, topology: str,
                delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token trust region ``[lo, hi] = {r : D(r) <= delta}`` of GPPO.

    ``mu = exp(old_logprobs)`` clamped to ``[1e-6, 1 - 1e-6]``; ``r = pi_new / pi_old``.
    ``delta`` may be a pair ``(delta_low, delta_high)``: the lower bound is that of
    ``delta_low``'s region, the upper that of ``delta_high``'s (an asymmetric region).
    Integrands ``f``: ``tv`` ½|r−1| · ``chi2`` (r−1)² · ``hellinger`` (√r−1)² · ``kl`` −log r ·
    ``two_sided_log`` |log r|. Topologies: ``mc`` D = f(r) · ``atomic`` D = μ f(r) ·
    ``binary`` D = μ f(r) + (1−μ) f((1−μr)/(1−μ)) (Bernoulli(μ) vs Bernoulli(μr), r ≤ 1/μ).
    Closed forms (``w = delta`` for mc, ``delta/mu`` for atomic)::

        tv         mc/atomic [1 − 2w, 1 + 2w]          binary [1 − δ/μ, min(1/μ, 1 + δ/μ)]
        chi2       mc/atomic 1 ± √w                    binary 1 ± √(δ(1−μ)/μ), hi ≤ 1/μ
        hellinger  mc/atomic [(1−√w)₊², (1+√w)²]       binary π ∈ [sin²(max(0, α−θ)),
                                                               sin²(min(π/2, α+θ))] / μ,
                                                       α = asin √μ, θ = acos(max(−1, 1−δ/2))
        kl         mc/atomic [e^{−w}, +inf)            binary roots of μ log(μ/π) +
                                                               (1−μ) log((1−μ)/(1−π)) = δ
        two_sided_log  [e^{−w}, e^{w}]                 binary roots of μ|log r| +
                                                               (1−μ)|log((1−μr)/(1−μ))| = δ

    Lower bounds clamp at 0; an upper bound that does not fit the dtype is ``+inf``. The binary
    upper bound never exceeds the domain edge ``1/μ`` (π = 1): that is the ``min`` of the tv cell,
    applied to chi2 as well (its quadratic root passes 1/μ once δ > (1−μ)/μ). Hellinger/binary
    uses the trig-free form of the SPEC (``c = max(−1, 1−δ/2)``, ``s = √(1−c²)``, ``a = √μ``,
    ``b = √(1−μ)``: ``π_lo = (ac − bs)²`` if ``ac − bs > 0`` else 0, ``π_hi = (ac + bs)²`` if
    ``bc − as > 0`` else 1). kl/binary and two_sided_log/binary are found by a vectorised fp64
    bisection on each side of r = 1 (see :func:`_binary_root_bounds`).

    All bounds are computed in fp64; they come back in fp64 for fp64 input, fp32 otherwise.
    Elementwise: a NaN ``old_logprobs`` gives NaN bounds.
    Check value: chi2/atomic, μ = 0.1, δ = 0.04 → [0.3675445, 1.6324555].
    """
    delta_low, delta_high = check_bounds_args(old_logprobs, geometry, topology, delta)
    mu = old_logprobs.detach().double().exp().clamp(MU_MIN, 1.0 - MU_MIN)
    lo = _bounds_fp64(mu, geometry, topology, delta_low)[0]
    hi = _bounds_fp64(mu, geometry, topology, delta_high)[1]
    out = compute_dtype(old_logprobs.dtype)
    return lo.clamp_min(0.0).to(out), hi.to(out)


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


# --------------------------------------------------------------------------------------------
# Pieces shared with GR-OPD
# --------------------------------------------------------------------------------------------

class Surrogate(NamedTuple):
    """Per-token result of :func:`clipped_surrogate` (all [B, T])."""

    value: torch.Tensor          # J, differentiable, 0 off the mask
    ratio_used: torch.Tensor     # bool: J = r A (the unclipped branch, A != 0)
    clipped_low: torch.Tensor    # bool: A < 0 and r < lo
    clipped_high: torch.Tensor   # bool: A > 0 and r > hi
    dual_clipped: torch.Tensor   # bool: A < 0 and r > c (the dual clip)
    overflow: torch.Tensor       # bool: the selected value is not representable


def clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, lo: torch.Tensor,
                      hi: torch.Tensor, mask: torch.Tensor,
                      dual_clip: float = math.inf) -> Surrogate:
    """Per-token ``J = min(r A, clip(r, lo, hi) A)`` with ``r = exp(log_ratio)``, zero off the mask;
    with a dual clip ``c`` (``A < 0`` only) ``J = max(min(r A, clip(r, lo, hi) A), c A)``.

    The branch is decided in log space — ``clipped_high = A > 0 ∧ log r > log hi``,
    ``clipped_low = A < 0 ∧ log r < log lo``, ``dual_clipped = A < 0 ∧ log r > log c``
    (log 0 = −inf, log inf = +inf) — and only the selected branch is evaluated: a clipped token is
    the constant ``bound · A`` (zero gradient) and never exponentiates its log-ratio, so any
    log-ratio is safe there. Elsewhere ``J = r A`` and ``∂J/∂log r = r A``; a token with
    ``A = 0`` is 0 without evaluating r. ``overflow`` marks the tokens whose selected value is not
    representable in the dtype (the unclipped ``r A`` of a negative advantage, or of a positive
    one under an upper bound beyond the dtype's range): the losses refuse them
    (``validate=True``) or report them.
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
    return Surrogate(value, ratio_used, clipped_low, clipped_high, dual_clipped, overflow)


def overflow_metric(sur: Surrogate, validate: bool) -> torch.Tensor:
    """The ``overflow`` metric (1 if some selected ``r A`` overflowed, else 0); with
    ``validate`` an overflow raises instead."""
    count = sur.overflow.sum()
    if validate:
        raise_on_overflow(count, sur.value.dtype)
    return (count > 0).to(sur.value.dtype)


def surrogate_loss(policy, old_logprobs, args, bounds, *, agg: str, validate: bool,
                   sequence: bool = False):
    """``(loss, metrics)`` of the clipped surrogate family (GPPO, PPO) from the normalised
    ``args`` (``rlfuse._contract.SurrogateArgs``); ``bounds(old)`` gives the per-token fp64
    ``(lo, hi)`` of the behavior log-probs ``old`` (rounded once to the compute dtype here).

    ``old_logprobs`` None: on policy, ``old = lp.detach()`` (r = 1). ``sequence`` (GSPO): every
    token of row i takes the row's ratio ``s_i = exp(Σ_t M (lp − old) / T_i)`` (differentiated
    through the mean). ``weights`` multiply each token's J. Metrics over the actor tokens:
    ``clip_frac_low``, ``clip_frac_high``, ``dual_clip_frac`` (the dual clip's share), ``ratio_mean``
    (of r, or of s_i), ``approx_kl`` (mean ``old − lp``), ``overflow``.
    """
    info, mask = args.info, args.mask
    cdt = info.compute_dtype
    lp = torch.where(mask, learner_logprobs(policy, mask).to(cdt), 0.0)
    old = lp.detach() if old_logprobs is None else torch.where(
        mask, old_logprobs.detach().to(cdt), 0.0)
    adv = torch.where(mask, per_token(args.advantages, info.shape).detach().to(cdt), 0.0)
    lo, hi = bounds(old.detach())
    log_ratio = lp - old
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, mask)
    if sequence:
        tokens = mask.sum(-1, keepdim=True).clamp_min(1)
        log_ratio = torch.where(mask, log_ratio.sum(-1, keepdim=True) / tokens, 0.0)
    sur = clipped_surrogate(log_ratio, adv, lo.to(cdt), hi.to(cdt), mask, args.dual_clip)
    value = sur.value
    if args.weights is not None:
        value = value * torch.where(mask, args.weights.detach().to(cdt), 0.0)
    loss = -args.loss_scale * aggregate(value, mask, agg, num_tokens=args.num_tokens,
                                        num_sequences=args.num_sequences)
    with torch.no_grad():
        metrics = {
            "clip_frac_low": masked_mean(sur.clipped_low.to(cdt), mask),
            "clip_frac_high": masked_mean(sur.clipped_high.to(cdt), mask),
            "dual_clip_frac": masked_mean(sur.dual_clipped.to(cdt), mask),
            "ratio_mean": masked_mean(log_ratio.exp(), mask),
            "approx_kl": approx_kl,
            "overflow": overflow_metric(sur, validate),
        }
    return loss, metrics


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str, *,
              num_tokens: Optional[float] = None,
              num_sequences: Optional[float] = None) -> torch.Tensor:
    """verl's ``agg_loss`` (``verl.trainer.ppo.core_algos``) of per-token ``values`` [B, T]
    (already 0 off the mask): ``Σ_i w_i Σ_t x_it`` with the row weights ``w`` of
    ``rlfuse._contract.aggregation_weights``, the weights the kernels use::

        token-mean               Σ_it M_it x_it / N_tok
        seq-mean-token-mean      Σ_i (Σ_t M_it x_it / T_i) / N_seq
        seq-mean-token-sum       Σ_i (Σ_t M_it x_it) / N_seq
        seq-mean-token-sum-norm  Σ_i (Σ_t M_it x_it / T) / N_seq      (Dr. GRPO; T = mask.shape[-1])
        token-sum                Σ_it M_it x_it

    ``N_tok = num_tokens`` (default: local ``Σ M``), ``N_seq = num_sequences`` (default: the
    local ``B``, every row: TRL's and verl's trainers; verl's ``agg_loss`` called without a
    ``global_batch_size`` divides by the non-empty rows instead), ``T_i = Σ_t M_it``, padded
    length T. The counts may be numbers or 0-dim tensors.
    """
    weights = aggregation_weights(mask, agg, values.dtype, num_tokens=num_tokens,
                                  num_sequences=num_sequences)
    return (values.sum(-1) * weights).sum()


# --------------------------------------------------------------------------------------------
# Loss and advantages
# --------------------------------------------------------------------------------------------

def gppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, *, geometry: str = "chi2", topology: str = "atomic",
              delta: float = 0.04, agg: str = "token-mean", dual_clip: Optional[float] = None,
              weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
              num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
              validate: bool = True) -> LossOutput:
    """GPPO: the policy-gradient surrogate clipped to each token's f-divergence trust region.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` behavior-policy log-probs (detached), or None on policy
            (``old = lp.detach()``, r = 1; the region then centres on the learner's own μ).
        advantages: ``[B]`` / ``[B, 1]`` (per sequence, broadcast over its tokens) or ``[B, T]``.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        geometry: ``tv``, ``chi2``, ``hellinger``, ``kl`` or ``two_sided_log``.
        topology: ``mc``, ``atomic`` or ``binary``.
        delta: region size ``> 0``, or ``(delta_low, delta_high)``: the lower bound from the
            first, the upper from the second (runtime kernel arguments).
        agg: ``token-mean`` (default), ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm``, ``token-sum`` (verl's names and divisors, see
            :func:`aggregate`). A response without actor tokens contributes 0 and counts in the
            default ``num_sequences``.
        dual_clip: ``c > 1``: for ``A < 0`` the token objective is
            ``max(min(r A, clip(r) A), c A)`` (verl's ``clip_ratio_c``); None: no dual clip.
        weights: optional ``[B, T]`` non-negative per-token multipliers of J (an
            importance-sampling correction, an entropy or off-policy mask); detached.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_tokens, num_sequences: global counts for gradient accumulation / data parallelism,
            numbers or 0-dim tensors (default: the local ones; the count an ``agg`` does not
            use is ignored).
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``r A``
            (host syncs); shapes, dtypes and devices are always checked.

    Per actor token::

        r = exp(lp − old_lp),   [l, u] = gppo_bounds(old_lp, geometry, topology, delta)
        J_t = w_t min(r A, clip(r, l, u) A)        (A < 0 with dual_clip: w_t max(…, c A))
        ∂J_t/∂lp_t = w_t A r · 1[active],
        active = ¬((A > 0 ∧ r > u) ∨ (A < 0 ∧ r < l) ∨ (A < 0 ∧ r > c))
        loss = −loss_scale · agg(J)

    ``active`` is decided in log space and only the selected branch is exponentiated, so a
    clipped token with any log-ratio is finite; an unclipped ``r A`` that overflows raises
    ``ValueError`` (with ``validate=False``: the ``overflow`` metric is 1 and the loss is not
    finite). ``token-mean`` divides by ``num_tokens`` (default: the local actor-token count), the
    ``seq-mean-*`` ones by ``num_sequences`` (default: the local ``B``); ``seq-mean-token-mean``
    also by each sequence's token count and ``seq-mean-token-sum-norm`` by the padded length T.

    Metrics (detached, over the local actor tokens, 0 when there are none):
    ``clip_frac_low`` share of tokens with A < 0 and r < l (clipped from below);
    ``clip_frac_high`` share with A > 0 and r > u; ``dual_clip_frac`` share with A < 0 and
    r > c; ``ratio_mean`` mean of r; ``approx_kl`` mean of ``old_lp − lp`` (verl's ``ppo_kl``);
    ``overflow`` 1 if some selected ``r A`` overflowed.

    Fused (``rlfuse.gppo_loss``): from log-probs one forward and one backward kernel; from
    ``Logits`` one kernel computes the log-probs, the loss and ``dlogits`` in a single pass;
    from ``LinearHead`` that pass on each chunk of the logits.
    """
    args = check_gppo_args(
        policy, old_logprobs, advantages, mask, geometry=geometry, topology=topology, delta=delta,
        agg=agg, dual_clip=dual_clip, weights=weights, loss_scale=loss_scale,
        num_tokens=num_tokens, num_sequences=num_sequences, validate=validate)

    def bounds(old: torch.Tensor):
        return gppo_bounds(torch.where(args.mask, old, torch.zeros_like(old)).double(),
                           geometry=geometry, topology=topology, delta=args.delta)

    return LossOutput(*surrogate_loss(policy, old_logprobs, args, bounds, agg=agg,
                                      validate=validate))


def group_advantages(rewards: torch.Tensor, *, group_size: int, eps: float = 1e-6,
                     normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages: rewards centred (and scaled) within each group of ``group_size`` rows.

    ``A_i = (r_i − mean_g r) / (std_g r + eps)``, or ``r_i − mean_g r`` with
    ``normalize_std=False`` (Dr. GRPO). ``std`` is the sample standard deviation (ddof = 1,
    ``torch.std``'s default), as verl's ``compute_grpo_outcome_advantage`` and TRL's
    ``GRPOTrainer`` use. A group of one row follows verl: mean 0 and std 1, so ``A = r/(1+eps)``.
    ``eps`` must be > 0 when ``normalize_std`` (a group of equal rewards has std 0). Returns [B]
    in fp32 (fp64 for fp64 rewards), detached.
    """
    m, eps = check_group_advantages_args(rewards, group_size, eps, normalize_std)
    with torch.no_grad():
        r = rewards.to(compute_dtype(rewards.dtype)).reshape(-1, m)
        if m == 1:
            centred, std = r, torch.ones_like(r)
        else:
            centred = r - r.mean(-1, keepdim=True)
            std = (centred.square().sum(-1, keepdim=True) / (m - 1)).sqrt()   # ddof = 1
        adv = centred / (std + eps) if normalize_std else centred
    return adv.reshape(-1)
