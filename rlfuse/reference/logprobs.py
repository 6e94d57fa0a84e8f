"""Reference per-token log-probs and entropy (plain torch, autograd)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .._types import LinearHead, Logits, compute_dtype
from ..checks.policy import matmul_head, vocab_size
from ..scaleout import layout, vocab
from ..scaleout.rank_rows import RankRowsHead, rank_rows_logprobs
from ..shared.head import scaled_logits


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
    rows = hidden.reshape(-1, hidden.shape[-1]).split(1)
    logits = torch.cat([torch.nn.functional.linear(row, weight, bias) for row in rows])
    return logits.view(*hidden.shape[:-1], weight.shape[0])


def as_logits(policy) -> Logits:
    """A ``LinearHead`` as the ``Logits`` it defines: ``softcap(logit_scale (hidden @ weight.T
    + bias))``, all of it (the definition), the matmul in its ``head_dtype`` when it has one
    (``batch_invariant``: each row by its own matmul).
    Under a ``vocab_parallel_group`` that is this rank's shard, and the hidden states' gradient
    is summed over the group."""
    if isinstance(policy, LinearHead):
        head = matmul_head(policy)
        hidden, group = head.hidden, head.vocab_parallel_group
        if group is not None:
            hidden = vocab.SumGradOverGroup.apply(hidden, group)
        # the matmul in head_dtype, whatever autocast says
        with contextlib.nullcontext() if policy.head_dtype is None else \
                torch.autocast(hidden.device.type, enabled=False):
            if policy.batch_invariant:   # each row by its own matmul: its bits its own
                logits = head_logits(hidden, head.weight, head.bias)
            else:
                logits = torch.nn.functional.linear(hidden, head.weight, head.bias)
        if policy.logit_scale != 1.0 or policy.softcap is not None:
            logits = scaled_logits(logits, policy.logit_scale, policy.softcap)
        return Logits(logits, policy.targets, policy.temperature, offset=policy.offset,
                      index=policy.index, vocab_parallel_group=group)
    return policy


def window_logprobs(policy, mask: Optional[torch.Tensor], *, validate: bool,
                    return_entropy: bool = False):
    """``(logp, entropy)`` ``[B, T]`` (entropy None without ``return_entropy``) of the window
    of a ``Logits`` / ``LinearHead`` policy (whose arguments the caller has checked, as far as
    its ``validate`` asked); packed rows at their loss positions (``[N]`` without a mask); a
    split vocabulary gathered whole (its shard sizes compared first with ``validate``)."""
    if isinstance(policy, RankRowsHead):
        logp, entropy = rank_rows_logprobs(policy, mask, lambda head, head_mask: (
            window_logprobs(head, head_mask, validate=validate, return_entropy=True)))
        return logp, entropy if return_entropy else None
    if validate and policy.vocab_parallel_group is not None:
        vocab.check_shard_sizes(policy.vocab_parallel_group, vocab_size(policy),
                                policy.targets.device)
    rows = layout.as_rows(as_logits(policy))
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
    if isinstance(policy, (Logits, LinearHead)):
        return window_logprobs(policy, mask, validate=validate)[0]
    return policy
