"""The per-position functions of distillation's kernels, one per ``function`` a record of
``rlfuse.divergences`` names (``divergence_function``)::

    <function>(s, t, aux, params) -> (term, aux_term, grad)

over a block of a position's vocabulary: ``s`` and ``t`` the student's and the teacher's exact
log-probs (-inf past the row), ``params`` the record's parameters (``DivergenceTerms.params``,
in the compute dtype). The forward sums ``term`` (to the divergence D, term by term: no
difference of large sums) and ``aux_term`` (what the gradient needs beside D) over the row; the
backward, given ``aux`` (that sum), takes ``grad = ∂D/∂z_v`` with respect to the student's
logits over its temperature. What a kernel leaves unused is compiled away.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._names import FunctionsByName
from .utils import exp_accurate, fp64_args

# The per-position functions by name: each is registered where it is defined
# (``per_position``); ``divergence_function``: the one a record's ``terms()`` names
DIVERGENCE_FUNCTIONS = FunctionsByName("divergence", "per-position", "the kernels")
per_position, divergence_function = DIVERGENCE_FUNCTIONS.register, DIVERGENCE_FUNCTIONS.lookup


@triton.jit
def weighted(p, x):
    """``p x`` where ``p > 0``, else 0 (whatever x is there)."""
    return tl.where(p > 0, p * x, 0.0)


@triton.jit
def _mixture(s, t, log_a, log_b):
    """``μ = log(e^(s + log_a) + e^(t + log_b))``, -inf where both are."""
    u, w = s + log_a, t + log_b
    hi = tl.maximum(u, w)
    safe = tl.where(hi == float("-inf"), 0.0, hi)
    return safe + tl.log(exp_accurate(u - safe) + exp_accurate(w - safe))


@per_position
@triton.jit
def forward_kl(s, t, aux, params):
    """``KL(T ‖ S) = Σ T_v (t_v − s_v)``; ``∂/∂z_v = S_v − T_v``."""
    p_t = exp_accurate(t)
    return weighted(p_t, t - s), tl.zeros_like(s), exp_accurate(s) - p_t


@per_position
@triton.jit
def reverse_kl(s, t, aux, params):
    """``KL(S ‖ T) = Σ S_v (s_v − t_v)`` (aux: the same sum);
    ``∂/∂z_v = S_v ((s_v − t_v) − D)``."""
    p_s = exp_accurate(s)
    term = weighted(p_s, s - t)
    return term, term, weighted(p_s, (s - t) - aux)


@per_position
@triton.jit
def jsd(s, t, aux, params):
    """TRL's generalized JSD, ``params = (β, log(1 − β), log β)``, 0 < β < 1:
    ``β Σ T_v (t_v − μ_v) + (1 − β) Σ S_v (s_v − μ_v)``, ``μ_v = log((1 − β) S_v + β T_v)``
    (aux: ``KL(S ‖ M)``, the second sum); the term in μ_v of the gradient cancels, leaving
    ``∂/∂z_v = (1 − β) S_v ((s_v − μ_v) − KL(S ‖ M))``."""
    beta = params[0]
    mu = _mixture(s, t, params[1], params[2])
    p_s = exp_accurate(s)
    to_student = weighted(p_s, s - mu)
    term = beta * weighted(exp_accurate(t), t - mu) + (1.0 - beta) * to_student
    return term, to_student, (1.0 - beta) * weighted(p_s, (s - mu) - aux)


def divergence_args(terms):
    """The constexpr ``DIVERGENCE`` (the per-position function) and the runtime parameters (fp64
    pairs of ``utils.fp64_args``) of an ``rlfuse.divergences.DivergenceTerms`` (or a tuple of its
    fields)."""
    name, params = terms
    return divergence_function(name), fp64_args(params)
