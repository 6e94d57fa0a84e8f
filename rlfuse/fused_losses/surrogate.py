"""The surrogate losses fused (GPPO, GR-OPD, the PPO family, every token-local and sequence
objective): custom ops, autograd formulas, and the dispatch over the policy forms.

Three ops over ``kernels.surrogate``: the forward and backward from learner log-probs ``[B, T]``,
and the single pass from logits that writes ``dlogits`` in the forward (for an upstream gradient
of 1; ``linear_head.linear_surrogate_op`` is its chunked twin for a ``LinearHead``). The single
pass's backward rescales that buffer in place by the upstream gradient, read on the device: no
host sync, and no pass over it when the gradient is 1. fp16 logits take the two-pass path
instead (log-probs, then the surrogate; the backward forms ``dlogits`` from the logits at the
true upstream scale), since a gradient rounded to fp16 at scale 1 would lose what a loss
scaler's 2^16 is meant to keep; so do GSPO's sequence-level ratio (every log-prob of a row
first), ``Logits`` over a split vocabulary (a row's gradient needs the group's logsumexp,
known only after an all-gather of every shard's row statistics: the second read is not saved,
``docs/scale-out.md``) and batch-invariant policies (their log-probs from fixed vocabulary
blocks, a ``LinearHead``'s from tiles that never leave the chip, ``kernels.head_blocks``: no
chunk of logits). A ``LinearHead`` over a split vocabulary runs the single pass chunk by
chunk, each chunk's statistics gathered before its gradient is written. Packed rows run the
single pass as N sequences of one token each (``scaleout.layout.as_one_token_rows``).

Every op takes the objective's ``TokenSurrogate`` flat (``_op.surrogate_fields``): its per-token
function, the region's geometry and topology, the sizes of the region's two sides, the
function's parameters and the clamp of the log-ratio.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..forms import LinearHead, Logits, RankRowsHead
from ..checks.values import raise_on_overflow
from ..kernels.token_functions import SUM_COLUMNS
from ..kernels.head import HeadParams
from ..kernels.surrogate import surrogate_bwd, surrogate_fwd, surrogate_logits_fwd
from ..scaleout.layout import as_one_token_rows
from ..scaleout.vocab import check_shard_sizes
from ..objectives import Objective
from ..shared.aggregation import sequence_shares
from ..shared.masks import term_ratio
from ._op import (custom_op, input_names, kl_fields, kl_of, register_autograd, surrogate_fields,
                  surrogate_of)
from .kl import kl_penalty_op
from .linear_head import chunk_tokens_for, head_fields, linear_surrogate_op
from .logprobs import batched_rows
from .policy import learner_logprobs
from .scale_rows import hand_out, register_single_pass_autograd


def _loss(sums: Tensor) -> Tensor:
    return -sums[..., SUM_COLUMNS.index("loss")].sum()


# --------------------------------------------------------------------------------------------
# From log-probs
# --------------------------------------------------------------------------------------------

@custom_op("surrogate")
def surrogate_op(lp: Tensor, old_lp: Optional[Tensor], adv: Tensor, mask: Tensor,
                 weights: Optional[Tensor], row_scale: Tensor, function: str, geometry: str,
                 topology: str, delta_low: float, delta_high: float, params: List[float],
                 clamp: float, ratio: str) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, sums [B, SUM_COLUMNS], seq)`` from learner log-probs ``lp [B, T]``
    (``old_lp`` None: on policy); ``row_scale``: the aggregation weight of each row's tokens;
    ``ratio``: a name of ``_names.RATIO_MODES``, whose per-row state ``seq [B]`` the backward
    needs (empty for the token's own ratio)."""
    spec = (function, geometry, topology, delta_low, delta_high, params, clamp)
    sums, seq = surrogate_fwd(lp, old_lp, adv, mask, weights, row_scale, spec, ratio=ratio)
    return _loss(sums), sums, row_scale.new_empty(0) if seq is None else seq


@surrogate_op.register_fake
def _(lp, old_lp, adv, mask, weights, row_scale, function, geometry, topology, delta_low,
      delta_high, params, clamp, ratio):
    return (row_scale.new_empty(()), row_scale.new_empty((lp.shape[0], len(SUM_COLUMNS))),
            row_scale.new_empty(lp.shape[0] if ratio != "token" else 0))


@custom_op("surrogate_backward")
def surrogate_backward_op(lp: Tensor, old_lp: Optional[Tensor], adv: Tensor, mask: Tensor,
                          weights: Optional[Tensor], row_scale: Tensor, seq: Optional[Tensor],
                          grad: Tensor, function: str, geometry: str, topology: str,
                          delta_low: float, delta_high: float, params: List[float],
                          clamp: float, ratio: str) -> Tensor:
    """``dlp [B, T]`` for the upstream gradient ``grad`` (0-dim, read on the device)."""
    spec = (function, geometry, topology, delta_low, delta_high, params, clamp)
    return surrogate_bwd(lp, old_lp, adv, mask, weights, row_scale, seq, grad, spec,
                         ratio=ratio)


@surrogate_backward_op.register_fake
def _(lp, old_lp, adv, mask, weights, row_scale, seq, grad, function, geometry, topology,
      delta_low, delta_high, params, clamp, ratio):
    return torch.empty_like(lp, memory_format=torch.contiguous_format)


def _surrogate_setup(ctx, inputs, output):
    _, sums, seq = output
    ctx.save_for_backward(inputs.lp, inputs.old_lp, inputs.adv, inputs.mask, inputs.weights,
                          inputs.row_scale, seq if inputs.ratio != "token" else None)
    ctx.surrogate, ctx.ratio = surrogate_of(inputs), inputs.ratio
    ctx.mark_non_differentiable(sums, seq)


def _surrogate_backward(ctx, grad_loss, _grad_sums, _grad_seq):
    lp, old_lp, adv, mask, weights, row_scale, seq = ctx.saved_tensors
    return {"lp": surrogate_backward_op(lp, old_lp, adv, mask, weights, row_scale, seq,
                                        grad_loss.to(row_scale.dtype), *ctx.surrogate,
                                        ctx.ratio)}


register_autograd(surrogate_op, _surrogate_backward, _surrogate_setup)


# --------------------------------------------------------------------------------------------
# The single pass from logits
# --------------------------------------------------------------------------------------------

def _single_pass(logits, targets, mask, old_lp, adv, weights, row_scale, ref_lp, kl_scale,
                 entropy_scale, temperature, function, geometry, topology, delta_low,
                 delta_high, params, clamp, kl_estimator, kl_straight, kl_weighted, kl_clamp,
                 write_dlogits, dlogits, offset) -> Tuple[Optional[Tensor], Tensor]:
    """``(dlogits or None, sums)`` of the single pass (``surrogate_logits_op``), the gradient
    written into ``dlogits`` when given."""
    spec = (function, geometry, topology, delta_low, delta_high, params, clamp)
    kl = kl_of(kl_estimator, kl_straight, kl_weighted, kl_clamp)
    return surrogate_logits_fwd(
        logits, targets, mask, old_lp, adv, weights, row_scale, spec,
        head=HeadParams(temperature),
        write_dlogits=write_dlogits, dlogits=dlogits, offset=offset, ref_lp=ref_lp, kl=kl,
        kl_scale=kl_scale, entropy_scale=entropy_scale)


@custom_op("surrogate_logits")
def surrogate_logits_op(logits: Tensor, targets: Tensor, mask: Tensor, old_lp: Optional[Tensor],
                        adv: Tensor, weights: Optional[Tensor], row_scale: Tensor,
                        ref_lp: Optional[Tensor], kl_scale: Optional[Tensor],
                        entropy_scale: Optional[Tensor], temperature: float, function: str,
                        geometry: str, topology: str, delta_low: float, delta_high: float,
                        params: List[float], clamp: float, kl_estimator: str, kl_straight: bool,
                        kl_weighted: bool, kl_clamp: bool, write_dlogits: bool,
                        offset: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, sums [B*T, SUM_COLUMNS], dlogits)`` in one pass over ``logits [B, S, V]``, whose
    rows ``[offset, offset + T)`` predict ``targets [B, T]`` (``old_lp`` None: on policy, the
    kernel forms old = lp itself), with the KL term to ``ref_lp`` of row weights ``kl_scale``
    (``kl_estimator`` empty: none) and the entropy bonus of row weights ``entropy_scale`` (None:
    none), both with their coefficients.

    ``dlogits`` (for an upstream gradient of 1) is a new ``[B, S, V]`` buffer (zero rows outside
    the window), or empty without ``write_dlogits`` (the loss alone, one read of the logits).
    ``surrogate_logits_inplace_op`` writes it into the logits' own buffer instead.
    """
    dlogits, sums = _single_pass(logits, targets, mask, old_lp, adv, weights, row_scale, ref_lp,
                                 kl_scale, entropy_scale, temperature, function, geometry,
                                 topology, delta_low, delta_high, params, clamp, kl_estimator,
                                 kl_straight, kl_weighted, kl_clamp, write_dlogits, None, offset)
    return _loss(sums), sums, logits.new_empty(0) if dlogits is None else dlogits


@surrogate_logits_op.register_fake
def _(logits, targets, mask, old_lp, adv, weights, row_scale, ref_lp, kl_scale, entropy_scale,
      temperature, function, geometry, topology, delta_low, delta_high, params, clamp,
      kl_estimator, kl_straight, kl_weighted, kl_clamp, write_dlogits, offset):
    return (row_scale.new_empty(()), row_scale.new_empty((targets.numel(), len(SUM_COLUMNS))),
            logits.new_empty(logits.shape if write_dlogits else (0,)))


register_single_pass_autograd(surrogate_logits_op, "logits")


@custom_op("surrogate_logits_", mutates_args=("logits",))
def surrogate_logits_inplace_op(logits: Tensor, targets: Tensor, mask: Tensor,
                                old_lp: Optional[Tensor], adv: Tensor, weights: Optional[Tensor],
                                row_scale: Tensor, ref_lp: Optional[Tensor],
                                kl_scale: Optional[Tensor], entropy_scale: Optional[Tensor],
                                temperature: float, function: str, geometry: str,
                                topology: str, delta_low: float, delta_high: float,
                                params: List[float], clamp: float, kl_estimator: str,
                                kl_straight: bool, kl_weighted: bool, kl_clamp: bool,
                                offset: int) -> Tuple[Tensor, Tensor]:
    """``(loss, sums)`` of ``surrogate_logits_op`` with the gradient (for an upstream gradient
    of 1) written over ``logits`` (``inplace_backward``; ``stride(-1) == 1`` required). An op
    that mutates an input carries no autograd formula: ``InPlaceSinglePass`` holds it."""
    _, sums = _single_pass(logits, targets, mask, old_lp, adv, weights, row_scale, ref_lp,
                           kl_scale, entropy_scale, temperature, function, geometry, topology,
                           delta_low, delta_high, params, clamp, kl_estimator, kl_straight,
                           kl_weighted, kl_clamp, True, logits, offset)
    return _loss(sums), sums


@surrogate_logits_inplace_op.register_fake
def _(logits, targets, *rest):
    row_scale = rest[4]
    return (row_scale.new_empty(()), row_scale.new_empty((targets.numel(), len(SUM_COLUMNS))))


class InPlaceSinglePass(torch.autograd.Function):
    """``surrogate_logits_inplace_op`` with its gradient: the logits' own buffer, which holds
    the gradient after the forward, rescaled by the upstream gradient (``scale_rows.hand_out``).
    The op's declared write moves the logits' version, so a consumer that saved them before raises
    in its backward rather than differentiate through overwritten values."""

    @staticmethod
    def forward(ctx, logits, targets, mask, *rest):
        loss, sums = surrogate_logits_inplace_op(logits, targets, mask, *rest)
        ctx.save_for_backward(logits, mask)
        ctx.mark_non_differentiable(sums)
        ctx.offset, ctx.backward_done, ctx.inputs = rest[-1], False, 3 + len(rest)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        return (hand_out(ctx, grad_loss),) + (None,) * (ctx.inputs - 1)


# --------------------------------------------------------------------------------------------
# Every policy form
# --------------------------------------------------------------------------------------------

def _in_one_pass(policy, ratio: str) -> bool:
    """Whether ``policy``'s loss runs in one pass over its logits (see the module)."""
    if ratio != "token" or not isinstance(policy, (Logits, LinearHead)) or \
            isinstance(policy, RankRowsHead) or policy.batch_invariant or (
                isinstance(policy, Logits) and policy.vocab_parallel_group is not None):
        return False
    rows = policy.logits if isinstance(policy, Logits) else policy.hidden
    return rows.dtype != torch.float16


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
    flat, ratio = surrogate_fields(objective.surrogate()), objective.ratio
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
                    entropy_scale=entropy_scale, **kl_fields(kl))
    if single and isinstance(policy, LinearHead):
        grad = torch.is_grad_enabled()
        needs = [grad and t is not None and t.requires_grad
                 for t in (policy.hidden, policy.weight, policy.bias)]
        chunk = chunk_tokens_for(policy.weight, policy.chunk_tokens, policy.targets.numel())
        group = policy.vocab_parallel_group
        if validate and group is not None:
            check_shard_sizes(group, policy.weight.shape[0], policy.targets.device)
        loss, sums, *_ = linear_surrogate_op(
            policy.hidden, policy.weight, policy.bias, policy.targets, **tokens, **terms_in,
            **head_fields(policy), **flat, offset=int(policy.offset),
            chunk_tokens=chunk, gather=validate, needs=needs,
            group_name="" if group is None else group.group_name, row_blocks=blocks)
        terms = {}
    elif single:
        logits, targets, _ = batched_rows(policy.logits, policy.targets, mask)
        write = policy.logits.requires_grad and torch.is_grad_enabled()
        inputs = dict(logits=logits, targets=targets, **tokens, **terms_in,
                      temperature=float(policy.temperature), **flat, offset=int(policy.offset))
        if write and policy.inplace_backward and logits is policy.logits:
            loss, sums = InPlaceSinglePass.apply(
                *(inputs[name] for name in input_names(surrogate_logits_inplace_op)))
        else:
            loss, sums, _ = surrogate_logits_op(**inputs, write_dlogits=write)
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
