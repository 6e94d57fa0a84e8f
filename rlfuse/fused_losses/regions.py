"""Fused trust regions: the op that exports GPPO's per-token bounds (``rlfuse.gppo_bounds``)."""
from __future__ import annotations

from typing import Tuple

from torch import Tensor

from .._types import compute_dtype
from ..kernels.lib.regions import gppo_bounds_fwd
from ._op import custom_op


@custom_op("gppo_bounds")
def gppo_bounds_op(old_logprobs: Tensor, geometry: str, topology: str, delta_low: float,
                   delta_high: float) -> Tuple[Tensor, Tensor]:
    return gppo_bounds_fwd(old_logprobs, geometry, topology, delta_low, delta_high)


@gppo_bounds_op.register_fake
def _(old_logprobs, geometry, topology, delta_low, delta_high):
    out = compute_dtype(old_logprobs.dtype)
    return (old_logprobs.new_empty(old_logprobs.shape, dtype=out),
            old_logprobs.new_empty(old_logprobs.shape, dtype=out))


def gppo_bounds(old_logprobs: Tensor, surrogate) -> Tuple[Tensor, Tensor]:
    """``(lo, hi)`` of a ``TokenSurrogate``'s region at each token (``rlfuse.gppo_bounds``)."""
    _, geometry, topology, delta_low, delta_high = surrogate[:5]
    return gppo_bounds_op(old_logprobs, geometry, topology, delta_low, delta_high)
