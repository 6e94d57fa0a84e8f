"""The log-probs of every policy form, fused: the window pipeline.

A ``Logits`` / ``LinearHead`` policy goes one way: its rows (packed rows as one batch of N,
``scaleout.layout.as_rows``), then the local row ops (``logprobs``, ``linear_head``) or, with a
split vocabulary, the split ops (``vocab_split``), then the loss layout (packed rows at
their ``[B, T]`` positions).
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from ..scaleout import layout, vocab
from .form_ops import of


def window_logprobs(policy, mask: Optional[Tensor], *, validate: bool,
                    return_entropy: bool = False) -> Tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[B, T]`` (entropy empty unless ``return_entropy``) of a ``Logits``
    or ``LinearHead`` policy, whose arguments the caller has checked; packed rows at their loss
    positions (``[N]`` without a mask). ``validate``: a ``LinearHead`` forms the logits of the
    actor rows only (reads the mask on the host), and a split vocabulary's shard sizes are
    compared first (one collective)."""
    over_ranks = policy.every_ranks_rows(mask)
    if over_ranks is not None:    # each rank's own rows: every rank's at once
        head, head_mask, own = over_ranks
        logp, entropy = window_logprobs(head, head_mask, validate=validate,
                                        return_entropy=return_entropy)
        return own(logp), own(entropy) if return_entropy else logp.new_empty(0)
    group = policy.vocab_parallel_group
    if validate and group is not None:
        vocab.check_shard_sizes(group, policy.vocab_size, policy.targets.device)
    rows, rows_mask = layout.as_rows(policy), layout.row_mask(policy, mask)
    logp, entropy = of(policy).logprobs(rows, rows_mask, gather=validate,
                                        return_entropy=return_entropy)
    return (layout.to_loss_layout(policy, logp, mask),
            layout.to_loss_layout(policy, entropy, mask) if return_entropy else entropy)


def learner_logprobs(policy, mask: Tensor, *, validate: bool, return_entropy: bool = False):
    """The learner log-probs ``[B, T]`` of any policy form (checked by the loss), with
    ``return_entropy`` ``(logp, entropy)`` (entropy None for ``[B, T]`` log-probs); the loss's
    gradient reaches logits or head through one backward pass over them."""
    if not isinstance(policy, Tensor):      # a form: its log-probs to compute
        logp, entropy = window_logprobs(policy, mask, validate=validate,
                                        return_entropy=return_entropy)
        return (logp, entropy) if return_entropy else logp
    return (policy, None) if return_entropy else policy
