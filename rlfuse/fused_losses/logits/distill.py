"""Distillation's ops over the divergence kernels (``kernels.rows.distill``) between a ``Logits``
student's rows and a teacher's logits (a ``LinearHead`` teacher's window formed once, never
differentiated), the per-position divergence and the student's entropy:

- ``rlfuse::distill``: the forward reads each model's window rows twice, the backward once and
  writes the student's gradient once;
- ``rlfuse::distill_loss``: the loss in a single pass (each position's upstream gradient is
  its weight in the loss, known before the kernels: one launch reads the rows and writes the
  gradient, which the backward rescales by the loss's upstream gradient);
- ``rlfuse::vocab_split_distill``: ``distill`` over a split vocabulary.

A ``LinearHead`` student's are ``linear_distill``'s, chunk by chunk; which runs is the
student's form's (``form_ops``), the distillation itself ``distillation.token_divergence``.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor

from ...kernels.rows.distill import distill_bwd, distill_fwd, distill_single_pass
from ...kernels.lib.head_functions import HeadParams
from ...kernels.rows.logprobs import token_logprobs_fwd
from ...scaleout.vocab import group_sum
from .._op import custom_op, register_backward_op
from ..head.linear_distill import distill_stats_fake
from .scale_rows import register_single_pass_autograd
from ..top_k import whole_rows


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
