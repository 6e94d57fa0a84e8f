"""The surrogate losses fused (GPPO, GR-OPD, the PPO family, every token-local and sequence
objective): custom ops, autograd formulas, and the dispatch over the policy forms.

Three ops over ``kernels.rows.surrogate``: the forward and backward from learner log-probs
``[B, T]``,
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
blocks, a ``LinearHead``'s from tiles that never leave the chip, ``kernels.tiles.head_tiles``: no
chunk of logits). A ``LinearHead`` over a split vocabulary runs the single pass chunk by
chunk, each chunk's statistics gathered before its gradient is written. Packed rows run the
single pass as N sequences of one token each (``scaleout.layout.as_one_token_rows``).

Every op takes the objective's ``TokenSurrogate`` flat (``_op.op_inputs``): its per-token
function, the region's geometry and topology, the sizes of the region's two sides, the
function's parameters and the clamp of the log-ratio.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.lib.token_functions import SUM_COLUMNS
from ..kernels.lib.head_functions import HeadParams
from ..kernels.rows.surrogate import surrogate_bwd, surrogate_fwd, surrogate_logits_fwd
from ..objectives import TokenSurrogate
from ._op import custom_op, kl_of, record_of, register_autograd
from .logits.scale_rows import hand_out, register_single_pass_autograd


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
    spec = record_of(TokenSurrogate, locals())
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
    spec = record_of(TokenSurrogate, locals())
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
    ctx.surrogate, ctx.ratio = record_of(TokenSurrogate, inputs), inputs.ratio
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
                 write_dlogits, dlogits, offset) -> dict:
    """The arguments of ``surrogate_logits_fwd`` for the single pass (``surrogate_logits_op``),
    the gradient written into ``dlogits`` when given."""
    spec, kl = record_of(TokenSurrogate, locals()), kl_of(locals())
    return dict(logits=logits, targets=targets, mask=mask, old_lp=old_lp, adv=adv,
                weights=weights, row_scale=row_scale, objective=spec,
                head=HeadParams(temperature), write_dlogits=write_dlogits, dlogits=dlogits,
                offset=offset, ref_lp=ref_lp,
                kl=kl, kl_scale=kl_scale,
                entropy_scale=entropy_scale)


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
    dlogits, sums = surrogate_logits_fwd(**_single_pass(
        logits, targets, mask, old_lp, adv, weights, row_scale, ref_lp, kl_scale, entropy_scale,
        temperature, function, geometry, topology, delta_low, delta_high, params, clamp,
        kl_estimator, kl_straight, kl_weighted, kl_clamp, write_dlogits, None, offset))
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
    _, sums = surrogate_logits_fwd(**_single_pass(
        logits, targets, mask, old_lp, adv, weights, row_scale, ref_lp, kl_scale, entropy_scale,
        temperature, function, geometry, topology, delta_low, delta_high, params, clamp,
        kl_estimator, kl_straight, kl_weighted, kl_clamp, True, logits, offset))
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
