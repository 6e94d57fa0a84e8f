"""Distillation's ops over the divergence kernels (``kernels.distill``), the per-position
divergence and the student's entropy:

- ``rlfuse::distill``, between two ``Logits`` (a ``LinearHead`` teacher beside them: its
  window's logits formed once, never differentiated): the forward reads each model's window
  rows twice, the backward once and writes the student's gradient once; ``rlfuse::distill_loss``
  the loss in a single pass (each position's upstream gradient is its weight in the loss,
  known before the kernels: one launch reads the rows and writes the gradient, which the
  backward rescales by the loss's upstream gradient);
  ``rlfuse::vocab_split_distill`` the same over a split vocabulary;
- a ``LinearHead`` student: ``linear_distill``'s ops, chunk by chunk;
- a ``TopK`` teacher: the student's log-probs at its ids (``top_k``'s ops), verl's top-k
  forward KL on those ``[B, T, k]`` (``reference.distill``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..forms import LinearHead, Logits, TopK
from ..kernels.distill import distill_bwd, distill_fwd, distill_single_pass
from ..kernels.head import HeadParams
from ..kernels.logprobs import token_logprobs_fwd
from ..scaleout.vocab import group_sum
from ..reference import distill as twin
from ._op import custom_op, register_backward_op
from .head_matmuls import chunk_logits
from .linear_distill import distill_stats_fake, linear_distill_loss_op, linear_distill_op
from .linear_head import chunk_tokens_for, head_fields
from .scale_rows import register_single_pass_autograd
from .top_k import linear_logprobs_at_op, logprobs_at_op, whole_rows


def window_rows(logits: Tensor, offset: int, T: int) -> Tensor:
    """The rows ``[offset, offset + T)`` of ``logits [B, S, V]`` as the kernels read them."""
    window = logits[:, offset:offset + T]
    return window if window.stride(-1) == 1 else window.contiguous()


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


@custom_op("distill_loss")
def distill_loss_op(student: Tensor, teacher: Tensor, mask: Tensor, token_weights: Tensor,
                    temperature: float, teacher_temperature: float, offset: int,
                    teacher_offset: int, function: str, params: List[float],
                    teacher_logit_scale: float = 1.0, teacher_softcap: float = 0.0
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, divergence [B, T], entropy [B, T], dlogits [B, S, V])``: ``distill_op``'s
    divergence and the loss ``sum token_weights * divergence`` (``token_weights [B, T]``, 0 at
    masked positions; summed in fp64, rounded once) in a single pass, the gradient of the whole
    ``student`` logits for an upstream gradient of 1 written in the forward."""
    T = mask.shape[1]
    value, entropy, dlogits = distill_single_pass(
        student, offset, window_rows(teacher, teacher_offset, T), mask, token_weights,
        HeadParams(temperature),
        HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap),
        (function, params))
    loss = (value.double() * token_weights.double()).sum().to(value.dtype)
    return loss, value, entropy, dlogits


@distill_loss_op.register_fake
def _(student, teacher, mask, token_weights, *args):
    value, entropy, _ = distill_stats_fake(student, mask)
    return (value.new_empty(()), value, entropy,
            torch.empty_like(student, memory_format=torch.contiguous_format))


register_single_pass_autograd(distill_loss_op, "student")


# --------------------------------------------------------------------------------------------
# Two Logits over a split vocabulary
# --------------------------------------------------------------------------------------------

@custom_op("vocab_split_distill")
def vocab_split_distill_op(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float,
                           teacher_temperature: float, offset: int, teacher_offset: int,
                           function: str, params: List[float], group_name: str,
                           teacher_logit_scale: float = 1.0,
                           teacher_softcap: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """``distill.distill_op``'s outputs from this rank's shards ``[B, S, V_l]`` of both models'
    rows: each shard reduced to its statistics (``token_logprobs``' forward: one read), one
    all-gather of each model's (``top_k.whole_rows``: the whole rows' max, log-sum and the
    student's entropy), the divergence's terms of the shard from the whole rows' statistics
    (a second read), one all-reduce of the value and aux. The backward is the shard's own
    (``distill_backward_op``: no collective)."""
    B, T = mask.shape
    heads = (HeadParams(temperature),
             HeadParams(teacher_temperature, teacher_logit_scale, teacher_softcap))
    no_target = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    whole = []
    for rows, rows_offset, head in ((student, offset, heads[0]),
                                    (teacher, teacher_offset, heads[1])):
        _, stats, entropy = token_logprobs_fwd(rows, no_target, mask, head, True, rows_offset)
        whole.append(whole_rows(stats, entropy, head, group_name))
    (s_stats, entropy), (t_stats, _) = whole
    stats = torch.cat([s_stats, t_stats, torch.zeros_like(s_stats[:, :1])], -1)
    value, _, stats = distill_fwd(window_rows(student, offset, T),
                                  window_rows(teacher, teacher_offset, T), mask, *heads,
                                  (function, params), stats=stats)
    sums = torch.stack([value.reshape(-1), stats[:, -1]], -1)
    group_sum(sums, group_name)
    stats[:, -1] = sums[:, 1]
    return sums[:, 0].contiguous().view(B, T), torch.where(mask, entropy.view(B, T), 0.0), stats


@vocab_split_distill_op.register_fake
def _(student, teacher, mask, *args, **kwargs):
    return distill_stats_fake(student, mask)


register_distill_autograd(vocab_split_distill_op)


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
    """Over a split vocabulary (``vocab_split_distill_op``): a ``Logits`` student
    beside a ``Logits`` or ``LinearHead`` teacher (its shard's logits formed once)."""
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


def token_divergence(student, teacher, divergence, mask: Tensor, validate: bool = False,
                     token_weights: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Tensor, Dict[str, Tensor], Optional[Tensor]]:
    """``reference.distill.token_divergence`` on the kernels; ``validate``: a ``LinearHead``
    student forms the logits of the actor positions only (reads the mask on the host). With
    ``token_weights`` (each position's weight in a loss) a ``LinearHead`` student beside a
    whole model's teacher gives that loss from its single pass (``linear_distill_loss``), and a
    ``Logits`` student with a gradient from its single pass (``distill_loss_op``)."""
    if isinstance(student, Logits) and student.logits.stride(-1) != 1:
        # the kernels read a row's logits at unit stride (the gradient flows through the copy)
        student = student._replace(logits=student.logits.contiguous())
    if isinstance(teacher, TopK):
        return (*_top_k_divergence(student, teacher, divergence, mask, validate), None)
    group = student.vocab_parallel_group
    if group is not None and isinstance(student, Logits):
        return (*_split_divergence(student, teacher, divergence, mask), None)
    function, params = divergence.terms()
    teacher = _detached(teacher)
    t_head = HeadParams.of(teacher)
    if isinstance(student, LinearHead):
        t_rows, t_weight, t_bias = (teacher.logits, None, None) if isinstance(teacher, Logits) \
            else (teacher.hidden, teacher.weight, teacher.bias)
        fields = dict(
            **head_fields(student), teacher_temperature=t_head.temperature,
            teacher_logit_scale=t_head.logit_scale, teacher_softcap=t_head.softcap,
            offset=int(student.offset), teacher_offset=int(teacher.offset), function=function,
            params=list(params),
            chunk_tokens=chunk_tokens_for(student.weight, student.chunk_tokens, mask.numel()),
            gather=validate, batch_invariant=bool(student.batch_invariant))
        models = (student.hidden, student.weight, student.bias, t_rows, t_weight, t_bias, mask)
        if token_weights is not None and group is None:
            needs = [x is not None and x.requires_grad
                     for x in (student.hidden, student.weight, student.bias)]
            loss, value, entropy, *_ = linear_distill_loss_op(*models, token_weights, **fields,
                                                             needs=needs)
            return value, entropy, {}, loss
        value, entropy, _ = linear_distill_op(
            *models, **fields, group_name="" if group is None else group.group_name)
        return value, entropy, {}, None
    T = mask.shape[1]
    t_logits, t_offset = (teacher.logits, int(teacher.offset)) if isinstance(teacher, Logits) \
        else (_teacher_logits(teacher, T), 0)
    if token_weights is not None and _single_pass(student.logits):
        loss, value, entropy, _ = distill_loss_op(
            student.logits, t_logits, mask, token_weights, float(student.temperature),
            t_head.temperature, int(student.offset), t_offset, function, list(params),
            t_head.logit_scale, t_head.softcap)
        return value, entropy, {}, loss
    value, entropy, _ = distill_op(student.logits, t_logits, mask, float(student.temperature),
                                   t_head.temperature, int(student.offset), t_offset, function,
                                   list(params), t_head.logit_scale, t_head.softcap)
    return value, entropy, {}, None


def _single_pass(logits: Tensor) -> bool:
    """Whether a loss from the student's ``logits`` runs as a single pass: when their gradient
    is wanted, and not in fp16, whose range would lose the small gradients a loss scaler's
    upstream 2^16 is meant to keep (the two passes form them at the true upstream scale)."""
    return logits.requires_grad and torch.is_grad_enabled() and logits.dtype != torch.float16
