"""The argument checks of every loss, and the normalised arguments they return (read by name).

Both implementations call the same check of a public function first, so they accept and refuse
exactly the same inputs with the same messages. With ``validate=False`` only metadata is
checked: nothing reads a tensor's values, so nothing syncs with the host.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch

from ..shared.aggregation import per_token
from .._names import AGGREGATIONS, GEOMETRIES, RATIO_LEVELS, TOPOLOGIES
from .._types import LinearHead, Logits
from ..checks.policy import PolicyInfo, check_policy, check_policy_targets
from .._specs import VERL_LOG_RATIO_CLAMP, KLTerm, Objective, ObjectiveSpec
from ..checks.values import (check_actor_tokens, check_choice, check_clip, check_count,
                          check_dual_clip, check_finite, check_group_size, check_loss_scale,
                          check_nonnegative, check_number, check_positive, check_sequence_tensor,
                          check_sides, check_tensor, check_token_tensors, check_unit_interval)
from ..objectives import objective_spec
from ..terms import EntropyBonus, KLPenalty, OffPolicyMask, TopEntropyMask, kl_estimator


def _loss_policy(policy, mask, tensors, validate: bool):
    """The policy, the bool mask and the ``[B, T]`` float ``tensors`` (name -> tensor, None
    left out) of a loss; returns ``(info, mask)``."""
    info = check_policy(policy, getattr(mask, "shape", None))
    mask = check_token_tensors(mask, {k: v for k, v in tensors.items() if v is not None},
                               shape=info.shape, device=info.device, validate=validate)
    return info, mask


# --------------------------------------------------------------------------------------------
# GGPO
# --------------------------------------------------------------------------------------------

class GGPOArgs(NamedTuple):
    info: PolicyInfo
    mask: torch.Tensor             # bool
    group_size: int
    beta: float
    clip_radius: Optional[float]   # None: the unclipped branch
    loss_scale: float
    num_tokens: Optional[float]


def check_ggpo_args(policy, ref_logprobs, rewards, mask, *, group_size, beta, clip_radius,
                    loss_scale, num_tokens, validate) -> GGPOArgs:
    info, mask = _loss_policy(policy, mask, {"ref_logprobs": ref_logprobs}, validate)
    check_sequence_tensor("rewards", rewards, batch=info.shape[0], device=info.device,
                          validate=validate)
    m = check_group_size(group_size, info.shape[0], minimum=2)
    beta = check_positive("beta", beta)
    rho = None if clip_radius is None else check_positive("clip_radius", clip_radius,
                                                          allow_inf=True)
    if num_tokens is not None:
        num_tokens = check_positive("num_tokens", num_tokens)
    check_policy_targets(policy, mask, mask.shape, validate)
    if validate:
        check_actor_tokens(mask, m, what="group")
    return GGPOArgs(info, mask, m, beta, rho, check_loss_scale(loss_scale), num_tokens)


# --------------------------------------------------------------------------------------------
# The surrogate family: GPPO, PPO (GR-OPD below)
# --------------------------------------------------------------------------------------------

class SurrogateArgs(NamedTuple):
    """The normalised arguments of the surrogate-family losses (GPPO, PPO)."""

    info: PolicyInfo
    mask: torch.Tensor             # bool
    advantages: torch.Tensor       # [B] or [B, T]
    weights: Optional[torch.Tensor]
    objective: Objective
    loss_scale: float
    num_tokens: Optional[float]
    num_sequences: Optional[float]


def check_region(geometry: str, topology: str, delta) -> Tuple[float, float]:
    """A known geometry and topology and ``delta > 0`` (or a pair of them, for the lower and
    the upper side of the region); returns ``(delta_low, delta_high)``."""
    check_choice("geometry", geometry, GEOMETRIES)
    check_choice("topology", topology, TOPOLOGIES)
    return check_sides("delta", delta, check_positive)


def check_bounds_args(old_logprobs, geometry, topology, delta) -> Tuple[float, float]:
    """The checks of ``gppo_bounds``; returns ``(delta_low, delta_high)``."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    return check_region(geometry, topology, delta)


def check_advantages(advantages, info: PolicyInfo, mask, validate: bool) -> torch.Tensor:
    """``[B]``, ``[B, 1]`` or ``[B, T]`` advantages (finite at actor tokens with ``validate``);
    returns them as ``[B]`` or ``[B, T]``."""
    batch, shape = info.shape[0], info.shape
    check_tensor("advantages", advantages, device=info.device, floating=True)
    if tuple(advantages.shape) not in ((batch,), (batch, 1), shape):
        raise ValueError(f"advantages: expected shape ({batch},), ({batch}, 1) or {shape}, got "
                         f"{tuple(advantages.shape)}")
    if advantages.dim() == 2 and advantages.shape[1] == 1 and shape[1] != 1:
        advantages = advantages[:, 0]
    if validate:
        check_finite("advantages", per_token(advantages, shape), mask)
    return advantages


def check_weights(weights, info: PolicyInfo, mask, validate: bool) -> Optional[torch.Tensor]:
    """Optional ``[B, T]`` per-token multipliers, finite and >= 0 at actor tokens."""
    if weights is None:
        return None
    check_tensor("weights", weights, shape=info.shape, device=info.device, floating=True)
    if validate:
        check_finite("weights", weights, mask)
        bad = (weights < 0) & mask
        if bool(bad.any()):
            raise ValueError(f"weights: expected values >= 0 at actor (mask=True) positions; "
                             f"found {weights[bad][0].item()}")
    return weights


def _check_surrogate_args(policy, old_logprobs, advantages, mask, region, *, agg, weights,
                          dual_clip, loss_scale, num_tokens, num_sequences, validate,
                          clamp=math.inf) -> SurrogateArgs:
    """``region``: ``(geometry, topology, (low, high))``, checked by the caller; ``clamp``: of
    the log-ratio (``Objective``)."""
    info, mask = _loss_policy(policy, mask, {"old_logprobs": old_logprobs}, validate)
    advantages = check_advantages(advantages, info, mask, validate)
    weights = check_weights(weights, info, mask, validate)
    check_choice("agg", agg, AGGREGATIONS)
    num_tokens = check_count("num_tokens", num_tokens, info.device, validate)
    num_sequences = check_count("num_sequences", num_sequences, info.device, validate)
    check_policy_targets(policy, mask, mask.shape, validate)
    geometry, topology, (low, high) = region
    objective = Objective("clip", geometry, topology, low, high,
                          (check_dual_clip(dual_clip), math.inf), clamp)
    return SurrogateArgs(info, mask, advantages, weights, objective,
                         check_loss_scale(loss_scale), num_tokens, num_sequences)


def check_gppo_args(policy, old_logprobs, advantages, mask, *, geometry, topology, delta, agg,
                    dual_clip, weights, loss_scale, num_tokens, num_sequences,
                    validate) -> SurrogateArgs:
    """The checks of ``gppo_loss``: PPO's clipped objective over GPPO's region."""
    region = (geometry, topology, check_region(geometry, topology, delta))
    return _check_surrogate_args(
        policy, old_logprobs, advantages, mask, region, agg=agg, weights=weights,
        dual_clip=dual_clip, loss_scale=loss_scale, num_tokens=num_tokens,
        num_sequences=num_sequences, validate=validate)


def check_ppo_args(policy, old_logprobs, advantages, mask, *, clip, dual_clip, ratio_level, agg,
                   weights, loss_scale, num_tokens, num_sequences, validate) -> SurrogateArgs:
    """The checks of ``ppo_loss``: the clipped objective over ``[1 - eps_low, 1 + eps_high]``."""
    region = ("ppo_clip", "mc", check_clip("clip", clip))
    check_choice("ratio_level", ratio_level, RATIO_LEVELS)
    return _check_surrogate_args(
        policy, old_logprobs, advantages, mask, region, agg=agg, weights=weights,
        dual_clip=dual_clip, loss_scale=loss_scale, num_tokens=num_tokens,
        num_sequences=num_sequences, validate=validate,
        clamp=VERL_LOG_RATIO_CLAMP if ratio_level == "token" else math.inf)


# --------------------------------------------------------------------------------------------
# GR-OPD
# --------------------------------------------------------------------------------------------

class AdvantageArgs(NamedTuple):
    """The normalised hyper-parameters of GR-OPD's advantages (the kernel's argument order)."""

    group_size: int
    gamma: float
    lam: float
    feedback_clip: float
    adv_clip: float
    std_eps: float


def _check_advantage_args(group_size, batch: int, gamma, lam, feedback_clip, adv_clip,
                          std_eps) -> AdvantageArgs:
    return AdvantageArgs(check_group_size(group_size, batch), check_unit_interval("gamma", gamma),
                         check_number("lam", lam),
                         check_nonnegative("feedback_clip", feedback_clip),
                         check_nonnegative("adv_clip", adv_clip),
                         check_positive("std_eps", std_eps))


class GROPDAdvantageArgs(NamedTuple):
    mask: torch.Tensor             # bool
    hyper: AdvantageArgs


def check_advantage_inputs(old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                           feedback_clip, adv_clip, std_eps, validate) -> GROPDAdvantageArgs:
    """The checks of ``gr_opd_advantages``."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs: expected shape [B, T], got {tuple(old_logprobs.shape)}")
    shape = tuple(old_logprobs.shape)
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=shape, device=old_logprobs.device, validate=validate)
    hyper = _check_advantage_args(group_size, shape[0], gamma, lam, feedback_clip, adv_clip,
                                  std_eps)
    if validate:
        check_actor_tokens(mask, 1, what="sequence")
    return GROPDAdvantageArgs(mask, hyper)


class GROPDArgs(NamedTuple):
    info: PolicyInfo
    mask: torch.Tensor             # bool
    hyper: AdvantageArgs
    objective: Objective           # the clip over [1 - eps_low, 1 + eps_high], no dual clip
    advantages: Optional[torch.Tensor]   # [B]
    loss_scale: float
    num_sequences: Optional[float]


def check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                      eps, feedback_clip, adv_clip, std_eps, advantages, loss_scale,
                      num_sequences, validate) -> GROPDArgs:
    info, mask = _loss_policy(policy, mask, {"old_logprobs": old_logprobs,
                                             "teacher_logprobs": teacher_logprobs}, validate)
    batch, device = info.shape[0], info.device
    hyper = _check_advantage_args(group_size, batch, gamma, lam, feedback_clip, adv_clip,
                                  std_eps)
    eps_low, eps_high = check_sides("eps", eps, check_positive)
    objective = Objective("clip", "ppo_clip", "mc", eps_low, eps_high, (math.inf, math.inf),
                          math.inf)
    if advantages is not None:
        if isinstance(advantages, torch.Tensor) and tuple(advantages.shape) == (batch, 1):
            advantages = advantages[:, 0]
        check_sequence_tensor("advantages", advantages, batch=batch, device=device,
                              validate=validate)
    num_sequences = check_count("num_sequences", num_sequences, device, validate)
    check_policy_targets(policy, mask, mask.shape, validate)
    if validate:
        check_actor_tokens(mask, 1, what="sequence")
    return GROPDArgs(info, mask, hyper, objective, advantages, check_loss_scale(loss_scale),
                     num_sequences)


# --------------------------------------------------------------------------------------------
# policy_loss: any objective with its terms; the KL penalty alone
# --------------------------------------------------------------------------------------------

class PolicyLossArgs(NamedTuple):
    """The normalised arguments of ``policy_loss``."""

    info: PolicyInfo
    mask: torch.Tensor                  # bool
    advantages: torch.Tensor            # [B] or [B, T]
    weights: Optional[torch.Tensor]
    spec: ObjectiveSpec
    agg: str
    kl: Optional[KLTerm]
    entropy: Optional[EntropyBonus]
    entropy_mask: Optional[TopEntropyMask]
    off_policy_mask: Optional[OffPolicyMask]
    loss_scale: float
    num_tokens: Optional[float]
    num_sequences: Optional[float]


def _check_term(name: str, value, kind: type):
    if value is not None and not isinstance(value, kind):
        raise TypeError(f"{name}: expected None or an rlfuse.terms.{kind.__name__}, got "
                        f"{type(value).__name__}")
    return value


def _check_agg(agg, spec: ObjectiveSpec) -> str:
    if spec.agg is None:
        return check_choice("agg", "token-mean" if agg is None else agg, AGGREGATIONS)
    if agg is not None and agg != spec.agg:
        raise ValueError(f"agg: objective {spec.source.name!r} aggregates by {spec.agg!r} "
                         f"(got agg={agg!r}); leave agg unset")
    return spec.agg


def check_policy_loss_args(policy, old_logprobs, advantages, mask, objective, *, agg, weights,
                           ref_logprobs, kl, entropy, entropy_mask, off_policy_mask,
                           loss_scale, num_tokens, num_sequences, generator,
                           validate) -> PolicyLossArgs:
    """The checks of ``policy_loss``."""
    spec = objective_spec(objective)
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
    info, mask = _loss_policy(policy, mask, {"old_logprobs": old_logprobs,
                                             "ref_logprobs": ref_logprobs,
                                             "sampling_logprobs": sampling}, validate)
    for name, term in (("entropy", entropy), ("entropy_mask", entropy_mask)):
        if term is not None and not isinstance(policy, (Logits, LinearHead)):
            raise ValueError(f"{name}: needs the policy's entropy, which [B, T] log-probs do not "
                             f"have; pass rlfuse.Logits or rlfuse.LinearHead")
    advantages = check_advantages(advantages, info, mask, validate)
    weights = check_weights(weights, info, mask, validate)
    agg = _check_agg(agg, spec)
    num_tokens = check_count("num_tokens", num_tokens, info.device, validate)
    num_sequences = check_count("num_sequences", num_sequences, info.device, validate)
    if entropy is not None:
        entropy.check()
        check_count("entropy.num_tokens", entropy.num_tokens, info.device, validate)
        check_count("entropy.num_sequences", entropy.num_sequences, info.device, validate)
    if entropy_mask is not None:
        entropy_mask.check()
    check_policy_targets(policy, mask, mask.shape, validate)
    return PolicyLossArgs(info, mask, advantages, weights, spec, agg,
                          None if kl is None else kl.term(), entropy, entropy_mask,
                          off_policy_mask, check_loss_scale(loss_scale), num_tokens,
                          num_sequences)


def check_kl_penalty_args(logprobs, ref_logprobs, estimator) -> Tuple[str, bool]:
    """The checks of ``kl_penalty``; returns ``(estimator, straight-through)``."""
    check_tensor("logprobs", logprobs, floating=True)
    check_tensor("ref_logprobs", ref_logprobs, shape=logprobs.shape, device=logprobs.device,
                 floating=True)
    return kl_estimator(estimator)
