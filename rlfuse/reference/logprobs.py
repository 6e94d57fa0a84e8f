"""Reference per-token log-probs and entropy (plain torch, autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import parallel
from .._contract import check_logits_targets, check_logprob_args, check_policy
from .._types import LinearHead, Logits, compute_dtype


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   return_entropy: bool = False, inplace_backward: bool = False,
                   mask: Optional[torch.Tensor] = None, validate: bool = True):
    """Per-token log-probs of ``targets`` under ``softmax(logits / temperature)``.

    Args:
        logits: ``[B, T, V]`` or ``[N, V]``, bf16/fp16/fp32/fp64; any batch and time strides
            (``logits[:, :-1]`` is used without a copy).
        targets: integer ids ``[B, T]`` / ``[N]``; unmasked ones must lie in ``[0, V)``.
        temperature: log-probs are ``log_softmax(logits / temperature)``; must be > 0.
        return_entropy: also return the entropy ``lse - sum_v p_v z_v`` of each position.
        inplace_backward: write the gradient w.r.t. the logits into the logits' own buffer (saves
            a logits-sized allocation; only safe when nothing else needs the logits afterwards;
            the reference accepts it and has no such buffer to save).
        mask: optional ``[B, T]`` / ``[N]`` bool (or 0/1); masked positions get log-prob 0,
            entropy 0 and zero gradient, and their targets are never read.
        validate: check the mask holds 0/1 and the unmasked targets lie in ``[0, V)`` (reads
            ``[B, T]`` data, one host sync); without it an out-of-range target gives NaN, never
            an out-of-bounds read.

    Returns:
        ``logp`` (fp32; fp64 for fp64 logits), or ``(logp, entropy)``::

            z = logits / temperature,  lse = logsumexp(z),  logp = z[y] - lse
            entropy = lse - sum_v softmax(z)_v z_v

    Fused (``rlfuse.token_logprobs``): the forward reads the logits once and saves two fp32
    numbers per position (the row max and the log-sum of the shifted exponentials, whose sum is
    the logsumexp); the backward reads the logits once more and writes the gradient once.
    """
    mask = check_logprob_args(logits, targets, temperature, mask, inplace_backward, validate)
    z = logits.to(compute_dtype(logits.dtype))
    if mask is not None:  # masked rows may hold NaN / inf: never let them into the arithmetic
        z = torch.where(mask.unsqueeze(-1), z, torch.zeros_like(z))
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    safe_targets = targets.long().clamp(0, logits.shape[-1] - 1)
    if mask is not None:
        safe_targets = torch.where(mask, safe_targets, torch.zeros_like(safe_targets))
    logp = logp_all.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    if not validate:
        in_range = (targets >= 0) & (targets < logits.shape[-1])
        logp = torch.where(in_range, logp, torch.full_like(logp, float("nan")))
    if mask is not None:
        logp = torch.where(mask, logp, torch.zeros_like(logp))
    if not return_entropy:
        return logp
    p = logp_all.exp()
    entropy = -(p * torch.where(p > 0, logp_all, torch.zeros_like(logp_all))).sum(-1)
    if mask is not None:
        entropy = torch.where(mask, entropy, torch.zeros_like(entropy))
    return logp, entropy


def as_logits(policy) -> Logits:
    """A ``LinearHead`` as the ``Logits`` it defines: ``hidden @ weight.T + bias``, all of it
    (the definition; the fused path never holds more than a chunk). Under a
    ``vocab_parallel_group`` that is this rank's shard, and the hidden states' gradient is
    summed over the group."""
    if isinstance(policy, LinearHead):
        hidden, group = policy.hidden, policy.vocab_parallel_group
        if group is not None:
            hidden = parallel.SumGradOverGroup.apply(hidden, group)
        logits = torch.nn.functional.linear(hidden, policy.weight, policy.bias)
        return Logits(logits, policy.targets, policy.temperature, offset=policy.offset,
                      index=policy.index, vocab_parallel_group=group)
    return policy


def window_logprobs(policy, mask: Optional[torch.Tensor], *, return_entropy: bool = False):
    """Log-probs (and entropy) ``[B, T]`` of the window of a ``Logits`` / ``LinearHead``
    policy (whose arguments the caller has checked, as far as its ``validate`` asked); packed
    rows at their loss positions (``[N]`` without a mask); a split vocabulary gathered whole
    (the definition: the fused path moves per-row statistics only)."""
    rows = parallel.as_rows(as_logits(policy))
    T = rows.targets.shape[1]
    window = rows.logits[:, rows.offset:rows.offset + T]
    if rows.vocab_parallel_group is not None:
        window = parallel.GatherVocab.apply(window, rows.vocab_parallel_group)
    out = token_logprobs(window, rows.targets, temperature=rows.temperature,
                         mask=parallel.row_mask(policy, mask), return_entropy=return_entropy,
                         validate=False)
    if not return_entropy:
        return parallel.to_loss_layout(policy, out, mask)
    return tuple(parallel.to_loss_layout(policy, x, mask) for x in out)


def learner_logprobs(policy, mask: torch.Tensor) -> torch.Tensor:
    """The learner log-probs ``[B, T]`` of any policy form."""
    if isinstance(policy, (Logits, LinearHead)):
        return window_logprobs(policy, mask)
    return policy


def policy_logprobs(policy, *, return_entropy: bool = False, validate: bool = True):
    """Per-token log-probs ``[B, T]`` (fp32; fp64 for fp64 inputs) of any policy form, with
    autograd — the old or reference log-probs a trainer needs, and the entropy for a bonus,
    without a ``[B, T, V]`` tensor when the policy is a ``LinearHead``.

    Args:
        policy: ``rlfuse.Logits``, ``rlfuse.LinearHead`` or ``[B, T]`` log-probs (returned as
            they are; they carry no entropy).
        return_entropy: also return the entropy of each position.
        validate: check that every target lies in ``[0, V)`` (one host sync); without it an
            out-of-range target gives NaN, never an out-of-bounds read.

    Returns:
        ``logp`` or ``(logp, entropy)``. Fused (``rlfuse.policy_logprobs``): from ``Logits`` the
        log-prob kernels (one read forward, one read and one write backward); from
        ``LinearHead`` each chunk's logits are formed by one matmul in the forward and once more
        in the backward, where they turn into the gradients of the hidden states, weight and
        bias.
    """
    info = check_policy(policy)
    if isinstance(policy, (Logits, LinearHead)):
        check_logits_targets(policy, None, info.shape, validate)
        return window_logprobs(policy, None, return_entropy=return_entropy)
    if return_entropy:
        raise ValueError("return_entropy: a policy given as log-probs has no entropy; pass "
                         "rlfuse.Logits or rlfuse.LinearHead")
    return policy
