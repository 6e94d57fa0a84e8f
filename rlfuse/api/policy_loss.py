"""The surrogate losses: ``policy_loss`` (any objective of ``rlfuse.objectives`` with the terms
of ``rlfuse.terms``), ``ppo_loss`` and ``gppo_loss`` (``policy_loss`` with ``Clip`` /
``GSPOTRL`` and ``GPPO``), GPPO's trust region ``gppo_bounds``, and ``kl_penalty``."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .._names import AGGREGATIONS, RATIO_LEVELS
from .._types import LossOutput, SequenceCounts
from ..checks.policy import (PolicyInfo, check_advantages, check_loss_policy,
                             check_policy_targets, check_weights)
from ..checks.values import check_choice, check_count, check_loss_scale, check_tensor
from ..objectives import GPPO, GSPOTRL, Clip, Objective, as_objective
from ..scaleout import context
from ..terms import (EntropyBonus, KLPenalty, KLTerm, OffPolicyMask, TopEntropyMask,
                     kl_estimator)


def policy_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
                mask: torch.Tensor, objective="clip", *, agg: Optional[str] = None,
                weights: Optional[torch.Tensor] = None,
                ref_logprobs: Optional[torch.Tensor] = None, kl=None, entropy=None,
                entropy_mask=None, off_policy_mask=None, loss_scale: float = 1.0,
                num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
                generator: Optional[torch.Generator] = None,
                context_parallel_group=None, validate: bool = True, run) -> LossOutput:
    """Any policy objective TRL or verl runs, with a KL penalty, an entropy bonus and TRL's masks.

    Args:
        policy: ``[B, T]`` learner log-probs (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` behaviour log-probs, or None (on policy: ``old = lp``).
        advantages: ``[B]``, ``[B, 1]`` or ``[B, T]``.
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        objective: an instance of ``rlfuse.objectives`` (``Clip``, ``GPPO``, ``CISPO``,
            ``CISPOTRL``, ``SAPO``, ``SAPOTRL``, ``GPG``, ``DRO``, ``DPPOTV``, ``DPPOKL``,
            ``GSPO``, ``GSPOTRL``, ``LUSPO``, ``GeoMean``, ``VESPO``, ``ClipCov``, ``KLCov``)
            or its name (its defaults; ``"dro"`` has none).
        agg: verl's aggregation of the objective and the KL term (default ``token-mean``); an
            objective that fixes its own (``SAPO``, ``LUSPO``) refuses another.
        weights: optional ``[B, T]`` multipliers (>= 0) of the objective (not of the terms);
            ``VESPO`` takes them as importance ratios into its weight, as TRL does.
        ref_logprobs: ``[B, T]`` reference log-probs of the KL penalty (with ``kl``).
        kl: ``rlfuse.terms.KLPenalty(coef, estimator, clamp, importance_weighted)``.
        entropy: ``rlfuse.terms.EntropyBonus(coef, agg, ...)`` (needs ``Logits`` /
            ``LinearHead``).
        entropy_mask: ``rlfuse.terms.TopEntropyMask(quantile, process_group)`` (TRL's
            ``top_entropy_quantile``; needs ``Logits`` / ``LinearHead``).
        off_policy_mask: ``rlfuse.terms.OffPolicyMask(threshold, sampling_logprobs)`` (TRL's
            OPSM).
        loss_scale: multiplies the loss and every gradient.
        num_tokens, num_sequences: the global counts of ``agg`` (default: the local ones).
        generator: the ``torch.Generator`` of ``ClipCov``'s random choice (default: torch's
            default generator, as verl draws it).
        context_parallel_group: the ranks that hold chunks of the same sequences (Megatron's
            load-balanced layout, ``rlfuse.scaleout.context``; None: whole sequences): the
            ``[B, T]`` inputs are this rank's chunks, the ranks' losses sum to one process's
            loss of whole sequences, each rank's gradients are its positions' of it, the
            metrics are the same on every rank.
        validate: check the values of the ``[B, T]`` inputs (log-probs <= 0 and finite at
            actor tokens) and refuse an overflowing objective (host syncs).

    With ``r = exp(lp − old)`` per actor token and ``J`` the objective's value::

        loss = −loss_scale agg(w J) + kl.coef agg(KL(lp, ref)) − entropy.coef agg_H(H)

    ``rlfuse.objectives`` gives each objective's formula; ``rlfuse.terms`` the terms'. The
    masks multiply ``w``; the entropy bonus covers the tokens the entropy mask keeps.

    Metrics (detached, over the local actor tokens): a token-local or sequence objective's
    flags (``clip_frac_low`` / ``clip_frac_high`` / ``dual_clip_frac`` of ``Clip``, GSPO and
    LUSPO; ``clip_frac`` / ``clip_frac_high`` of CISPO; ``dropped_frac`` / ``truncated_frac`` of
    DPPO; with ``clip_frac_low`` / ``clip_frac_high`` their per-sequence extremes
    ``clip_frac_low_seq_min`` / ``clip_frac_high_seq_max``), ``ratio_mean``, ``approx_kl``
    (the mean of ``old − lp``, each clamped to ±20 where verl's own loss clamps it) and
    ``overflow``; a batch-level objective's own (``GeoMean``:
    ``clip_frac_high``, ``clip_frac_low``, ``approx_kl``; ``VESPO``: ``phi_mean``,
    ``approx_kl``; ``ClipCov``: ``cut_frac``, ``approx_kl``; ``KLCov``: ``approx_kl`` of
    ``|lp − old|``); ``kl`` (the mean KL term), ``entropy`` (the mean entropy),
    ``entropy_mask_frac`` and ``off_policy_mask_frac`` (the shares of actor tokens kept).

    Fused (``rlfuse.policy_loss``): a token-local objective with its terms runs the surrogate
    kernels, in one pass over the logits from ``Logits`` / ``LinearHead``; a sequence- or
    batch-level objective or a mask runs the log-prob kernels first, then the loss on
    ``[B, T]``.
    """
    def check(policy, old_logprobs, advantages, mask, weights, ref_logprobs, off_policy_mask,
              *, known_entropy=False):
        return check_policy_loss_args(
            policy, old_logprobs, advantages, mask, objective, agg=agg, weights=weights,
            ref_logprobs=ref_logprobs, kl=kl, entropy=entropy, entropy_mask=entropy_mask,
            off_policy_mask=off_policy_mask, loss_scale=loss_scale, num_tokens=num_tokens,
            num_sequences=num_sequences, generator=generator, validate=validate,
            known_entropy=known_entropy)

    with run.on(policy) as (impl, policy):
        if context_parallel_group is None:
            args = check(policy, old_logprobs, advantages, mask, weights, ref_logprobs,
                         off_policy_mask)
            return impl.policy_loss(policy, args, old_logprobs, ref_logprobs, generator,
                                    validate)
        with context.agreed(context_parallel_group, mask):
            args = check(policy, old_logprobs, advantages, mask, weights, ref_logprobs,
                         off_policy_mask)
            if args.objective.draws and generator is None:
                raise ValueError(f"generator: {type(args.objective).__name__} under context "
                                 f"parallelism draws its choice on every rank of the group; "
                                 f"pass a torch.Generator seeded the same on each")
        if impl.context_in_place and context.in_place(args):
            counts = context.sequence_counts(args.mask, context_parallel_group)
            return impl.policy_loss(policy, args._replace(
                counts=counts, context_parallel_group=context_parallel_group), old_logprobs,
                ref_logprobs, generator, validate)
        sampling = None if off_policy_mask is None else off_policy_mask.sampling_logprobs
        whole = context.whole_sequences(
            impl, context_parallel_group, policy, args.mask,
            {"old": old_logprobs, "advantages": args.advantages, "weights": args.weights,
             "ref": ref_logprobs, "sampling": sampling}, validate=validate,
            return_entropy=entropy is not None or entropy_mask is not None)
        t = whole.tensors
        args = check(whole.logprobs, t["old"], t["advantages"], whole.mask, t["weights"],
                     t["ref"], context.with_sampling(off_policy_mask, t["sampling"]),
                     known_entropy=whole.entropy is not None)
        return context.share(impl.policy_loss(whole.logprobs, args, t["old"], t["ref"],
                                              generator, validate, entropy=whole.entropy),
                             context_parallel_group)


def ppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
             mask: torch.Tensor, *, clip=0.2, dual_clip: Optional[float] = None,
             ratio_level: str = "token", agg: str = "token-mean",
             weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
             num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
             context_parallel_group=None, validate: bool = True, run) -> LossOutput:
    """The PPO clipped surrogate, as GRPO / DAPO / Dr. GRPO / GSPO trainers run it.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad), ``rlfuse.Logits`` or
            ``rlfuse.LinearHead``.
        old_logprobs: ``[B, T]`` log-probs of the policy that sampled the tokens (detached), or
            None on policy (``old = lp.detach()``: ratio 1; from logits or a head the kernel
            forms it itself, no extra pass).
        advantages: ``[B]`` / ``[B, 1]`` (per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        clip: ``eps`` or ``(eps_low, eps_high)``, each in (0, 1): the region
            ``[1 − eps_low, 1 + eps_high]`` (DAPO's clip-higher, TRL's ``epsilon_high``,
            verl's ``clip_ratio_low`` / ``clip_ratio_high``).
        dual_clip: ``c > 1``: for ``A < 0`` the token objective is
            ``max(min(r A, clip(r) A), c A)`` (verl's ``clip_ratio_c``); None: no dual clip.
        ratio_level: ``"token"`` (r per token) or ``"sequence"`` (GSPO: every token of row i
            takes ``s_i = exp(mean over its actor tokens of lp − old)``, clipped as r is; the
            gradient flows through the mean, ``∂s_i/∂lp_it = s_i / T_i``; TRL's
            ``importance_sampling_level="sequence"``).
        agg: ``token-mean`` (default), ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm``, ``token-sum`` (verl's names and divisors, as in
            ``gppo_loss``). A response without actor tokens contributes 0 and counts in the default
            ``num_sequences``. TRL's loss types: ``grpo`` = ``seq-mean-token-mean``, ``bnpo`` =
            ``token-mean``, ``dr_grpo`` = ``token-mean`` with ``num_tokens = B ·
            max_completion_length``, ``dapo`` = ``token-mean`` with the global token count.
        weights: optional ``[B, T]`` non-negative per-token multipliers of J (vLLM's
            importance-sampling correction, an entropy or off-policy mask); detached.
        loss_scale: multiplies the loss and every gradient inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``).
        num_tokens, num_sequences: global counts, numbers or 0-dim tensors (default: the
            local ones).
        context_parallel_group: as in ``policy_loss``.
        validate: check the values of the ``[B, T]`` inputs and refuse an overflowing ``r A``
            (host syncs); shapes, dtypes and devices are always checked.

    Per actor token, ``r = exp(lp − old)`` (or ``s_i``)::

        J_t = w_t min(r A, clip(r, 1 − eps_low, 1 + eps_high) A)   (A < 0, dual: max(…, c A))
        loss = −loss_scale · agg(J)

    decided in log space as in ``gppo_loss`` (only the selected branch is exponentiated; an
    overflowing unclipped ``r A`` raises, or is the ``overflow`` metric without validation).
    Metrics: ``clip_frac_low``, ``clip_frac_high``, their per-sequence extremes
    ``clip_frac_low_seq_min`` / ``clip_frac_high_seq_max``, ``dual_clip_frac``, ``ratio_mean``,
    ``approx_kl``, ``overflow`` (as GPPO's).

    Fused (``rlfuse.ppo_loss``): GPPO's kernels with PPO's region — from ``Logits`` /
    ``LinearHead`` one pass for the token-level ratio; the sequence-level ratio needs every
    log-prob of a row first, so it runs the log-prob pass and the surrogate on ``[B, T]``.
    """
    if check_choice("ratio_level", ratio_level, RATIO_LEVELS) == "sequence":
        objective = GSPOTRL(clip=clip, dual_clip=dual_clip)
    else:
        objective = Clip(clip=clip, dual_clip=dual_clip)
    return policy_loss(policy, old_logprobs, advantages, mask, objective, agg=agg,
                       weights=weights, loss_scale=loss_scale, num_tokens=num_tokens,
                       num_sequences=num_sequences,
                       context_parallel_group=context_parallel_group, validate=validate,
                       run=run)


def gppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, *, geometry: str = "chi2", topology: str = "atomic",
              delta: float = 0.04, agg: str = "token-mean", dual_clip: Optional[float] = None,
              weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
              num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
              context_parallel_group=None, validate: bool = True, run) -> LossOutput:
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
            ``seq-mean-token-sum-norm``, ``token-sum`` (verl's names and divisors, below). A
            response without actor tokens contributes 0 and counts in the default
            ``num_sequences``.
        dual_clip: ``c > 1``: for ``A < 0`` the token objective is
            ``max(min(r A, clip(r) A), c A)`` (verl's ``clip_ratio_c``); None: no dual clip.
        weights: optional ``[B, T]`` non-negative per-token multipliers of J (an
            importance-sampling correction, an entropy or off-policy mask); detached.
        loss_scale: multiplies the loss and every gradient, inside the kernels (e.g.
            ``1 / gradient_accumulation_steps``): no pass over a gradient to rescale it.
        num_tokens, num_sequences: global counts for gradient accumulation / data parallelism,
            numbers or 0-dim tensors (default: the local ones; the count an ``agg`` does not
            use is ignored).
        context_parallel_group: as in ``policy_loss``.
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
    ``clip_frac_high`` share with A > 0 and r > u; ``clip_frac_low_seq_min`` /
    ``clip_frac_high_seq_max`` the least / greatest of those shares over the sequences with
    tokens (TRL's ``clip_ratio/low_min`` / ``high_max``); ``dual_clip_frac`` share with A < 0
    and r > c; ``ratio_mean`` mean of r; ``approx_kl`` mean of ``old_lp − lp``, each clamped to ±20
    (verl's ``ppo_kl``);
    ``overflow`` 1 if some selected ``r A`` overflowed.

    Fused (``rlfuse.gppo_loss``): from log-probs one forward and one backward kernel; from
    ``Logits`` one kernel computes the log-probs, the loss and ``dlogits`` in a single pass;
    from ``LinearHead`` that pass on each chunk of the logits.
    """
    return policy_loss(policy, old_logprobs, advantages, mask,
                       GPPO(geometry, topology, delta, dual_clip), agg=agg, weights=weights,
                       loss_scale=loss_scale, num_tokens=num_tokens,
                       num_sequences=num_sequences,
                       context_parallel_group=context_parallel_group, validate=validate,
                       run=run)


def gppo_bounds(old_logprobs: torch.Tensor, *, geometry: str, topology: str,
                delta: float, run) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token trust region ``[lo, hi] = {r : D(r) <= delta}`` of GPPO.

    Args:
        old_logprobs: behavior-policy log-probs of any shape (bounds are elementwise).
        geometry: ``tv``, ``chi2``, ``hellinger``, ``kl`` or ``two_sided_log``.
        topology: ``mc``, ``atomic`` or ``binary``.
        delta: region size ``> 0``, or ``(delta_low, delta_high)``.

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
    ``bc − as > 0`` else 1). kl/binary and two_sided_log/binary are the roots of ``D = δ`` on each
    side of r = 1, found in fp64 (each side has exactly one: D is 0 at r = 1, monotone on each
    side and unbounded at both ends of the domain).

    All bounds are computed in fp64; they come back in fp64 for fp64 input, fp32 otherwise.
    Elementwise: a NaN ``old_logprobs`` gives NaN bounds.
    Check value: chi2/atomic, μ = 0.1, δ = 0.04 → [0.3675445, 1.6324555].
    """
    with run.on(old_logprobs) as (impl, old_logprobs):
        check_tensor("old_logprobs", old_logprobs, floating=True)
        surrogate = GPPO(geometry, topology, delta).surrogate()
        return impl.gppo_bounds(old_logprobs.detach(), surrogate)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", *,
               clamp: bool = True, run) -> torch.Tensor:
    """Per-token KL estimates of a policy against reference log-probs (verl's ``kl_penalty``).

    Args:
        logprobs: learner log-probs, any shape (the gradient flows to them).
        ref_logprobs: reference log-probs of the same shape (detached).
        estimator: ``k1`` / ``kl``, ``abs``, ``k2`` / ``mse``, ``k3`` / ``low_var_kl``, each
            with verl's ``+`` (the estimator's value, k2's gradient).
        clamp: verl's clamps of k3 (``ref − lp`` to ±20, the value to ±10); TRL clamps
            nothing.

    With ``d = lp − ref``: k1 ``d``, abs ``|d|``, k2 ``d²/2``, k3 ``e^(−d) + d − 1``. Returns
    fp32 (fp64 for fp64 inputs).

    Fused (``rlfuse.kl_penalty``): one elementwise kernel forward, one backward.
    """
    with run.on(logprobs) as (impl, logprobs):
        name, straight = check_kl_penalty_args(logprobs, ref_logprobs, estimator)
        return impl.kl_penalty(logprobs, ref_logprobs.detach(), name, straight, bool(clamp))


class PolicyLossArgs(NamedTuple):
    """The normalised arguments of ``policy_loss``."""

    info: PolicyInfo
    mask: torch.Tensor                  # bool
    advantages: torch.Tensor            # [B] or [B, T]
    weights: Optional[torch.Tensor]
    objective: Objective
    agg: str
    kl: Optional[KLTerm]
    entropy: Optional[EntropyBonus]
    entropy_mask: Optional[TopEntropyMask]
    off_policy_mask: Optional[OffPolicyMask]
    loss_scale: float
    num_tokens: Optional[float]
    num_sequences: Optional[float]
    # context parallelism in place (``scaleout.context.in_place``): the whole sequences' counts
    # and the group over which the metrics' sums are reduced
    counts: Optional[SequenceCounts] = None
    context_parallel_group: Optional[object] = None


def _check_term(name: str, value, kind: type):
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name}: expected None or an rlfuse.terms.{kind.__name__}, got "
                        f"{type(value).__name__}")
    return value


def _check_agg(agg, objective: Objective) -> str:
    if objective.agg is None:
        return check_choice("agg", "token-mean" if agg is None else agg, AGGREGATIONS)
    if agg is not None and agg != objective.agg:
        raise ValueError(f"agg: objective {objective.name!r} aggregates by {objective.agg!r} "
                         f"(got agg={agg!r}); leave agg unset")
    return objective.agg


def check_policy_loss_args(policy, old_logprobs, advantages, mask, objective, *, agg, weights,
                           ref_logprobs, kl, entropy, entropy_mask, off_policy_mask,
                           loss_scale, num_tokens, num_sequences, generator,
                           validate, known_entropy: bool = False) -> PolicyLossArgs:
    """The checks of ``policy_loss`` (``known_entropy``: ``[B, T]`` log-probs whose entropies
    come beside them)."""
    objective = as_objective(objective)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator or None; got "
                        f"{type(generator).__name__}")
    kl = _check_term("kl", kl, KLPenalty)
    entropy = _check_term("entropy", entropy, EntropyBonus)
    entropy_mask = _check_term("entropy_mask", entropy_mask, TopEntropyMask)
    off_policy_mask = _check_term("off_policy_mask", off_policy_mask, OffPolicyMask)
    if (kl is None) != (ref_logprobs is None):
        raise ValueError("ref_logprobs: the KL penalty needs both kl=rlfuse.terms.KLPenalty(...) "
                         "and ref_logprobs; got " + ("kl alone" if ref_logprobs is None
                                                     else "ref_logprobs alone"))
    sampling = None if off_policy_mask is None else off_policy_mask.check().sampling_logprobs
    info, mask = check_loss_policy(policy, mask, {"old_logprobs": old_logprobs,
                                             "ref_logprobs": ref_logprobs,
                                             "sampling_logprobs": sampling}, validate)
    for name, term in (("entropy", entropy), ("entropy_mask", entropy_mask)):
        if term is not None and not known_entropy and isinstance(policy, torch.Tensor):
            raise ValueError(f"{name}: needs the policy's entropy, which [B, T] log-probs do not "
                             f"have; pass rlfuse.Logits or rlfuse.LinearHead")
    advantages = check_advantages(advantages, info, mask, validate)
    weights = check_weights(weights, info, mask, validate)
    agg = _check_agg(agg, objective)
    num_tokens = check_count("num_tokens", num_tokens, info.device, validate)
    num_sequences = check_count("num_sequences", num_sequences, info.device, validate)
    if entropy is not None:
        entropy.check()
    for name, term in (("kl", kl), ("entropy", entropy)):
        if term is not None:
            check_count(f"{name}.num_tokens", term.num_tokens, info.device, validate)
            check_count(f"{name}.num_sequences", term.num_sequences, info.device, validate)
    if entropy_mask is not None:
        entropy_mask.check()
    check_policy_targets(policy, mask, mask.shape, validate)
    return PolicyLossArgs(info, mask, advantages, weights, objective, agg,
                          None if kl is None else kl.term(), entropy, entropy_mask,
                          off_policy_mask, check_loss_scale(loss_scale), num_tokens,
                          num_sequences)


def check_kl_penalty_args(logprobs, ref_logprobs, estimator) -> Tuple[str, bool]:
    """The checks of ``kl_penalty``; returns ``(estimator, straight-through)``."""
    check_tensor("logprobs", logprobs, floating=True)
    check_tensor("ref_logprobs", ref_logprobs, shape=logprobs.shape, device=logprobs.device,
                 floating=True)
    return kl_estimator(estimator)
