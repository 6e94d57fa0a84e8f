"""Reference per-token log-probs and entropy (plain torch, autograd)."""
from __future__ import annotations

from typing import Optional

import torch

from .._types import compute_dtype
from ..scaleout import layout, vocab
from ..shared.head import linear_row_by_row


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, mask: Optional[torch.Tensor],
                   temperature: float, return_entropy: bool, inplace_backward: bool,
                   validate: bool, batch_invariant: bool = False):
    """``logp`` (or ``(logp, entropy)``) of ``rlfuse.token_logprobs``: ``log_softmax(logits /
    temperature)`` at the targets, masked positions 0 and never read (``inplace_backward``
    has no buffer to save here, ``batch_invariant`` no bits to fix: its rows are the same
    math); without ``validate`` a target outside the row gives NaN."""
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


def head_logits(hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``rlfuse.head_logits``: each row's logits by its own matmul."""
    return linear_row_by_row(hidden, weight, bias)


def window_logprobs(policy, mask: Optional[torch.Tensor], *, validate: bool,
                    return_entropy: bool = False):
    """``(logp, entropy)`` ``[B, T]`` (entropy None without ``return_entropy``) of the window
    of a ``Logits`` / ``LinearHead`` policy (whose arguments the caller has checked, as far as
    its ``validate`` asked); packed rows at their loss positions (``[N]`` without a mask); a
    split vocabulary gathered whole (its shard sizes compared first with ``validate``)."""
    over_ranks = policy.every_ranks_rows(mask)
    if over_ranks is not None:    # each rank's own rows: every rank's at once
        head, head_mask, own = over_ranks
        logp, entropy = window_logprobs(head, head_mask, validate=validate, return_entropy=True)
        return own(logp), own(entropy) if return_entropy else None
    if validate and policy.vocab_parallel_group is not None:
        vocab.check_shard_sizes(policy.vocab_parallel_group, policy.vocab_size,
                                policy.targets.device)
    rows = layout.as_rows(policy.as_logits())
    T = rows.targets.shape[1]
    window = rows.logits[:, rows.offset:rows.offset + T]
    if rows.vocab_parallel_group is not None:
        window = vocab.GatherVocab.apply(window, rows.vocab_parallel_group)
    out = token_logprobs(window, rows.targets, layout.row_mask(policy, mask), rows.temperature,
                         return_entropy, False, False)
    logp, entropy = out if return_entropy else (out, None)
    return (layout.to_loss_layout(policy, logp, mask),
            None if entropy is None else layout.to_loss_layout(policy, entropy, mask))


def learner_logprobs(policy, mask: torch.Tensor, *, validate: bool) -> torch.Tensor:
    """The learner log-probs ``[B, T]`` of any policy form."""
    if not isinstance(policy, torch.Tensor):      # a form: its log-probs to compute
        return window_logprobs(policy, mask, validate=validate)[0]
    return policy
