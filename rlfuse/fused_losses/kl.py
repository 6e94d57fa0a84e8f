"""The KL penalty to reference log-probs, fused: an elementwise custom op over ``[B, T]``
log-probs (``kernels.tokens.kl``) and ``kl_penalty``'s implementation."""
from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.tokens.kl import kl_penalty_bwd, kl_penalty_fwd
from ._op import custom_op, register_autograd


@custom_op("kl_penalty")
def kl_penalty_op(lp: Tensor, ref: Tensor, estimator: str, straight: bool,
                  clamp: bool) -> Tensor:
    """The per-token estimate (compute dtype) of ``lp`` against ``ref`` (same shape)."""
    return kl_penalty_fwd(lp.contiguous(), ref.contiguous(), estimator, straight=straight,
                          clamp=clamp)


@kl_penalty_op.register_fake
def _(lp, ref, estimator, straight, clamp):
    dtype = torch.float64 if torch.float64 in (lp.dtype, ref.dtype) else torch.float32
    return lp.new_empty(lp.shape, dtype=dtype)


@custom_op("kl_penalty_backward")
def kl_penalty_backward_op(lp: Tensor, ref: Tensor, grad: Tensor, estimator: str,
                           straight: bool, clamp: bool) -> Tensor:
    """dL/dlp for the upstream ``grad`` (the shape of ``lp``)."""
    return kl_penalty_bwd(lp.contiguous(), ref.contiguous(), grad.contiguous(), estimator,
                          straight=straight, clamp=clamp)


@kl_penalty_backward_op.register_fake
def _(lp, ref, grad, estimator, straight, clamp):
    return torch.empty_like(lp, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs.lp, inputs.ref)
    ctx.form = (inputs.estimator, inputs.straight, inputs.clamp)


def _backward(ctx, grad):
    lp, ref = ctx.saved_tensors
    return {"lp": kl_penalty_backward_op(lp, ref, grad, *ctx.form)}


register_autograd(kl_penalty_op, _backward, _setup)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, straight: bool,
               clamp: bool) -> Tensor:
    """The per-token estimates of ``rlfuse.kl_penalty``: one elementwise kernel."""
    return kl_penalty_op(logprobs, ref_logprobs, estimator, straight, clamp)
