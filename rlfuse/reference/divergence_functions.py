"""Reference per-position functions of distillation, one per ``function`` a record of
``rlfuse.divergences`` names (``divergence_function``)::

    <function>(s, t, params) -> D

the divergence ``D [B, T]`` between the student's and the teacher's log-probs ``s``, ``t``
``[B, T, V]`` (the student's differentiable, the teacher's not), ``params`` the record's
parameters (``DivergenceTerms.params``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._names import FunctionsByName

# The per-position functions by name: each is registered where it is defined
# (``per_position``); ``divergence_function``: the one a record's ``terms()`` names
DIVERGENCE_FUNCTIONS = FunctionsByName("divergence", "per-position", "the reference")
per_position, divergence_function = DIVERGENCE_FUNCTIONS.register, DIVERGENCE_FUNCTIONS.lookup


def weighted(p: Tensor, x: Tensor) -> Tensor:
    """``Σ_v p_v x_v``, a term of probability 0 counted 0 (whatever ``x`` is there)."""
    return torch.where(p > 0, p * x, 0.0).sum(-1)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """``KL(p ‖ q) = Σ p (log p − log q)`` over the last dimension."""
    return weighted(log_p.exp(), log_p - log_q)


@per_position
def forward_kl(s: Tensor, t: Tensor, params) -> Tensor:
    """``KL(T ‖ S)``."""
    return _kl(t, s)


@per_position
def reverse_kl(s: Tensor, t: Tensor, params) -> Tensor:
    """``KL(S ‖ T)``."""
    return _kl(s, t)


@per_position
def jsd(s: Tensor, t: Tensor, params) -> Tensor:
    """TRL's generalized JSD ``β KL(T ‖ M) + (1 − β) KL(S ‖ M)``, ``M = (1 − β) S + β T``,
    ``params = (β, log(1 − β), log β)``."""
    beta, log_a, log_b = params
    log_m = torch.logaddexp(s + log_a, t + log_b)
    return beta * _kl(t, log_m) + (1 - beta) * _kl(s, log_m)
