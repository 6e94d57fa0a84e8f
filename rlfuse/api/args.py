"""The argument checks of every loss, and the normalised arguments they return (read by name).

Both implementations call the same check of a public function first, so they accept and refuse
exactly the same inputs with the same messages. With ``validate=False`` only metadata is
checked: nothing reads a tensor's values, so nothing syncs with the host.
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Optional, Tuple

import torch

from .._names import AGGREGATIONS
from .._types import SequenceCounts
from ..checks.policy import PolicyInfo, check_policy, check_policy_targets
from ..checks.values import (check_actor_tokens, check_choice, check_clip, check_count,
                             check_finite, check_group_size, check_loss_scale,
                             check_nonnegative, check_number, check_positive,
                             check_sequence_tensor, check_tensor, check_token_tensors,
                             check_unit_interval)
from ..objectives import Clip, Objective, as_objective
from ..shared.aggregation import per_token
from ..terms import (EntropyBonus, KLPenalty, KLTerm, OffPolicyMask, TopEntropyMask,
                     kl_estimator)


def _loss_policy(policy, mask, tensors, validate: bool):
    """The policy, the bool mask and the ``[B, T]`` float ``tensors`` (name -> tensor, None
    left out) of a loss; returns ``(info, mask)``."""
    shape = getattr(mask, "shape", None)
    if not isinstance(policy, torch.Tensor) and getattr(policy, "index", None) is not None:
        # a form's packed rows
        shape = _packed_loss_shape(mask, tensors)
    info = check_policy(policy, shape)
    mask = check_token_tensors(mask, {k: v for k, v in tensors.items() if v is not None},
                               shape=info.shape, device=info.device, validate=validate)
    return info, mask


def _packed_loss_shape(mask, tensors):
    """Packed rows have no ``[B, T]`` of their own: the shape most of the mask and ``tensors``
    share; with no majority the mask's, after an error naming the mask and the first tensor
    of another shape (either may be the wrong one)."""
    named = {"mask": mask, **{k: v for k, v in tensors.items() if v is not None}}
    shapes = {k: tuple(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}
    if len(set(shapes.values())) <= 1 or "mask" not in shapes:
        return shapes.get("mask")
    counts = collections.Counter(shapes.values())
    shape, count = counts.most_common(1)[0]
    if 2 * count > len(shapes):
        return shape
    other = next(k for k, v in shapes.items() if v != shapes["mask"])
    raise ValueError(f"mask, {other}: shapes {shapes['mask']} and {shapes[other]} differ (packed "
                     f"rows take the loss's [B, T] from the mask and its [B, T] inputs alike)")


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
                    loss_scale, num_tokens, validate, whole: bool = True) -> GGPOArgs:
    """The checks of ``ggpo_loss`` (``whole``: the mask holds whole sequences, not a context-
    parallel rank's chunks of them, whose actor tokens may all sit elsewhere)."""
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
    if validate and whole:
        check_actor_tokens(mask, m, what="group")
    return GGPOArgs(info, mask, m, beta, rho, check_loss_scale(loss_scale), num_tokens)


# --------------------------------------------------------------------------------------------
# The surrogate losses' tensors
# --------------------------------------------------------------------------------------------

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
                           feedback_clip, adv_clip, std_eps, validate,
                           whole: bool = True) -> GROPDAdvantageArgs:
    """The checks of ``gr_opd_advantages`` (``whole`` as in ``check_ggpo_args``)."""
    check_tensor("old_logprobs", old_logprobs, floating=True)
    if old_logprobs.dim() != 2:
        raise ValueError(f"old_logprobs: expected shape [B, T], got {tuple(old_logprobs.shape)}")
    shape = tuple(old_logprobs.shape)
    mask = check_token_tensors(mask, {"old_logprobs": old_logprobs,
                                      "teacher_logprobs": teacher_logprobs},
                               shape=shape, device=old_logprobs.device, validate=validate)
    hyper = _check_advantage_args(group_size, shape[0], gamma, lam, feedback_clip, adv_clip,
                                  std_eps)
    if validate and whole:
        check_actor_tokens(mask, 1, what="sequence")
    return GROPDAdvantageArgs(mask, hyper)


class GROPDArgs(NamedTuple):
    """GR-OPD's loss: its advantages' hyper-parameters, the advantages given (or None), and the
    loss step, ``policy_loss`` of the clip over ``[1 - eps_low, 1 + eps_high]`` with no dual
    clip and no clamp of the log-ratio, aggregated by ``seq-mean-token-mean`` (its advantages
    filled in once known)."""

    hyper: AdvantageArgs
    advantages: Optional[torch.Tensor]   # [B]
    loss: "PolicyLossArgs"


def check_gr_opd_args(policy, old_logprobs, teacher_logprobs, mask, *, group_size, gamma, lam,
                      eps, feedback_clip, adv_clip, std_eps, advantages, loss_scale,
                      num_sequences, validate, whole: bool = True) -> GROPDArgs:
    """The checks of ``gr_opd_loss`` (``whole`` as in ``check_ggpo_args``)."""
    info, mask = _loss_policy(policy, mask, {"old_logprobs": old_logprobs,
                                             "teacher_logprobs": teacher_logprobs}, validate)
    batch, device = info.shape[0], info.device
    hyper = _check_advantage_args(group_size, batch, gamma, lam, feedback_clip, adv_clip,
                                  std_eps)
    objective = Clip(clip=check_clip("eps", eps), log_ratio_clamp=None)
    if advantages is not None:
        if isinstance(advantages, torch.Tensor) and tuple(advantages.shape) == (batch, 1):
            advantages = advantages[:, 0]
        check_sequence_tensor("advantages", advantages, batch=batch, device=device,
                              validate=validate)
    num_sequences = check_count("num_sequences", num_sequences, device, validate)
    check_policy_targets(policy, mask, mask.shape, validate)
    if validate and whole:
        check_actor_tokens(mask, 1, what="sequence")
    loss = PolicyLossArgs(info, mask, advantages, None, objective, "seq-mean-token-mean", None,
                          None, None, None, check_loss_scale(loss_scale), None, num_sequences)
    return GROPDArgs(hyper, advantages, loss)


# --------------------------------------------------------------------------------------------
# policy_loss: any objective with its terms; the KL penalty alone
# --------------------------------------------------------------------------------------------

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
    info, mask = _loss_policy(policy, mask, {"old_logprobs": old_logprobs,
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
