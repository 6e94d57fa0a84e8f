"""Fused GPPO: the bounds op, the loss (from log-probs or in one pass from logits) and the
nn.Module."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from ..api.args import check_bounds_args, check_gppo_args
from .._dispatch import falls_back_to
from .._types import LossOutput, compute_dtype
from ..kernels.regions import gppo_bounds_fwd
from ._op import custom_op
from .surrogate import surrogate_family_loss


@custom_op("gppo_bounds")
def gppo_bounds_op(old_logprobs: Tensor, geometry: str, topology: str, delta_low: float,
                   delta_high: float) -> Tuple[Tensor, Tensor]:
    return gppo_bounds_fwd(old_logprobs, geometry, topology, delta_low, delta_high)


@gppo_bounds_op.register_fake
def _(old_logprobs, geometry, topology, delta_low, delta_high):
    out = compute_dtype(old_logprobs.dtype)
    return (old_logprobs.new_empty(old_logprobs.shape, dtype=out),
            old_logprobs.new_empty(old_logprobs.shape, dtype=out))


@falls_back_to(reference.gppo_bounds)
def gppo_bounds(old_logprobs: torch.Tensor, *, geometry: str, topology: str,
                delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    delta = check_bounds_args(old_logprobs, geometry, topology, delta)
    return gppo_bounds_op(old_logprobs.detach(), geometry, topology, *delta)


@falls_back_to(reference.gppo_loss)
def gppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, *, geometry: str = "chi2", topology: str = "atomic",
              delta: float = 0.04, agg: str = "token-mean", dual_clip: Optional[float] = None,
              weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
              num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
              validate: bool = True) -> LossOutput:
    args = check_gppo_args(
        policy, old_logprobs, advantages, mask, geometry=geometry, topology=topology, delta=delta,
        agg=agg, dual_clip=dual_clip, weights=weights, loss_scale=loss_scale,
        num_tokens=num_tokens, num_sequences=num_sequences, validate=validate)
    return surrogate_family_loss(policy, old_logprobs, args, agg, validate=validate)
