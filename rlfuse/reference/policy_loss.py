"""Reference ``policy_loss``: any objective of ``rlfuse.objectives`` with the terms and masks
of ``rlfuse.terms``, from every policy form (the log-probs and entropies first, then the loss
on ``[B, T]``)."""
from __future__ import annotations

from typing import Optional

import torch

from .._types import LossOutput
from ..checks.values import raise_on_overflow
from ..shared.aggregation import aggregation_weights, masked_mean
from ..shared.masks import apply_masks, entropy_weights, kl_weights, term_ratio
from .kl import kl_estimate
from .logprobs import learner_logprobs, window_logprobs
from .surrogate import surrogate, surrogate_metrics


def _logprobs(policy, mask, *, validate: bool, entropy: bool):
    if entropy and not isinstance(policy, torch.Tensor):     # a form: its entropy too
        return window_logprobs(policy, mask, validate=validate, return_entropy=True)
    return learner_logprobs(policy, mask, validate=validate), None


def policy_loss(policy, args, old_logprobs: Optional[torch.Tensor],
                ref_logprobs: Optional[torch.Tensor], generator: Optional[torch.Generator],
                validate: bool, *, entropy: Optional[torch.Tensor] = None) -> LossOutput:
    """``rlfuse.policy_loss`` of checked ``args`` (``api.policy_loss.PolicyLossArgs``); ``entropy``:
    the entropies of ``[B, T]`` log-probs ``policy``, when known."""
    objective, mask, cdt = args.objective, args.mask, args.info.compute_dtype
    if entropy is not None:
        lp, h = policy, entropy
    else:
        lp, h = _logprobs(policy, mask, validate=validate,
                          entropy=args.entropy is not None or args.entropy_mask is not None)
    lp = torch.where(mask, lp.to(cdt), 0.0)
    if h is not None:
        h = torch.where(mask, h.to(cdt), 0.0)
    old = None if old_logprobs is None else torch.where(mask, old_logprobs.detach().to(cdt), 0.0)
    adv = args.advantages.detach().to(cdt)
    weights = None if args.weights is None else args.weights.detach().to(cdt)
    weights, entropy_mask, metrics = apply_masks(args, lp, h, old, weights)
    row_scale = args.loss_scale * aggregation_weights(mask, args.agg, cdt,
                                                      num_tokens=args.num_tokens,
                                                      num_sequences=args.num_sequences)
    if objective.ratio == "batch":
        loss, found = objective.batch(
            lp, lp.detach() if old is None else old, adv, mask, weights, row_scale,
            loss_scale=args.loss_scale, num_sequences=args.num_sequences, generator=generator)
        metrics.update(found)
    else:
        result = surrogate(lp, old, adv, mask, objective, agg=args.agg, weights=weights,
                           loss_scale=args.loss_scale, num_tokens=args.num_tokens,
                           num_sequences=args.num_sequences, validate=validate)
        loss = result.loss
        metrics.update(surrogate_metrics(result, mask))
    if args.kl is not None:
        term = args.kl
        ref = torch.where(mask, ref_logprobs.detach().to(cdt), 0.0)
        value = kl_estimate(lp, ref, term.estimator, straight=term.straight, clamp=term.clamp)
        if term.weighted:
            value = value * term_ratio(lp, lp.detach() if old is None else old, mask,
                                       objective.weight_ratio)
        value = torch.where(mask, value, 0.0)
        loss = loss + (value.sum(-1) * kl_weights(args, mask, cdt)).sum()
        bad = (~torch.isfinite(value.detach()) & mask).sum()
        if validate:
            raise_on_overflow(bad, cdt)
        if "overflow" in metrics:
            metrics["overflow"] = torch.maximum(metrics["overflow"], (bad > 0).to(cdt))
        metrics["kl"] = masked_mean(value.detach(), mask)
    scale = entropy_weights(args, entropy_mask, cdt)
    if scale is not None:
        loss = loss - (torch.where(entropy_mask, h, 0.0).sum(-1) * scale).sum()
    if h is not None:
        metrics["entropy"] = masked_mean(h.detach(), mask)
    return LossOutput(loss, metrics)
