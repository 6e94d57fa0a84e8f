"""Reference per-token log-probs and entropy (plain torch, autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from .._types import Logits, compute_dtype
from .._validation import check_logprob_args


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                   return_entropy: bool = False, inplace_backward: bool = False,
                   mask: Optional[torch.Tensor] = None, validate: bool = True):
    """Per-token log-probs of ``targets`` under ``softmax(logits / temperature)``.

    For each position (``logits`` ``[B, T, V]`` or ``[N, V]``, ``targets`` ``[B, T]`` or ``[N]``)::

        z = logits / temperature,  lse = logsumexp(z),  logp = z[y] - lse
        entropy = lse - sum_v softmax(z)_v z_v

    Positions where ``mask`` is False get log-prob 0, entropy 0 and zero gradient; their targets
    may be anything. Results are fp32 (fp64 for fp64 logits). ``inplace_backward`` is accepted for
    signature parity with the fused path and has no effect here. ``validate=False`` skips the
    value checks (0/1 mask, unmasked targets in ``[0, V)``); an out-of-range target then gives
    NaN.
    """
    mask = check_logprob_args(logits, targets, temperature, mask, validate)
    compute = compute_dtype(logits.dtype)
    logp_all = torch.log_softmax(logits.to(compute) / temperature, dim=-1)
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


def policy_logprobs(policy, mask: torch.Tensor) -> torch.Tensor:
    """The learner log-probs ``[B, T]`` of a policy given as log-probs or as ``Logits`` (whose
    arguments the loss has already checked, as far as its ``validate`` asked)."""
    if isinstance(policy, Logits):
        return token_logprobs(policy.logits, policy.targets, temperature=policy.temperature,
                              mask=mask, validate=False)
    return policy
