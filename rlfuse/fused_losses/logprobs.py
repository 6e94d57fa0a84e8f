"""Fused per-token log-probs: the custom ops, their autograd formula and the functional API."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from .._contract import check_logits_targets, check_logprob_args, check_policy
from .._dispatch import falls_back_to
from ..parallel import is_scaled_out
from .._types import LinearHead, Logits, compute_dtype
from ._op import custom_op
from .linear_head import chunk_tokens_for, linear_logprobs_op


def as_rows(logits: Tensor, targets: Tensor, mask: Optional[Tensor]):
    """Views ``[N, V]`` inputs as ``[1, N, V]`` and makes ``stride(-1) == 1`` (the only layout
    requirement of the kernels; batch and time strides are passed as they are)."""
    if logits.dim() == 2:
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits, targets, mask


def new_dlogits(logits: Tensor) -> Tensor:
    """A fresh gradient buffer of the logits' shape and dtype (poisoned under test)."""
    from ..kernels.utils import empty

    return empty(tuple(logits.shape), dtype=logits.dtype, device=logits.device)


@custom_op("token_logprobs")
def token_logprobs_op(logits: Tensor, targets: Tensor, mask: Optional[Tensor], temperature: float,
                      with_entropy: bool, inplace_backward: bool,
                      offset: int) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy, stats)``: log-probs and entropy of the targets' shape (``entropy`` is
    empty without ``with_entropy``) and the per-row statistics the backward needs. The rows
    ``[offset, offset + T)`` of ``logits [B, S, V]`` predict ``targets [B, T]``; the gradient
    is that of the whole ``logits``."""
    from ..kernels.logprobs import token_logprobs_fwd

    logits3, targets3, mask3 = as_rows(logits, targets, mask)
    logp, stats, entropy = token_logprobs_fwd(logits3, targets3, mask3, temperature, with_entropy,
                                              offset)
    entropy = entropy.view(targets.shape) if with_entropy else logp.new_empty(0)
    return logp.view(targets.shape), entropy, stats


@token_logprobs_op.register_fake
def _(logits, targets, mask, temperature, with_entropy, inplace_backward, offset):
    from ..kernels.logprobs import STAT_COLUMNS

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
    from ..kernels.logprobs import token_logprobs_bwd

    token_logprobs_bwd(dlogits if logits is None else logits, targets, mask, temperature, stats,
                       entropy, dlogp, dentropy, dlogits, offset)


@logits_grad_op.register_fake
def _(dlogits, logits, targets, mask, stats, entropy, dlogp, dentropy, temperature, offset):
    return None


def logits_backward(logits: Tensor, targets: Tensor, mask: Optional[Tensor], stats: Tensor,
                    entropy: Optional[Tensor], dlogp: Tensor, dentropy: Optional[Tensor],
                    temperature: float, inplace: bool, offset: int) -> Tensor:
    """The gradient w.r.t. the whole ``logits`` (``[B, S, V]`` or ``[N, V]``), written into a
    new buffer or, ``inplace``, into the logits' own."""
    logits3, targets3, mask3 = as_rows(logits, targets, mask)
    dlogits = logits3 if inplace else new_dlogits(logits3)
    logits_grad_op(dlogits, None if inplace else logits3, targets3, mask3, stats, entropy,
                   dlogp.reshape(targets3.shape),
                   None if dentropy is None else dentropy.reshape(targets3.shape), temperature,
                   offset)
    return dlogits.view(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, targets, mask, temperature, with_entropy, inplace_backward, offset = inputs
    _, entropy, stats = output
    ctx.save_for_backward(logits, targets, mask, stats, entropy if with_entropy else None)
    ctx.temperature, ctx.inplace, ctx.offset = temperature, inplace_backward, offset
    ctx.mark_non_differentiable(stats)
    if not with_entropy:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)


def _backward(ctx, dlogp, dentropy, _dstats):
    logits, targets, mask, stats, entropy = ctx.saved_tensors
    if entropy is None:  # the empty placeholder output may still be handed a gradient
        dentropy = None
    if dlogp is None and dentropy is None:
        return (None,) * 7
    if dlogp is None:
        dlogp = torch.zeros(targets.shape, dtype=stats.dtype, device=stats.device)
    dlogits = logits_backward(logits, targets, mask, stats,
                              None if dentropy is None else entropy, dlogp, dentropy,
                              ctx.temperature, ctx.inplace, ctx.offset)
    return dlogits, None, None, None, None, None, None


token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


@falls_back_to(reference.token_logprobs)
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   return_entropy: bool = False, inplace_backward: bool = False,
                   mask: Optional[torch.Tensor] = None, validate: bool = True):
    mask = check_logprob_args(logits, targets, temperature, mask, inplace_backward, validate)
    logp, entropy, _ = token_logprobs_op(logits, targets, mask, float(temperature),
                                         bool(return_entropy), bool(inplace_backward), 0)
    return (logp, entropy) if return_entropy else logp


def window_logprobs(policy, mask: Optional[torch.Tensor], *, gather: bool,
                    return_entropy: bool = False):
    """``(logp, entropy)`` ``[B, T]`` (entropy empty unless ``return_entropy``) of a ``Logits``
    or ``LinearHead`` policy, whose arguments the caller has checked; ``gather``: a
    ``LinearHead`` forms the logits of the actor rows only (reads the mask on the host).
    Packed rows: at their loss positions (``[N]`` without a mask)."""
    if is_scaled_out(policy):
        from .parallel import scaled_out_logprobs

        return scaled_out_logprobs(
            policy, mask, gather=gather, return_entropy=return_entropy,
            local_logprobs=lambda rows, rows_mask: window_logprobs(
                rows, rows_mask, gather=gather, return_entropy=return_entropy))
    temperature = float(policy.temperature)
    if isinstance(policy, LinearHead):
        chunk = chunk_tokens_for(policy.weight.shape[0], policy.weight.element_size(),
                                 policy.chunk_tokens)
        logp, entropy, _ = linear_logprobs_op(policy.hidden, policy.weight, policy.bias,
                                              policy.targets, mask, temperature,
                                              int(policy.offset), chunk, gather,
                                              bool(return_entropy))
    else:
        logp, entropy, _ = token_logprobs_op(policy.logits, policy.targets, mask, temperature,
                                             bool(return_entropy), bool(policy.inplace_backward),
                                             int(policy.offset))
    return logp, entropy


def learner_logprobs(policy, mask: torch.Tensor, *, gather: bool = False) -> torch.Tensor:
    """The learner log-probs ``[B, T]`` of any policy form (checked by the loss); the loss's
    gradient reaches logits or head through one backward pass over them."""
    if isinstance(policy, (Logits, LinearHead)):
        return window_logprobs(policy, mask, gather=gather)[0]
    return policy


@falls_back_to(reference.policy_logprobs)
def policy_logprobs(policy, *, return_entropy: bool = False, validate: bool = True):
    info = check_policy(policy)
    if isinstance(policy, (Logits, LinearHead)):
        check_logits_targets(policy, None, info.shape, validate)
        logp, entropy = window_logprobs(policy, None, gather=False,
                                        return_entropy=return_entropy)
        return (logp, entropy) if return_entropy else logp
    if return_entropy:
        raise ValueError("return_entropy: a policy given as log-probs has no entropy; pass "
                         "rlfuse.Logits or rlfuse.LinearHead")
    return policy
