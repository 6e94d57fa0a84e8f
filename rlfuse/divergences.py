"""The divergences of ``rlfuse.distill_loss`` and ``rlfuse.token_divergence``: per token, between
the student's next-token distribution ``S`` and the teacher's ``T`` (each
``softmax(logits / temperature)`` of its own logits), in nats.

- ``ForwardKL(min_logprob=None)``: ``KL(T ‖ S) = Σ_v T_v (log T_v − log S_v)``. Over a
  ``TopK`` teacher, verl's ``forward_kl_topk``: the sum over the teacher's k ids, the student's
  log-probs there under its full softmax, both sides' log-probs clamped below at
  ``min_logprob`` (verl's ``log_prob_min_clamp``) when given, the value clamped at 0.
- ``ReverseKL()``: ``KL(S ‖ T)``.
- ``JSD(beta)``: TRL's generalized Jensen–Shannon divergence (``GKDTrainer.generalized_jsd_loss``,
  the ``DistillationTrainer``'s loss): ``beta = 0`` is the forward KL, ``beta = 1`` the reverse
  KL, otherwise ``β KL(T ‖ M) + (1 − β) KL(S ‖ M)`` with ``M = β T + (1 − β) S``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional


def _check_beta(beta) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"divergence.beta: expected a number in [0, 1], got "
                        f"{type(beta).__name__}")
    if not 0.0 <= float(beta) <= 1.0:   # NaN fails too
        raise ValueError(f"divergence.beta: expected a number in [0, 1], got {beta}")
    return float(beta)


@dataclasses.dataclass(frozen=True)
class ForwardKL:
    """``KL(teacher ‖ student)``; ``min_logprob``: a ``TopK`` teacher's clamp (verl's
    ``log_prob_min_clamp``), for no other teacher."""

    min_logprob: Optional[float] = None

    def __post_init__(self):
        value = self.min_logprob
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"divergence.min_logprob: expected None or a finite number, got "
                             f"{value!r}")


@dataclasses.dataclass(frozen=True)
class ReverseKL:
    """``KL(student ‖ teacher)``."""


@dataclasses.dataclass(frozen=True)
class JSD:
    """TRL's generalized JSD of weight ``beta`` in [0, 1] (0: forward KL, 1: reverse KL)."""

    beta: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "beta", _check_beta(self.beta))


DIVERGENCES = (ForwardKL, ReverseKL, JSD)


def check_divergence(divergence, topk: bool):
    """``divergence``, one of the records above; over a ``TopK`` teacher ``ForwardKL`` only,
    ``min_logprob`` over a ``TopK`` teacher only."""
    if not isinstance(divergence, DIVERGENCES):
        raise TypeError(f"divergence: expected rlfuse.divergences.ForwardKL(), ReverseKL() or "
                        f"JSD(beta), got {divergence!r}")
    if topk and not isinstance(divergence, ForwardKL):
        raise ValueError(f"divergence: a TopK teacher has the teacher's top-k log-probs only, "
                         f"which give the forward KL (ForwardKL()); got {divergence!r}")
    if not topk and isinstance(divergence, ForwardKL) and divergence.min_logprob is not None:
        raise ValueError("divergence.min_logprob: clamps a TopK teacher's log-probs (verl's "
                         "log_prob_min_clamp); the teacher here has its whole vocabulary")
    return divergence
