"""The objectives of ``rlfuse.policy_loss``: one record per objective, a frozen dataclass of its
parameters, checked when it is built. Names follow verl's ``loss_mode`` and TRL's
``loss_type``; where the two trainers define one name differently, both forms exist (``cispo``
and ``cispo_trl``, ``sapo`` and ``sapo_trl``, ``gspo`` and ``gspo_trl``).

A record is all that the rest of rlfuse knows of its objective (``Objective`` says what it
holds): the kernels, both implementations, the metrics and the compile-only driver read it.
``OBJECTIVES`` maps each name to its record; ``policy_loss`` also takes a name (the defaults).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar, Dict, NamedTuple, Optional, Tuple, Union

from ._names import GEOMETRIES, RATIO_LEVELS, TOPOLOGIES
from .checks.values import (check_choice, check_clip, check_dual_clip, check_number,
                            check_positive, check_sides)
from .shared import batch_objectives as by_batch

Clip_ = Union[float, Tuple[float, float]]

# verl clamps the log-ratio to +-20 before it exponentiates it (and in its ``ppo_kl`` metric)
VERL_LOG_RATIO_CLAMP = 20.0


class TokenSurrogate(NamedTuple):
    """What the surrogate kernels and the reference evaluate at each token: the per-token
    function ``function`` (a record's ``token``), over the trust region of ``geometry`` (a name
    of ``_names.REGION_GEOMETRIES``) and ``topology`` with the sizes of its lower and upper
    sides, the function's parameters in the order it takes them, and the clamp of the
    log-ratio (verl's +-20 where it exponentiates a clamped log-ratio, and in the
    ``approx_kl`` metric; inf: none)."""

    function: str
    geometry: str
    topology: str
    delta_low: float
    delta_high: float
    params: Tuple[float, ...] = ()
    clamp: float = math.inf


def _cap(name: str, value) -> float:
    return math.inf if value is None else check_positive(name, value)


# The metrics of the flags of the per-token functions that set some
_CLIP_FLAGS = ("clip_frac_low", "clip_frac_high", "dual_clip_frac")
_CISPO_FLAGS = ("clip_frac", "clip_frac_high")
_DPPO_FLAGS = ("dropped_frac", "truncated_frac")


@dataclasses.dataclass(frozen=True)
class Objective:
    """What every objective record says of itself, read by the rest of rlfuse:

    - ``name``: its key in ``OBJECTIVES`` (verl's ``loss_mode`` / TRL's ``loss_type``);
    - ``token``: the per-token function of a token-local or sequence objective
      (``kernels.lib.token_functions.<token>``, ``reference.token_functions.<token>``),
      ``flags`` the metric names of that function's flags and ``surrogate()`` what it takes
      (a ``TokenSurrogate``);
    - ``batch``: a batch-level objective's ``[B, T]`` function (``shared.batch_objectives``);
    - ``ratio``: how a token's ratio is formed (a name of ``_names.RATIO_MODES``, "batch" for a
      batch-level objective); ``weight_ratio``: the ratio TRL's importance-weighted KL
      multiplies by; ``agg``: the aggregation it fixes (None: the caller's); ``draws``: it
      chooses at random (``policy_loss``'s ``generator``);
    - ``example()``: an instance, of its defaults or of a required parameter's value.
    """

    name: ClassVar[str]
    token: ClassVar[Optional[str]] = None
    flags: ClassVar[Tuple[str, ...]] = ()
    batch: ClassVar[Optional[Callable]] = None
    agg: ClassVar[Optional[str]] = None
    draws: ClassVar[bool] = False

    def __post_init__(self):
        self.check()

    @classmethod
    def example(cls) -> "Objective":
        return cls()

    def check(self) -> None:
        """Raises on a parameter out of its range (a token-local objective's: those of
        ``surrogate()``)."""
        if self.ratio != "batch":
            self.surrogate()

    def surrogate(self) -> TokenSurrogate:
        raise TypeError(f"objective {self.name!r}: a batch-level objective has no per-token "
                        f"function")

    @property
    def ratio(self) -> str:
        return "token" if self.token is not None else "batch"

    @property
    def weight_ratio(self) -> str:
        return "token" if self.ratio == "batch" else self.ratio


def _ppo_clip(token, low, high, params=(), clamp=VERL_LOG_RATIO_CLAMP) -> TokenSurrogate:
    """A surrogate over PPO's region ``[low, high]`` (or none that the function reads)."""
    return TokenSurrogate(token, "ppo_clip", "mc", low, high, tuple(params), clamp)


@dataclasses.dataclass(frozen=True)
class Clip(Objective):
    """PPO's clipped surrogate (GRPO, DAPO, Dr. GRPO; verl's ``vanilla`` is
    ``Clip(dual_clip=3.0)``): ``J = min(min(r, ratio_cap) A, clip(r, 1 - eps_low, 1 + eps_high)
    A)``, for A < 0 at most ``dual_clip A``'s loss (verl's ``clip_ratio_c``); ``ratio_cap`` is
    TRL's ``delta``. The log-ratio is clamped to +-``log_ratio_clamp`` before it is
    exponentiated (verl's 20; None: no clamp, as GR-OPD)."""

    name: ClassVar[str] = "clip"
    token: ClassVar[str] = "clip"
    flags: ClassVar = _CLIP_FLAGS
    clip: Clip_ = 0.2
    dual_clip: Optional[float] = None
    ratio_cap: Optional[float] = None
    log_ratio_clamp: Optional[float] = VERL_LOG_RATIO_CLAMP

    def surrogate(self) -> TokenSurrogate:
        low, high = check_clip("clip", self.clip)
        return _ppo_clip(self.token, low, high,
                         (check_dual_clip(self.dual_clip), _cap("ratio_cap", self.ratio_cap)),
                         _cap("log_ratio_clamp", self.log_ratio_clamp))


@dataclasses.dataclass(frozen=True)
class GPPO(Objective):
    """GPPO's clipped surrogate over the trust region of an f-divergence (``gppo_loss``)."""

    name: ClassVar[str] = "gppo"
    token: ClassVar[str] = "clip"
    flags: ClassVar = _CLIP_FLAGS
    geometry: str = "chi2"
    topology: str = "atomic"
    delta: Clip_ = 0.04
    dual_clip: Optional[float] = None

    def surrogate(self) -> TokenSurrogate:
        check_choice("geometry", self.geometry, GEOMETRIES)
        check_choice("topology", self.topology, TOPOLOGIES)
        low, high = check_sides("delta", self.delta, check_positive)
        return TokenSurrogate(self.token, self.geometry, self.topology, low, high,
                              (check_dual_clip(self.dual_clip), math.inf))


@dataclasses.dataclass(frozen=True)
class CISPO(Objective):
    """verl's CISPO: ``J = sg(clip(r, 1 - eps_low, 1 + eps_high)) A lp``."""

    name: ClassVar[str] = "cispo"
    token: ClassVar[str] = "cispo"
    flags: ClassVar = _CISPO_FLAGS
    clip: Clip_ = 0.2

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, *check_clip("clip", self.clip))


@dataclasses.dataclass(frozen=True)
class CISPOTRL(Objective):
    """TRL's CISPO: ``J = sg(min(r, epsilon_high)) A lp`` (TRL's ``epsilon_high``; ScaleRL
    recommends 5); ``ratio_level="sequence"``: r is the sequence's ratio (TRL's
    ``importance_sampling_level``), a batch-level objective."""

    name: ClassVar[str] = "cispo_trl"
    token: ClassVar[str] = "cispo"
    flags: ClassVar = _CISPO_FLAGS
    # the stopped coefficient of the sequence ratio: J depends on each lp directly
    batch: ClassVar = by_batch.cispo_trl
    epsilon_high: float = 5.0
    ratio_level: str = "token"

    def check(self) -> None:
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        check_positive("epsilon_high", self.epsilon_high)

    @property
    def ratio(self) -> str:
        return "token" if self.ratio_level == "token" else "batch"

    @property
    def weight_ratio(self) -> str:
        return self.ratio_level

    def surrogate(self) -> TokenSurrogate:
        return TokenSurrogate(self.token, "ratio_range", "mc", 0.0,
                              check_positive("epsilon_high", self.epsilon_high))


class _AtRatioLevel(Objective):
    """A token-local objective of the token's ratio or of its sequence's (``ratio_level``, TRL's
    ``importance_sampling_level``)."""

    def check(self) -> None:
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        super().check()

    @property
    def ratio(self) -> str:
        return self.ratio_level


def _taus(objective) -> Tuple[float, float]:
    return (check_positive("tau_pos", objective.tau_pos),
            check_positive("tau_neg", objective.tau_neg))


@dataclasses.dataclass(frozen=True)
class SAPO(Objective):
    """verl's SAPO: ``J = sigma(tau (r - 1)) 4 / tau A`` with ``tau = tau_pos`` if A > 0 else
    ``tau_neg``, r of the log-ratio clamped to +-20; verl aggregates it by
    ``seq-mean-token-mean`` whatever its ``loss_agg_mode``."""

    name: ClassVar[str] = "sapo"
    token: ClassVar[str] = "sapo"
    agg: ClassVar[str] = "seq-mean-token-mean"
    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, 1.0, 1.0, _taus(self))


@dataclasses.dataclass(frozen=True)
class SAPOTRL(_AtRatioLevel):
    """TRL's SAPO (``sapo_temperature_pos`` / ``_neg``): verl's gate on the unclamped ratio,
    aggregated as the caller says; ``ratio_level="sequence"``: the gate of the sequence's
    ratio."""

    name: ClassVar[str] = "sapo_trl"
    token: ClassVar[str] = "sapo"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    ratio_level: str = "token"

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, 1.0, 1.0, _taus(self), math.inf)


@dataclasses.dataclass(frozen=True)
class GPG(Objective):
    """The plain policy gradient ``J = A lp`` (verl's ``gpg``, REINFORCE)."""

    name: ClassVar[str] = "gpg"
    token: ClassVar[str] = "gpg"

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, 1.0, 1.0, clamp=math.inf)


@dataclasses.dataclass(frozen=True)
class DRO(Objective):
    """Direct reward optimisation (verl's ``dro``): ``J = lp A - dro_beta (lp - old)^2 / 2``;
    ``dro_beta`` > 0 is required."""

    name: ClassVar[str] = "dro"
    token: ClassVar[str] = "dro"
    dro_beta: Optional[float] = None

    @classmethod
    def example(cls) -> "DRO":
        return cls(dro_beta=0.1)

    def surrogate(self) -> TokenSurrogate:
        if self.dro_beta is None:
            raise ValueError("dro_beta: DRO needs its penalty, a value > 0 (got None)")
        return _ppo_clip(self.token, 1.0, 1.0, (check_positive("dro_beta", self.dro_beta),),
                         math.inf)


@dataclasses.dataclass(frozen=True)
class DPPOTV(Objective):
    """DPPO with the total variation (verl's ``dppo_tv``): ``J = sg(min(r, truncation)) A lp``
    on the tokens whose probability moves by at most ``clip`` (``(low, high)``: down, up), 0
    elsewhere; ``truncation`` is verl's ``clip_ratio_c``."""

    name: ClassVar[str] = "dppo_tv"
    token: ClassVar[str] = "dppo_tv"
    flags: ClassVar = _DPPO_FLAGS
    clip: Clip_ = 0.2
    truncation: float = 20.0

    def surrogate(self) -> TokenSurrogate:
        low, high = check_sides("clip", self.clip, check_positive)
        return _ppo_clip(self.token, 1.0, 1.0, (
            low, high, check_positive("truncation", self.truncation, allow_inf=True)))


@dataclasses.dataclass(frozen=True)
class DPPOKL(DPPOTV):
    """DPPO with the binary KL (verl's ``dppo_kl``): as ``DPPOTV`` with the move measured by
    the KL of Bernoulli(mu) and Bernoulli(p)."""

    name: ClassVar[str] = "dppo_kl"
    token: ClassVar[str] = "dppo_kl"


@dataclasses.dataclass(frozen=True)
class GSPO(Objective):
    """verl's GSPO: the clipped surrogate of the sequence ratio ``s_i = exp(mean_t (lp -
    old))`` (its log clamped at 10), passed straight through to each token
    (``s_it = sg(s_i) pi / sg(pi)``), no dual clip."""

    name: ClassVar[str] = "gspo"
    token: ClassVar[str] = "clip"
    flags: ClassVar = _CLIP_FLAGS
    clip: Clip_ = 0.2
    ratio: ClassVar[str] = "sequence_straight"

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, *check_clip("clip", self.clip), (math.inf, math.inf),
                         math.inf)


@dataclasses.dataclass(frozen=True)
class GSPOTRL(Objective):
    """TRL's GSPO (``importance_sampling_level="sequence"``): the clipped surrogate of the
    sequence ratio, differentiated through the sequence's mean; ``ratio_cap`` is TRL's
    ``delta``, ``dual_clip`` verl's (``ppo_loss(ratio_level="sequence")``)."""

    name: ClassVar[str] = "gspo_trl"
    token: ClassVar[str] = "clip"
    flags: ClassVar = _CLIP_FLAGS
    clip: Clip_ = 0.2
    ratio_cap: Optional[float] = None
    dual_clip: Optional[float] = None
    ratio: ClassVar[str] = "sequence"

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, *check_clip("clip", self.clip),
                         (check_dual_clip(self.dual_clip), _cap("ratio_cap", self.ratio_cap)),
                         math.inf)


@dataclasses.dataclass(frozen=True)
class LUSPO(_AtRatioLevel):
    """TRL's LUSPO: the clipped surrogate at ``ratio_level`` ("sequence": TRL's GSPO), each
    sequence's loss its token sum (a sequence weighs by its length): the aggregation is
    ``seq-mean-token-sum``."""

    name: ClassVar[str] = "luspo"
    token: ClassVar[str] = "clip"
    flags: ClassVar = _CLIP_FLAGS
    agg: ClassVar[str] = "seq-mean-token-sum"
    clip: Clip_ = 0.2
    ratio_cap: Optional[float] = None
    ratio_level: str = "sequence"

    def surrogate(self) -> TokenSurrogate:
        return _ppo_clip(self.token, *check_clip("clip", self.clip),
                         (math.inf, _cap("ratio_cap", self.ratio_cap)), math.inf)


@dataclasses.dataclass(frozen=True)
class GeoMean(Objective):
    """GMPO (verl's ``geo_mean``): per sequence, the geometric mean of the token ratios, each
    log-ratio clipped to ``[-eps_low, eps_high]`` on the side of its advantage's sign, times the
    sequence's mean advantage; a mean over the sequences (verl's own aggregation), its terms'
    by ``seq-mean-token-mean`` (each sequence's token mean, a mean over the sequences)."""

    name: ClassVar[str] = "geo_mean"
    batch: ClassVar = by_batch.geo_mean
    agg: ClassVar[str] = "seq-mean-token-mean"
    clip: Clip_ = 0.4

    def check(self) -> None:
        check_sides("clip", self.clip, check_positive)


@dataclasses.dataclass(frozen=True)
class VESPO(Objective):
    """TRL's VESPO: ``J = sg(phi_i) A lp`` with the gamma weight ``phi(w) = e^lambda w^k
    e^(-lambda w)`` of the sequence ratio ``w = exp(sum_t (lp - old))`` (k, lambda by the sign
    of A); per-token ``weights`` (vLLM's importance ratios) enter w, not the objective."""

    name: ClassVar[str] = "vespo"
    batch: ClassVar = by_batch.vespo
    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def check(self) -> None:
        for field in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            check_number(field, getattr(self, field))


@dataclasses.dataclass(frozen=True)
class ClipCov(Objective):
    """Clip-Cov (verl's ``clip_cov``): PPO's clipped surrogate (no dual clip) whose gradient is
    cut on a random ``clip_cov_ratio`` share of the unclipped tokens with ``clip_cov_lb <
    cov < clip_cov_ub``, cov the centred product of advantage and log-prob."""

    name: ClassVar[str] = "clip_cov"
    batch: ClassVar = by_batch.clip_cov
    draws: ClassVar[bool] = True
    clip: Clip_ = 0.2
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def check(self) -> None:
        check_clip("clip", self.clip)
        check_positive("clip_cov_ratio", self.clip_cov_ratio)
        check_number("clip_cov_lb", self.clip_cov_lb)
        check_number("clip_cov_ub", self.clip_cov_ub)
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"clip_cov_ub: expected a value above clip_cov_lb "
                             f"({self.clip_cov_lb}), got {self.clip_cov_ub}")


@dataclasses.dataclass(frozen=True)
class KLCov(Objective):
    """KL-Cov (verl's ``kl_cov``): the unclipped ``J = r A``, minus ``ppo_kl_coef |lp - old|``
    on the ``kl_cov_ratio`` share of the tokens with the largest centred product of advantage
    and log-prob."""

    name: ClassVar[str] = "kl_cov"
    batch: ClassVar = by_batch.kl_cov
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1

    def check(self) -> None:
        check_positive("kl_cov_ratio", self.kl_cov_ratio)
        check_number("ppo_kl_coef", self.ppo_kl_coef)


OBJECTIVES: Dict[str, type] = {cls.name: cls for cls in (
    Clip, GPPO, CISPO, CISPOTRL, SAPO, SAPOTRL, GPG, DRO, DPPOTV, DPPOKL, GSPO, GSPOTRL, LUSPO,
    GeoMean, VESPO, ClipCov, KLCov)}


def as_objective(objective) -> Objective:
    """An objective record from a record or a name (its defaults)."""
    if isinstance(objective, str):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective: expected one of {', '.join(map(repr, OBJECTIVES))} or "
                             f"an instance of rlfuse.objectives, got {objective!r}")
        return OBJECTIVES[objective]()
    if OBJECTIVES.get(getattr(objective, "name", None)) is not type(objective):  # a record
        raise TypeError(f"objective: expected a name or an instance of rlfuse.objectives "
                        f"({', '.join(c.__name__ for c in OBJECTIVES.values())}), got "
                        f"{type(objective).__name__}")
    return objective
