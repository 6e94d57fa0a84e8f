"""Fused ``policy_loss``: any objective of ``rlfuse.objectives`` with the terms and masks of
``rlfuse.terms``, from every policy form.

A token-local objective with its KL and entropy terms runs in the surrogate kernels: in one
pass over the logits from ``Logits`` / ``LinearHead`` (``surrogate.surrogate_loss``). A
sequence- or batch-level objective, or a mask that reads the current policy, needs every
log-prob (and entropy) of the batch first: the log-prob kernels run, then the loss on
``[B, T]`` (the surrogate kernels from log-probs, or the objective's ``batch`` function), and
the backward reaches the logits through the log-prob kernels' backward (two reads and one
write of the logits in all).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._types import LossOutput
from ..checks.values import raise_on_overflow
from ..scaleout import context
from ..shared.aggregation import aggregation_weights
from ..shared.masks import apply_masks, entropy_weights, kl_weights
from .policy import learner_logprobs
from .surrogate import surrogate_loss, surrogate_metrics, terms_apart


def _detached(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach()


def policy_loss(policy, args, old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                generator: Optional[torch.Generator], validate: bool, *,
                entropy: Optional[Tensor] = None) -> LossOutput:
    """``rlfuse.policy_loss`` of checked ``args`` (``api.args.PolicyLossArgs``); ``entropy``:
    the entropies of ``[B, T]`` log-probs ``policy``, when known. With the ``counts`` of
    ``args`` (context parallelism in place, ``scaleout.context``) the policy holds chunks of
    whole sequences: a token-local objective's loss over them with the whole sequences'
    weights, its sums (the metrics') summed over the group."""
    objective, mask, cdt = args.objective, args.mask, args.info.compute_dtype
    old, adv, ref = _detached(old_logprobs), args.advantages.detach(), _detached(ref_logprobs)
    weights = _detached(args.weights)
    counts = args.counts
    row_scale = args.loss_scale * aggregation_weights(mask, args.agg, cdt,
                                                      num_tokens=args.num_tokens,
                                                      num_sequences=args.num_sequences,
                                                      counts=counts)
    tokens = (mask.sum() if counts is None else counts.tokens.sum()).to(cdt)
    two_pass = objective.ratio == "batch" or args.entropy_mask is not None or \
        args.off_policy_mask is not None or entropy is not None
    if not two_pass:
        loss, totals, sums = surrogate_loss(
            policy, old, adv, mask, row_scale, objective, weights=weights, ref_lp=ref,
            kl=args.kl, kl_scale=kl_weights(args, mask, cdt),
            entropy_scale=entropy_weights(args, mask, cdt), validate=validate,
            raise_overflow=counts is None)
        if counts is not None:   # chunks of whole sequences: the group's sums, then the check
            totals, sums = context.group_sums(totals, sums, args.context_parallel_group)
            if validate:
                raise_on_overflow(totals["overflow"], cdt)
        metrics = surrogate_metrics(totals, sums, mask, objective.flags,
                                    None if counts is None else counts.tokens)
    else:
        with_entropy = args.entropy is not None or args.entropy_mask is not None
        if entropy is not None:
            lp, h = policy, entropy
        elif with_entropy:
            lp, h = learner_logprobs(policy, mask, validate=validate, return_entropy=True)
        else:
            lp, h = learner_logprobs(policy, mask, validate=validate), None
        lp = torch.where(mask, lp.to(cdt), 0.0)
        old_c = None if old is None else torch.where(mask, old.to(cdt), 0.0)
        weights, entropy_mask, metrics = apply_masks(args, lp, h, old_c, weights)
        if objective.ratio == "batch":
            loss, found = objective.batch(
                lp, lp.detach() if old_c is None else old_c, adv.to(cdt), mask,
                None if weights is None else weights.to(cdt), row_scale,
                loss_scale=args.loss_scale, num_sequences=args.num_sequences,
                generator=generator)
            metrics.update(found)
            extra, totals = terms_apart(lp, old_c, mask, objective.weight_ratio, ref, args.kl,
                                        kl_weights(args, mask, cdt), None, None)
        else:
            loss, totals, sums = surrogate_loss(lp, old, adv, mask, row_scale, objective,
                                                weights=weights, ref_lp=ref, kl=args.kl,
                                                kl_scale=kl_weights(args, mask, cdt),
                                                validate=validate)
            metrics.update(surrogate_metrics(totals, sums, mask, objective.flags))
            extra = 0.0
        scale = entropy_weights(args, entropy_mask, cdt)
        bonus, found = terms_apart(lp, old_c, entropy_mask, objective.weight_ratio, None, None,
                                   None, h, scale)
        loss = loss + extra + bonus
        totals.update(found)
        if h is not None:   # the metric: over the actor tokens, whatever the bonus covers
            totals["entropy"] = torch.where(mask, h, 0.0).detach().sum()
    if args.kl is not None:
        metrics["kl"] = totals["kl"] / tokens.clamp_min(1)
    if "entropy" in totals and (args.entropy is not None or args.entropy_mask is not None):
        metrics["entropy"] = totals["entropy"] / tokens.clamp_min(1)
    return LossOutput(loss, metrics)
