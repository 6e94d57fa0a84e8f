"""Fused ``policy_loss``: any objective of ``rlfuse.objectives`` with the terms and masks of
``rlfuse.terms``, from every policy form.

A token-local objective with its KL and entropy terms runs in the surrogate kernels: in one
pass over the logits from ``Logits`` / ``LinearHead`` (``surrogate_loss``: the policy's
form's single pass, ``form_ops``). A
sequence- or batch-level objective, or a mask that reads the current policy, needs every
log-prob (and entropy) of the batch first: the log-prob kernels run, then the loss on
``[B, T]`` (the surrogate kernels from log-probs, or the objective's ``batch`` function), and
the backward reaches the logits through the log-prob kernels' backward (two reads and one
write of the logits in all).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .._types import LossOutput
from ..checks.values import raise_on_overflow
from ..kernels.lib.token_functions import SUM_COLUMNS
from ..objectives import Objective
from ..scaleout import context
from ..scaleout.layout import as_one_token_rows
from ..shared.aggregation import aggregation_weights, sequence_shares
from ..shared.masks import apply_masks, entropy_weights, kl_weights, term_ratio
from ._op import kl_inputs, op_inputs
from .form_ops import learner_logprobs, of
from .kl import kl_penalty_op
from .surrogate import surrogate_op


def _detached(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.detach()


def policy_loss(policy, args, old_logprobs: Optional[Tensor], ref_logprobs: Optional[Tensor],
                generator: Optional[torch.Generator], validate: bool, *,
                entropy: Optional[Tensor] = None) -> LossOutput:
    """``rlfuse.policy_loss`` of checked ``args`` (``api.policy_loss.PolicyLossArgs``); ``entropy``:
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


# --------------------------------------------------------------------------------------------
# Every policy form
# --------------------------------------------------------------------------------------------

def _in_one_pass(policy, ratio: str) -> bool:
    """Whether ``policy``'s loss runs in one pass over its logits: a token's own ratio, a form
    of logits (not ``[B, T]`` log-probs) whose rows are every rank's, not batch-invariant (its
    log-probs from fixed vocabulary blocks, a head's from tiles that never leave the chip: no
    chunk of logits), that its form runs so (``form_ops``), not in fp16 (a gradient rounded to
    fp16 at scale 1 would lose what a loss scaler's 2^16 is meant to keep: the two passes form
    it at the true upstream scale)."""
    if ratio != "token" or isinstance(policy, Tensor) or policy.batch_invariant or \
            policy.own_rows or not of(policy).can_single_pass(policy):
        return False
    return policy.rows.dtype != torch.float16


def _masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, x, torch.zeros_like(x)).sum()


def terms_apart(lp: Tensor, old_lp: Optional[Tensor], mask: Tensor, ratio: str,
                ref_lp: Optional[Tensor], kl, kl_scale: Optional[Tensor],
                entropy: Optional[Tensor],
                entropy_scale: Optional[Tensor]) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The KL and entropy terms from ``[B, T]`` log-probs (and entropies), each with its row
    weights (coefficient included): ``(loss, totals)``."""
    scales = [s for s in (kl_scale, entropy_scale) if s is not None]
    loss = (scales[0] if scales else lp).new_zeros(())
    totals = {}
    if kl is not None:   # masked positions may hold anything: zeros go into the kernels
        cdt = kl_scale.dtype
        lp = torch.where(mask, lp.to(cdt), 0.0)
        ref = torch.where(mask, ref_lp.to(cdt), 0.0)
        value = kl_penalty_op(lp, ref, kl.estimator, kl.straight, kl.clamp)
        if kl.weighted:
            old = lp.detach() if old_lp is None else torch.where(mask, old_lp, 0.0)
            value = value * term_ratio(lp.to(value.dtype), old.to(value.dtype), mask, ratio)
        per_row = torch.where(mask, value, torch.zeros_like(value)).sum(-1)
        loss = loss + (per_row * kl_scale).sum()
        totals["kl"] = per_row.detach().sum()
        totals["overflow"] = _masked_sum(~torch.isfinite(value.detach()), mask).to(loss.dtype)
    if entropy_scale is not None:
        h = torch.where(mask, entropy, torch.zeros_like(entropy))
        scale = entropy_scale if entropy_scale.dim() == 2 else entropy_scale.unsqueeze(-1)
        loss = loss - (h * scale).sum()
        totals["entropy"] = h.detach().sum()
    return loss, totals


def surrogate_loss(policy, old_lp: Optional[Tensor], adv: Tensor, mask: Tensor,
                   row_scale: Tensor, objective: Objective, *, weights: Optional[Tensor] = None,
                   ref_lp: Optional[Tensor] = None, kl=None, kl_scale: Optional[Tensor] = None,
                   entropy_scale: Optional[Tensor] = None, validate: bool,
                   raise_overflow: bool = True) -> Tuple[Tensor, Dict[str, Tensor], Tensor]:
    """``(loss, {column: total}, sums [B, SUM_COLUMNS])`` (each sequence's column sums) of a
    token-local or sequence ``objective`` (a record of ``rlfuse.objectives``) for any policy
    form (``old_lp`` None: on policy), with the KL term ``kl`` (an ``rlfuse.terms.KLTerm``) to
    ``ref_lp`` of row weights ``kl_scale`` (``[B]``) and the entropy bonus of weights
    ``entropy_scale`` (``[B]``, or ``[B, T]`` apart from the single pass; the coefficients
    included). The single pass carries the terms
    in its kernel; otherwise they are ops over the ``[B, T]`` log-probs. With ``validate`` (and
    ``raise_overflow``) an overflowing objective raises (one host sync)."""
    flat, ratio = op_inputs(objective.surrogate()), objective.ratio
    single = _in_one_pass(policy, ratio) and (entropy_scale is None or entropy_scale.dim() == 1)
    blocks = getattr(policy, "row_blocks", 0)   # the rows of sequence parallelism
    packed = policy.index if single and policy.index is not None else None
    batch, T = mask.shape
    if packed is not None:
        policy, mask, found, rows = as_one_token_rows(
            policy, mask, dict(old_lp=old_lp, adv=adv, weights=weights, ref_lp=ref_lp),
            dict(row_scale=row_scale, kl_scale=kl_scale, entropy_scale=entropy_scale))
        old_lp, adv, weights, ref_lp = (found[k] for k in ("old_lp", "adv", "weights", "ref_lp"))
        row_scale, kl_scale, entropy_scale = (rows[k] for k in ("row_scale", "kl_scale",
                                                                "entropy_scale"))
        adv = adv[:, 0]
    tokens = dict(mask=mask, old_lp=old_lp, adv=adv, weights=weights, row_scale=row_scale)
    terms_in = dict(ref_lp=ref_lp, kl_scale=kl_scale,
                    entropy_scale=entropy_scale, **kl_inputs(kl))
    if single:
        loss, sums = of(policy).single_pass_call(policy, mask, tokens, terms_in, flat,
                                                 validate, blocks)()[:2]
        terms = {}
    else:
        if entropy_scale is not None:
            lp, entropy = learner_logprobs(policy, mask, validate=validate, return_entropy=True)
        else:
            lp, entropy = learner_logprobs(policy, mask, validate=validate), None
        loss, sums, _ = surrogate_op(lp, **tokens, **flat, ratio=ratio)
        extra, terms = terms_apart(lp, old_lp, mask, ratio, ref_lp, kl, kl_scale, entropy,
                                   entropy_scale)
        loss = loss + extra
    if sums.shape[0] != mask.shape[0]:          # the single pass from logits: per token
        sums = sums.view(mask.shape[0], -1, len(SUM_COLUMNS)).sum(1)
    if packed is not None:                       # packed rows back to their sequences
        sums = sums.new_zeros((batch, len(SUM_COLUMNS))).index_add_(
            0, packed.clamp_min(0) // T, sums)
    totals = dict(zip(SUM_COLUMNS, sums.sum(0).unbind()))
    for name, value in terms.items():
        totals[name] = totals[name] + value
    if validate and raise_overflow:
        raise_on_overflow(totals["overflow"], row_scale.dtype)
    return loss, totals, sums


def surrogate_metrics(totals: Dict[str, Tensor], sums: Tensor, mask: Tensor,
                      flags: Tuple[str, ...],
                      row_tokens: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """The metrics of a surrogate objective from its column totals and per-sequence sums: the
    shares of its ``flags`` (the metric names of the columns flag0, ...), the extremes and mean
    of some per sequence (``shared.aggregation.sequence_shares``), ratio_mean, approx_kl,
    overflow; ``row_tokens``: the sequences' actor tokens (default: the mask's)."""
    row_tokens = (mask.sum(-1) if row_tokens is None else row_tokens).to(sums.dtype)
    tokens = row_tokens.sum().clamp_min(1)
    metrics = {name: totals[f"flag{i}"] / tokens for i, name in enumerate(flags)}
    metrics.update(ratio_mean=totals["ratio"] / tokens, approx_kl=totals["neg_log_ratio"] / tokens,
                   overflow=(totals["overflow"] > 0).to(tokens.dtype))
    metrics.update(sequence_shares(
        {name: sums[:, SUM_COLUMNS.index(f"flag{i}")] for i, name in enumerate(flags)},
        row_tokens))
    return metrics
