"""Reference KL penalty to reference log-probs: the per-token estimators (verl's
``kl_penalty``, with TRL's unclamped k3 and importance weighting as options)."""
from __future__ import annotations

import torch


# verl's clamps of k3: the log-ratio to +-20, the value to +-10
LOG_CLAMP, VALUE_CLAMP = 20.0, 10.0


def _k3(d: torch.Tensor, clamp: bool) -> torch.Tensor:
    u = -d
    if clamp:
        u = u.clamp(-LOG_CLAMP, LOG_CLAMP)
    value = torch.exp(u) - u - 1.0
    return value.clamp(-VALUE_CLAMP, VALUE_CLAMP) if clamp else value


# Each estimator of ``_names.KL_ESTIMATORS`` as a function of d = lp - ref (and verl's clamp)
ESTIMATORS = {
    "k1": lambda d, clamp: d,
    "abs": lambda d, clamp: d.abs(),
    "k2": lambda d, clamp: 0.5 * d.square(),
    "k3": _k3,
}


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str, *, straight: bool = False,
                clamp: bool = True) -> torch.Tensor:
    """The estimator ``estimator`` (a name of ``_names.KL_ESTIMATORS``) of KL(pi || ref) at
    each token, differentiable in ``lp``; ``straight``: its value with the gradient of k2;
    ``clamp``: verl's clamps of k3 (its gradient 0 past them)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: expected one of {', '.join(map(repr, ESTIMATORS))}, got "
                         f"{estimator!r}")
    d = lp - ref
    value = ESTIMATORS[estimator](d, clamp)
    if straight:
        k2 = 0.5 * d.square()
        value = k2 - k2.detach() + value.detach()
    return value


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
               straight: bool, clamp: bool) -> torch.Tensor:
    """The per-token estimates in fp32 (fp64 for fp64 inputs) of ``rlfuse.kl_penalty``."""
    cdt = torch.float64 if torch.float64 in (logprobs.dtype, ref_logprobs.dtype) \
        else torch.float32
    return kl_estimate(logprobs.to(cdt), ref_logprobs.to(cdt), estimator, straight=straight,
                       clamp=clamp)
