"""Distillation's op (``rlfuse::distill``) over the divergence kernels (``kernels.distill``):
from a student's and a teacher's ``Logits``, the per-position divergence and the student's
entropy, the forward reading each model's window rows twice, the backward once and writing the
student's gradient once. The other forms (a ``LinearHead`` on either side, a ``TopK`` teacher)
run the reference's twin (``reference.distill``) until their kernels exist."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import Tensor

from .._types import Logits, compute_dtype
from ..kernels.distill import DISTILL_STATS, distill_bwd, distill_fwd
from ..reference import distill as twin
from ._op import custom_op, register_autograd


def _window(logits: Tensor, offset: int, T: int) -> Tensor:
    window = logits[:, offset:offset + T]
    return window if window.stride(-1) == 1 else window.contiguous()


@custom_op("distill")
def distill_op(student: Tensor, teacher: Tensor, mask: Tensor, temperature: float,
               teacher_temperature: float, offset: int, teacher_offset: int, function: str,
               params: List[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(divergence [B, T], the student's entropy [B, T], stats [B T, DISTILL_STATS])`` of the
    rows ``[offset, offset + T)`` of ``student [B, S, V]`` and ``[teacher_offset, ... + T)`` of
    ``teacher``, ``mask [B, T]``, for a divergence's per-position ``function`` and its
    ``params`` (``DivergenceTerms``); the gradient is the whole student logits'."""
    T = mask.shape[1]
    return distill_fwd(_window(student, offset, T), _window(teacher, teacher_offset, T), mask,
                       temperature, teacher_temperature, (function, params))


@distill_op.register_fake
def _(student, teacher, mask, temperature, teacher_temperature, offset, teacher_offset,
      function, params):
    acc = compute_dtype(student.dtype)
    return (student.new_empty(mask.shape, dtype=acc), student.new_empty(mask.shape, dtype=acc),
            student.new_empty((mask.numel(), len(DISTILL_STATS)), dtype=acc))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs.student, inputs.teacher, inputs.mask, output[2])
    ctx.fields = (inputs.temperature, inputs.teacher_temperature, inputs.offset,
                  inputs.teacher_offset, inputs.function, inputs.params)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)


@custom_op("distill_backward")
def distill_backward_op(student: Tensor, teacher: Tensor, mask: Tensor, stats: Tensor,
                        dvalue: Tensor, temperature: float, teacher_temperature: float,
                        offset: int, teacher_offset: int, function: str,
                        params: List[float]) -> Tensor:
    """The gradient of ``distill_op``'s whole ``student`` logits for ``dvalue [B, T]``."""
    return distill_bwd(student, offset, _window(teacher, teacher_offset, mask.shape[1]), mask,
                       stats, dvalue, temperature, teacher_temperature, (function, params))


@distill_backward_op.register_fake
def _(student, teacher, mask, stats, dvalue, temperature, teacher_temperature, offset,
      teacher_offset, function, params):
    return torch.empty_like(student, memory_format=torch.contiguous_format)


def _backward(ctx, dvalue, _dentropy, _dstats):
    if dvalue is None:
        return None
    return {"student": distill_backward_op(*ctx.saved_tensors, dvalue, *ctx.fields)}


register_autograd(distill_op, _backward, _setup)


def token_divergence(student, teacher, divergence, mask: Tensor
                     ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """``reference.distill.token_divergence`` on the kernels where they exist (two ``Logits``),
    else the twin."""
    if not (isinstance(student, Logits) and isinstance(teacher, Logits)):
        return twin.token_divergence(student, teacher, divergence, mask)
    function, params = divergence.terms()
    value, entropy, _ = distill_op(student.logits, teacher.logits.detach(), mask,
                                   float(student.temperature), float(teacher.temperature),
                                   int(student.offset), int(teacher.offset), function,
                                   list(params))
    return value, entropy, {}
