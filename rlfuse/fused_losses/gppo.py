"""Fused GPPO: trust-region bounds, the loss (from log-probs or in one pass from logits), the
functional API and nn.Module."""
from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from .._dispatch import use_kernels
from .._types import LossOutput
from .._validation import check_policy, check_tensor
from ..reference.gppo import check_gppo_args, check_region, group_advantages
from .surrogate import row_scales, surrogate_loss


def gppo_bounds(old_logprobs: torch.Tensor, *, geometry: str, topology: str, delta: float):
    """Per-token trust region ``(lo, hi)`` of GPPO, from the kernels' own device function.

    Same definition as ``rlfuse.reference.gppo_bounds``: ``mu = exp(old_logprobs)`` clamped to
    ``[1e-6, 1 - 1e-6]``, the 15 cells of SPEC 4.2 computed in fp64, returned in fp32 (fp64 for
    fp64 input); ``hi`` may be ``inf`` (kl mc/atomic).
    """
    check_tensor("old_logprobs", old_logprobs, floating=True)
    delta = check_region(geometry, topology, delta)
    if not use_kernels(old_logprobs.device):
        return reference.gppo_bounds(old_logprobs, geometry=geometry, topology=topology,
                                     delta=delta)
    from ..kernels.gppo import gppo_bounds_kernel

    return gppo_bounds_kernel(old_logprobs.detach(), geometry, topology, delta)


def surrogate_metrics(totals: torch.Tensor, tokens: torch.Tensor):
    from ..kernels import surrogate as k

    tokens = tokens.clamp_min(1)
    return {
        "clip_frac_low": totals[k.SUM_CLIP_LOW] / tokens,
        "clip_frac_high": totals[k.SUM_CLIP_HIGH] / tokens,
        "ratio_mean": totals[k.SUM_RATIO] / tokens,
        "approx_kl": totals[k.SUM_NEG_LOG_RATIO] / tokens,
    }


def gppo_loss(policy, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              *, geometry: str = "chi2", topology: str = "atomic", delta: float = 0.04,
              agg: str = "token-mean", num_tokens: Optional[float] = None,
              num_sequences: Optional[float] = None, validate: bool = True) -> LossOutput:
    """GPPO: the policy-gradient surrogate clipped to each token's f-divergence trust region.

    Args:
        policy: learner log-probs ``[B, T]`` (requires grad) or ``rlfuse.Logits``.
        old_logprobs: ``[B, T]`` behavior-policy log-probs (detached).
        advantages: ``[B]`` (per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` bool (or 0/1): the response tokens.
        geometry: ``tv``, ``chi2``, ``hellinger``, ``kl`` or ``two_sided_log``.
        topology: ``mc``, ``atomic`` or ``binary``.
        delta: region size ``> 0`` (a runtime kernel argument).
        agg: ``token-mean`` (default), ``seq-mean-token-mean``, ``seq-mean-token-sum``,
            ``seq-mean-token-sum-norm`` (verl's names and divisors).
        num_tokens, num_sequences: global counts for gradient accumulation / data parallelism
            (default: the local ones).
        validate: check values of the ``[B, T]`` inputs (shapes are always checked).

    Per token ``r = exp(lp - old_lp)``, ``[l, u] = gppo_bounds(old_lp)``,
    ``J = min(r A, clip(r, l, u) A)``, loss ``= -agg(J)``; the branch is chosen in log space and
    only the selected one exponentiated. An unclipped ``r A`` that overflows raises
    ``ValueError``. Metrics: ``clip_frac_low``, ``clip_frac_high``, ``ratio_mean``,
    ``approx_kl``. See ``rlfuse.reference.gppo_loss`` for the full definition.

    From log-probs: one forward and one backward kernel. From ``Logits``: one kernel that
    computes the log-probs, the loss and ``dlogits`` in a single pass over the logits.
    """
    if not use_kernels(check_policy(policy).device):
        return reference.gppo_loss(policy, old_logprobs, advantages, mask, geometry=geometry,
                                   topology=topology, delta=delta, agg=agg,
                                   num_tokens=num_tokens, num_sequences=num_sequences,
                                   validate=validate)
    info, mask, delta, num_tokens, num_sequences = check_gppo_args(
        policy, old_logprobs, advantages, mask, geometry=geometry, topology=topology, delta=delta,
        agg=agg, num_tokens=num_tokens, num_sequences=num_sequences, validate=validate)

    from ..kernels.gppo import GEOMETRY_CODE, TOPOLOGY_CODE

    scale = row_scales(mask, agg, info.compute_dtype, num_tokens=num_tokens,
                       num_sequences=num_sequences)
    loss, totals = surrogate_loss(policy, old_logprobs.detach(), advantages.detach(), mask, scale,
                                  geometry_code=GEOMETRY_CODE[geometry],
                                  topology_code=TOPOLOGY_CODE[topology], delta=delta)
    return LossOutput(loss, surrogate_metrics(totals, mask.sum()))


class GPPOLoss(torch.nn.Module):
    """``gppo_loss`` with its hyper-parameters held by the module."""

    def __init__(self, *, geometry: str = "chi2", topology: str = "atomic", delta: float = 0.04,
                 agg: str = "token-mean", validate: bool = True):
        super().__init__()
        self.geometry, self.topology, self.delta, self.agg = geometry, topology, delta, agg
        self.validate = validate

    def forward(self, policy, old_logprobs, advantages, mask, *, num_tokens=None,
                num_sequences=None) -> LossOutput:
        return gppo_loss(policy, old_logprobs, advantages, mask, geometry=self.geometry,
                         topology=self.topology, delta=self.delta, agg=self.agg,
                         num_tokens=num_tokens, num_sequences=num_sequences,
                         validate=self.validate)


__all__ = ["GPPOLoss", "gppo_bounds", "gppo_loss", "group_advantages"]
