"""Fused per-token log-probs: autograd Function and functional API."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._dispatch import use_kernels
from .._types import Logits
from .._validation import check_logprob_args


def as_rows(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor]):
    """Views ``[N, V]`` inputs as ``[1, N, V]`` and makes ``stride(-1) == 1`` (the only layout
    requirement of the kernels; batch and time strides are passed as they are)."""
    if logits.dim() == 2:
        logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
        mask = None if mask is None else mask.unsqueeze(0)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return logits, targets, mask


class TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, mask, temperature, return_entropy, inplace_backward):
        from ..kernels.logprobs import token_logprobs_fwd

        logits3, targets3, mask3 = as_rows(logits, targets, mask)
        logp, stats, entropy = token_logprobs_fwd(logits3, targets3, mask3, temperature,
                                                return_entropy)
        ctx.save_for_backward(logits, targets, mask, stats, entropy)
        ctx.temperature = temperature
        ctx.inplace_backward = inplace_backward
        ctx.set_materialize_grads(False)
        out_shape = targets.shape
        if return_entropy:
            return logp.view(out_shape), entropy.view(out_shape)
        return logp.view(out_shape)

    @staticmethod
    def backward(ctx, dlogp, dentropy=None):
        from ..kernels.logprobs import token_logprobs_bwd

        logits, targets, mask, stats, entropy = ctx.saved_tensors
        if dlogp is None and dentropy is None:
            return (None,) * 6
        logits3, targets3, mask3 = as_rows(logits, targets, mask)
        if dlogp is None:
            dlogp = torch.zeros(targets3.shape, dtype=stats.dtype, device=stats.device)
        dlogits_out = logits3 if ctx.inplace_backward else None
        dlogits = token_logprobs_bwd(logits3, targets3, mask3, ctx.temperature, stats,
                                     None if dentropy is None else entropy,
                                     dlogp.reshape(targets3.shape),
                                     None if dentropy is None else dentropy.reshape(targets3.shape),
                                     dlogits_out)
        return dlogits.view(logits.shape), None, None, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   return_entropy: bool = False, inplace_backward: bool = False,
                   mask: Optional[torch.Tensor] = None, validate: bool = True):
    """Per-token log-probs of ``targets`` under ``softmax(logits / temperature)``, fused.

    Args:
        logits: ``[B, T, V]`` or ``[N, V]``, bf16/fp16/fp32/fp64; any batch and time strides
            (``logits[:, :-1]`` is used without a copy).
        targets: integer ids ``[B, T]`` / ``[N]``; unmasked ones must lie in ``[0, V)``.
        temperature: log-probs are ``log_softmax(logits / temperature)``; must be > 0.
        return_entropy: also return the entropy ``lse - sum_v p_v z_v`` of each position.
        inplace_backward: write the gradient w.r.t. the logits into the logits' own buffer (saves
            a logits-sized allocation; only safe when nothing else needs the logits afterwards).
        mask: optional ``[B, T]`` / ``[N]`` bool (or 0/1); masked positions get log-prob 0,
            entropy 0 and zero gradient, and their targets are never read.
        validate: check the mask holds 0/1 and the unmasked targets lie in ``[0, V)`` (reads
            ``[B, T]`` data, one host sync); without it an out-of-range target gives NaN, never
            an out-of-bounds read.

    Returns:
        ``logp`` (fp32; fp64 for fp64 logits), or ``(logp, entropy)``.

    The forward reads the logits once and saves two fp32 numbers per position (the row max and
    the log-sum of the shifted exponentials, whose sum is the logsumexp); the backward reads the
    logits once more and writes the gradient once.
    """
    if not use_kernels(logits.device):
        return reference.token_logprobs(logits, targets, temperature=temperature,
                                        return_entropy=return_entropy, mask=mask,
                                        validate=validate)
    mask = check_logprob_args(logits, targets, temperature, mask, validate)
    return TokenLogprobsFunction.apply(logits, targets, mask, float(temperature),
                                       bool(return_entropy), bool(inplace_backward))


def policy_logprobs(policy, mask: torch.Tensor) -> torch.Tensor:
    """The learner log-probs ``[B, T]`` of a policy given as log-probs or as ``Logits`` (whose
    arguments the loss has already checked); the loss's gradient reaches the logits through one
    backward pass over them."""
    if isinstance(policy, Logits):
        return TokenLogprobsFunction.apply(policy.logits, policy.targets, mask,
                                           float(policy.temperature), False,
                                           bool(policy.inplace_backward))
    return policy
