"""The clipped surrogate shared by GPPO, GR-OPD and the PPO family: custom ops, autograd
formulas, the dispatch over the policy forms.

Three ops: the forward and backward from learner log-probs ``[B, T]``, and the single pass from
logits that writes ``dlogits`` in the forward (for an upstream gradient of 1). The single pass's
backward rescales that buffer in place by the upstream gradient, read on the device: no host
sync, and no pass over it when the gradient is 1. fp16 logits take the two-pass path instead
(log-probs, then the surrogate; the backward forms ``dlogits`` from the logits at the true
upstream scale), since a gradient rounded to fp16 at scale 1 would lose what a loss scaler's
2^16 is meant to keep; so does GSPO's sequence-level ratio (every log-prob of a row first).

Every op takes the region as (geometry name, topology, delta_low, delta_high, dual_clip):
GPPO's cells, or ``ppo_clip`` with ``(eps_low, eps_high)``; ``dual_clip`` inf is none.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .._contract import raise_on_overflow
from .._types import LinearHead, Logits
from ..parallel import is_scaled_out
from ._op import custom_op
from .linear_head import chunk_tokens_for, linear_surrogate_op
from .logprobs import as_rows, learner_logprobs


class Region(NamedTuple):
    """A surrogate's region: a name of ``kernels.gppo.REGION_GEOMETRIES``, a topology, the
    sizes of its lower and upper sides, and the dual clip (inf: none)."""

    geometry: str
    topology: str
    delta_low: float
    delta_high: float
    dual_clip: float


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
def surrogate_op(lp: Tensor, old_lp: Optional[Tensor], adv: Tensor, mask: Tensor,
                 weights: Optional[Tensor], row_scale: Tensor, geometry: str, topology: str,
                 delta_low: float, delta_high: float, dual_clip: float,
                 sequence: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, sums [B, SUM_COLUMNS], seq_grad)`` from learner log-probs ``lp [B, T]``
    (``old_lp`` None: on policy); ``row_scale``: the aggregation weight of each row's tokens;
    ``sequence``: GSPO's ratio, whose per-row gradient coefficient ``seq_grad [B]`` the backward
    needs (empty otherwise)."""
    from ..kernels.surrogate import surrogate_fwd

    region = (geometry, topology, delta_low, delta_high, dual_clip)
    sums, seq_grad = surrogate_fwd(lp, old_lp, adv, mask, weights, row_scale, region,
                                   sequence=sequence)
    return -_column(sums, "loss").sum(), sums, row_scale.new_empty(0) if seq_grad is None \
        else seq_grad


@surrogate_op.register_fake
def _(lp, old_lp, adv, mask, weights, row_scale, geometry, topology, delta_low, delta_high,
      dual_clip, sequence):
    return (row_scale.new_empty(()), row_scale.new_empty(_sums_shape(lp.shape[0])),
            row_scale.new_empty(lp.shape[0] if sequence else 0))


@custom_op("surrogate_backward")
def surrogate_backward_op(lp: Tensor, old_lp: Optional[Tensor], adv: Tensor, mask: Tensor,
                          weights: Optional[Tensor], row_scale: Tensor,
                          seq_grad: Optional[Tensor], grad: Tensor, geometry: str,
                          topology: str, delta_low: float, delta_high: float,
                          dual_clip: float) -> Tensor:
    """``dlp [B, T]`` for the upstream gradient ``grad`` (0-dim, read on the device)."""
    from ..kernels.surrogate import surrogate_bwd

    region = (geometry, topology, delta_low, delta_high, dual_clip)
    return surrogate_bwd(lp, old_lp, adv, mask, weights, row_scale, seq_grad, grad, region)


@surrogate_backward_op.register_fake
def _(lp, old_lp, adv, mask, weights, row_scale, seq_grad, grad, geometry, topology, delta_low,
      delta_high, dual_clip):
    return torch.empty_like(lp, memory_format=torch.contiguous_format)


def _surrogate_setup(ctx, inputs, output):
    lp, old_lp, adv, mask, weights, row_scale = inputs[:6]
    sequence = inputs[-1]
    _, sums, seq_grad = output
    ctx.save_for_backward(lp, old_lp, adv, mask, weights, row_scale,
                          seq_grad if sequence else None)
    ctx.region = inputs[6:11]
    ctx.mark_non_differentiable(sums, seq_grad)


def _surrogate_backward(ctx, grad_loss, _grad_sums, _grad_seq):
    lp, old_lp, adv, mask, weights, row_scale, seq_grad = ctx.saved_tensors
    dlp = surrogate_backward_op(lp, old_lp, adv, mask, weights, row_scale, seq_grad,
                                grad_loss.to(row_scale.dtype), *ctx.region)
    return (dlp,) + (None,) * 11


surrogate_op.register_autograd(_surrogate_backward, setup_context=_surrogate_setup)


# --------------------------------------------------------------------------------------------
# The single pass from logits
# --------------------------------------------------------------------------------------------

@custom_op("surrogate_logits")
def surrogate_logits_op(logits: Tensor, targets: Tensor, mask: Tensor, old_lp: Optional[Tensor],
                        adv: Tensor, weights: Optional[Tensor], row_scale: Tensor,
                        temperature: float, geometry: str, topology: str, delta_low: float,
                        delta_high: float, dual_clip: float, write_dlogits: bool, inplace: bool,
                        offset: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, sums [B*T, SUM_COLUMNS], dlogits)`` in one pass over ``logits [B, S, V]``, whose
    rows ``[offset, offset + T)`` predict ``targets [B, T]`` (``old_lp`` None: on policy, the
    kernel forms old = lp itself).

    ``dlogits`` (for an upstream gradient of 1) is a new ``[B, S, V]`` buffer (zero rows outside
    the window), or empty: without ``write_dlogits`` (the loss alone, one read of the logits) or
    ``inplace``, where it is written into the logits' own buffer (``stride(-1) == 1`` required),
    which the op does not return: an op's outputs never alias its inputs.
    """
    from ..kernels.surrogate import surrogate_logits

    region = (geometry, topology, delta_low, delta_high, dual_clip)
    dlogits, sums = surrogate_logits(
        logits, targets, mask, old_lp, adv, weights, row_scale, region, temperature=temperature,
        write_dlogits=write_dlogits, dlogits=logits if inplace and write_dlogits else None,
        offset=offset)
    if dlogits is None or inplace:
        dlogits = logits.new_empty(0)
    return -_column(sums, "loss").sum(), sums, dlogits


@surrogate_logits_op.register_fake
def _(logits, targets, mask, old_lp, adv, weights, row_scale, temperature, geometry, topology,
      delta_low, delta_high, dual_clip, write_dlogits, inplace, offset):
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
        return (None,) * 16
    if ctx.backward_done:
        raise RuntimeError(
            "rlfuse: a surrogate loss (GPPO, GR-OPD, PPO) from Logits writes its gradient in the "
            "forward and hands that buffer out in the first backward; it cannot be "
            "backpropagated twice (retain_graph=True). Compute the loss again for a second "
            "backward.")
    ctx.backward_done = True
    dlogits, mask = ctx.saved_tensors
    scale_rows_op(dlogits, mask, grad_loss, ctx.offset)
    return (dlogits.view(dlogits.shape),) + (None,) * 15


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
# Every policy form
# --------------------------------------------------------------------------------------------

def surrogate_loss(policy, old_lp: Optional[Tensor], adv: Tensor, mask: Tensor,
                   row_scale: Tensor, region: Region, *, weights: Optional[Tensor] = None,
                   sequence: bool = False, validate: bool) -> Tuple[Tensor, Dict[str, Tensor]]:
    """``(loss, {column: total})`` of the clipped surrogate for any policy form (``old_lp``
    None: on policy); with ``validate`` an overflowing ``r A`` raises (one host sync)."""
    region = tuple(region)
    # fp16 takes two passes (its gradient is formed with the true upstream scale); packed rows
    # and a split vocabulary too (the gradient needs the whole row's logsumexp first)
    single_pass = not sequence and isinstance(policy, (Logits, LinearHead)) and (
        policy.logits if isinstance(policy, Logits) else policy.hidden).dtype != torch.float16 \
        and not is_scaled_out(policy)
    if single_pass and isinstance(policy, LinearHead):
        grad = torch.is_grad_enabled()
        needs = [grad and t is not None and t.requires_grad
                 for t in (policy.hidden, policy.weight, policy.bias)]
        chunk = chunk_tokens_for(policy.weight.shape[0], policy.weight.element_size(),
                                 policy.chunk_tokens)
        loss, sums, *_ = linear_surrogate_op(policy.hidden, policy.weight, policy.bias,
                                             policy.targets, mask, old_lp, adv, weights,
                                             row_scale, float(policy.temperature), *region,
                                             int(policy.offset), chunk, validate, needs)
    elif single_pass:
        logits, targets, _ = as_rows(policy.logits, policy.targets, mask)
        write = policy.logits.requires_grad and torch.is_grad_enabled()
        inplace = bool(policy.inplace_backward) and logits is policy.logits
        loss, sums, _ = surrogate_logits_op(logits, targets, mask, old_lp, adv, weights,
                                            row_scale, float(policy.temperature), *region,
                                            write, inplace, int(policy.offset))
    else:
        lp = learner_logprobs(policy, mask, gather=validate)
        loss, sums, _ = surrogate_op(lp, old_lp, adv, mask, weights, row_scale, *region,
                                     sequence)
    from ..kernels.surrogate import SUM_COLUMNS

    totals = dict(zip(SUM_COLUMNS, (sums if sums.dim() == 1 else sums.sum(0)).unbind()))
    if validate:
        raise_on_overflow(totals["overflow"], row_scale.dtype)
    return loss, totals


def surrogate_metrics(totals: Dict[str, Tensor], tokens: Tensor) -> Dict[str, Tensor]:
    """The metrics of GPPO and PPO from the surrogate's column totals."""
    tokens = tokens.clamp_min(1)
    return {
        "clip_frac_low": totals["clip_low"] / tokens,
        "clip_frac_high": totals["clip_high"] / tokens,
        "dual_clip_frac": totals["dual_clip"] / tokens,
        "ratio_mean": totals["ratio"] / tokens,
        "approx_kl": totals["neg_log_ratio"] / tokens,
        "overflow": (totals["overflow"] > 0).to(tokens.dtype),
    }
