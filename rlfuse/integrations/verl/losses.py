"""verl's ``loss_mode``s by rlfuse, registered in verl's policy-loss registry when this module is
imported (by ``import rlfuse.integrations.verl``, which says what each is): ``rlfuse_<mode>``
for every mode of :data:`MODES` (``rlfuse_ppo`` too), ``rlfuse_bypass_mode``, ``rlfuse_gppo``
(:func:`register_gppo` for other regions), and verl's ``kl_penalty`` (:func:`kl_penalty`)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from verl.trainer.ppo.core_algos import register_policy_loss

import rlfuse
from rlfuse import objectives
from .aggregation import fused_metric, verl_aggregation, verl_clip

__all__ = ["MODES", "kl_penalty", "register_gppo"]


def _policy_config(config):
    return config.policy_loss


# Each mode: its objective from verl's config, the aggregation it uses (None: the caller's
# loss_agg_mode; "own": the objective's, whatever verl is told), and its metrics: {verl's name:
# rlfuse's name(s) (summed), or None for verl's constant 0}.
_CLIP_METRICS = {"actor/pg_clipfrac": ("clip_frac_low", "clip_frac_high"),
                 "actor/ppo_kl": "approx_kl", "actor/pg_clipfrac_lower": "dual_clip_frac"}
_DPPO_METRICS = {"actor/pg_clipfrac": "dropped_frac", "actor/ppo_kl": "approx_kl",
                 "actor/pg_clipfrac_lower": "truncated_frac"}


def _dppo(cls):
    return lambda c: cls(clip=verl_clip(c), truncation=c.get("clip_ratio_c", 20.0))


MODES: Dict[str, Tuple[Callable, Optional[str], Dict[str, Any]]] = {
    "vanilla": (lambda c: objectives.Clip(clip=verl_clip(c), dual_clip=c.get("clip_ratio_c", 3.0)),
                None, _CLIP_METRICS),
    "dppo_tv": (_dppo(objectives.DPPOTV), None, _DPPO_METRICS),
    "dppo_kl": (_dppo(objectives.DPPOKL), None, _DPPO_METRICS),
    "gspo": (lambda c: objectives.GSPO(clip=verl_clip(c)), None,
             {"actor/pg_clipfrac": ("clip_frac_low", "clip_frac_high"),
              "actor/ppo_kl": "approx_kl", "actor/pg_clipfrac_lower": None}),
    "sapo": (lambda c: objectives.SAPO(tau_pos=c.tau_pos, tau_neg=c.tau_neg),
             "seq-mean-token-mean", {"actor/pg_clipfrac": None, "actor/ppo_kl": "approx_kl",
                                     "actor/pg_clipfrac_lower": None}),
    "gpg": (lambda c: objectives.GPG(), None, {}),
    "clip_cov": (lambda c: objectives.ClipCov(
        clip=verl_clip(c), clip_cov_ratio=_or(_policy_config(c).clip_cov_ratio, 0.0002),
        clip_cov_lb=_or(_policy_config(c).clip_cov_lb, 1.0),
        clip_cov_ub=_or(_policy_config(c).clip_cov_ub, 5.0)), None,
        {"actor/pg_clipfrac": "cut_frac", "actor/ppo_kl": "approx_kl"}),
    "kl_cov": (lambda c: objectives.KLCov(
        kl_cov_ratio=_or(_policy_config(c).kl_cov_ratio, 0.0002),
        ppo_kl_coef=_or(_policy_config(c).ppo_kl_coef, 1.0)), None,
        {"actor/ppo_kl": "approx_kl"}),
    "geo_mean": (lambda c: objectives.GeoMean(clip=verl_clip(c)), "own",
                 {"actor/pg_clipfrac": "clip_frac_high", "actor/ppo_kl": "approx_kl",
                  "actor/pg_clipfrac_lower": "clip_frac_low"}),
    "dro": (lambda c: objectives.DRO(dro_beta=_policy_config(c).dro_beta), None,
            {"actor/ppo_kl": "approx_kl"}),
    "cispo": (lambda c: objectives.CISPO(clip=verl_clip(c)), None,
              {"actor/pg_clipfrac": "clip_frac", "actor/ppo_kl": "approx_kl",
               "actor/pg_clipfrac_lower": None}),
}


def _or(value, default):
    return default if value is None else value


def _metrics(names: Dict[str, Any], found: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """verl's metric names (and values: floats) from rlfuse's metrics, and whether the fused
    kernels ran."""
    out = fused_metric(next(iter(found.values())))
    for verl_name, ours in names.items():
        if ours is None:
            out[verl_name] = 0.0
        elif isinstance(ours, tuple):
            out[verl_name] = sum(found[name] for name in ours).item()
        else:
            out[verl_name] = found[ours].item()
    if "overflow" in found:
        out["actor/rlfuse_overflow"] = found["overflow"].item()
    return out


def _loss(mode: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
          rollout_is_weights):
    make, agg, names = MODES[mode]
    info = config.get("global_batch_info")
    aggregation = {} if agg == "own" else verl_aggregation(agg or loss_agg_mode, response_mask,
                                                           info)
    out = rlfuse.policy_loss(log_prob, old_log_prob, advantages, response_mask.bool(),
                             make(config), weights=rollout_is_weights, validate=False,
                             **aggregation)
    return out.loss, _metrics(names, out.metrics)


def _register(mode: str) -> Callable:
    def compute_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                            advantages: torch.Tensor, response_mask: torch.Tensor,
                            loss_agg_mode: str = "token-mean", config=None,
                            rollout_is_weights: Optional[torch.Tensor] = None):
        if config is None:
            raise ValueError(f"config: loss_mode 'rlfuse_{mode}' needs verl's actor config")
        return _loss(mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                     config, rollout_is_weights)

    compute_policy_loss.__name__ = f"compute_policy_loss_rlfuse_{mode}"
    compute_policy_loss.__doc__ = f"verl's ``{mode}`` policy loss by ``rlfuse.policy_loss``."
    return register_policy_loss(f"rlfuse_{mode}")(compute_policy_loss)


for _mode in MODES:
    globals()[f"compute_policy_loss_rlfuse_{_mode}"] = _register(_mode)
compute_policy_loss_rlfuse_ppo = register_policy_loss("rlfuse_ppo")(
    globals()["compute_policy_loss_rlfuse_vanilla"])


@register_policy_loss("rlfuse_bypass_mode")
def compute_policy_loss_rlfuse_bypass_mode(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                                           advantages: torch.Tensor, response_mask: torch.Tensor,
                                           loss_agg_mode: str = "token-mean", config=None,
                                           rollout_is_weights: Optional[torch.Tensor] = None):
    """verl's ``bypass_mode`` (``old_log_prob`` is the rollout's): verl's rollout correction
    (importance weights and rejection mask, from ``[B, T]`` log-probs), then ``vanilla``
    without weights (``loss_type="ppo_clip"``) or the policy gradient with the importance
    weights (``"reinforce"``), by ``rlfuse.policy_loss``."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    if config is None:
        raise ValueError("config: loss_mode 'rlfuse_bypass_mode' needs verl's actor config")
    corr = config.policy_loss.get("rollout_correction", None) \
        if hasattr(config, "policy_loss") else None
    if corr is None:
        raise ValueError("rollout_correction config not found in policy_loss: "
                         "loss_mode='rlfuse_bypass_mode' needs it")
    loss_type = corr.get("loss_type", "ppo_clip")
    with torch.no_grad():
        weights, mask, corr_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob, rollout_log_prob=old_log_prob, response_mask=response_mask,
            rollout_is=corr.get("rollout_is", None),
            rollout_is_threshold=corr.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=corr.get("rollout_is_batch_normalize", False),
            rollout_rs=corr.get("rollout_rs", None),
            rollout_rs_threshold=corr.get("rollout_rs_threshold", None))
    weights = weights.batch["rollout_is_weights"] if weights else None
    if loss_type == "ppo_clip":
        loss, metrics = _loss("vanilla", old_log_prob, log_prob, advantages, mask,
                              loss_agg_mode, config, None)
    elif loss_type == "reinforce":
        loss, _ = _loss("gpg", old_log_prob, log_prob, advantages, mask, loss_agg_mode, config,
                        weights)
        kl = (old_log_prob - log_prob.detach()) * mask
        metrics = {"actor/ppo_kl": (kl.sum() / (mask.sum() + 1e-8)).item(),
                   **fused_metric(log_prob)}
    else:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    metrics.update(corr_metrics)
    return loss, metrics


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl's ``kl_penalty`` (every type and its ``+`` form) by ``rlfuse.kl_penalty``."""
    return rlfuse.kl_penalty(logprob, ref_logprob, kl_penalty)


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
        return out.loss, _metrics(_CLIP_METRICS, out.metrics)

    return compute_policy_loss_rlfuse_gppo


register_gppo()
