"""Policies given as a linear head over hidden states: custom ops that form the logits one
chunk of tokens at a time (one cuBLAS matmul), run the row kernels on the chunk, and turn the
chunk's gradient, written in place into the chunk's own buffer, into the gradients of the
hidden states, weight and bias at once. No ``[N, V]`` tensor ever exists.

Two ladders, as for ``Logits``:
- the log-probs (``linear_logprobs``): forward over chunks keeps each row's max and log-sum;
  the backward, given dL/dlp, forms each chunk's logits once more and writes its gradient.
  GGPO (every log-prob of a group first) and ``policy_logprobs`` use it.
- the single pass of the token-local losses (``linear_surrogate``): the gradients are known
  in the forward, so each chunk's logits are formed once; the backward scales the three
  gradients by the upstream one.

Only actor rows need logits: with ``gather`` (the losses' ``validate=True``, which reads the mask
on the host anyway) the chunks hold actor rows only; without it every row of the window is
multiplied (no host read) and the kernels give the masked ones zero gradient.
"""
from __future__ import annotations

import functools
import os
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..._types import compute_dtype
from ...objectives import TokenSurrogate
from ...kernels.rows.logprobs import STAT_COLUMNS, token_logprobs_bwd, token_logprobs_fwd
from ...kernels.rows.scale_rows import scale_cast
from ...kernels.lib.token_functions import SUM_COLUMNS
from ...kernels.lib.head_functions import HeadParams
from ...kernels.tiles.head_tiles import head_backward
from ...kernels.rows.surrogate import surrogate_logits_fwd
from ...scaleout import vocab
from .._op import custom_op, kl_of, record_of, register_autograd, register_backward_op
from .head_matmuls import HeadChunks
from .invariant_stats import head_block_row_stats, logit_at_targets

DEFAULT_CHUNK_BYTES = 1 << 30   # the most a default chunk of logits takes: 1 GiB
# The fewest tokens a default chunk takes (the matmul's M), and the multiple its tokens are of.
MIN_CHUNK_TOKENS = 64


def head_fields(head) -> dict:
    """The fields of a ``LinearHead`` that its ops take as floats (``head_functions.HeadParams``)."""
    return HeadParams.of(head)._asdict()


def chunk_tokens_for(weight: Tensor, chunk_tokens: Optional[int], tokens: int) -> int:
    """Tokens per chunk of a head of ``weight [V, H]`` over ``tokens`` positions:
    ``chunk_tokens``; else the budget of chunk logits in bytes given by ``RLFUSE_CHUNK_BYTES``
    over the bytes of one row; else ``tokens H / V`` rounded up to a multiple of
    ``MIN_CHUNK_TOKENS`` (at least that, at most H tokens and 1 GiB of logits): a chunk's logits
    about as large as the hidden states ``[tokens, H]`` and never larger than the weight, so
    that a step holds little beyond the head's own gradients, at any number of tokens (about
    V / H chunks)."""
    if chunk_tokens:
        return chunk_tokens
    vocab_size, hidden_size = weight.shape
    row = vocab_size * weight.element_size()
    if "RLFUSE_CHUNK_BYTES" in os.environ:
        return max(1, int(os.environ["RLFUSE_CHUNK_BYTES"]) // row)
    like_hidden = -(-tokens * hidden_size // vocab_size)
    rounded = MIN_CHUNK_TOKENS * -(-like_hidden // MIN_CHUNK_TOKENS)
    return max(1, min(DEFAULT_CHUNK_BYTES // row,
                      max(MIN_CHUNK_TOKENS, min(hidden_size, rounded))))


def _flat(x: Optional[Tensor]) -> Optional[Tensor]:
    return None if x is None else x.reshape(-1)


def _split_row_stats(logits: Tensor, targets: Tensor, mask: Tensor, head: HeadParams,
                     with_entropy: bool, group_name: str) -> Tuple[Tensor, Tensor]:
    """A chunk's ``logits [C, 1, V_l]`` on a shard of a split vocabulary: ``(the targets within
    the shard, -1 where another rank holds them; the whole rows' statistics [C,
    ROW_STAT_COLUMNS])``, one read of the chunk and one all-gather of its ``[C, 4]``
    statistics."""
    local, _ = vocab.shard_targets(targets, logits.shape[-1], group_name)
    _, stats, entropy = token_logprobs_fwd(logits, local.clamp_min(0), mask, head, with_entropy)
    x_y = logit_at_targets(logits, local.clamp_min(0), head)
    logp, entropy, stats = vocab.whole_rows(x_y, stats, entropy, targets, logits.shape[-1], mask,
                                            head.inv_temp, with_entropy, group_name)
    entropy = entropy.reshape(-1) if with_entropy else torch.zeros_like(stats[:, 0])
    return local, torch.stack([logp.reshape(-1), stats[:, 0], stats[:, 1], entropy], -1)


def head_gradients_fake(hidden, weight, bias, needs, accumulated=False):
    """The fake ``(dhidden, dweight, dbias)`` of a head's backward op (empty where not needed;
    ``accumulated``: the weight's and bias's in fp32)."""
    dtype = compute_dtype(weight.dtype) if accumulated else weight.dtype
    return (hidden.new_empty(hidden.shape if needs[0] else (0,)),
            weight.new_empty(weight.shape if needs[1] else (0,), dtype=dtype),
            weight.new_empty((weight.shape[0],) if needs[2] and bias is not None else (0,),
                             dtype=dtype))


# --------------------------------------------------------------------------------------------
# Log-probs: forward over chunks, backward over chunks again
# --------------------------------------------------------------------------------------------

@custom_op("linear_logprobs")
def linear_logprobs_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                       mask: Optional[Tensor], temperature: float, logit_scale: float,
                       softcap: float, offset: int, chunk_tokens: int, gather: bool,
                       with_entropy: bool, target_logit: bool = False,
                       batch_invariant: bool = False,
                       group_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp [B, T], entropy [B, T] or empty, stats [B*T, 2])`` of the head's window
    (``logit_scale`` and ``softcap``, 0: none, as in ``LinearHead``); with ``target_logit`` the
    first output is the target's logit in the units of the row statistics (``logit_at_targets``)
    instead (what a shard of a split vocabulary contributes, ``scaleout.vocab``; not with
    ``batch_invariant``); ``batch_invariant``: each chunk's rows' statistics from fixed
    vocabulary blocks of the fixed-order matmul's tiles, never formed whole
    (``invariant_stats.head_block_row_stats``: the whole rows' over the split vocabulary of
    ``group_name``, of which ``weight`` is this rank's shard)."""
    acc = compute_dtype(hidden.dtype)
    B, T = targets.shape
    # rows left out of the chunks (masked, when gathering) have log-prob 0, entropy 0
    logp = torch.zeros(B * T, dtype=acc, device=hidden.device)
    entropy = torch.zeros(B * T if with_entropy else 0, dtype=acc, device=hidden.device)
    stats = torch.zeros((B * T, len(STAT_COLUMNS)), dtype=acc, device=hidden.device)
    y_flat, m_flat = _flat(targets), _flat(mask)
    head = HeadParams(temperature, logit_scale, softcap)
    chunks = HeadChunks(hidden, weight, bias, targets, mask, offset, chunk_tokens, gather)
    for chunk in chunks:
        tokens = chunk.tokens
        m_c = None if m_flat is None else m_flat[tokens, None]
        if batch_invariant:     # the chunk's logits never formed whole
            _, row_stats = head_block_row_stats(chunk.hidden, weight, bias, y_flat[tokens, None],
                                                m_c, head, with_entropy, group_name)
            lp_c, stats_c, ent_c = row_stats[:, :1], row_stats[:, 1:3], row_stats[:, 3:]
        else:
            logits = chunks.logits(chunk)
            lp_c, stats_c, ent_c = token_logprobs_fwd(logits, y_flat[tokens, None], m_c, head,
                                                      with_entropy)
            if target_logit:
                lp_c = logit_at_targets(logits, y_flat[tokens], head)
        logp[tokens] = lp_c[:, 0]
        stats[tokens] = stats_c
        if with_entropy:
            entropy[tokens] = ent_c[:, 0]
    return logp.view(B, T), entropy.view(B, T) if with_entropy else entropy, stats


@linear_logprobs_op.register_fake
def _(hidden, weight, bias, targets, mask, temperature, logit_scale, softcap, offset,
      chunk_tokens, gather, with_entropy, target_logit=False, batch_invariant=False,
      group_name=""):
    acc = compute_dtype(hidden.dtype)
    return (hidden.new_empty(targets.shape, dtype=acc),
            hidden.new_empty(targets.shape if with_entropy else (0,), dtype=acc),
            hidden.new_empty((targets.numel(), len(STAT_COLUMNS)), dtype=acc))


@custom_op("linear_logprobs_backward")
def linear_logprobs_backward_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                targets: Tensor, mask: Optional[Tensor], stats: Tensor,
                                entropy: Optional[Tensor], dlogp: Tensor,
                                dentropy: Optional[Tensor], temperature: float,
                                logit_scale: float, softcap: float, offset: int,
                                chunk_tokens: int, gather: bool, needs: List[bool],
                                group_name: str = "", batch_invariant: bool = False,
                                row_blocks: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` (empty where not needed) for the upstream ``dlogp`` /
    ``dentropy`` ``[B, T]``: each chunk's logits formed again, their gradient written in
    place; ``group_name``: a shard of a split vocabulary, ``batch_invariant``: the chunk's
    gradient from its logits' tiles formed again on the chip (``HeadGradients.add_tiles``),
    ``row_blocks``: sequence-parallel rows (``HeadGradients``)."""
    chunks = HeadChunks(hidden, weight, bias, targets, mask, offset, chunk_tokens, gather,
                        needs=needs, group_name=group_name, batch_invariant=batch_invariant,
                        row_blocks=row_blocks)
    y_flat, m_flat = _flat(targets), _flat(mask)
    dlogp, dentropy, entropy = _flat(dlogp), _flat(dentropy), _flat(entropy)
    head = HeadParams(temperature, logit_scale, softcap)
    for chunk in chunks:
        tokens = chunk.tokens
        if batch_invariant:     # the chunk's logits never formed whole
            keep = torch.ones_like(tokens, dtype=torch.bool) if m_flat is None else m_flat[tokens]
            chunks.add_tiles(chunk, functools.partial(
                head_backward, chunk.hidden, weight, bias, y_flat[tokens], keep, stats[tokens],
                None if dentropy is None else entropy[tokens], dlogp[tokens],
                None if dentropy is None else dentropy[tokens], *head.kernel_args()))
            continue
        logits = chunks.logits(chunk)
        token_logprobs_bwd(logits, y_flat[tokens, None],
                           None if m_flat is None else m_flat[tokens, None], head,
                           stats[tokens], None if dentropy is None else entropy[tokens, None],
                           dlogp[tokens, None],
                           None if dentropy is None else dentropy[tokens, None], logits)
        chunks.add(chunk, logits)
    return chunks.gradients()


@linear_logprobs_backward_op.register_fake
def _(hidden, weight, bias, targets, mask, stats, entropy, dlogp, dentropy, temperature,
      logit_scale, softcap, offset, chunk_tokens, gather, needs, group_name="",
      batch_invariant=False, row_blocks=0):
    return head_gradients_fake(hidden, weight, bias, needs)


def _logprobs_setup(ctx, inputs, output):
    _, entropy, stats = output
    ctx.save_for_backward(inputs.hidden, inputs.weight, inputs.bias, inputs.targets, inputs.mask,
                          stats, entropy if inputs.with_entropy else None)
    ctx.chunking = (inputs.temperature, inputs.logit_scale, inputs.softcap, inputs.offset,
                    inputs.chunk_tokens, inputs.gather)
    ctx.batch_invariant = inputs.batch_invariant
    ctx.mark_non_differentiable(stats)
    if not inputs.with_entropy:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)


def _logprobs_backward(ctx, dlogp, dentropy, _dstats):
    hidden, weight, bias, targets, mask, stats, entropy = ctx.saved_tensors
    if entropy is None:
        dentropy = None
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    if (dlogp is None and dentropy is None) or not any(needs):
        return None
    if dlogp is None:
        dlogp = torch.zeros(targets.shape, dtype=stats.dtype, device=stats.device)
    dh, dw, db = linear_logprobs_backward_op(hidden, weight, bias, targets, mask, stats,
                                             entropy, dlogp, dentropy, *ctx.chunking, needs,
                                             batch_invariant=ctx.batch_invariant)
    return head_gradients(needs, bias is not None, dh, dw, db)


def head_gradients(needs, has_bias: bool, dhidden, dweight, dbias) -> dict:
    """The gradients of the head's inputs by name, the needed ones only."""
    needs = (needs[0], needs[1], needs[2] and has_bias)
    grads = {"hidden": dhidden, "weight": dweight, "bias": dbias}
    return {name: grad for (name, grad), needed in zip(grads.items(), needs) if needed}


register_autograd(linear_logprobs_op, _logprobs_backward, _logprobs_setup)


def register_head_autograd(op, backward_op, saved: Sequence[str],
                           fields: Sequence[str]) -> None:
    """``register_backward_op`` for a head op (its first three inputs hidden, weight, bias)
    whose backward op takes the inputs needed last and returns ``(dhidden, dweight,
    dbias)``."""
    def gradients(ctx, call):
        needs = [bool(n) for n in ctx.needs_input_grad[:3]]
        if not any(needs):
            return None
        has_bias = ctx.saved_tensors[2] is not None
        return head_gradients(needs, has_bias, *call(needs))

    register_backward_op(op, backward_op, saved, fields, gradients)


# --------------------------------------------------------------------------------------------
# The single pass of the token-local losses
# --------------------------------------------------------------------------------------------

@custom_op("linear_surrogate")
def linear_surrogate_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                        mask: Tensor, old_lp: Optional[Tensor], adv: Tensor,
                        weights: Optional[Tensor], row_scale: Tensor, ref_lp: Optional[Tensor],
                        kl_scale: Optional[Tensor], entropy_scale: Optional[Tensor],
                        temperature: float, logit_scale: float, softcap: float,
                        function: str, geometry: str, topology: str,
                        delta_low: float, delta_high: float, params: List[float], clamp: float,
                        kl_estimator: str, kl_straight: bool, kl_weighted: bool, kl_clamp: bool,
                        offset: int,
                        chunk_tokens: int, gather: bool, needs: List[bool],
                        group_name: str = "",
                        row_blocks: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, sums [B, SUM_COLUMNS], dhidden, dweight, dbias)``: the surrogate ``objective``
    over the head's window (``old_lp`` None: on policy) with its terms (those of
    ``surrogate.surrogate_logits_op``) and its gradients for an upstream gradient of 1 (empty
    where not needed; the weight's and the bias's as accumulated, in fp32: the backward scales
    and casts them in one pass), each chunk's logits formed once. The sums are kept per token
    and summed over each row at the end: no atomic add, the same bits on every run.

    ``group_name``: the head is this rank's shard of a vocabulary split over that group; each
    chunk's whole-row statistics are gathered before its gradient is written (one all-gather of
    ``[C, 4]`` per chunk), and the hidden states' gradient is summed over the group at the end
    (one all-reduce; with ``row_blocks``, sequence-parallel rows, one reduce-scatter: see
    ``HeadGradients``)."""
    spec, kl = record_of(TokenSurrogate, locals()), kl_of(locals())
    head = HeadParams(temperature, logit_scale, softcap)
    chunks = HeadChunks(hidden, weight, bias, targets, mask, offset, chunk_tokens, gather,
                        needs=needs, group_name=group_name, row_blocks=row_blocks)
    write = any(needs)
    B, T = targets.shape
    sums_of_tokens = torch.zeros((B * T, len(SUM_COLUMNS)), dtype=row_scale.dtype,
                                 device=hidden.device)
    y_flat, m_flat = _flat(targets), _flat(mask)
    old_flat, w_flat, ref_flat = _flat(old_lp), _flat(weights), _flat(ref_lp)
    adv_flat = _flat(adv.unsqueeze(-1).expand(B, T) if adv.dim() == 1 else adv)
    scale_flat = row_scale.unsqueeze(-1).expand(B, T).reshape(-1)
    kl_flat, entropy_flat = (None if x is None else x.unsqueeze(-1).expand(B, T).reshape(-1)
                             for x in (kl_scale, entropy_scale))
    for chunk in chunks:
        tokens = chunk.tokens
        logits = chunks.logits(chunk)
        targets_c, row_stats = y_flat[tokens, None], None
        if group_name:
            targets_c, row_stats = _split_row_stats(logits, targets_c, m_flat[tokens, None],
                                                    head, entropy_flat is not None, group_name)
        _, sums = surrogate_logits_fwd(
            logits, targets_c, m_flat[tokens, None],
            None if old_flat is None else old_flat[tokens, None], adv_flat[tokens],
            None if w_flat is None else w_flat[tokens, None], scale_flat[tokens], spec,
            head=head, write_dlogits=write, dlogits=logits if write else None,
            ref_lp=None if ref_flat is None else ref_flat[tokens, None], kl=kl,
            kl_scale=None if kl_flat is None else kl_flat[tokens],
            entropy_scale=None if entropy_flat is None else entropy_flat[tokens],
            row_stats=row_stats)
        sums_of_tokens[tokens] = sums
        if write:
            chunks.add(chunk, logits)
    sums_of_rows = sums_of_tokens.view(B, T, len(SUM_COLUMNS)).sum(1)
    loss = -sums_of_rows[:, SUM_COLUMNS.index("loss")].sum()
    return (loss, sums_of_rows) + chunks.gradients(accumulated=True)


@linear_surrogate_op.register_fake
def _(hidden, weight, bias, targets, mask, old_lp, adv, weights, row_scale, ref_lp, kl_scale,
      entropy_scale, temperature, logit_scale, softcap, function, geometry, topology,
      delta_low, delta_high, params, clamp, kl_estimator, kl_straight, kl_weighted, kl_clamp,
      offset, chunk_tokens, gather, needs, group_name="", row_blocks=0):
    sums = row_scale.new_empty((targets.shape[0], len(SUM_COLUMNS)))
    return (row_scale.new_empty(()), sums) + head_gradients_fake(hidden, weight, bias, needs,
                                                             accumulated=True)


@custom_op("scale_cast")
def scale_cast_op(x: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``(x * scale).to(dtype)`` in one pass (``kernels.rows.scale_rows.scale_cast``)."""
    return scale_cast(x, scale, dtype)


@scale_cast_op.register_fake
def _(x, scale, dtype):
    return x.new_empty(x.shape, dtype=dtype)


def register_single_pass_autograd(op) -> None:
    """The autograd of a head's single pass: its first output the scalar loss, its last three
    the loss's ``(dhidden, dweight, dbias)`` formed in the forward (the weight's and bias's
    accumulated in fp32); the backward scales them by the loss's upstream gradient."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*output[-3:])
        ctx.needs, ctx.has_bias = inputs.needs, inputs.bias is not None
        ctx.weight_dtype = inputs.weight.dtype
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    register_autograd(op, _single_pass_backward, setup)


def _single_pass_backward(ctx, grad_loss, *_):
    if grad_loss is None:
        return None
    needs = head_gradients(ctx.needs, ctx.has_bias, *ctx.saved_tensors)
    # one pass over each gradient, no host sync: the hidden states' scaled, the weight's and
    # the bias's fp32 accumulators scaled into new tensors of their parameters' dtype
    return {name: grad * grad_loss.to(grad.dtype) if name == "hidden" else
            scale_cast_op(grad, grad_loss, ctx.weight_dtype) for name, grad in needs.items()}


register_single_pass_autograd(linear_surrogate_op)
