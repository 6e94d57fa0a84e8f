"""Fused ``head_logits``: a head's logits by the fixed-order matmul (``kernels.tiles.matmul``), the
custom op and its autograd formula (each product of the backward in the same fixed order)."""
from __future__ import annotations

from typing import List, Optional, Tuple

from torch import Tensor

from ..._types import compute_dtype
from ...kernels.tiles.matmul import fixed_matmul
from .._op import custom_op, register_autograd


@custom_op("head_logits")
def head_logits_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``hidden [..., H] @ weight.T (+ bias)`` ``[..., V]`` in the weight's dtype."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    logits = fixed_matmul(rows, weight.t(), bias=bias, dtype=weight.dtype)
    return logits.reshape(*hidden.shape[:-1], weight.shape[0])


@head_logits_op.register_fake
def _(hidden, weight, bias):
    return hidden.new_empty((*hidden.shape[:-1], weight.shape[0]), dtype=weight.dtype)


@custom_op("head_logits_backward")
def head_logits_backward_op(grad: Tensor, hidden: Tensor, weight: Tensor,
                            needs: List[bool]) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)`` of ``grad [..., V]`` (empty where not needed), each
    product in the fixed order; the weight's and the bias's summed over the rows in fp32,
    rounded once."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    grad = grad.reshape(-1, weight.shape[0]).to(weight.dtype)
    acc = compute_dtype(weight.dtype)
    return (fixed_matmul(grad, weight, dtype=hidden.dtype).view(hidden.shape) if needs[0]
            else hidden.new_empty(0),
            fixed_matmul(grad.t(), rows, dtype=acc).to(weight.dtype) if needs[1]
            else weight.new_empty(0),
            grad.sum(0, dtype=acc).to(weight.dtype) if needs[2] else weight.new_empty(0))


@head_logits_backward_op.register_fake
def _(grad, hidden, weight, needs):
    return (hidden.new_empty(hidden.shape if needs[0] else (0,)),
            weight.new_empty(weight.shape if needs[1] else (0,)),
            weight.new_empty((weight.shape[0],) if needs[2] else (0,)))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs.hidden, inputs.weight)
    ctx.has_bias = inputs.bias is not None


def _backward(ctx, grad):
    hidden, weight = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:3]]
    needs[2] = needs[2] and ctx.has_bias
    found = head_logits_backward_op(grad, hidden, weight, needs)
    return {name: g for name, g, needed in zip(("hidden", "weight", "bias"), found, needs)
            if needed}


register_autograd(head_logits_op, _backward, _setup)


def head_logits(hidden: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``rlfuse.head_logits`` of checked arguments."""
    return head_logits_op(hidden, weight, bias)
