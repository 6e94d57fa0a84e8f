"""The names of the choices rlfuse offers, one registry for the checks, both implementations and
the kernels (whose constexpr codes are positions in these tuples:
``kernels.lib.utils.constexpr_codes``), and ``FunctionsByName``, the tables of an implementation's
functions that a record names."""

# GPPO's trust regions: the divergence (or PPO's symmetric log region) and how it is estimated.
GEOMETRIES = ("tv", "chi2", "hellinger", "kl", "two_sided_log")
TOPOLOGIES = ("mc", "atomic", "binary")
# The regions the surrogate kernels know: GPPO's geometries, then PPO's fixed clip range and a
# fixed range of the ratio.
REGION_GEOMETRIES = GEOMETRIES + ("ppo_clip", "ratio_range")
MU_MIN = 1e-6  # GPPO's mu = exp(old_lp) is clamped to [MU_MIN, 1 - MU_MIN]

# How a surrogate kernel forms a token's ratio: its own, its sequence's (GSPO: differentiated
# through the sequence's mean, TRL; or straight through to each token, verl).
RATIO_MODES = ("token", "sequence", "sequence_straight")

# The KL penalty's estimators (verl's ``kl_penalty`` names; ``kernels.tokens.kl``) and their
# aliases.
KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# verl's loss aggregations (``agg``), and the level of the importance ratio.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                "seq-mean-token-sum-norm", "token-sum")
RATIO_LEVELS = ("token", "sequence")


class FunctionsByName(dict):
    """An implementation's functions by name (the per-token functions of the objectives, the
    per-position ones of the divergences): each registered where it is defined (``register``,
    a decorator; a ``@triton.jit`` function by its Python function's name), each looked up by
    the name a record gives (``lookup``: an unknown name raises, naming the record's
    ``argument``)."""

    def __init__(self, argument: str, kind: str, where: str):
        super().__init__()
        self.argument, self.kind, self.where = argument, kind, where

    def register(self, function):
        self[getattr(function, "fn", function).__name__] = function
        return function

    def lookup(self, name: str):
        if name not in self:
            raise ValueError(f"{self.argument}: no {self.kind} function {name!r} in "
                             f"{self.where} (it has {', '.join(map(repr, self))})")
        return self[name]
