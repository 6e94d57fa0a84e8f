"""Reference KL penalty to reference log-probs: the per-token estimators (verl's
``kl_penalty``, with TRL's unclamped k3 and importance weighting as options)."""
from __future__ import annotations

import torch

from ..api.args import check_kl_penalty_args
from .._docs import documented

# verl's clamps of k3: the log-ratio to +-20, the value to +-10
LOG_CLAMP, VALUE_CLAMP = 20.0, 10.0


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str, *, straight: bool = False,
                clamp: bool = True) -> torch.Tensor:
    """The estimator ``estimator`` (a name of ``_names.KL_ESTIMATORS``) of KL(pi || ref) at
    each token, differentiable in ``lp``; ``straight``: its value with the gradient of k2;
    ``clamp``: verl's clamps of k3 (its gradient 0 past them)."""
    d = lp - ref
    if estimator == "k1":
        value = d
    elif estimator == "abs":
        value = d.abs()
    elif estimator == "k2":
        value = 0.5 * d.square()
    else:
        u = -d
        if clamp:
            u = u.clamp(-LOG_CLAMP, LOG_CLAMP)
        value = torch.exp(u) - u - 1.0
        if clamp:
            value = value.clamp(-VALUE_CLAMP, VALUE_CLAMP)
    if straight:
        k2 = 0.5 * d.square()
        value = k2 - k2.detach() + value.detach()
    return value


@documented
def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", *,
               clamp: bool = True) -> torch.Tensor:
    name, straight = check_kl_penalty_args(logprobs, ref_logprobs, estimator)
    cdt = torch.float64 if torch.float64 in (logprobs.dtype, ref_logprobs.dtype) \
        else torch.float32
    return kl_estimate(logprobs.to(cdt), ref_logprobs.detach().to(cdt), name, straight=straight,
                       clamp=clamp)
