"""The checked forms of a surrogate loss's parts, as the kernels and both implementations take
them: the per-token objective over its trust region, the KL term, and what an objective is made
of (``ObjectiveSpec``, from the public dataclasses of ``rlfuse.objectives``)."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple


class Objective(NamedTuple):
    """A surrogate loss's per-token objective over a trust region: ``name`` (of
    ``_names.OBJECTIVES``), the region (a name of ``_names.REGION_GEOMETRIES``, a topology, the
    sizes of its lower and upper sides), the objective's own parameters in the order its
    functions take them (``clip``: the dual clip and the cap of the ratio, inf for none) and
    the clamp of the log-ratio (verl's +-20 where it exponentiates a clamped log-ratio, and in
    the ``approx_kl`` metric; inf: none)."""

    name: str
    geometry: str
    topology: str
    delta_low: float
    delta_high: float
    params: Tuple[float, ...] = ()
    clamp: float = math.inf


# verl clamps the log-ratio to +-20 before it exponentiates it (and in its ``ppo_kl`` metric)
VERL_LOG_RATIO_CLAMP = 20.0


class KLTerm(NamedTuple):
    """A KL penalty to reference log-probs, checked: an estimator of ``_names.KL_ESTIMATORS``,
    its coefficient, verl's straight-through ``+`` form, TRL's importance weighting and verl's
    clamps of k3."""

    estimator: str
    coef: float
    straight: bool = False
    weighted: bool = False
    clamp: bool = True


class ObjectiveSpec(NamedTuple):
    """What a loss needs of a public objective: its per-token objective ``token`` (None for a
    batch-level one), how its ratio is formed (a name of ``_names.RATIO_MODES``, or "batch":
    computed on ``[B, T]`` log-probs by ``rlfuse._batch_objectives``), the aggregation it fixes
    (None: the caller's), the metric names of the kernel's flags, the objective itself, and
    the level of the ratio TRL's importance-weighted KL multiplies by ("token" or
    "sequence")."""

    token: Optional[Objective]
    ratio: str
    agg: Optional[str]
    flags: Tuple[str, ...]
    source: object
    level: str = "token"
