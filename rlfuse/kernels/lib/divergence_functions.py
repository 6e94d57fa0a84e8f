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

from ..._names import FunctionsByName
from .utils import LOG2E_HI, LOG2E_LO, fp64_args

# The per-position functions by name: each is registered where it is defined
# (``per_position``); ``divergence_function``: the one a record's ``terms()`` names
DIVERGENCE_FUNCTIONS = FunctionsByName("divergence", "per-position", "the kernels")
per_position, divergence_function = DIVERGENCE_FUNCTIONS.register, DIVERGENCE_FUNCTIONS.lookup


@triton.jit
def weighted(p, x):
    """``p x`` where ``p > 0``, else 0 (whatever x is there)."""
    return tl.where(p > 0, p * x, 0.0)


@triton.jit
def prob(x):
    """``e^x`` of a log-prob ``x <= 0``: one ``exp2`` (MUFU.EX2 in fp32, a few units of rounding;
    0 below 2^-126 on a GPU, where ``weighted`` gives 0) of ``x log2(e)`` formed in two parts,
    so that the product's rounding does not move e^x by ``|x| u`` beyond x's own (``tl.exp``
    rounds ``x log2(e)`` once); fp64: ``tl.exp``."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    return tl.math.exp2(tl.fma(x, LOG2E_HI, x * LOG2E_LO))


@per_position
@triton.jit
def forward_kl(s, t, aux, params):
    """``KL(T ‖ S) = Σ T_v (t_v − s_v)``; ``∂/∂z_v = S_v − T_v``."""
    p_t = prob(t)
    return weighted(p_t, t - s), tl.zeros_like(s), prob(s) - p_t


@per_position
@triton.jit
def reverse_kl(s, t, aux, params):
    """``KL(S ‖ T) = Σ S_v (s_v − t_v)`` (aux: the same sum);
    ``∂/∂z_v = S_v ((s_v − t_v) − D)``."""
    p_s = prob(s)
    term = weighted(p_s, s - t)
    return term, term, weighted(p_s, (s - t) - aux)


@per_position
@triton.jit
def jsd(s, t, aux, params):
    """TRL's generalized JSD, ``params = (β, log(1 − β), log β)`` (β read), 0 < β < 1:
    ``β Σ T_v (t_v − μ_v) + (1 − β) Σ S_v (s_v − μ_v)``, ``μ_v = log((1 − β) S_v + β T_v)``
    (a sum of two positive terms: no cancellation; -inf where both are 0, whose terms are 0)
    (aux: ``KL(S ‖ M)``, the second sum); the term in μ_v of the gradient cancels, leaving
    ``∂/∂z_v = (1 − β) S_v ((s_v − μ_v) − KL(S ‖ M))``."""
    beta = params[0]
    p_s, p_t = prob(s), prob(t)
    mu = tl.log(tl.fma(1.0 - beta, p_s, beta * p_t))
    to_student = weighted(p_s, s - mu)
    term = beta * weighted(p_t, t - mu) + (1.0 - beta) * to_student
    return term, to_student, (1.0 - beta) * weighted(p_s, (s - mu) - aux)


def divergence_args(terms):
    """The constexpr ``DIVERGENCE`` (the per-position function) and the runtime parameters (fp64
    pairs of ``utils.fp64_args``) of an ``rlfuse.divergences.DivergenceTerms`` (or a tuple of its
    fields)."""
    name, params = terms
    return divergence_function(name), fp64_args(params)
