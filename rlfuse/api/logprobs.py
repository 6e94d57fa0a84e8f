"""The log-probs of a policy: ``token_logprobs`` from logits, ``policy_logprobs`` from any
policy form; ``head_logits``, the batch-invariant head's logits."""
from __future__ import annotations

from typing import Optional

import torch

from ..checks.policy import check_bool, check_head_tensors, check_policy, check_policy_targets
from ..checks.values import (as_bool_mask, check_logits, check_mask, check_no_overlap,
                             check_positive, check_targets, check_tensor)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   return_entropy: bool = False, inplace_backward: bool = False,
                   mask: Optional[torch.Tensor] = None, validate: bool = True,
                   batch_invariant: bool = False, run):
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
        batch_invariant: each row's log-prob and entropy from fixed vocabulary blocks combined
            in one order: the bits of a ``LinearHead(..., batch_invariant=True)`` over the
            same logits (``head_logits``), on one rank or a split vocabulary.

    Returns:
        ``logp`` (fp32; fp64 for fp64 logits), or ``(logp, entropy)``::

            z = logits / temperature,  lse = logsumexp(z),  logp = z[y] - lse
            entropy = lse - sum_v softmax(z)_v z_v

    Fused (``rlfuse.token_logprobs``): the forward reads the logits once and saves two fp32
    numbers per position (the row max and the log-sum of the shifted exponentials, whose sum is
    the logsumexp); the backward reads the logits once more and writes the gradient once.
    """
    with run.on(logits) as (impl, logits):
        mask = check_logprob_args(logits, targets, temperature, mask, inplace_backward, validate)
        check_bool("batch_invariant", batch_invariant)
        return impl.token_logprobs(logits, targets, mask, float(temperature),
                                   bool(return_entropy), bool(inplace_backward), validate,
                                   batch_invariant)


def policy_logprobs(policy, *, return_entropy: bool = False, validate: bool = True, run):
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
    with run.on(policy) as (impl, policy):
        info = check_policy(policy)
        if not isinstance(policy, torch.Tensor):      # a form: its log-probs to compute
            check_policy_targets(policy, None, info.shape, validate)
            logp, entropy = impl.window_logprobs(policy, None, validate=validate,
                                                 return_entropy=return_entropy)
            return (logp, entropy) if return_entropy else logp
        if return_entropy:
            raise ValueError("return_entropy: a policy given as log-probs has no entropy; pass "
                             "rlfuse.Logits or rlfuse.LinearHead")
        return policy


def head_logits(hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None, *, run) -> torch.Tensor:
    """A head's logits ``hidden @ weight.T + bias``, each row's bits its own whatever the
    batch: those of ``LinearHead(..., batch_invariant=True)`` before its logit scale, softcap
    and temperature.

    Args:
        hidden: ``[..., H]`` hidden states, bf16/fp16/fp32/fp64.
        weight: ``[V, H]``, the hidden states' dtype and device.
        bias: ``[V]`` or None.

    Returns:
        ``[..., V]`` logits in the weight's dtype (as a model's own head stores them), with
        autograd. A row's logits do not depend on the other rows (their number, their values,
        the row's position), and they are the logits a batch-invariant ``LinearHead`` forms for
        that row: a rollout engine that samples from these and a trainer on that head agree bit
        for bit on the head (the rest of the model, attention and norms, is the engine's to
        make invariant).

    Fused (``rlfuse.head_logits``): the fixed-order matmul of ``kernels.tiles.matmul`` (one tile
    configuration for every shape, fp32 sums, no split-K), its backward's products likewise;
    the reference forms each row by its own matmul.
    """
    with run.on(hidden) as (impl, hidden):
        check_head_logits_args(hidden, weight, bias)
        return impl.head_logits(hidden, weight, bias)


def check_head_logits_args(hidden, weight, bias) -> None:
    """``head_logits``' tensors: ``hidden [..., H]``, ``weight [V, H]`` and ``bias [V]`` (or
    None) of one floating dtype and device."""
    check_tensor("hidden", hidden, floating=True)
    if hidden.dim() < 1:
        raise ValueError("hidden: expected shape [..., H], got a 0-dim tensor")
    check_head_tensors(hidden, weight, bias)




def check_logprob_args(logits, targets, temperature, mask, inplace_backward: bool,
                       validate: bool) -> Optional[torch.Tensor]:
    """Checks the arguments of ``token_logprobs``; returns the mask as bool (or None). Without
    ``validate`` the values (0/1 mask, target range: one host sync) are not checked."""
    check_logits(logits)
    check_positive("temperature", temperature)
    if inplace_backward:
        check_no_overlap("logits", logits)
    shape = tuple(logits.shape[:-1])
    if mask is not None:
        if validate:
            mask = check_mask(mask, shape, logits.device)
        else:
            check_tensor("mask", mask, shape=shape, device=logits.device)
            mask = as_bool_mask(mask)
    if validate:
        check_targets(targets, shape, logits.shape[-1], logits.device, mask)
    else:
        check_tensor("targets", targets, shape=shape, device=logits.device, floating=False)
    return mask
