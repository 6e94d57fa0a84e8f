"""The terms and masks ``rlfuse.policy_loss`` adds to any objective (frozen dataclasses, checked
when they are built). Per-token ``weights`` and the masks multiply the objective, never the KL
or entropy terms (as TRL and verl do).

- ``KLPenalty``: ``loss += coef agg_KL(KL(lp, ref))``, from reference log-probs
  (``policy_loss(ref_logprobs=...)``), with its own aggregation (default the objective's; verl's
  actor: its ``loss_agg_mode``).
- ``EntropyBonus``: ``loss -= coef agg_H(H)``, the policy's entropy (needs logits: ``Logits`` or
  ``LinearHead``), with its own aggregation (default the objective's; TRL: the mean over the
  tokens the entropy mask keeps).
- ``TopEntropyMask``: TRL's ``top_entropy_quantile``: the objective only at the tokens whose
  entropy is at least the ``1 - quantile`` quantile of the batch's (over a process group).
- ``OffPolicyMask``: TRL's off-policy sequence mask (OPSM): a sequence with a negative advantage
  whose mean ``sampling - lp`` exceeds ``threshold`` is dropped.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from ._names import AGGREGATIONS, KL_ALIASES, KL_ESTIMATORS
from .checks.values import check_choice, check_nonnegative, check_number, check_positive


class KLTerm(NamedTuple):
    """A KL penalty to reference log-probs, checked (``KLPenalty.term``): an estimator of
    ``_names.KL_ESTIMATORS``, its coefficient, verl's straight-through ``+`` form, TRL's
    importance weighting, verl's clamps of k3 and its aggregation (``agg`` None: the
    objective's)."""

    estimator: str
    coef: float
    straight: bool = False
    weighted: bool = False
    clamp: bool = True
    agg: Optional[str] = None
    num_tokens: Optional[object] = None
    num_sequences: Optional[object] = None


def kl_estimator(name) -> tuple:
    """(canonical estimator, straight-through) of a verl ``kl_penalty`` name such as ``"k3+"``
    or ``"low_var_kl"``."""
    known = KL_ESTIMATORS + tuple(KL_ALIASES)
    if not isinstance(name, str) or name.rstrip("+") not in known or name.count("+") > 1:
        choices = ", ".join(repr(n) for n in known)
        raise ValueError(f"estimator: expected one of {choices} (each with an optional '+'), got "
                         f"{name!r}")
    base = KL_ALIASES.get(name.rstrip("+"), name.rstrip("+"))
    return base, name.endswith("+") and base != "k2"


@dataclasses.dataclass(frozen=True)
class KLPenalty:
    """A KL penalty to reference log-probs, ``coef`` >= 0 times the estimator ``estimator``
    (verl's ``kl_penalty`` names: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl``,
    each with verl's straight-through ``+``); ``clamp``: verl's clamps of k3 (TRL: False);
    ``importance_weighted``: TRL's ``use_bias_correction_kl`` (the estimate times the
    objective's ratio, differentiated through it); ``agg``, ``num_tokens``,
    ``num_sequences``: its aggregation (None: the objective's; verl's actor aggregates its KL
    loss by its ``loss_agg_mode``, TRL by the loss type's)."""

    coef: float
    estimator: str = "k3"
    clamp: bool = True
    importance_weighted: bool = False
    agg: Optional[str] = None
    num_tokens: Optional[float] = None
    num_sequences: Optional[float] = None

    def term(self) -> KLTerm:
        coef = check_nonnegative("kl.coef", self.coef, allow_inf=False)
        base, straight = kl_estimator(self.estimator)
        agg = None if self.agg is None else check_choice("kl.agg", self.agg, AGGREGATIONS)
        return KLTerm(base, coef, straight, bool(self.importance_weighted), bool(self.clamp),
                      agg, self.num_tokens, self.num_sequences)


@dataclasses.dataclass(frozen=True)
class EntropyBonus:
    """``loss -= coef agg(H)``, ``coef`` >= 0 (0: the ``entropy`` metric alone); ``agg``,
    ``num_tokens``, ``num_sequences``: its aggregation (None: the objective's)."""

    coef: float
    agg: Optional[str] = None
    num_tokens: Optional[float] = None
    num_sequences: Optional[float] = None

    def check(self) -> "EntropyBonus":
        check_nonnegative("entropy.coef", self.coef, allow_inf=False)
        if self.agg is not None:
            check_choice("entropy.agg", self.agg, AGGREGATIONS)
        return self


@dataclasses.dataclass(frozen=True)
class TopEntropyMask:
    """TRL's ``top_entropy_quantile``: keeps the tokens whose entropy is at least the
    ``1 - quantile`` quantile (``torch.quantile``) of the actor tokens' entropies, gathered over
    ``process_group`` (None: this process's). ``quantile`` in [0, 1]."""

    quantile: float
    process_group: Optional[object] = None

    def check(self) -> "TopEntropyMask":
        q = check_number("entropy_mask.quantile", self.quantile)
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"entropy_mask.quantile: expected a value in [0, 1], got {q}")
        return self


@dataclasses.dataclass(frozen=True)
class OffPolicyMask:
    """TRL's off-policy sequence mask (DeepSeek-V3.2): keeps a token if its advantage is >= 0
    or its sequence's mean of ``sampling_logprobs - lp`` (NaN counted as 0) is at most
    ``threshold``; ``sampling_logprobs`` default the old log-probs."""

    threshold: float
    sampling_logprobs: Optional[torch.Tensor] = None

    def check(self) -> "OffPolicyMask":
        check_positive("off_policy_mask.threshold", self.threshold, allow_inf=True)
        return self
