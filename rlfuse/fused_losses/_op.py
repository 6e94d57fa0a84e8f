"""How rlfuse registers its custom ops (``torch.ops.rlfuse.<name>``) and their autograd formulas.

Triton launches a kernel on the *current* CUDA device, not on its tensors' device: a call on
``cuda:1`` tensors while ``cuda:0`` is current would run on device 0 with device-1 pointers.
Every kernel launch happens inside an op's implementation, and every implementation runs here
under the device of its first tensor argument: the one place that guards them all.

An op's autograd formula sees its inputs by name (``inputs.mask``, not ``inputs[3]``) and
returns the gradients it has by name; every other input gets None.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from ..objectives import TokenSurrogate
from ..terms import KLTerm

_INPUTS: Dict[object, type] = {}   # op -> the namedtuple of its inputs


def device_guard(device: torch.device):
    """The context a launch on ``device`` runs in: that CUDA device made current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def custom_op(name: str, *, mutates_args: Sequence[str] = ()) -> Callable:
    """``torch.library.custom_op("rlfuse::<name>")`` over an implementation that runs under
    ``device_guard`` of its first tensor argument."""
    def register(impl: Callable):
        @functools.wraps(impl)
        def on_its_device(*args, **kwargs):
            device = next(a.device for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor))
            with device_guard(device):
                return impl(*args, **kwargs)

        schema = torch.library.infer_schema(impl, mutates_args=tuple(mutates_args))
        op = torch.library.custom_op(f"rlfuse::{name}", on_its_device,
                                     mutates_args=tuple(mutates_args), schema=schema)
        _INPUTS[op] = collections.namedtuple(f"{name.strip('_')}_inputs",
                                             list(inspect.signature(impl).parameters))
        return op

    return register


def input_names(op) -> Tuple[str, ...]:
    """The names of ``op``'s inputs, in order."""
    return _INPUTS[op]._fields


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """``op``'s autograd formula: ``setup_context(ctx, inputs, output)`` with the inputs as a
    namedtuple, and ``backward(ctx, *output_grads) -> {input name: gradient}``."""
    inputs_of = _INPUTS[op]
    names = inputs_of._fields

    def setup(ctx, inputs, output):
        setup_context(ctx, inputs_of(*inputs), output)

    def backward_all(ctx, *grads):
        named = backward(ctx, *grads) or {}
        unknown = set(named) - set(names)
        if unknown:
            raise TypeError(f"rlfuse::{op._name}: gradients of unknown inputs {sorted(unknown)}")
        return tuple(named.get(name) for name in names)

    op.register_autograd(backward_all, setup_context=setup)


def register_backward_op(op, backward_op, saved: Sequence[str], fields: Sequence[str],
                         gradients: Callable) -> None:
    """The autograd of an op whose outputs are ``(differentiable, no gradient, stats)`` and
    whose gradient is ``backward_op(*saved inputs, stats, upstream, *fields, *extra)``:
    ``gradients(ctx, call)`` calls it (``call(*extra)``) and returns ``{input name:
    gradient}``; None where no gradient came."""
    def setup(ctx, inputs, output):
        ctx.save_for_backward(*(getattr(inputs, name) for name in saved), output[2])
        ctx.fields = tuple(getattr(inputs, name) for name in fields)
        ctx.mark_non_differentiable(output[1], output[2])
        ctx.set_materialize_grads(False)

    def backward(ctx, upstream, *_):
        if upstream is None:
            return None
        return gradients(ctx, lambda *extra: backward_op(*ctx.saved_tensors, upstream,
                                                         *ctx.fields, *extra))

    register_autograd(op, backward, setup)


def surrogate_fields(surrogate: TokenSurrogate) -> dict:
    """A ``TokenSurrogate`` as a surrogate op's flat inputs (an op's schema takes no tuples)."""
    function, geometry, topology, delta_low, delta_high, params, clamp = surrogate
    return dict(function=function, geometry=geometry, topology=topology,
                delta_low=float(delta_low), delta_high=float(delta_high),
                params=[float(p) for p in params], clamp=float(clamp))


def surrogate_of(inputs) -> TokenSurrogate:
    """The ``TokenSurrogate`` of a surrogate op's named inputs (``surrogate_fields``)."""
    return TokenSurrogate(inputs.function, inputs.geometry, inputs.topology, inputs.delta_low,
                          inputs.delta_high, tuple(inputs.params), inputs.clamp)


def kl_fields(kl: Optional[KLTerm]) -> dict:
    """A KL term as a single-pass op's flat inputs (``kl_estimator`` empty: none; its
    coefficient goes in with the row weights)."""
    kl = kl or KLTerm("", 0.0)
    return dict(kl_estimator=kl.estimator, kl_straight=kl.straight, kl_weighted=kl.weighted,
                kl_clamp=kl.clamp)


def kl_of(kl_estimator: str, kl_straight: bool, kl_weighted: bool,
          kl_clamp: bool) -> Optional[KLTerm]:
    """The KL term of a single-pass op's flat inputs (``kl_fields``; its coefficient is in the
    row weights), None for none."""
    if not kl_estimator:
        return None
    return KLTerm(kl_estimator, 1.0, kl_straight, kl_weighted, kl_clamp)
