"""The divergences of ``rlfuse.distill_loss`` and ``rlfuse.token_divergence``: per token, between
the student's next-token distribution ``S`` and the teacher's ``T`` (each
``softmax(logits / temperature)`` of its own logits), in nats; one record per divergence, a
frozen dataclass of its parameters, checked when it is built.

- ``ForwardKL(min_logprob=None)``: ``KL(T ‖ S) = Σ_v T_v (log T_v − log S_v)``. Over a
  ``TopK`` teacher, verl's ``forward_kl_topk``: the sum over the teacher's k ids, the student's
  log-probs there under its full softmax, both sides' log-probs clamped below at
  ``min_logprob`` (verl's ``log_prob_min_clamp``) when given, the value clamped at 0.
- ``ReverseKL()``: ``KL(S ‖ T)``.
- ``JSD(beta)``: TRL's generalized Jensen–Shannon divergence (``GKDTrainer.generalized_jsd_loss``,
  the ``DistillationTrainer``'s loss): ``beta = 0`` is the forward KL, ``beta = 1`` the reverse
  KL, otherwise ``β KL(T ‖ M) + (1 − β) KL(S ‖ M)`` with ``M = β T + (1 − β) S``.

A record is all that the rest of rlfuse knows of its divergence (``Divergence`` says what it
holds): the kernels (``kernels.lib.divergence_functions``) and the reference
(``reference.divergence_functions``) evaluate the function its ``terms()`` names.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple, Optional, Tuple


class DivergenceTerms(NamedTuple):
    """What both implementations evaluate at a position: the per-position function ``function``
    (``kernels.lib.divergence_functions.<function>``, ``reference.divergence_functions.<function>``)
    and its parameters in the order it takes them."""

    function: str
    params: Tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Divergence:
    """What every divergence record says of itself:

    - ``function``: its per-position function, ``terms()`` the function and parameters an
      instance is computed by (a record may name another's for some parameters);
    - ``topk``: it can be computed from a ``TopK`` teacher;
    - ``example()``: an instance, of its defaults.
    """

    function: ClassVar[str]
    topk: ClassVar[bool] = False

    @classmethod
    def example(cls) -> "Divergence":
        return cls()

    def terms(self) -> DivergenceTerms:
        return DivergenceTerms(self.function)

    def check_teacher(self, topk: bool) -> None:
        """Raises where the teacher's form (``topk``: a ``TopK``) cannot give this divergence."""
        if topk and not self.topk:
            able = " or ".join(f"{cls.__name__}()" for cls in DIVERGENCES if cls.topk)
            raise ValueError(f"divergence: a TopK teacher has the teacher's top-k log-probs "
                             f"only, which give {able}; got {self!r}")


@dataclasses.dataclass(frozen=True)
class ForwardKL(Divergence):
    """``KL(teacher ‖ student)``; ``min_logprob``: a ``TopK`` teacher's clamp (verl's
    ``log_prob_min_clamp``), for no other teacher."""

    function: ClassVar[str] = "forward_kl"
    topk: ClassVar[bool] = True
    min_logprob: Optional[float] = None

    def __post_init__(self):
        value = self.min_logprob
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValueError(f"divergence.min_logprob: expected None or a finite number, got "
                             f"{value!r}")

    def check_teacher(self, topk: bool) -> None:
        if not topk and self.min_logprob is not None:
            raise ValueError("divergence.min_logprob: clamps a TopK teacher's log-probs (verl's "
                             "log_prob_min_clamp); the teacher here has its whole vocabulary")


@dataclasses.dataclass(frozen=True)
class ReverseKL(Divergence):
    """``KL(student ‖ teacher)``."""

    function: ClassVar[str] = "reverse_kl"


@dataclasses.dataclass(frozen=True)
class JSD(Divergence):
    """TRL's generalized JSD of weight ``beta`` in [0, 1] (0: forward KL, 1: reverse KL); its
    function takes ``(β, log(1 − β), log β)``."""

    function: ClassVar[str] = "jsd"
    beta: float = 0.5

    def __post_init__(self):
        beta = self.beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"divergence.beta: expected a number in [0, 1], got "
                            f"{type(beta).__name__}")
        if not 0.0 <= float(beta) <= 1.0:   # NaN fails too
            raise ValueError(f"divergence.beta: expected a number in [0, 1], got {beta}")
        object.__setattr__(self, "beta", float(beta))

    def terms(self) -> DivergenceTerms:
        if self.beta == 0.0:
            return ForwardKL().terms()
        if self.beta == 1.0:
            return ReverseKL().terms()
        return DivergenceTerms(self.function,
                               (self.beta, math.log1p(-self.beta), math.log(self.beta)))


DIVERGENCES = (ForwardKL, ReverseKL, JSD)


def check_divergence(divergence, topk: bool) -> Divergence:
    """``divergence``, an instance of a record above that the teacher's form can give (``topk``:
    a ``TopK`` teacher)."""
    if not isinstance(divergence, DIVERGENCES):
        names = ", ".join(f"{cls.__name__}()" for cls in DIVERGENCES)
        raise TypeError(f"divergence: expected an instance of rlfuse.divergences' {names}, got "
                        f"{divergence!r}")
    divergence.check_teacher(topk)
    return divergence
