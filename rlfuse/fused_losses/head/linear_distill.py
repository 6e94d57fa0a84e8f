"""Distillation from a ``LinearHead`` student (and a ``LinearHead`` or ``Logits`` teacher), chunk
by chunk: ``rlfuse::linear_distill``, each chunk of tokens' logits formed in fp32 by one matmul
per model (never rounded to a bf16 head's dtype) and reduced by the divergence kernels
(``kernels.rows.distill``); its backward forms both chunks once more, writes the student's gradient
in place into its chunk and turns it, in the head's dtype, into the gradients of the hidden
states, weight and bias at once. No ``[N, V]`` tensor of either model exists. Over a split
vocabulary (``group_name``) the chunks are formed once more for the statistics first. A
batch-invariant student head forms no chunk at all beside a batch-invariant teacher head or the
teacher's logits, over a split vocabulary too: each chunk's logits exist only as tiles on the
chip (``kernels.tiles.head_tiles`` for the statistics, ``kernels.tiles.distill_tiles`` for the
divergence
and the student's gradients), the sums over a split's ranks added in rank order.

``rlfuse::linear_distill_loss``, the single pass of ``distill_loss``: each position's upstream
gradient is the aggregation's weight, known before the kernels, so each chunk of both models is
formed once: the divergence, then the student's gradient written in place, then the products.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import functools

import torch
from torch import Tensor

from ..._types import compute_dtype
from ...kernels.rows.distill import DISTILL_STATS, distill_bwd, distill_fwd
from ...kernels.tiles.distill_tiles import TwoHeads, distill_blocks, distill_head_backward
from ...kernels.lib.head_functions import HeadParams
from ...kernels.rows.logprobs import token_logprobs_fwd
from ...scaleout.vocab import group_sum
from .._op import custom_op
from .head_matmuls import HeadChunks, chunk_logits
from .linear_head import head_gradients_fake, register_head_autograd, register_single_pass_autograd
from ..top_k import whole_rows
from .invariant_stats import head_block_row_stats


def distill_stats_fake(student: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The fake ``(value, entropy, stats)`` of a distillation op."""
    acc = compute_dtype(student.dtype)
    return (student.new_empty(mask.shape, dtype=acc), student.new_empty(mask.shape, dtype=acc),
            student.new_empty((mask.numel(), len(DISTILL_STATS)), dtype=acc))


class _Teacher:
    """A chunk's rows of the teacher: of its hidden states through its head (``weight`` given)
    or of its logits, at the flat rows ``b S_t + teacher_offset + t`` of the chunk's tokens
    (``mask [B, T]``: the positions that count)."""

    def __init__(self, teacher: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 offset: int, mask: Tensor, batch_invariant: bool):
        self.teacher = teacher
        self.S, self.offset, self.mask, self.T = teacher.shape[1], offset, mask, mask.shape[1]
        self.weight, self.bias, self.batch_invariant = weight, bias, batch_invariant
        self.logit_stats = None

    @functools.cached_property
    def flat(self) -> Tensor:
        """The teacher's rows ``[B S_t, H_t or V]`` (a copy where its strides do not merge)."""
        return self.teacher.reshape(-1, self.teacher.shape[-1])

    @property
    def on_chip(self) -> bool:
        """Whether the chunks of a batch-invariant student head beside this teacher are formed
        as tiles on the chip only (a batch-invariant teacher head, or logits read in place at
        unit stride)."""
        return self.batch_invariant and \
            (self.weight is not None or self.teacher.stride(-1) == 1)

    def rows(self, tokens: Tensor) -> Tensor:
        """The teacher's rows (hidden states or logits) of the chunk's ``tokens``."""
        return self.flat[(tokens // self.T) * self.S + self.offset + tokens % self.T]

    def chunk(self, tokens: Tensor) -> Tensor:
        if self.weight is None:
            return self.rows(tokens).unsqueeze(1)
        return chunk_logits(self.rows(tokens), self.weight, self.bias, self.batch_invariant,
                            fp32=True)

    def tiles(self, h_rows: Tensor, weight: Tensor, bias: Optional[Tensor], tokens: Tensor,
              keep: Tensor, heads, terms) -> TwoHeads:
        """The launch arguments of a chunk of the student's ``h_rows`` and this teacher's rows
        of its ``tokens`` (``keep``: the rows that count) on the chip."""
        if self.weight is None:
            at = (tokens // self.T) * self.teacher.stride(0) + \
                (self.offset + tokens % self.T) * self.teacher.stride(1)
            return TwoHeads(h_rows, weight, bias, heads[0], self.teacher, None, None, heads[1],
                            keep, terms, t_rows=at)
        return TwoHeads(h_rows, weight, bias, heads[0], self.rows(tokens), self.weight,
                        self.bias, heads[1], keep, terms)

    def stats(self, tiles: TwoHeads, tokens: Tensor, keep: Tensor, head: HeadParams,
              group_name: str) -> Tensor:
        """The teacher's ``(max, log-sum)`` ``[C, 2]`` of a chunk's ``tokens`` (over a split
        vocabulary: the whole rows'): a head's from its tiles (``head_block_row_stats``),
        logits' from their rows, read in place by the row kernel (every position of the mask
        at the first chunk; a split's shards combined by ``top_k.whole_rows``)."""
        if self.weight is None:
            if self.logit_stats is None:
                no_target = torch.zeros(self.mask.shape, dtype=torch.long, device=keep.device)
                shard = token_logprobs_fwd(self.teacher, no_target, self.mask, head, False,
                                           self.offset)[1]
                self.logit_stats, _ = whole_rows(shard, torch.zeros_like(shard[:, 0]), head,
                                                 group_name)
            return self.logit_stats[tokens]
        no_target = torch.zeros((keep.numel(), 1), dtype=torch.long, device=keep.device)
        _, t = head_block_row_stats(*tiles.teacher, no_target, keep[:, None], head, False,
                                    group_name, fp32=True)
        return t[:, 1:3]


def _on_chip(tiles: TwoHeads, rows_of: _Teacher, tokens: Tensor, keep: Tensor, heads,
             group_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """``(value [C], entropy [C], stats [C, DISTILL_STATS])`` of a chunk of a batch-invariant
    student head and a teacher (``tiles``), masked rows 0: the student's statistics from its
    tiles (``head_block_row_stats``) and the teacher's (``_Teacher.stats``), then the
    divergence from both models' tiles (``distill_blocks``); ``group_name``: the whole rows'
    statistics and entropy, the divergence and its aux sum this shard's."""
    no_target = torch.zeros((keep.numel(), 1), dtype=torch.long, device=keep.device)
    _, s = head_block_row_stats(*tiles.student, no_target, keep[:, None], heads[0], True,
                                group_name, fp32=True)
    stats = torch.cat([s[:, 1:3],
                       rows_of.stats(tiles, tokens, keep, heads[1], group_name).to(s.dtype),
                       torch.zeros_like(s[:, :1])], 1)
    sums = distill_blocks(tiles, stats)
    stats[:, -1] = sums[:, 1]
    return (torch.where(keep, sums[:, 0], 0.0), s[:, 3],
            torch.where(keep[:, None], stats, 0.0))


@custom_op("linear_distill")
def linear_distill_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], teacher: Tensor,
                      teacher_weight: Optional[Tensor], teacher_bias: Optional[Tensor],
                      mask: Tensor, temperature: float, logit_scale: float, softcap: float,
                      teacher_temperature: float, teacher_logit_scale: float,
                      teacher_softcap: float, offset: int, teacher_offset: int, function: str,
                      params: List[float], chunk_tokens: int, gather: bool,
                      batch_invariant: bool,
                      group_name: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    """``distill_op``'s outputs for a student head (``hidden [B, S, H]``, ``weight [V, H]``,
    ``bias``; its logit scale and softcap, 0: none) and a teacher head (``teacher [B, S_t,
    H_t]``, ``teacher_weight``) or the teacher's logits (``teacher [B, S_t, V]``,
    ``teacher_weight`` None), over chunks of ``chunk_tokens`` positions (with ``gather``: the
    actor positions only); ``batch_invariant``: both heads' logits by the fixed-order matmul;
    ``group_name``: both models' vocabularies split over that group (``_split_heads``)."""
    acc = compute_dtype(hidden.dtype)
    B, T = mask.shape
    value = torch.zeros(B * T, dtype=acc, device=hidden.device)
    entropy = torch.zeros(B * T, dtype=acc, device=hidden.device)
    stats = torch.zeros((B * T, len(DISTILL_STATS)), dtype=acc, device=hidden.device)
    m_flat = mask.reshape(-1)
    rows_of = _Teacher(teacher, teacher_weight, teacher_bias, teacher_offset, mask,
                       batch_invariant)
    heads = (HeadParams(temperature, logit_scale, softcap),
             HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap))
    chunks = HeadChunks(hidden, weight, bias, mask, mask, offset, chunk_tokens, gather,
                        batch_invariant=batch_invariant, fp32=True)

    def both(chunk):
        return chunks.logits(chunk), rows_of.chunk(chunk.tokens), m_flat[chunk.tokens, None]

    if group_name and not rows_of.on_chip:
        entropy, stats = _split_heads(chunks, both, heads, stats, group_name)
    for chunk in chunks:
        tokens = chunk.tokens
        if rows_of.on_chip:
            keep = m_flat[tokens]
            value[tokens], entropy[tokens], stats[tokens] = _on_chip(
                rows_of.tiles(chunk.hidden, weight, bias, tokens, keep, heads,
                              (function, params)), rows_of, tokens, keep, heads, group_name)
            continue
        value_c, entropy_c, stats_c = distill_fwd(*both(chunk), *heads, (function, params),
                                                  stats[tokens] if group_name else None)
        value[tokens], stats[tokens] = value_c[:, 0], stats_c
        if not group_name:
            entropy[tokens] = entropy_c[:, 0]
    if group_name:
        sums = torch.stack([value, stats[:, -1]], -1)
        group_sum(sums, group_name, batch_invariant)
        value, stats[:, -1] = sums[:, 0].contiguous(), sums[:, 1]
        entropy = torch.where(m_flat, entropy, 0.0)
    return value.view(B, T), entropy.view(B, T), stats


def _split_heads(chunks, both, heads, stats: Tensor, group_name: str
                 ) -> Tuple[Tensor, Tensor]:
    """Over a split vocabulary: each chunk's shards of both models reduced to their statistics
    (a first pass over the chunks, each formed once more for the divergence after it), one
    all-gather of each model's (``top_k.whole_rows``): ``(the student's entropy, stats)`` with
    the whole rows' statistics in its first four columns."""
    entropy = torch.zeros(stats.shape[0], dtype=stats.dtype, device=stats.device)
    shard = [torch.zeros_like(stats[:, :2]), torch.zeros_like(stats[:, :2])]
    for chunk in chunks:
        tokens = chunk.tokens
        s_logits, t_logits, m = both(chunk)
        no_target = torch.zeros(m.shape, dtype=torch.long, device=m.device)
        _, shard[0][tokens], entropy_c = token_logprobs_fwd(s_logits, no_target, m, heads[0],
                                                            True)
        _, shard[1][tokens], _ = token_logprobs_fwd(t_logits, no_target, m, heads[1], False)
        entropy[tokens] = entropy_c[:, 0]
    s_stats, entropy = whole_rows(shard[0], entropy, heads[0], group_name)
    t_stats, _ = whole_rows(shard[1], torch.zeros_like(entropy), heads[1], group_name)
    stats[:, :2], stats[:, 2:4] = s_stats, t_stats
    return entropy, stats


@linear_distill_op.register_fake
def _(hidden, weight, bias, teacher, teacher_weight, teacher_bias, mask, *args):
    return distill_stats_fake(hidden, mask)


@custom_op("linear_distill_backward")
def linear_distill_backward_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                               teacher: Tensor, teacher_weight: Optional[Tensor],
                               teacher_bias: Optional[Tensor], mask: Tensor, stats: Tensor,
                               dvalue: Tensor, temperature: float, logit_scale: float,
                               softcap: float, teacher_temperature: float,
                               teacher_logit_scale: float, teacher_softcap: float, offset: int,
                               teacher_offset: int, function: str, params: List[float],
                               chunk_tokens: int, gather: bool, batch_invariant: bool,
                               group_name: str, needs: List[bool]
                               ) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` (empty where not needed) of ``linear_distill_op`` for the
    upstream ``dvalue [B, T]``: each chunk's logits formed again, the student's gradient
    written in place into its chunk."""
    chunks = HeadChunks(hidden, weight, bias, mask, mask, offset, chunk_tokens, gather,
                        batch_invariant=batch_invariant, fp32=True, needs=needs,
                        group_name=group_name)
    m_flat, dvalue = mask.reshape(-1), dvalue.reshape(-1)
    rows_of = _Teacher(teacher, teacher_weight, teacher_bias, teacher_offset, mask,
                       batch_invariant)
    heads = (HeadParams(temperature, logit_scale, softcap),
             HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap))
    for chunk in chunks:
        tokens = chunk.tokens
        if rows_of.on_chip:
            tiles = rows_of.tiles(chunk.hidden, weight, bias, tokens, m_flat[tokens], heads,
                                  (function, params))
            chunks.add_tiles(chunk, functools.partial(
                distill_head_backward, tiles, stats[tokens], dvalue[tokens]))
            continue
        logits = chunks.logits(chunk)
        distill_bwd(logits, 0, rows_of.chunk(tokens), m_flat[tokens, None], stats[tokens],
                    dvalue[tokens, None], *heads, (function, params), dlogits=logits)
        chunks.add(chunk, logits.to(weight.dtype))
    return chunks.gradients()


@linear_distill_backward_op.register_fake
def _(hidden, weight, bias, teacher, teacher_weight, teacher_bias, mask, stats, dvalue, *args):
    return head_gradients_fake(hidden, weight, bias, args[-1])


_LINEAR_FIELDS = ("temperature", "logit_scale", "softcap", "teacher_temperature",
                  "teacher_logit_scale", "teacher_softcap", "offset", "teacher_offset",
                  "function", "params", "chunk_tokens", "gather", "batch_invariant",
                  "group_name")


register_head_autograd(linear_distill_op, linear_distill_backward_op,
                       ("hidden", "weight", "bias", "teacher", "teacher_weight", "teacher_bias",
                        "mask"), _LINEAR_FIELDS)


@custom_op("linear_distill_loss")
def linear_distill_loss_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                           teacher: Tensor, teacher_weight: Optional[Tensor],
                           teacher_bias: Optional[Tensor], mask: Tensor, token_weights: Tensor,
                           temperature: float, logit_scale: float, softcap: float,
                           teacher_temperature: float, teacher_logit_scale: float,
                           teacher_softcap: float, offset: int, teacher_offset: int,
                           function: str, params: List[float], chunk_tokens: int, gather: bool,
                           batch_invariant: bool, needs: List[bool]
                           ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(loss, value [B, T], entropy [B, T], dhidden, dweight, dbias)``: the loss ``sum
    token_weights * value`` (``token_weights [B, T]``, 0 at masked positions; summed in fp64,
    rounded once) of ``linear_distill_op``'s divergence, with its gradients (the weight's and
    bias's accumulated in fp32; empty where not ``needs``) from one formation of each chunk."""
    acc = compute_dtype(hidden.dtype)
    B, T = mask.shape
    value = torch.zeros(B * T, dtype=acc, device=hidden.device)
    entropy = torch.zeros(B * T, dtype=acc, device=hidden.device)
    chunks = HeadChunks(hidden, weight, bias, mask, mask, offset, chunk_tokens, gather,
                        batch_invariant=batch_invariant, fp32=True, needs=needs)
    m_flat, w_flat = mask.reshape(-1), token_weights.reshape(-1)
    rows_of = _Teacher(teacher, teacher_weight, teacher_bias, teacher_offset, mask,
                       batch_invariant)
    heads = (HeadParams(temperature, logit_scale, softcap),
             HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap))
    for chunk in chunks:
        tokens = chunk.tokens
        if rows_of.on_chip:    # the forward's tiles, then the backward's
            keep = m_flat[tokens]
            tiles = rows_of.tiles(chunk.hidden, weight, bias, tokens, keep, heads,
                                  (function, params))
            value[tokens], entropy[tokens], stats_c = _on_chip(tiles, rows_of, tokens, keep,
                                                               heads)
            chunks.add_tiles(chunk, functools.partial(
                distill_head_backward, tiles, stats_c, w_flat[tokens]))
            continue
        logits = chunks.logits(chunk)
        t_logits, m = rows_of.chunk(tokens), m_flat[tokens, None]
        value_c, entropy_c, stats_c = distill_fwd(logits, t_logits, m, *heads,
                                                  (function, params))
        distill_bwd(logits, 0, t_logits, m, stats_c, w_flat[tokens, None], *heads,
                    (function, params), dlogits=logits)
        chunks.add(chunk, logits.to(weight.dtype))
        value[tokens], entropy[tokens] = value_c[:, 0], entropy_c[:, 0]
    loss = (value.double() * w_flat.double()).sum().to(acc)
    return (loss, value.view(B, T), entropy.view(B, T)) + chunks.gradients(accumulated=True)


@linear_distill_loss_op.register_fake
def _(hidden, weight, bias, teacher, teacher_weight, teacher_bias, mask, token_weights, *args):
    value, entropy, _ = distill_stats_fake(hidden, mask)
    return (value.new_empty(()), value, entropy) + head_gradients_fake(hidden, weight, bias,
                                                                      args[-1], True)


register_single_pass_autograd(linear_distill_loss_op)
