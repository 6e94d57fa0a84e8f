"""The reference surrogate of a token-local or sequence objective (``policy_loss`` of ``Clip``,
``GPPO``, ``CISPO``, ... and of GR-OPD): its per-token function over each token's trust region,
the per-token multipliers, and verl's aggregations."""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

import torch

from ..checks.values import raise_on_overflow
from ..objectives import Objective
from ..shared.aggregation import aggregation_weights, masked_mean, per_token, sequence_shares
from .token_functions import TokenResult, token_function
from .regions import region_bounds


class Surrogate(NamedTuple):
    """What a surrogate loss computed: the loss, each token's objective, the log-ratios it
    used (a sequence's under GSPO's ratio) and the mean of ``old - lp`` over the actor tokens
    (each log-ratio clamped to +-``objective.clamp``)."""

    loss: torch.Tensor
    terms: TokenResult
    log_ratio: torch.Tensor
    approx_kl: torch.Tensor
    flags: Tuple[str, ...]


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str, *,
              num_tokens: Optional[float] = None,
              num_sequences: Optional[float] = None) -> torch.Tensor:
    """verl's ``agg_loss`` (``verl.trainer.ppo.core_algos``) of per-token ``values`` [B, T]
    (already 0 off the mask): ``Σ_i w_i Σ_t x_it`` with the row weights ``w`` of
    ``rlfuse.shared.aggregation.aggregation_weights``::

        token-mean               Σ_it M_it x_it / N_tok
        seq-mean-token-mean      Σ_i (Σ_t M_it x_it / T_i) / N_seq
        seq-mean-token-sum       Σ_i (Σ_t M_it x_it) / N_seq
        seq-mean-token-sum-norm  Σ_i (Σ_t M_it x_it / T) / N_seq      (Dr. GRPO; T = mask.shape[-1])
        token-sum                Σ_it M_it x_it

    ``N_tok = num_tokens`` (default: local ``Σ M``), ``N_seq = num_sequences`` (default: the
    local ``B``, every row: TRL's and verl's trainers; verl's ``agg_loss`` called without a
    ``global_batch_size`` divides by the non-empty rows instead), ``T_i = Σ_t M_it``, padded
    length T. The counts may be numbers or 0-dim tensors.
    """
    weights = aggregation_weights(mask, agg, values.dtype, num_tokens=num_tokens,
                                  num_sequences=num_sequences)
    return (values.sum(-1) * weights).sum()


# verl's GSPO clamps the log of its straight-through sequence ratio at 10
STRAIGHT_LOG_MAX = 10.0


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, lp: torch.Tensor,
                       ratio: str) -> torch.Tensor:
    """The log-ratio every token of a row takes under a sequence-level ``ratio``: the mean over
    the row's actor tokens (``sequence``: differentiated through the mean), or that mean
    clamped at 10 and passed straight through to each token (``sequence_straight``)."""
    tokens = mask.sum(-1, keepdim=True).clamp_min(1)
    mean = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True) / tokens
    if ratio == "sequence":
        return torch.where(mask, mean, 0.0)
    straight = lp - lp.detach() + mean.detach()
    return torch.where(mask, straight.clamp(max=STRAIGHT_LOG_MAX), 0.0)


def surrogate(lp: torch.Tensor, old: Optional[torch.Tensor], advantages: torch.Tensor,
              mask: torch.Tensor, objective: Objective, *, agg: str,
              weights: Optional[torch.Tensor] = None, loss_scale: float = 1.0, num_tokens=None,
              num_sequences=None, validate: bool) -> Surrogate:
    """``-loss_scale · agg(w J)`` of ``objective`` (a token-local or sequence objective record)
    at the learner log-probs ``lp [B, T]`` (in the compute dtype, 0 off the mask; ``old`` None:
    on policy, ``old = lp.detach()``, r = 1), its ratio formed as its ``ratio`` says
    (``sequence_log_ratio``). With ``validate`` an overflowing selected objective raises."""
    surrogate_of = objective.surrogate()
    old = lp.detach() if old is None else old
    adv = torch.where(mask, per_token(advantages, mask.shape).detach().to(lp.dtype), 0.0)
    lo, hi = region_bounds(old, surrogate_of.geometry, surrogate_of.topology,
                           (surrogate_of.delta_low, surrogate_of.delta_high))
    log_ratio = lp - old
    clamp = surrogate_of.clamp
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio.clamp(-clamp, clamp), mask)
    if objective.ratio != "token":
        log_ratio = sequence_log_ratio(log_ratio, mask, lp, objective.ratio)
    terms = token_function(surrogate_of.function)(
        log_ratio, lp, old, adv, lo.to(lp.dtype), hi.to(lp.dtype), mask, surrogate_of.params,
        clamp)
    value = terms.value
    if weights is not None:
        value = value * torch.where(mask, weights.detach().to(lp.dtype), 0.0)
    loss = -loss_scale * aggregate(value, mask, agg, num_tokens=num_tokens,
                                   num_sequences=num_sequences)
    if validate:
        raise_on_overflow(terms.overflow.sum(), value.dtype)
    return Surrogate(loss, terms, log_ratio, approx_kl, objective.flags)


def overflow_metric(terms: TokenResult) -> torch.Tensor:
    """1 if some selected objective overflowed, else 0."""
    return terms.overflow.any().to(terms.value.dtype)


def surrogate_metrics(result: Surrogate, mask: torch.Tensor) -> Dict[str, torch.Tensor]:
    """The metrics of a surrogate objective over the actor tokens: its flags' shares, the mean
    ratio, approx_kl and the overflow flag."""
    terms = result.terms
    dtype = terms.value.dtype
    with torch.no_grad():
        metrics = {name: masked_mean(flag.to(dtype), mask)
                   for name, flag in zip(result.flags, terms.flags)}
        metrics.update(ratio_mean=masked_mean(result.log_ratio.detach().exp(), mask),
                       approx_kl=result.approx_kl, overflow=overflow_metric(terms))
        metrics.update(sequence_shares(
            {name: torch.where(mask, flag.to(dtype), 0.0).sum(-1)
             for name, flag in zip(result.flags, terms.flags)}, mask.sum(-1).to(dtype)))
        return metrics
