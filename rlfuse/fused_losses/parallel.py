"""Fused log-probs of packed rows and of a vocabulary split over a process group
(``rlfuse.parallel`` has the math).

Packed rows run the row machinery as one batch of N rows and are placed at their loss positions
afterwards. A split vocabulary: each rank's kernels reduce its shard of every row to the four
statistics of ``parallel.SHARD_COLUMNS`` (one read of the shard), one all-gather gives every
rank the whole rows' log-prob, logsumexp and entropy, and the backward writes each shard's
gradient from them (one read, one write) — for a ``LinearHead`` each chunk formed again, the
hidden-state gradient summed over the group by one all-reduce. Collectives per call: one
all-gather forward (plus one of the shard sizes with ``validate``), none backward for
``Logits``, one all-reduce backward for ``LinearHead``. The losses take this two-pass path for
such policies (their single pass needs the whole row's logsumexp before the gradient).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .. import parallel
from .._contract import vocab_size
from .._types import LinearHead
from .linear_head import chunk_tokens_for, linear_logprobs_backward_op, linear_logprobs_op
from .logprobs import logits_backward, token_logprobs_op


class _Split(NamedTuple):
    """What the autograd function needs of a row policy with a split vocabulary."""
    policy: object          # Logits / LinearHead over [B, S, ...] rows (not packed)
    mask: Optional[Tensor]
    gather: bool
    with_entropy: bool


def _shard_stats(split: _Split, local: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(target logit / temperature, stats [B*T, 2], entropy)`` of this rank's shard, for
    the targets ``local`` (valid ids of the shard; rows whose target is elsewhere have any)."""
    p, mask = split.policy, split.mask
    if isinstance(p, LinearHead):
        chunk = chunk_tokens_for(p.weight.shape[0], p.weight.element_size(), p.chunk_tokens)
        z_y, entropy, stats = linear_logprobs_op(p.hidden, p.weight, p.bias, local, mask,
                                                 float(p.temperature), int(p.offset), chunk,
                                                 split.gather, split.with_entropy, True)
        return z_y, stats, entropy
    _, entropy, stats = token_logprobs_op(p.logits, local, mask, float(p.temperature),
                                          split.with_entropy, False, int(p.offset))
    T = local.shape[1]
    window = p.logits[:, p.offset:p.offset + T]
    z_y = window.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(stats.dtype) \
        * (1.0 / float(p.temperature))
    return z_y, stats, entropy


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, split: _Split, *leaves: Tensor):
        import torch.distributed as dist

        p, group = split.policy, split.policy.vocab_parallel_group
        rank = dist.get_rank(group)
        local, owner = parallel.local_targets(p.targets, vocab_size(p), rank)
        mine = local >= 0
        z_y, stats, entropy = _shard_stats(split, torch.where(mine, local, 0))
        shift = torch.where(mine.reshape(-1), z_y.reshape(-1) - stats[:, 0], 0.0)
        shard_entropy = entropy.reshape(-1) if split.with_entropy else torch.zeros_like(shift)
        shard = torch.stack([shift, stats[:, 0], stats[:, 1], shard_entropy], -1)
        logp, row_max, log_sum, entropy = parallel.combine_shards(shard, owner.reshape(-1),
                                                                  group)
        if split.mask is not None:
            keep = split.mask.reshape(-1)
            logp, entropy = (torch.where(keep, x, 0.0) for x in (logp, entropy))
        ctx.split, ctx.local = split, local
        ctx.save_for_backward(torch.stack([row_max, log_sum], -1), entropy)
        if not split.with_entropy:
            ctx.mark_non_differentiable(entropy)
        shape = p.targets.shape
        return logp.view(shape), entropy.view(shape)

    @staticmethod
    def backward(ctx, dlogp: Optional[Tensor], dentropy: Optional[Tensor]):
        split, local = ctx.split, ctx.local
        stats, entropy = ctx.saved_tensors
        p = split.policy
        if not split.with_entropy:
            dentropy = None
        if dlogp is None:
            dlogp = torch.zeros(local.shape, dtype=stats.dtype, device=stats.device)
        ent = None if dentropy is None else entropy.view(local.shape)
        if isinstance(p, LinearHead):
            import torch.distributed as dist

            needs = [ctx.needs_input_grad[1 + i] for i in range(3)]
            chunk = chunk_tokens_for(p.weight.shape[0], p.weight.element_size(), p.chunk_tokens)
            dh, dw, db = linear_logprobs_backward_op(
                p.hidden, p.weight, p.bias, local, split.mask, stats, ent, dlogp, dentropy,
                float(p.temperature), int(p.offset), chunk, split.gather, needs)
            if needs[0]:
                dist.all_reduce(dh, group=p.vocab_parallel_group)
            return (None, dh if needs[0] else None, dw if needs[1] else None,
                    db if needs[2] else None)
        dlogits = logits_backward(p.logits, local, split.mask, stats, ent, dlogp, dentropy,
                                  float(p.temperature), bool(p.inplace_backward), int(p.offset))
        return None, dlogits


def _vocab_parallel(policy, mask, gather: bool, return_entropy: bool):
    split = _Split(policy, mask, gather, return_entropy)
    if isinstance(policy, LinearHead):
        leaves = (policy.hidden, policy.weight,
                  policy.bias if policy.bias is not None else policy.weight.new_empty(0))
    else:
        leaves = (policy.logits,)
    return _VocabParallelLogprobs.apply(split, *leaves)


def scaled_out_logprobs(policy, mask: Optional[Tensor], *, gather: bool,
                        return_entropy: bool, local_logprobs) -> Tuple[Tensor, Tensor]:
    """``(logp, entropy)`` of a packed and/or vocabulary-split policy at its loss positions;
    ``local_logprobs(rows, mask)`` computes those of unsplit rows."""
    rows, rows_mask = parallel.as_rows(policy), parallel.row_mask(policy, mask)
    if rows.vocab_parallel_group is None:
        logp, entropy = local_logprobs(rows, rows_mask)
    else:
        logp, entropy = _vocab_parallel(rows, rows_mask, gather, return_entropy)
        if not return_entropy:
            entropy = entropy.new_empty(0)
    return (parallel.to_loss_layout(policy, logp, mask),
            parallel.to_loss_layout(policy, entropy, mask))
