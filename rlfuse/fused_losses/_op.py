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


def op_inputs(record, prefix: str = "", fields: Optional[Sequence[str]] = None) -> dict:
    """A frozen record (a ``NamedTuple``: an objective's ``TokenSurrogate``, a ``KLTerm``) as
    a custom op's flat inputs ``prefix + field`` (``fields``: those the op takes, default all).
    An op's schema takes no tuples and no int for a float: a tuple goes in as a list of floats,
    a number as a float; strings and bools as they are."""
    def flat(value):
        if isinstance(value, tuple):
            return [float(v) for v in value]
        return float(value) if type(value) in (int, float) else value

    return {prefix + name: flat(getattr(record, name))
            for name in (record._fields if fields is None else fields)}


def record_of(cls, inputs, prefix: str = "", **rest):
    """The record ``cls`` of a custom op's flat inputs (``op_inputs``): ``inputs`` a mapping
    (an op's arguments, ``locals()`` of its implementation) or a namedtuple of them; ``rest``:
    the record's fields the op does not take."""
    if hasattr(inputs, "_asdict"):
        inputs = inputs._asdict()
    fields = {name: inputs[prefix + name] for name in cls._fields if prefix + name in inputs}
    return cls(**{name: tuple(v) if isinstance(v, list) else v
                  for name, v in fields.items()}, **rest)


# A single-pass op takes a KL term as its estimator ("": none) and switches; its coefficient
# goes in with the row weights.
KL_INPUTS = ("estimator", "straight", "weighted", "clamp")
NO_KL = KLTerm("", 0.0)


def kl_inputs(kl: Optional[KLTerm]) -> dict:
    """A KL term (None: none) as a single-pass op's flat inputs ``kl_*``."""
    return op_inputs(kl or NO_KL, "kl_", KL_INPUTS)


def kl_of(inputs) -> Optional[KLTerm]:
    """The KL term of a single-pass op's flat inputs (``kl_inputs``), None for none."""
    kl = record_of(KLTerm, inputs, "kl_", coef=1.0)
    return kl if kl.estimator else None
