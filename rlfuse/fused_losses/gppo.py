"""Fused GPPO: the bounds op, the loss (from log-probs or in one pass from logits) and the
nn.Module."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import reference
from .._contract import aggregation_weights, check_bounds_args, check_gppo_args
from .._dispatch import falls_back_to
from .._types import LossOutput, compute_dtype
from ._op import custom_op
from .surrogate import Region, surrogate_loss, surrogate_metrics


@custom_op("gppo_bounds")
def gppo_bounds_op(old_logprobs: Tensor, geometry: str, topology: str, delta_low: float,
                   delta_high: float) -> Tuple[Tensor, Tensor]:
    from ..kernels.gppo import gppo_bounds_kernel

    return gppo_bounds_kernel(old_logprobs, geometry, topology, (delta_low, delta_high))


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


def run_surrogate(policy, old_logprobs, args, agg: str, region: Region, *, validate: bool,
                  sequence: bool = False) -> LossOutput:
    """A surrogate-family loss (GPPO, PPO) from its normalised ``args``."""
    cdt = args.info.compute_dtype
    weights = args.loss_scale * aggregation_weights(args.mask, agg, cdt,
                                                    num_tokens=args.num_tokens,
                                                    num_sequences=args.num_sequences)
    old = None if old_logprobs is None else old_logprobs.detach()
    w = None if args.weights is None else args.weights.detach()
    loss, totals = surrogate_loss(policy, old, args.advantages.detach(), args.mask, weights,
                                  region, weights=w, sequence=sequence, validate=validate)
    return LossOutput(loss, surrogate_metrics(totals, args.mask.sum().to(cdt)))


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
    region = Region(geometry, topology, *args.delta, args.dual_clip)
    return run_surrogate(policy, old_logprobs, args, agg, region, validate=validate)


class GPPOLoss(torch.nn.Module):
    """``gppo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, geometry: str = "chi2", topology: str = "atomic", delta=0.04,
                 agg: str = "token-mean", dual_clip: Optional[float] = None,
                 loss_scale: float = 1.0, validate: bool = True):
        super().__init__()
        self.kwargs = dict(geometry=geometry, topology=topology, delta=delta, agg=agg,
                           dual_clip=dual_clip, loss_scale=loss_scale, validate=validate)

    def forward(self, policy, old_logprobs, advantages, mask, *, weights=None, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return gppo_loss(policy, old_logprobs, advantages, mask, weights=weights,
                         num_tokens=num_tokens, num_sequences=num_sequences, **self.kwargs)
