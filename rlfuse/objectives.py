"""The policy objectives of ``rlfuse.policy_loss``: one frozen dataclass per objective, holding
its parameters (checked when it is built). Names follow verl's ``loss_mode`` and TRL's
``loss_type``; where the two trainers define one name differently, both forms exist (``cispo``
and ``cispo_trl``, ``sapo`` and ``sapo_trl``, ``gspo`` and ``gspo_trl``).

Token-local objectives (one pass over the logits from ``Logits`` / ``LinearHead``): ``Clip``,
``GPPO``, ``CISPO``, ``CISPOTRL``, ``SAPO``, ``SAPOTRL``, ``GPG``, ``DRO``, ``DPPOTV``,
``DPPOKL``. Sequence- and batch-level ones (the log-probs first, then the loss on ``[B, T]``):
``GSPO``, ``GSPOTRL``, ``LUSPO``, ``GeoMean``, ``VESPO``, ``ClipCov``, ``KLCov``.
``OBJECTIVES`` maps each name to its class; ``policy_loss`` also takes a name (the defaults).
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Dict, Optional, Tuple, Union

from ._names import GEOMETRIES, OBJECTIVE_FLAGS, RATIO_LEVELS, TOPOLOGIES
from ._specs import VERL_LOG_RATIO_CLAMP, Objective, ObjectiveSpec
from .checks.values import (check_choice, check_clip, check_dual_clip, check_number,
                            check_positive, check_sides)

Clip_ = Union[float, Tuple[float, float]]


def _cap(name: str, value) -> float:
    return math.inf if value is None else check_positive(name, value)


def _spec(source, name, geometry, low, high, params=(), *, topology="mc",
          clamp=VERL_LOG_RATIO_CLAMP, ratio="token", agg=None) -> ObjectiveSpec:
    token = Objective(name, geometry, topology, low, high, tuple(params), clamp)
    return ObjectiveSpec(token, ratio, agg, OBJECTIVE_FLAGS[name], source,
                         "token" if ratio == "token" else "sequence")


@dataclasses.dataclass(frozen=True)
class Clip:
    """PPO's clipped surrogate (GRPO, DAPO, Dr. GRPO; verl's ``vanilla`` is
    ``Clip(dual_clip=3.0)``): ``J = min(min(r, ratio_cap) A, clip(r, 1 - eps_low, 1 + eps_high)
    A)``, for A < 0 at most ``dual_clip A``'s loss (verl's ``clip_ratio_c``); ``ratio_cap`` is
    TRL's ``delta``."""

    name: ClassVar[str] = "clip"
    clip: Clip_ = 0.2
    dual_clip: Optional[float] = None
    ratio_cap: Optional[float] = None

    def spec(self) -> ObjectiveSpec:
        low, high = check_clip("clip", self.clip)
        return _spec(self, "clip", "ppo_clip", low, high,
                     (check_dual_clip(self.dual_clip), _cap("ratio_cap", self.ratio_cap)))


@dataclasses.dataclass(frozen=True)
class GPPO:
    """GPPO's clipped surrogate over the trust region of an f-divergence (``gppo_loss``)."""

    name: ClassVar[str] = "gppo"
    geometry: str = "chi2"
    topology: str = "atomic"
    delta: Clip_ = 0.04
    dual_clip: Optional[float] = None

    def spec(self) -> ObjectiveSpec:
        check_choice("geometry", self.geometry, GEOMETRIES)
        check_choice("topology", self.topology, TOPOLOGIES)
        low, high = check_sides("delta", self.delta, check_positive)
        return _spec(self, "clip", self.geometry, low, high,
                     (check_dual_clip(self.dual_clip), math.inf), topology=self.topology,
                     clamp=math.inf)


@dataclasses.dataclass(frozen=True)
class CISPO:
    """verl's CISPO: ``J = sg(clip(r, 1 - eps_low, 1 + eps_high)) A lp``."""

    name: ClassVar[str] = "cispo"
    clip: Clip_ = 0.2

    def spec(self) -> ObjectiveSpec:
        low, high = check_clip("clip", self.clip)
        return _spec(self, "cispo", "ppo_clip", low, high)


@dataclasses.dataclass(frozen=True)
class CISPOTRL:
    """TRL's CISPO: ``J = sg(min(r, epsilon_high)) A lp`` (TRL's ``epsilon_high``; ScaleRL
    recommends 5); ``ratio_level="sequence"``: r is the sequence's ratio (TRL's
    ``importance_sampling_level``)."""

    name: ClassVar[str] = "cispo_trl"
    epsilon_high: float = 5.0
    ratio_level: str = "token"

    def spec(self) -> ObjectiveSpec:
        cap = check_positive("epsilon_high", self.epsilon_high)
        if check_choice("ratio_level", self.ratio_level, RATIO_LEVELS) == "sequence":
            # the stopped coefficient of the sequence ratio: J depends on each lp directly
            return ObjectiveSpec(None, "batch", None, (), self, "sequence")
        return _spec(self, "cispo", "ratio_range", 0.0, cap, clamp=math.inf)


@dataclasses.dataclass(frozen=True)
class SAPO:
    """verl's SAPO: ``J = sigma(tau (r - 1)) 4 / tau A`` with ``tau = tau_pos`` if A > 0 else
    ``tau_neg``, r of the log-ratio clamped to +-20; verl aggregates it by
    ``seq-mean-token-mean`` whatever its ``loss_agg_mode``."""

    name: ClassVar[str] = "sapo"
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def spec(self) -> ObjectiveSpec:
        return _spec(self, "sapo", "ppo_clip", 1.0, 1.0,
                     (check_positive("tau_pos", self.tau_pos),
                      check_positive("tau_neg", self.tau_neg)), agg="seq-mean-token-mean")


@dataclasses.dataclass(frozen=True)
class SAPOTRL:
    """TRL's SAPO (``sapo_temperature_pos`` / ``_neg``): verl's gate on the unclamped ratio,
    aggregated as the caller says; ``ratio_level="sequence"``: the gate of the sequence's
    ratio."""

    name: ClassVar[str] = "sapo_trl"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    ratio_level: str = "token"

    def spec(self) -> ObjectiveSpec:
        ratio = check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        return _spec(self, "sapo", "ppo_clip", 1.0, 1.0,
                     (check_positive("tau_pos", self.tau_pos),
                      check_positive("tau_neg", self.tau_neg)), clamp=math.inf, ratio=ratio)


@dataclasses.dataclass(frozen=True)
class GPG:
    """The plain policy gradient ``J = A lp`` (verl's ``gpg``, REINFORCE)."""

    name: ClassVar[str] = "gpg"

    def spec(self) -> ObjectiveSpec:
        return _spec(self, "gpg", "ppo_clip", 1.0, 1.0, clamp=math.inf)


@dataclasses.dataclass(frozen=True)
class DRO:
    """Direct reward optimisation (verl's ``dro``): ``J = lp A - dro_beta (lp - old)^2 / 2``;
    ``dro_beta`` > 0 is required."""

    name: ClassVar[str] = "dro"
    dro_beta: Optional[float] = None

    def spec(self) -> ObjectiveSpec:
        if self.dro_beta is None:
            raise ValueError("dro_beta: DRO needs its penalty, a value > 0 (got None)")
        return _spec(self, "dro", "ppo_clip", 1.0, 1.0,
                     (check_positive("dro_beta", self.dro_beta),), clamp=math.inf)


@dataclasses.dataclass(frozen=True)
class DPPOTV:
    """DPPO with the total variation (verl's ``dppo_tv``): ``J = sg(min(r, truncation)) A lp``
    on the tokens whose probability moves by at most ``clip`` (``(low, high)``: down, up), 0
    elsewhere; ``truncation`` is verl's ``clip_ratio_c``."""

    name: ClassVar[str] = "dppo_tv"
    clip: Clip_ = 0.2
    truncation: float = 20.0

    def spec(self) -> ObjectiveSpec:
        low, high = check_sides("clip", self.clip, check_positive)
        return _spec(self, self.name, "ppo_clip", 1.0, 1.0,
                     (low, high, check_positive("truncation", self.truncation, allow_inf=True)))


@dataclasses.dataclass(frozen=True)
class DPPOKL(DPPOTV):
    """DPPO with the binary KL (verl's ``dppo_kl``): as ``DPPOTV`` with the move measured by
    the KL of Bernoulli(mu) and Bernoulli(p)."""

    name: ClassVar[str] = "dppo_kl"


@dataclasses.dataclass(frozen=True)
class GSPO:
    """verl's GSPO: the clipped surrogate of the sequence ratio ``s_i = exp(mean_t (lp -
    old))`` (its log clamped at 10), passed straight through to each token
    (``s_it = sg(s_i) pi / sg(pi)``), no dual clip."""

    name: ClassVar[str] = "gspo"
    clip: Clip_ = 0.2

    def spec(self) -> ObjectiveSpec:
        low, high = check_clip("clip", self.clip)
        return _spec(self, "clip", "ppo_clip", low, high, (math.inf, math.inf),
                     clamp=math.inf, ratio="sequence_straight")


@dataclasses.dataclass(frozen=True)
class GSPOTRL:
    """TRL's GSPO (``importance_sampling_level="sequence"``): the clipped surrogate of the
    sequence ratio, differentiated through the sequence's mean; ``ratio_cap`` is TRL's
    ``delta``."""

    name: ClassVar[str] = "gspo_trl"
    clip: Clip_ = 0.2
    ratio_cap: Optional[float] = None

    def spec(self) -> ObjectiveSpec:
        low, high = check_clip("clip", self.clip)
        return _spec(self, "clip", "ppo_clip", low, high,
                     (math.inf, _cap("ratio_cap", self.ratio_cap)), clamp=math.inf,
                     ratio="sequence")


@dataclasses.dataclass(frozen=True)
class LUSPO:
    """TRL's LUSPO: the clipped surrogate at ``ratio_level`` ("sequence": TRL's GSPO), each
    sequence's loss its token sum (a sequence weighs by its length): the aggregation is
    ``seq-mean-token-sum``."""

    name: ClassVar[str] = "luspo"
    clip: Clip_ = 0.2
    ratio_cap: Optional[float] = None
    ratio_level: str = "sequence"

    def spec(self) -> ObjectiveSpec:
        low, high = check_clip("clip", self.clip)
        ratio = check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        return _spec(self, "clip", "ppo_clip", low, high,
                     (math.inf, _cap("ratio_cap", self.ratio_cap)), clamp=math.inf,
                     ratio=ratio, agg="seq-mean-token-sum")


def _batch(source, agg=None) -> ObjectiveSpec:
    return ObjectiveSpec(None, "batch", agg, (), source, "token")


@dataclasses.dataclass(frozen=True)
class GeoMean:
    """GMPO (verl's ``geo_mean``): per sequence, the geometric mean of the token ratios, each
    log-ratio clipped to ``[-eps_low, eps_high]`` on the side of its advantage's sign, times the
    sequence's mean advantage; a mean over the sequences (verl's own aggregation)."""

    name: ClassVar[str] = "geo_mean"
    clip: Clip_ = 0.4

    def spec(self) -> ObjectiveSpec:
        check_sides("clip", self.clip, check_positive)
        return _batch(self, "geo_mean")


@dataclasses.dataclass(frozen=True)
class VESPO:
    """TRL's VESPO: ``J = sg(phi_i) A lp`` with the gamma weight ``phi(w) = e^lambda w^k
    e^(-lambda w)`` of the sequence ratio ``w = exp(sum_t (lp - old))`` (k, lambda by the sign
    of A); per-token ``weights`` (vLLM's importance ratios) enter w, not the objective."""

    name: ClassVar[str] = "vespo"
    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def spec(self) -> ObjectiveSpec:
        for field in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            check_number(field, getattr(self, field))
        return _batch(self)


@dataclasses.dataclass(frozen=True)
class ClipCov:
    """Clip-Cov (verl's ``clip_cov``): PPO's clipped surrogate (no dual clip) whose gradient is
    cut on a random ``clip_cov_ratio`` share of the unclipped tokens with ``clip_cov_lb <
    cov < clip_cov_ub``, cov the centred product of advantage and log-prob."""

    name: ClassVar[str] = "clip_cov"
    clip: Clip_ = 0.2
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def spec(self) -> ObjectiveSpec:
        check_clip("clip", self.clip)
        check_positive("clip_cov_ratio", self.clip_cov_ratio)
        check_number("clip_cov_lb", self.clip_cov_lb)
        check_number("clip_cov_ub", self.clip_cov_ub)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_ub: expected a value above clip_cov_lb "
                             f"({self.clip_cov_lb}), got {self.clip_cov_ub}")
        return _batch(self)


@dataclasses.dataclass(frozen=True)
class KLCov:
    """KL-Cov (verl's ``kl_cov``): the unclipped ``J = r A``, minus ``ppo_kl_coef |lp - old|``
    on the ``kl_cov_ratio`` share of the tokens with the largest centred product of advantage
    and log-prob."""

    name: ClassVar[str] = "kl_cov"
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def spec(self) -> ObjectiveSpec:
        check_positive("kl_cov_ratio", self.kl_cov_ratio)
        check_number("ppo_kl_coef", self.ppo_kl_coef)
        return _batch(self)


OBJECTIVES: Dict[str, type] = {cls.name: cls for cls in (
    Clip, GPPO, CISPO, CISPOTRL, SAPO, SAPOTRL, GPG, DRO, DPPOTV, DPPOKL, GSPO, GSPOTRL, LUSPO,
    GeoMean, VESPO, ClipCov, KLCov)}


def objective_spec(objective) -> ObjectiveSpec:
    """The spec of an objective instance or name (its defaults)."""
    if isinstance(objective, str):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {', '.join(map(repr, OBJECTIVES))} or "
                             f"an instance of rlfuse.objectives, got {objective!r}")
        objective = OBJECTIVES[objective]()
    if type(objective) not in OBJECTIVES.values():
        raise TypeError(f"objective: expected a name or an instance of rlfuse.objectives "
                        f"({', '.join(c.__name__ for c in OBJECTIVES.values())}), got "
                        f"{type(objective).__name__}")
    return objective.spec()
