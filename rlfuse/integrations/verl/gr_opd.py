"""GR-OPD in verl 0.9.1: an advantage estimator ``rlfuse_gr_opd`` and a policy loss
``rlfuse_gr_opd`` (registered by importing ``rlfuse.integrations.verl``), run by
``python -m rlfuse.integrations.verl_gr_opd``, whose reference worker holds the teacher.

verl hands an advantage estimator the token rewards and the rows' uids, nothing of the
reference. With verl's KL in the reward (``use_kl_in_reward=True``, ``kl_penalty=kl``, a fixed
``kl_coef`` of 1) and no task reward, the token rewards are ``0 − 1·(old − ref)``: with the
teacher as the reference, exactly GR-OPD's feedback ``teacher_lp − old_lp`` (the same bits), from
which ``rlfuse.gr_opd_advantages`` forms each group's advantages. The loss is GR-OPD's clipped
surrogate over those advantages (``seq-mean-token-mean``), token-local: any micro-batching.
"""
from __future__ import annotations

import inspect

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss

import rlfuse
from rlfuse import objectives
from .aggregation import fused_metric, row_values, verl_aggregation, verl_clip
from .ggpo import kl_in_reward_coef

NAME = "rlfuse_gr_opd"
# GR-OPD's advantage settings under ``algorithm.rlfuse_gr_opd``, with gr_opd_advantages' defaults
ADVANTAGE_DEFAULTS = {name: inspect.signature(rlfuse.gr_opd_advantages).parameters[name].default
                      for name in ("gamma", "lam", "feedback_clip", "adv_clip", "std_eps")}
# what ``verl_gr_opd``'s runner writes under ``algorithm.rlfuse_gr_opd`` once its reference
# worker holds the teacher (verl's own runner loads the actor's model there)
TEACHER_STAMP = ("reference", "teacher")
# verl's ``reward.custom_reward_function`` (path, name) of the recipe
NO_TASK_REWARD = ("pkg://rlfuse.integrations.verl.gr_opd", "no_task_reward")


def no_task_reward(data_source=None, solution_str=None, ground_truth=None, extra_info=None,
                   **kwargs) -> float:
    """verl's ``custom_reward_function`` for GR-OPD: no task reward (its only signal is the
    teacher's feedback, which verl's KL in the reward adds)."""
    return 0.0


def advantage_settings(config) -> dict:
    """GR-OPD's advantage settings from verl's ``algorithm`` config, after checking that the
    token rewards are its feedback: the runner's teacher in the reference worker and verl's KL
    in the reward with a coefficient of 1."""
    node = None if config is None else config.get(NAME)
    key, value = TEACHER_STAMP
    if node is None or node.get(key) != value:
        raise ValueError(f"{NAME}: the reference worker does not hold the teacher (verl's own "
                         f"runner loads the actor's model there): train with "
                         f"`python -m rlfuse.integrations.verl_gr_opd "
                         f"algorithm.{NAME}.teacher=<teacher model>`")
    coef = kl_in_reward_coef(config, NAME, "1 (the feedback teacher_lp - old_lp)")
    if coef != 1.0:
        raise ValueError(f"{NAME}: algorithm.kl_ctrl.kl_coef={coef} (must be 1: the token "
                         f"rewards are then GR-OPD's feedback teacher_lp - old_lp)")
    unknown = set(node) - set(ADVANTAGE_DEFAULTS) - {"teacher", key}
    if unknown:
        raise ValueError(f"algorithm.{NAME}: unknown settings {sorted(unknown)} (expected "
                         f"teacher and {sorted(ADVANTAGE_DEFAULTS)})")
    return {name: float(node.get(name, default)) for name, default in ADVANTAGE_DEFAULTS.items()}


def groups_by_uid(index):
    """``(order, size)``: the rows sorted into groups by uid (stably, so verl's
    ``balance_batch`` may have reordered them), every group as large and at least 2."""
    _, inverse, counts = np.unique(np.asarray(index), return_inverse=True, return_counts=True)
    if len(set(counts.tolist())) != 1 or counts[0] < 2:
        raise ValueError(f"{NAME}: every uid needs as many rows, at least 2 (verl's rollout.n); "
                         f"got groups of {sorted(set(counts.tolist()))} rows")
    return torch.from_numpy(np.argsort(inverse.reshape(-1), kind="stable")), int(counts[0])


@register_adv_est(NAME)
def compute_gr_opd_advantages(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                              config=None, index=None, **kwargs):
    """``(advantages, returns)``: GR-OPD's advantage of each response on its tokens, from the
    token rewards ``teacher_lp − old_lp`` (see the module), its groups the rows of one uid."""
    if index is None:
        raise ValueError(f"{NAME}: needs the rows' uids (verl's non_tensor_batch['uid'])")
    settings = advantage_settings(config)
    order, size = groups_by_uid(index)
    order = order.to(token_level_rewards.device)
    feedback = token_level_rewards[order]
    # two log-probs (<= 0) whose difference is the feedback, exactly
    teacher, old = feedback.clamp(max=0), -feedback.clamp(min=0)
    grouped = rlfuse.gr_opd_advantages(old, teacher, response_mask[order].bool(),
                                       group_size=size, **settings)
    per_row = torch.empty_like(grouped)
    per_row[order] = grouped
    tokens = per_row[:, None].to(token_level_rewards.dtype) * response_mask
    return tokens, tokens


@register_policy_loss(NAME)
def compute_policy_loss_rlfuse_gr_opd(old_log_prob, log_prob, advantages, response_mask,
                                      loss_agg_mode="seq-mean-token-mean", config=None,
                                      rollout_is_weights=None):
    """GR-OPD's loss, ``rlfuse.gr_opd_loss`` given the estimator's advantages (the step it runs
    then: ``policy_loss`` with PPO's clip ``[1 − clip_ratio_low, 1 + clip_ratio_high]``, no
    dual clip, no log-ratio clamp), each response's token mean averaged over the mini-batch's
    responses."""
    if loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(f"{NAME}: loss_agg_mode={loss_agg_mode!r} (GR-OPD averages each "
                         f"response's tokens, then the responses: seq-mean-token-mean)")
    if rollout_is_weights is not None:
        raise ValueError(f"{NAME}: rollout importance weights (GR-OPD's loss takes none)")
    if config is None:
        raise ValueError(f"config: loss_mode '{NAME}' needs verl's actor config")
    mask = response_mask.bool()
    adv = row_values(advantages, mask)
    agg = verl_aggregation(loss_agg_mode, response_mask, config.get("global_batch_info"))
    out = rlfuse.policy_loss(log_prob, old_log_prob, adv, mask,
                             objectives.Clip(clip=verl_clip(config), log_ratio_clamp=None),
                             agg=loss_agg_mode, num_sequences=agg["num_sequences"],
                             validate=False)
    found = out.metrics
    return out.loss, {"actor/pg_clipfrac": (found["clip_frac_low"] +
                                            found["clip_frac_high"]).item(),
                      "actor/ppo_kl": found["approx_kl"].item(),
                      "actor/rlfuse_overflow": found["overflow"].item(),
                      **fused_metric(log_prob)}
