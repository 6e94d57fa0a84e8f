"""Fused per-token log-probs from logits: the custom ops, their autograd formula and
``token_logprobs``'s implementation."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..._types import compute_dtype
from ...kernels.rows.logprobs import STAT_COLUMNS, token_logprobs_bwd, token_logprobs_fwd
from ...kernels.lib.head_functions import HeadParams
from ...kernels.lib.utils import empty
from .._op import custom_op, register_autograd
from ..head.invariant_stats import window_block_logprobs


def batched_rows(logits: Tensor, targets: Tensor, mask: Optional[Tensor]):
    """Views ``[N, V]`` inputs as ``[1, N, V]`` and makes ``stride(-1) == 1`` (the only layout
    requirement of the kernels; batch and time strides are passed as they are)."""
    if logits.dim() == 2:
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits, targets, mask


@custom_op("token_logprobs")
def token_logprobs_op(logits: Tensor, targets: Tensor, mask: Optional[Tensor], temperature: float,
                      with_entropy: bool, inplace_backward: bool, offset: int,
                      batch_invariant: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy, stats)``: log-probs and entropy of the targets' shape (``entropy`` is
    empty without ``with_entropy``) and the per-row statistics the backward needs. The rows
    ``[offset, offset + T)`` of ``logits [B, S, V]`` predict ``targets [B, T]``; the gradient
    is that of the whole ``logits``. ``batch_invariant``: the statistics from fixed vocabulary
    blocks (``invariant_stats``), a batch-invariant ``LinearHead``'s bits."""
    logits3, targets3, mask3 = batched_rows(logits, targets, mask)
    head = HeadParams(temperature)
    if batch_invariant:
        logp, stats, entropy = window_block_logprobs(logits3, targets3, mask3, head,
                                                     with_entropy, offset)
    else:
        logp, stats, entropy = token_logprobs_fwd(logits3, targets3, mask3, head, with_entropy,
                                                  offset)
    entropy = entropy.view(targets.shape) if with_entropy else logp.new_empty(0)
    return logp.view(targets.shape), entropy, stats


@token_logprobs_op.register_fake
def _(logits, targets, mask, temperature, with_entropy, inplace_backward, offset,
      batch_invariant=False):
    acc = compute_dtype(logits.dtype)
    entropy_shape = targets.shape if with_entropy else (0,)
    return (logits.new_empty(targets.shape, dtype=acc), logits.new_empty(entropy_shape, dtype=acc),
            logits.new_empty((targets.numel(), len(STAT_COLUMNS)), dtype=acc))


@custom_op("logits_grad_", mutates_args=("dlogits",))
def logits_grad_op(dlogits: Tensor, logits: Optional[Tensor], targets: Tensor,
                   mask: Optional[Tensor], stats: Tensor, entropy: Optional[Tensor],
                   dlogp: Tensor, dentropy: Optional[Tensor], temperature: float,
                   offset: int) -> None:
    """Writes the gradient w.r.t. the logits ``[B, S, V]`` into ``dlogits`` from the upstream
    ``dlogp`` / ``dentropy`` ``[B, T]`` (rows outside ``[offset, offset + T)``: zeros);
    ``logits=None``: they are read from ``dlogits`` itself (the in-place backward)."""
    token_logprobs_bwd(dlogits if logits is None else logits, targets, mask,
                       HeadParams(temperature), stats, entropy, dlogp, dentropy, dlogits, offset)


@logits_grad_op.register_fake
def _(dlogits, logits, targets, mask, stats, entropy, dlogp, dentropy, temperature, offset):
    return None


def logits_backward(logits: Tensor, targets: Tensor, mask: Optional[Tensor], stats: Tensor,
                    entropy: Optional[Tensor], dlogp: Tensor, dentropy: Optional[Tensor],
                    temperature: float, inplace: bool, offset: int) -> Tensor:
    """The gradient w.r.t. the whole ``logits`` (``[B, S, V]`` or ``[N, V]``), written into a
    new buffer (poisoned under test) or, ``inplace``, into the logits' own."""
    logits3, targets3, mask3 = batched_rows(logits, targets, mask)
    dlogits = logits3 if inplace else empty(tuple(logits3.shape), dtype=logits3.dtype,
                                            device=logits3.device)
    logits_grad_op(dlogits, None if inplace else logits3, targets3, mask3, stats, entropy,
                   dlogp.reshape(targets3.shape),
                   None if dentropy is None else dentropy.reshape(targets3.shape), temperature,
                   offset)
    return dlogits.view(logits.shape)


def _setup_context(ctx, inputs, output):
    _, entropy, stats = output
    ctx.save_for_backward(inputs.logits, inputs.targets, inputs.mask, stats,
                          entropy if inputs.with_entropy else None)
    ctx.temperature, ctx.inplace, ctx.offset = (inputs.temperature, inputs.inplace_backward,
                                                inputs.offset)
    ctx.mark_non_differentiable(stats)
    if not inputs.with_entropy:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)


def _backward(ctx, dlogp, dentropy, _dstats):
    logits, targets, mask, stats, entropy = ctx.saved_tensors
    if entropy is None:  # the empty placeholder output may still be handed a gradient
        dentropy = None
    if dlogp is None and dentropy is None:
        return None
    if dlogp is None:
        dlogp = torch.zeros(targets.shape, dtype=stats.dtype, device=stats.device)
    return {"logits": logits_backward(logits, targets, mask, stats,
                                      None if dentropy is None else entropy, dlogp, dentropy,
                                      ctx.temperature, ctx.inplace, ctx.offset)}


register_autograd(token_logprobs_op, _backward, _setup_context)


def token_logprobs(logits: Tensor, targets: Tensor, mask: Optional[Tensor], temperature: float,
                   return_entropy: bool, inplace_backward: bool, validate: bool,
                   batch_invariant: bool = False):
    """``logp`` (or ``(logp, entropy)``) of ``rlfuse.token_logprobs`` (an out-of-range target
    without ``validate`` gives NaN in the kernels)."""
    logp, entropy, _ = token_logprobs_op(logits, targets, mask, temperature, return_entropy,
                                         inplace_backward, 0, batch_invariant)
    return (logp, entropy) if return_entropy else logp
