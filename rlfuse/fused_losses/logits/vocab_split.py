"""The fused vocabulary split (``scaleout.vocab`` has the math): custom ops over the row kernels.

Forward: each rank's kernels reduce its shard of every row to the statistics of
``vocab.SHARD_COLUMNS`` (one read of the shard), one all-gather gives every rank the whole rows'
log-prob, logsumexp and entropy. Backward: each shard's gradient from those (one read, one
write; a ``LinearHead`` forms each chunk again), the hidden-state gradient of a ``LinearHead``
summed over the group by one all-reduce. The process group travels by its name (an op's
schema takes no objects); the collectives run inside the ops, so ``torch.compile`` sees one
opaque op each. (The single pass of a ``LinearHead`` over the split is
``linear_head.linear_surrogate_op`` with a group name.)
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..._types import compute_dtype
from .._op import custom_op, register_autograd
from ..head.linear_head import head_gradients, linear_logprobs_backward_op, linear_logprobs_op
from .logprobs import logits_backward, token_logprobs_op
from ...kernels.rows.logprobs import STAT_COLUMNS
from ...kernels.lib.head_functions import HeadParams
from ..head.invariant_stats import window_block_logprobs
from ...scaleout.vocab import shard_targets, whole_rows


def _fake_outputs(like: Tensor, targets: Tensor, with_entropy: bool):
    acc = compute_dtype(like.dtype)
    return (like.new_empty(targets.shape, dtype=acc),
            like.new_empty(targets.shape if with_entropy else (0,), dtype=acc),
            like.new_empty((targets.numel(), len(STAT_COLUMNS)), dtype=acc))


def _save(ctx, inputs, output, leaves):
    _, entropy, stats = output
    ctx.save_for_backward(*leaves, inputs.targets, inputs.mask, stats,
                          entropy if inputs.with_entropy else None)
    ctx.mark_non_differentiable(stats)
    if not inputs.with_entropy:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)


def _upstream(dlogp, dentropy, entropy, targets, stats):
    """``(dlogp, dentropy or None, entropy or None)`` for the backward kernels; None when no
    gradient came."""
    if entropy is None:
        dentropy = None
    if dlogp is None and dentropy is None:
        return None
    if dlogp is None:
        dlogp = torch.zeros(targets.shape, dtype=stats.dtype, device=stats.device)
    return dlogp, dentropy, None if dentropy is None else entropy


# --------------------------------------------------------------------------------------------
# Logits
# --------------------------------------------------------------------------------------------

@custom_op("vocab_split_logprobs")
def vocab_split_logprobs_op(logits: Tensor, targets: Tensor, mask: Optional[Tensor],
                            temperature: float, with_entropy: bool, inplace_backward: bool,
                            offset: int, group_name: str, batch_invariant: bool = False
                            ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy or empty, stats [B*T, 2])`` of the whole rows of ``logits [B, S, V_l]``
    shards (rows ``[offset, offset + T)`` predict the global ``targets [B, T]``);
    ``batch_invariant``: from fixed vocabulary blocks (``invariant_stats``)."""
    if batch_invariant:
        logp, stats, entropy = window_block_logprobs(logits, targets, mask,
                                                     HeadParams(temperature), with_entropy,
                                                     offset, group_name)
        return (logp.view(targets.shape),
                entropy.view(targets.shape) if with_entropy else logp.new_empty(0), stats)
    local, _ = shard_targets(targets, logits.shape[-1], group_name)
    local = local.clamp_min(0)
    _, entropy, stats = token_logprobs_op(logits, local, mask, temperature, with_entropy, False,
                                          offset)
    window = logits[:, offset:offset + targets.shape[1]]
    x_y = window.gather(-1, local.unsqueeze(-1)).squeeze(-1).to(stats.dtype)
    return whole_rows(x_y, stats, entropy, targets, logits.shape[-1], mask,
                      HeadParams(temperature).inv_temp, with_entropy, group_name)


@vocab_split_logprobs_op.register_fake
def _(logits, targets, mask, temperature, with_entropy, inplace_backward, offset, group_name,
      batch_invariant=False):
    return _fake_outputs(logits, targets, with_entropy)


def _logits_setup(ctx, inputs, output):
    _save(ctx, inputs, output, (inputs.logits,))
    ctx.temperature, ctx.inplace, ctx.offset = (inputs.temperature, inputs.inplace_backward,
                                                inputs.offset)
    ctx.group_name = inputs.group_name


def _logits_backward(ctx, dlogp, dentropy, _dstats):
    logits, targets, mask, stats, entropy = ctx.saved_tensors
    upstream = _upstream(dlogp, dentropy, entropy, targets, stats)
    if upstream is None:
        return None
    local, _ = shard_targets(targets, logits.shape[-1], ctx.group_name)
    return {"logits": logits_backward(logits, local, mask, stats, upstream[2], upstream[0],
                                      upstream[1], ctx.temperature, ctx.inplace, ctx.offset)}


register_autograd(vocab_split_logprobs_op, _logits_backward, _logits_setup)


# --------------------------------------------------------------------------------------------
# LinearHead
# --------------------------------------------------------------------------------------------

@custom_op("vocab_split_linear_logprobs")
def vocab_split_linear_logprobs_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                   targets: Tensor, mask: Optional[Tensor], temperature: float,
                                   logit_scale: float, softcap: float, offset: int,
                                   chunk_tokens: int, gather: bool, with_entropy: bool,
                                   group_name: str, batch_invariant: bool = False,
                                   row_blocks: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy or empty, stats [B*T, 2])`` of the whole rows of a head whose
    ``weight [V_l, H]`` (and ``bias``) is this rank's shard; ``row_blocks``: its rows are
    every rank's sequence shard, the backward reduce-scatters their gradient
    (``scaleout.sequence``)."""
    if batch_invariant:     # the whole rows' statistics from fixed vocabulary blocks
        return linear_logprobs_op(hidden, weight, bias, targets, mask, temperature, logit_scale,
                                  softcap, offset, chunk_tokens, gather, with_entropy, False,
                                  True, group_name)
    local, _ = shard_targets(targets, weight.shape[0], group_name)
    x_y, entropy, stats = linear_logprobs_op(hidden, weight, bias, local.clamp_min(0), mask,
                                             temperature, logit_scale, softcap, offset,
                                             chunk_tokens, gather, with_entropy, True,
                                             batch_invariant)
    return whole_rows(x_y, stats, entropy, targets, weight.shape[0], mask,
                      HeadParams(temperature, logit_scale, softcap).inv_temp, with_entropy,
                      group_name)


@vocab_split_linear_logprobs_op.register_fake
def _(hidden, weight, bias, targets, mask, temperature, logit_scale, softcap, offset,
      chunk_tokens, gather, with_entropy, group_name, batch_invariant=False, row_blocks=0):
    return _fake_outputs(hidden, targets, with_entropy)


def _head_setup(ctx, inputs, output):
    _save(ctx, inputs, output, (inputs.hidden, inputs.weight, inputs.bias))
    ctx.chunking = (inputs.temperature, inputs.logit_scale, inputs.softcap, inputs.offset,
                    inputs.chunk_tokens, inputs.gather)
    ctx.group_name = inputs.group_name
    ctx.batch_invariant, ctx.row_blocks = inputs.batch_invariant, inputs.row_blocks


def _head_backward(ctx, dlogp, dentropy, _dstats):
    hidden, weight, bias, targets, mask, stats, entropy = ctx.saved_tensors
    needs: List[bool] = [bool(n) for n in ctx.needs_input_grad[:3]]
    upstream = _upstream(dlogp, dentropy, entropy, targets, stats)
    if upstream is None or not any(needs):
        return None
    local, _ = shard_targets(targets, weight.shape[0], ctx.group_name)
    dh, dw, db = linear_logprobs_backward_op(hidden, weight, bias, local, mask, stats,
                                             upstream[2], upstream[0], upstream[1],
                                             *ctx.chunking, needs, ctx.group_name,
                                             ctx.batch_invariant, ctx.row_blocks)
    return head_gradients(needs, bias is not None, dh, dw, db)


register_autograd(vocab_split_linear_logprobs_op, _head_backward, _head_setup)
