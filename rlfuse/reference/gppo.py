"""Reference GPPO: the clipped surrogate over the proximal region of an f-divergence."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..api.args import check_bounds_args, check_gppo_args
from .._docs import documented
from .._types import LossOutput, compute_dtype
from .regions import region_bounds
from .surrogate import surrogate, surrogate_metrics


@documented
def gppo_bounds(old_logprobs: torch.Tensor, *, geometry: str, topology: str,
                delta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    delta = check_bounds_args(old_logprobs, geometry, topology, delta)
    lo, hi = region_bounds(old_logprobs, geometry, topology, delta)
    out = compute_dtype(old_logprobs.dtype)
    return lo.to(out), hi.to(out)


@documented
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
    result = surrogate(policy, old_logprobs, args.advantages, args.mask, args.objective,
                       compute_dtype=args.info.compute_dtype, agg=agg, weights=args.weights,
                       loss_scale=args.loss_scale, num_tokens=args.num_tokens,
                       num_sequences=args.num_sequences, validate=validate)
    return LossOutput(result.loss, surrogate_metrics(result, args.mask))
