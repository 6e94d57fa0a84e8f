"""Distillation's ops over the divergence kernels (``kernels.distill``), the per-position
divergence and the student's entropy:

- ``rlfuse::distill``, between two ``Logits`` (a ``LinearHead`` teacher beside them: its
  window's logits formed once, never differentiated): the forward reads each model's window
  rows twice, the backward once and writes the student's gradient once;
- ``rlfuse::linear_distill``, a ``LinearHead`` student (and a ``LinearHead`` or ``Logits``
  teacher): each chunk of tokens' logits formed in fp32 by one matmul per model (never
  rounded to a bf16 head's dtype) and reduced as above; the backward forms both chunks once
  more, writes the student's gradient in place into its chunk and turns it, in the head's
  dtype, into the gradients of the hidden states, weight and bias at once. No ``[N, V]``
  tensor of either model exists.

- a ``TopK`` teacher: the student's log-probs at its ids (``top_k``'s ops), verl's top-k
  forward KL on those ``[B, T, k]`` (``reference.distill``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .._types import LinearHead, Logits, TopK, compute_dtype
from ..kernels.distill import DISTILL_STATS, distill_bwd, distill_fwd
from ..kernels.head import HeadParams
from ..reference import distill as twin
from ._op import custom_op, register_backward_op
from .head_matmuls import HeadGradients, chunk_logits
from .linear_head import (Rows, chunk_tokens_for, head_fields, head_gradients_fake,
                          register_head_autograd)
from .top_k import linear_logprobs_at_op, logprobs_at_op, whole_rows
from ..kernels.logprobs import token_logprobs_fwd
from ..scaleout.vocab import group_sum


def window_rows(logits: Tensor, offset: int, T: int) -> Tensor:
    """The rows ``[offset, offset + T)`` of ``logits [B, S, V]`` as the kernels read them."""
    window = logits[:, offset:offset + T]
    return window if window.stride(-1) == 1 else window.contiguous()


def distill_stats_fake(student: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """The fake ``(value, entropy, stats)`` of a distillation op."""
    acc = compute_dtype(student.dtype)
    return (student.new_empty(mask.shape, dtype=acc), student.new_empty(mask.shape, dtype=acc),
            student.new_empty((mask.numel(), len(DISTILL_STATS)), dtype=acc))


# --------------------------------------------------------------------------------------------
# Two Logits
# --------------------------------------------------------------------------------------------

@custom_op("distill")
def distill_op(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float,
               teacher_temperature: float, offset: int, teacher_offset: int, function: str,
               params: List[float], teacher_logit_scale: float = 1.0,
               teacher_softcap: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """``(divergence [B, T], the student's entropy [B, T], stats [B T, DISTILL_STATS])`` of the
    rows ``[offset, offset + T)`` of ``student [B, S, V]`` and ``[teacher_offset, ... + T)`` of
    ``teacher``, ``mask [B, T]``, for a divergence's per-position ``function`` and its
    ``params`` (``DivergenceTerms``; the teacher's rows: raw logits of a head with
    ``teacher_logit_scale`` and ``teacher_softcap``); the gradient is the whole student
    logits'."""
    T = mask.shape[1]
    return distill_fwd(window_rows(student, offset, T), window_rows(teacher, teacher_offset, T),
                       mask, HeadParams(temperature),
                       HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap),
                       (function, params))


@distill_op.register_fake
def _(student, teacher, mask, temperature, teacher_temperature, offset, teacher_offset,
      function, params, teacher_logit_scale=1.0, teacher_softcap=0.0):
    return distill_stats_fake(student, mask)


@custom_op("distill_backward")
def distill_backward_op(student: Tensor, teacher: Tensor, mask: Tensor, stats: Tensor,
                        dvalue: Tensor, temperature: float, teacher_temperature: float,
                        offset: int, teacher_offset: int, function: str, params: List[float],
                        teacher_logit_scale: float = 1.0,
                        teacher_softcap: float = 0.0) -> Tensor:
    """The gradient of ``distill_op``'s whole ``student`` logits for ``dvalue [B, T]``."""
    return distill_bwd(student, offset, window_rows(teacher, teacher_offset, mask.shape[1]),
                       mask, stats, dvalue, HeadParams(temperature),
                       HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap),
                       (function, params))


@distill_backward_op.register_fake
def _(student, teacher, mask, stats, dvalue, temperature, teacher_temperature, offset,
      teacher_offset, function, params, teacher_logit_scale=1.0, teacher_softcap=0.0):
    return torch.empty_like(student, memory_format=torch.contiguous_format)


# the inputs distill_backward_op takes besides the saved tensors and the upstream gradient
DISTILL_FIELDS = ("temperature", "teacher_temperature", "offset", "teacher_offset", "function",
                  "params", "teacher_logit_scale", "teacher_softcap")


def register_distill_autograd(op) -> None:
    """The autograd of a distillation op between two rows of logits (``distill_op``'s inputs):
    the student's gradient by ``distill_backward_op``."""
    register_backward_op(op, distill_backward_op, ("student", "teacher", "mask"),
                         DISTILL_FIELDS, lambda ctx, call: {"student": call()})


register_distill_autograd(distill_op)


# --------------------------------------------------------------------------------------------
# A LinearHead student, chunk by chunk
# --------------------------------------------------------------------------------------------

class _Teacher:
    """A chunk's rows of the teacher: of its hidden states through its head (``weight`` given)
    or of its logits, at the flat rows ``b S_t + teacher_offset + t`` of the chunk's tokens."""

    def __init__(self, teacher: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 offset: int, T: int, batch_invariant: bool):
        self.flat = teacher.reshape(-1, teacher.shape[-1])
        self.S, self.offset, self.T = teacher.shape[1], offset, T
        self.weight, self.bias, self.batch_invariant = weight, bias, batch_invariant

    def chunk(self, tokens: Tensor) -> Tensor:
        rows = self.flat[(tokens // self.T) * self.S + self.offset + tokens % self.T]
        if self.weight is None:
            return rows.unsqueeze(1)
        return chunk_logits(rows, self.weight, self.bias, self.batch_invariant, fp32=True)


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
    h_flat, m_flat = hidden.reshape(-1, hidden.shape[-1]), mask.reshape(-1)
    rows_of = _Teacher(teacher, teacher_weight, teacher_bias, teacher_offset, T, batch_invariant)
    heads = (HeadParams(temperature, logit_scale, softcap),
             HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap))
    chunks = Rows(hidden, mask, mask, offset, gather).chunks(chunk_tokens)

    def both(tokens, rows):
        return (chunk_logits(h_flat[rows], weight, bias, batch_invariant, fp32=True),
                rows_of.chunk(tokens), m_flat[tokens, None])

    if group_name:
        entropy, stats = _split_heads(chunks, both, heads, stats, group_name)
    for tokens, rows in chunks:
        value_c, entropy_c, stats_c = distill_fwd(*both(tokens, rows), *heads,
                                                  (function, params),
                                                  stats[tokens] if group_name else None)
        value[tokens], stats[tokens] = value_c[:, 0], stats_c
        if not group_name:
            entropy[tokens] = entropy_c[:, 0]
    if group_name:
        sums = torch.stack([value, stats[:, -1]], -1)
        group_sum(sums, group_name)
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
    for tokens, rows in chunks:
        s_logits, t_logits, m = both(tokens, rows)
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
    grads = HeadGradients(hidden, weight, bias, tuple(needs), group_name, batch_invariant)
    T = mask.shape[1]
    h_flat, m_flat, dvalue = hidden.reshape(-1, hidden.shape[-1]), mask.reshape(-1), \
        dvalue.reshape(-1)
    rows_of = _Teacher(teacher, teacher_weight, teacher_bias, teacher_offset, T, batch_invariant)
    heads = (HeadParams(temperature, logit_scale, softcap),
             HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap))
    for tokens, rows in Rows(hidden, mask, mask, offset, gather).chunks(chunk_tokens):
        h_rows = h_flat[rows]
        logits = chunk_logits(h_rows, weight, bias, batch_invariant, fp32=True)
        distill_bwd(logits, 0, rows_of.chunk(tokens), m_flat[tokens, None], stats[tokens],
                    dvalue[tokens, None], *heads, (function, params), dlogits=logits)
        grads.add(logits.to(weight.dtype), h_rows, rows)
    return grads.results(hidden, weight)


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


def _top_k_divergence(student, teacher: TopK, divergence, mask: Tensor, validate: bool
                      ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """A ``TopK`` teacher: the student's log-probs at its ids (``top_k``'s ops, over a split
    vocabulary too), then verl's top-k forward KL on those ``[B, T, k]``."""
    ids = torch.where(mask.unsqueeze(-1), teacher.ids, 0).long()   # masked: never read
    group = student.vocab_parallel_group
    group_name = "" if group is None else group.group_name
    if isinstance(student, LinearHead):
        s_k, entropy, _ = linear_logprobs_at_op(
            student.hidden, student.weight, student.bias, ids, mask, **head_fields(student),
            offset=int(student.offset),
            chunk_tokens=chunk_tokens_for(student.weight, student.chunk_tokens, mask.numel()),
            gather=validate, batch_invariant=bool(student.batch_invariant),
            group_name=group_name)
    else:
        s_k, entropy, _ = logprobs_at_op(student.logits, ids, mask, float(student.temperature),
                                         int(student.offset), group_name)
    value, extras = twin.top_k_divergence(s_k, teacher.logprobs.detach(), divergence)
    return twin.at_actor_positions(mask, value, entropy, extras)


def _split_divergence(student, teacher, divergence, mask: Tensor
                      ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """Over a split vocabulary (``vocab_split.vocab_split_distill_op``): a ``Logits`` student
    beside a ``Logits`` or ``LinearHead`` teacher (its shard's logits formed once)."""
    from .vocab_split import vocab_split_distill_op

    T = mask.shape[1]
    teacher = _detached(teacher)
    t_head = HeadParams.of(teacher)
    t_logits, t_offset = (teacher.logits, int(teacher.offset)) if isinstance(teacher, Logits) \
        else (_teacher_logits(teacher, T), 0)
    function, params = divergence.terms()
    value, entropy, _ = vocab_split_distill_op(
        student.logits, t_logits, mask, float(student.temperature), t_head.temperature,
        int(student.offset), t_offset, function, list(params),
        student.vocab_parallel_group.group_name, t_head.logit_scale, t_head.softcap)
    return value, entropy, {}


def _detached(teacher):
    """The teacher with its tensors detached (it is never differentiated)."""
    return teacher._replace(**{f: getattr(teacher, f).detach() for f in
                               ("logits", "hidden", "weight", "bias")
                               if isinstance(getattr(teacher, f, None), Tensor)})


def _teacher_logits(teacher: LinearHead, T: int) -> Tensor:
    """A teacher head's raw logits of its window ``[B, T, V]``, formed once."""
    window = teacher.hidden[:, int(teacher.offset):int(teacher.offset) + T]
    return chunk_logits(window.reshape(-1, window.shape[-1]), teacher.weight, teacher.bias,
                        bool(teacher.batch_invariant)).view(*window.shape[:2], -1)


def token_divergence(student, teacher, divergence, mask: Tensor, validate: bool = False
                     ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """``reference.distill.token_divergence`` on the kernels;
    ``validate``: a ``LinearHead`` student forms the logits of the actor positions only (reads
    the mask on the host)."""
    if isinstance(teacher, TopK):
        return _top_k_divergence(student, teacher, divergence, mask, validate)
    group = student.vocab_parallel_group
    if group is not None and isinstance(student, Logits):
        return _split_divergence(student, teacher, divergence, mask)
    function, params = divergence.terms()
    teacher = _detached(teacher)
    t_head = HeadParams.of(teacher)
    if isinstance(student, LinearHead):
        t_rows, t_weight, t_bias = (teacher.logits, None, None) if isinstance(teacher, Logits) \
            else (teacher.hidden, teacher.weight, teacher.bias)
        chunk = chunk_tokens_for(student.weight, student.chunk_tokens, mask.numel())
        value, entropy, _ = linear_distill_op(
            student.hidden, student.weight, student.bias, t_rows, t_weight, t_bias, mask,
            **head_fields(student), teacher_temperature=t_head.temperature,
            teacher_logit_scale=t_head.logit_scale, teacher_softcap=t_head.softcap,
            offset=int(student.offset), teacher_offset=int(teacher.offset), function=function,
            params=list(params), chunk_tokens=chunk, gather=validate,
            batch_invariant=bool(student.batch_invariant),
            group_name="" if group is None else group.group_name)
        return value, entropy, {}
    T = mask.shape[1]
    t_logits, t_offset = (teacher.logits, int(teacher.offset)) if isinstance(teacher, Logits) \
        else (_teacher_logits(teacher, T), 0)
    value, entropy, _ = distill_op(student.logits, t_logits, mask, float(student.temperature),
                                   t_head.temperature, int(student.offset), t_offset, function,
                                   list(params), t_head.logit_scale, t_head.softcap)
    return value, entropy, {}
