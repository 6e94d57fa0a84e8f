"""The clipped surrogate shared by GPPO and GR-OPD: custom ops, autograd formulas, metrics.

Three ops: the forward and backward from learner log-probs ``[B, T]``, and the single pass from
logits that writes ``dlogits`` in the forward (for an upstream gradient of 1). The single pass's
backward rescales that buffer in place by the upstream gradient, read on the device: no host
sync, and no pass over it when the gradient is 1. fp16 logits take the two-pass path instead
(log-probs, then the surrogate; the backward forms ``dlogits`` from the logits at the true
upstream scale), since a gradient rounded to fp16 at scale 1 would lose what a loss scaler's
2^16 is meant to keep.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from .._contract import raise_on_overflow
from .._types import LinearHead, Logits
from ._op import custom_op
from .linear_head import chunk_tokens_for, linear_surrogate_op
from .logprobs import as_rows, learner_logprobs


def _column(sums: Tensor, name: str) -> Tensor:
    from ..kernels.surrogate import SUM_COLUMNS

    return sums[..., SUM_COLUMNS.index(name)]


def _sums_shape(rows) -> Tuple:
    from ..kernels.surrogate import SUM_COLUMNS

    return (rows, len(SUM_COLUMNS))


# --------------------------------------------------------------------------------------------
# From log-probs
# --------------------------------------------------------------------------------------------

@custom_op("surrogate")
def surrogate_op(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor, row_scale: Tensor,
                 geometry: str, topology: str, delta: float) -> Tuple[Tensor, Tensor]:
    """``(loss, sums [B, SUM_COLUMNS])`` from learner log-probs ``lp [B, T]``; ``row_scale``: the
    aggregation weight of each row's tokens."""
    from ..kernels.surrogate import surrogate_fwd

    sums = surrogate_fwd(lp, old_lp, adv, mask, row_scale, geometry=geometry, topology=topology,
                         delta=delta)
    return -_column(sums, "loss").sum(), sums


@surrogate_op.register_fake
def _(lp, old_lp, adv, mask, row_scale, geometry, topology, delta):
    return row_scale.new_empty(()), row_scale.new_empty(_sums_shape(lp.shape[0]))


@custom_op("surrogate_backward")
def surrogate_backward_op(lp: Tensor, old_lp: Tensor, adv: Tensor, mask: Tensor,
                          row_scale: Tensor, grad: Tensor, geometry: str, topology: str,
                          delta: float) -> Tensor:
    """``dlp [B, T]`` for the upstream gradient ``grad`` (0-dim, read on the device)."""
    from ..kernels.surrogate import surrogate_bwd

    return surrogate_bwd(lp, old_lp, adv, mask, row_scale, grad, geometry=geometry,
                         topology=topology, delta=delta)


@surrogate_backward_op.register_fake
def _(lp, old_lp, adv, mask, row_scale, grad, geometry, topology, delta):
    return torch.empty_like(lp, memory_format=torch.contiguous_format)


def _surrogate_setup(ctx, inputs, output):
    lp, old_lp, adv, mask, row_scale, geometry, topology, delta = inputs
    ctx.save_for_backward(lp, old_lp, adv, mask, row_scale)
    ctx.region = (geometry, topology, delta)
    ctx.mark_non_differentiable(output[1])


def _surrogate_backward(ctx, grad_loss, _grad_sums):
    lp, old_lp, adv, mask, row_scale = ctx.saved_tensors
    dlp = surrogate_backward_op(lp, old_lp, adv, mask, row_scale, grad_loss.to(row_scale.dtype),
                                *ctx.region)
    return dlp, None, None, None, None, None, None, None


surrogate_op.register_autograd(_surrogate_backward, setup_context=_surrogate_setup)


# --------------------------------------------------------------------------------------------
# The single pass from logits
# --------------------------------------------------------------------------------------------

@custom_op("surrogate_logits")
def surrogate_logits_op(logits: Tensor, targets: Tensor, mask: Tensor, old_lp: Tensor, adv: Tensor,
                        row_scale: Tensor, temperature: float, geometry: str, topology: str,
                        delta: float, write_dlogits: bool, inplace: bool,
                        offset: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, sums [B*T, SUM_COLUMNS], dlogits)`` in one pass over ``logits [B, S, V]``, whose
    rows ``[offset, offset + T)`` predict ``targets [B, T]``.

    ``dlogits`` (for an upstream gradient of 1) is a new ``[B, S, V]`` buffer (zero rows outside
    the window), or empty: without
    ``write_dlogits`` (the loss alone, one read of the logits) or ``inplace``, where it is
    written into the logits' own buffer (``stride(-1) == 1`` required), which the op does not
    return: an op's outputs never alias its inputs.
    """
    from ..kernels.surrogate import surrogate_logits

    dlogits, sums = surrogate_logits(
        logits, targets, mask, old_lp, adv, row_scale, temperature=temperature,
        geometry=geometry, topology=topology, delta=delta, write_dlogits=write_dlogits,
        dlogits=logits if inplace and write_dlogits else None, offset=offset)
    if dlogits is None or inplace:
        dlogits = logits.new_empty(0)
    return -_column(sums, "loss").sum(), sums, dlogits


@surrogate_logits_op.register_fake
def _(logits, targets, mask, old_lp, adv, row_scale, temperature, geometry, topology, delta,
      write_dlogits, inplace, offset):
    dlogits_shape = logits.shape if write_dlogits and not inplace else (0,)
    return (row_scale.new_empty(()), row_scale.new_empty(_sums_shape(targets.numel())),
            logits.new_empty(dlogits_shape))


def _surrogate_logits_setup(ctx, inputs, output):
    logits, mask, inplace, offset = inputs[0], inputs[2], inputs[-2], inputs[-1]
    _, sums, dlogits = output
    ctx.save_for_backward(logits if inplace else dlogits, mask)
    ctx.mark_non_differentiable(sums, dlogits)
    ctx.set_materialize_grads(False)   # no zero-filled [B, S, V] "gradient" of dlogits
    ctx.offset = offset
    ctx.backward_done = False


def _surrogate_logits_backward(ctx, grad_loss, _grad_sums, _grad_dlogits):
    if grad_loss is None:
        return (None,) * 13
    if ctx.backward_done:
        raise RuntimeError(
            "rlfuse: a GPPO / GR-OPD loss from Logits writes its gradient in the forward and "
            "hands that buffer out in the first backward; it cannot be backpropagated twice "
            "(retain_graph=True). Compute the loss again for a second backward.")
    ctx.backward_done = True
    dlogits, mask = ctx.saved_tensors
    scale_rows_op(dlogits, mask, grad_loss, ctx.offset)
    return (dlogits.view(dlogits.shape),) + (None,) * 12


surrogate_logits_op.register_autograd(_surrogate_logits_backward,
                                      setup_context=_surrogate_logits_setup)


@custom_op("scale_rows_", mutates_args=("x",))
def scale_rows_op(x: Tensor, mask: Tensor, scale: Tensor, offset: int) -> None:
    """``x[b, s] *= scale`` at the actor rows of ``x [B, S, V]`` (rows ``[offset, offset + T)``
    go with ``mask [B, T]``), in place; ``scale`` (0-dim) is read on the device, and a scale of
    1 reads and writes nothing."""
    from ..kernels.logprobs import scale_rows_

    scale_rows_(x, mask, scale, offset)


@scale_rows_op.register_fake
def _(x, mask, scale, offset):
    return None


# --------------------------------------------------------------------------------------------
# Both policy forms
# --------------------------------------------------------------------------------------------

def surrogate_loss(policy, old_lp: Tensor, adv: Tensor, mask: Tensor, row_scale: Tensor, *,
                   geometry: str, topology: str, delta: float,
                   validate: bool) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, {column: total})`` of the clipped surrogate for either policy form; with
    ``validate`` an overflowing ``r A`` raises (one host sync)."""
    region = (geometry, topology, float(delta))
    if isinstance(policy, LinearHead) and policy.hidden.dtype != torch.float16:
        grad = torch.is_grad_enabled()
        needs = [grad and t is not None and t.requires_grad
                 for t in (policy.hidden, policy.weight, policy.bias)]
        chunk = chunk_tokens_for(policy.weight.shape[0], policy.weight.element_size(),
                                 policy.chunk_tokens)
        loss, sums, *_ = linear_surrogate_op(policy.hidden, policy.weight, policy.bias,
                                             policy.targets, mask, old_lp, adv, row_scale,
                                             float(policy.temperature), *region,
                                             int(policy.offset), chunk, validate, needs)
    elif isinstance(policy, Logits) and policy.logits.dtype != torch.float16:
        logits, targets, _ = as_rows(policy.logits, policy.targets, mask)
        write = policy.logits.requires_grad and torch.is_grad_enabled()
        inplace = bool(policy.inplace_backward) and logits is policy.logits
        loss, sums, _ = surrogate_logits_op(logits, targets, mask, old_lp, adv, row_scale,
                                            float(policy.temperature), *region, write, inplace,
                                            int(policy.offset))
    else:
        loss, sums = surrogate_op(learner_logprobs(policy, mask, gather=validate), old_lp, adv,
                                  mask, row_scale, *region)
    from ..kernels.surrogate import SUM_COLUMNS

    totals = dict(zip(SUM_COLUMNS, (sums if sums.dim() == 1 else sums.sum(0)).unbind()))
    if validate:
        raise_on_overflow(totals["overflow"], row_scale.dtype)
    return loss, totals
