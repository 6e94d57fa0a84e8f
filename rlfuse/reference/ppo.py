"""Reference PPO family: GRPO, DAPO (clip-higher), Dr. GRPO, GSPO — the clipped surrogate that
trainers run today."""
from __future__ import annotations

from typing import Optional

import torch

from ..api.args import check_ppo_args
from .._docs import documented
from .._types import LossOutput
from .surrogate import surrogate, surrogate_metrics


@documented
def ppo_loss(policy, old_logprobs: Optional[torch.Tensor], advantages: torch.Tensor,
             mask: torch.Tensor, *, clip=0.2, dual_clip: Optional[float] = None,
             ratio_level: str = "token", agg: str = "token-mean",
             weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
             num_tokens: Optional[float] = None, num_sequences: Optional[float] = None,
             validate: bool = True) -> LossOutput:
    args = check_ppo_args(
        policy, old_logprobs, advantages, mask, clip=clip, dual_clip=dual_clip,
        ratio_level=ratio_level, agg=agg, weights=weights, loss_scale=loss_scale,
        num_tokens=num_tokens, num_sequences=num_sequences, validate=validate)
    result = surrogate(policy, old_logprobs, args.advantages, args.mask, args.objective,
                       compute_dtype=args.info.compute_dtype, agg=agg, weights=args.weights,
                       loss_scale=args.loss_scale, num_tokens=args.num_tokens,
                       num_sequences=args.num_sequences, ratio=ratio_level,
                       validate=validate)
    return LossOutput(result.loss, surrogate_metrics(result, args.mask))
