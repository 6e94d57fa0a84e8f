"""GGPO in verl 0.9.1: an advantage estimator ``rlfuse_ggpo`` and a policy loss ``rlfuse_ggpo``
(registered by importing ``rlfuse.integrations.verl``).

verl hands an advantage estimator the token rewards and the rows' uids, and a policy loss the
learner's and the old log-probs with one advantage per token; neither sees the reference
log-probs. With verl's KL in the reward (``algorithm.use_kl_in_reward=True``,
``kl_penalty=kl``, a fixed ``kl_coef`` β) the token rewards are ``score − β (old − ref)``, so
their sum over a response is ``R̃_i = r_i − β (s_i^old − s_i^ref)``, and

    R_i / β = R̃_i / β − (s_i − s_i^old)

GGPO's loss depends on its adjusted rewards only through ``R / β``, so ``ggpo_loss`` with the
old log-probs as its reference, ``R̃ / β`` as the rewards and β = 1 is GGPO's loss with β and
the reference itself (the same value and gradient; ``test_verl_ggpo.py``).
"""
from __future__ import annotations

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss

import rlfuse
from .aggregation import fused_metric, row_values, verl_aggregation


def _check_groups(index) -> None:
    """Verl's groups of rows ``index`` (their uids) are each one run of rows, every run as long
    and at least 2 (verl's rollout order, which ``trainer.balance_batch`` would break)."""
    uids = np.asarray(index)
    starts = np.flatnonzero(np.r_[True, uids[1:] != uids[:-1]])
    sizes = np.diff(np.r_[starts, len(uids)])
    if len(set(uids[starts].tolist())) != len(starts) or len(set(sizes.tolist())) != 1 or \
            sizes[0] < 2:
        raise ValueError("rlfuse_ggpo: the rows of each uid must be one run of equal size >= 2 "
                         "(GGPO couples a group; set trainer.balance_batch=False)")


def kl_in_reward_coef(config, name: str, what: str) -> float:
    """The coefficient of verl's KL in the reward (``algorithm`` config ``config``), which must
    be on, k1 and fixed; ``name`` and ``what`` (the coefficient's meaning) for the error."""
    kl_ctrl = config.get("kl_ctrl") or {}
    if not config.get("use_kl_in_reward") or config.get("kl_penalty") != "kl" or \
            kl_ctrl.get("type") != "fixed" or not kl_ctrl.get("kl_coef", 0.0) > 0:
        raise ValueError(f"{name}: needs algorithm.use_kl_in_reward=True, "
                         f"algorithm.kl_penalty=kl, algorithm.kl_ctrl.type=fixed and "
                         f"algorithm.kl_ctrl.kl_coef={what}")
    return float(kl_ctrl.get("kl_coef"))


@register_adv_est("rlfuse_ggpo")
def compute_ggpo_rewards(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                         config=None, index=None, **kwargs):
    """``(advantages, returns)``: ``R̃_i / β`` on every token of response ``i`` (see the
    module), the groups checked whole and in order."""
    if config is None or index is None:
        raise ValueError("rlfuse_ggpo: needs verl's algorithm config and the rows' uids")
    beta = kl_in_reward_coef(config, "rlfuse_ggpo", "beta > 0 (GGPO's KL to the reference)")
    _check_groups(index)
    mask = response_mask.to(token_level_rewards.dtype)
    scaled = (token_level_rewards * mask).sum(-1, keepdim=True) / beta * mask
    return scaled, scaled


@register_policy_loss("rlfuse_ggpo")
def compute_policy_loss_rlfuse_ggpo(old_log_prob, log_prob, advantages, response_mask,
                                    loss_agg_mode="token-mean", config=None,
                                    rollout_is_weights=None):
    """``rlfuse.ggpo_loss`` over a micro-batch of whole groups of ``actor.rollout_n`` rows
    (``compute_ggpo_rewards``' advantages), normalised by the mini-batch's tokens as verl's
    ``token-mean`` is."""
    if loss_agg_mode != "token-mean":
        raise ValueError(f"rlfuse_ggpo: loss_agg_mode={loss_agg_mode!r} (GGPO's normaliser is "
                         f"the mini-batch's tokens: token-mean)")
    if rollout_is_weights is not None:
        raise ValueError("rlfuse_ggpo: rollout importance weights (no importance ratio enters "
                         "GGPO's loss)")
    mask = response_mask.bool()
    rewards = row_values(advantages, mask)      # the row's reward on each token
    agg = verl_aggregation("token-mean", response_mask, config.get("global_batch_info"))
    out = rlfuse.ggpo_loss(log_prob, old_log_prob, rewards, mask, group_size=config.rollout_n,
                           beta=1.0, num_tokens=agg["num_tokens"], validate=False)
    metrics = {"actor/ggpo_gap": out.metrics["gap"].item(),
               "actor/ggpo_q_max": out.metrics["q_max"].item(), **fused_metric(log_prob)}
    return out.loss, metrics
