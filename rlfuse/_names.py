"""The names of the choices rlfuse offers, one registry for the checks, both implementations and
the kernels (whose constexpr codes are positions in these tuples:
``kernels.utils.constexpr_codes``)."""

# GPPO's trust regions: the divergence (or PPO's symmetric log region) and how it is estimated.
GEOMETRIES = ("tv", "chi2", "hellinger", "kl", "two_sided_log")
TOPOLOGIES = ("mc", "atomic", "binary")
# The regions the surrogate kernels know: GPPO's geometries, then PPO's fixed clip range.
REGION_GEOMETRIES = GEOMETRIES + ("ppo_clip",)
MU_MIN = 1e-6  # GPPO's mu = exp(old_lp) is clamped to [MU_MIN, 1 - MU_MIN]

# Per-token objectives of the surrogate losses (``kernels.objectives``, ``reference.objectives``).
OBJECTIVES = ("clip",)

# verl's loss aggregations (``agg``), and the level of the importance ratio.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm", "token-sum")
RATIO_LEVELS = ("token", "sequence")
