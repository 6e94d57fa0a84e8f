"""What a head puts after the matmul that forms a logit, as the row kernels apply it: the
scalars of a head (``HeadParams``: the temperature, a logit scale, a softcap) and the softcap
``cap tanh(x cap_in)`` with its derivative (``softcap``), each logit as its block is read."""
from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .utils import LOG2E, fp64_args

# tanh(u) = u + u^3 P(u^2) for |u| < _TANH_SMALL (least-squares fits of (tanh(u) / u - 1) / u^2
# in u^2 on [0, 0.390625], weighted to tanh's relative error: within 1 ulp in fp32 and fp64),
# 1 - 2 / (e^(2|u|) + 1) above it, where the subtraction loses no more than one bit.
_TANH_SMALL = tl.constexpr(0.625)


class HeadParams(NamedTuple):
    """What a head puts after the matmul that forms a logit x, then the temperature: ``z =
    softcap(logit_scale x) / temperature`` with ``softcap(y) = cap tanh(y / cap)`` (``softcap``
    0: none): the one form of these scalars every launcher, op and split takes (a ``Logits``
    has the temperature alone)."""

    temperature: float = 1.0
    logit_scale: float = 1.0
    softcap: float = 0.0

    @classmethod
    def of(cls, policy) -> "HeadParams":
        """The head of a ``Logits`` (its temperature) or a ``LinearHead``."""
        return cls(float(policy.temperature), float(getattr(policy, "logit_scale", 1.0)),
                   float(getattr(policy, "softcap", None) or 0.0))

    @property
    def inv_temp(self) -> float:
        """The factor that turns the logit ``x`` the row kernels keep their statistics in into
        ``z = x * inv_temp``: without a softcap ``x`` is the raw logit and the scale folds in
        (``logit_scale / temperature``); with one ``x`` is ``softcap(logit_scale logit)``
        (``1 / temperature``). A row's max, and every logit compared with it, is in those
        units."""
        return (1.0 if self.softcap else float(self.logit_scale)) / float(self.temperature)

    def kernel_args(self):
        """``(head, SOFTCAP)`` as the row kernels take them: ``head`` the fp64 pairs
        (``utils.fp64_args``) of ``(inv_temp, cap, cap_in)``, ``cap_in = logit_scale / cap``
        (``(inv_temp, 1, 1)`` without a softcap), which ``utils.fp64_values`` sums in the
        kernel."""
        if self.softcap:
            values = (self.inv_temp, self.softcap, self.logit_scale / self.softcap)
        else:
            values = (self.inv_temp, 1.0, 1.0)
        return fp64_args(values), bool(self.softcap)


@triton.jit
def _tanh(u, ACC: tl.constexpr):
    """(tanh u, 1 - tanh^2 u), each within a few ulp (the second: relative, also where tanh u
    rounds to +-1: 1 - t^2 = r (2 - r) with r = 1 - |t| formed without cancelling)."""
    a = tl.abs(u)
    r = 2.0 / (tl.math.exp2(a * (2.0 * LOG2E)) + 1.0)      # 1 - tanh |u|, 0 past overflow
    v = u * u
    # Horner's steps as p * v + c (a Python float takes the tensor's dtype there, where an fma's
    # argument would be an fp32 constant; the compiler fuses each step into one fma)
    if ACC == tl.float64:
        p = v * -1.6076230392177118e-05 + 7.715145163688556e-05
        p = p * v - 0.00022856992745814506
        p = p * v + 0.0005863189975412841
        p = p * v - 0.001454959463096882
        p = p * v + 0.003591989240119084
        p = p * v - 0.008863221001908643
        p = p * v + 0.021869487574973215
        p = p * v - 0.05396825393114249
        p = p * v + 0.13333333333261532
        p = p * v - 0.3333333333333285
    else:
        p = v * -0.005704042501747608 + 0.020637862384319305
        p = p * v - 0.05373915657401085
        p = p * v + 0.133314311504364
        p = p * v - 0.3333328068256378
    t_small = tl.fma(u * v, p, u)
    small = a < _TANH_SMALL
    t = tl.where(small, t_small, tl.where(u < 0, r - 1.0, 1.0 - r))
    return t, tl.where(small, 1.0 - t_small * t_small, r * (2.0 - r))


@triton.jit
def softcap(x, cap, cap_in, ACC: tl.constexpr):
    """(cap tanh(x cap_in), its derivative over cap cap_in): a logit through the head's softcap
    (``HeadParams``)."""
    t, dt = _tanh(x * tl.cast(cap_in, ACC), ACC)
    return tl.cast(cap, ACC) * t, dt
