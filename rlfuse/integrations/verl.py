"""rlfuse in verl: importing this module registers policy losses in verl's registry.

    import rlfuse.integrations.verl   # e.g. through VERL_USE_EXTERNAL_MODULES
    # actor_rollout_ref.actor.policy_loss.loss_mode = rlfuse_ppo | rlfuse_gppo

``rlfuse_ppo`` is verl's ``vanilla`` loss (clip, clip-higher through ``clip_ratio_low`` /
``clip_ratio_high``, dual clip through ``clip_ratio_c``, every ``loss_agg_mode``,
``rollout_is_weights``) run by ``rlfuse.ppo_loss``; ``rlfuse_gppo`` is ``rlfuse.gppo_loss`` with
the seed's region (chi2 / atomic / delta 0.04), and :func:`register_gppo` registers other
regions under other names. Both take verl's signature and config fields and return verl's
metric names. verl's log-probs are ``[B, T]`` tensors, so the log-prob kernels run (one
forward and one backward kernel; the logits stay verl's).

Differences from ``vanilla``: verl clamps the log-ratio to [-20, 20] before exponentiating
(its gradient is 0 beyond); rlfuse decides the branch in log space and exponentiates only the
selected one, so it needs no clamp (an overflowing ratio is reported as
``actor/rlfuse_overflow``). verl's ``seq-mean-token-mean`` divides each row by ``T_i + 1e-8``,
rlfuse by ``T_i``: the same to fp32 rounding.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from verl.trainer.ppo.core_algos import register_policy_loss

import rlfuse

__all__ = ["register_gppo", "verl_aggregation"]


def verl_aggregation(loss_agg_mode: str, response_mask: torch.Tensor,
                     global_batch_info: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """rlfuse's ``agg``, ``num_tokens``, ``num_sequences`` and ``loss_scale`` that reproduce
    verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode, **global_batch_info)``.

    verl multiplies by the data-parallel size what it divides by a global count; rlfuse divides
    by the count over ``dp_size``. Without a global count, verl's ``seq-mean-*`` modes divide by
    the rows that hold a token (rlfuse's default is every row), and ``token-mean`` by the local
    tokens; ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor`` (default: the padded
    length, rlfuse's own divisor).
    """
    info = dict(global_batch_info or {})
    dp_size = info.get("dp_size", 1) or 1
    out: Dict[str, Any] = {"agg": loss_agg_mode, "loss_scale": 1.0}
    if loss_agg_mode == "token-sum":
        out["loss_scale"] = float(dp_size)
    elif loss_agg_mode == "token-mean":
        tokens = info.get("batch_num_tokens")
        if tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        out["num_tokens"] = None if tokens is None else tokens / dp_size
    else:
        rows = info.get("global_batch_size")
        if rows is None and dp_size > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        if rows is None:   # verl: the rows that hold a token
            rows = (response_mask.sum(-1) > 0).sum().to(torch.float32)
        out["num_sequences"] = rows / dp_size
        factor = info.get("loss_scale_factor")
        if loss_agg_mode == "seq-mean-token-sum-norm" and factor is not None:
            out["loss_scale"] = response_mask.shape[-1] / factor
    return out


def _clip(config) -> Tuple[float, float]:
    eps = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    high = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    return low, high


def _metrics(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """verl's metric names (and values: floats)."""
    return {"actor/pg_clipfrac": (metrics["clip_frac_low"] + metrics["clip_frac_high"]).item(),
            "actor/ppo_kl": metrics["approx_kl"].item(),
            "actor/pg_clipfrac_lower": metrics["dual_clip_frac"].item(),
            "actor/rlfuse_overflow": metrics["overflow"].item()}


@register_policy_loss("rlfuse_ppo")
def compute_policy_loss_rlfuse_ppo(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                                   advantages: torch.Tensor, response_mask: torch.Tensor,
                                   loss_agg_mode: str = "token-mean", config=None,
                                   rollout_is_weights: Optional[torch.Tensor] = None):
    """verl's ``vanilla`` policy loss by ``rlfuse.ppo_loss``."""
    assert config is not None
    out = rlfuse.ppo_loss(
        log_prob, old_log_prob, advantages, response_mask.bool(), clip=_clip(config),
        dual_clip=config.get("clip_ratio_c", 3.0), weights=rollout_is_weights,
        validate=False, **verl_aggregation(loss_agg_mode, response_mask,
                                           config.get("global_batch_info")))
    return out.loss, _metrics(out.metrics)


def register_gppo(name: str = "rlfuse_gppo", *, geometry: str = "chi2", topology: str = "atomic",
                  delta=0.04, dual_clip: Optional[float] = None):
    """Registers ``rlfuse.gppo_loss`` with this region as verl's policy loss ``name``."""
    @register_policy_loss(name)
    def compute_policy_loss_rlfuse_gppo(old_log_prob, log_prob, advantages, response_mask,
                                        loss_agg_mode="token-mean", config=None,
                                        rollout_is_weights=None):
        info = None if config is None else config.get("global_batch_info")
        out = rlfuse.gppo_loss(
            log_prob, old_log_prob, advantages, response_mask.bool(), geometry=geometry,
            topology=topology, delta=delta, dual_clip=dual_clip, weights=rollout_is_weights,
            validate=False, **verl_aggregation(loss_agg_mode, response_mask, info))
        return out.loss, _metrics(out.metrics)

    return compute_policy_loss_rlfuse_gppo


register_gppo()
