"""GGPO in verl (the real package): verl's KL in the reward (its own ``kl_penalty``, as its
``apply_kl_penalty`` applies it), the ``rlfuse_ggpo`` advantage estimator and policy loss from
verl's registries, against ``rlfuse.ggpo_loss`` with the rewards, the reference and β
themselves — loss and gradient, one batch and micro-batches of whole groups — and what the
mapping refuses."""
import numpy as np
import pytest
import torch

from conftest import TOL, integration  # noqa: E402

core_algos = integration("verl.trainer.ppo.core_algos")
from omegaconf import OmegaConf  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
import rlfuse  # noqa: E402
import rlfuse.integrations.verl  # noqa: E402,F401  (registers GGPO's estimator and loss)

M, GROUPS, T, BETA = 3, 4, 6, 0.2
B = M * GROUPS


def algorithm(**kw):
    """verl's ``algorithm`` config as the trainer hands it to an estimator (a DictConfig)."""
    base = dict(adv_estimator="rlfuse_ggpo", use_kl_in_reward=True, kl_penalty="kl",
                kl_ctrl=dict(type="fixed", kl_coef=BETA))
    base.update(kw)
    return OmegaConf.create(base)


def actor(info):
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=M, rollout_n=M,
                       ppo_mini_batch_size=B, global_batch_info=info)


def rollout(dtype, seed=0):
    """A batch of whole groups in verl's order: uids, mask (a row or two short), the
    sequence scores on each row's last token, old, reference and learner log-probs."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T) < torch.randint(2, T + 1, (B,), generator=gen)[:, None]).float()
    rewards = torch.randint(0, 2, (B,), generator=gen).to(torch.float64)
    scores = torch.zeros(B, T, dtype=torch.float64)
    scores[torch.arange(B), mask.sum(-1).long() - 1] = rewards
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    ref = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    lp = (old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    uids = np.repeat(np.array([f"u{g}" for g in range(GROUPS)], dtype=object), M)
    return uids, mask.to(dtype), rewards.to(dtype), scores.to(dtype), old.to(dtype), \
        ref.to(dtype), lp.to(dtype)


def verl_rewards(scores, old, ref, mask):
    """verl's ``apply_kl_penalty``: ``scores − β kl_penalty(old, ref, "kl") · mask``."""
    kld = core_algos.kl_penalty(old, ref, kl_penalty="kl") * mask
    return scores - BETA * kld


def verl_step(uids, mask, scores, old, ref, lp, parts=1):
    """The estimator over the batch, then the loss over ``parts`` micro-batches of whole
    groups (verl's token-mean with the mini-batch's token count): summed loss and gradient."""
    estimator = core_algos.get_adv_estimator_fn("rlfuse_ggpo")
    adv, returns = estimator(token_level_rewards=verl_rewards(scores, old, ref, mask),
                             response_mask=mask, config=algorithm(), index=uids)
    assert torch.equal(adv, returns)
    loss_fn = core_algos.get_policy_loss_fn("rlfuse_ggpo")
    cfg = actor({"dp_size": 1, "batch_num_tokens": int(mask.sum()), "global_batch_size": B})
    x = lp.clone().requires_grad_(True)
    total = 0.0
    for rows in torch.arange(B).chunk(parts):
        loss, metrics = loss_fn(old[rows], x[rows], adv[rows], mask[rows],
                                loss_agg_mode="token-mean", config=cfg)
        total = total + loss
        assert set(metrics) == {"actor/ggpo_gap", "actor/ggpo_q_max", "actor/rlfuse_fused"}
    (grad,) = torch.autograd.grad(total, x)
    return total.detach(), grad


@pytest.mark.parametrize("dtype, tol", [(torch.float64, "fp64_chain"),
                                        (torch.float32, "fp32_chain")], ids=["fp64", "fp32"])
@pytest.mark.parametrize("parts", [1, 2], ids=["one_batch", "micro_batches"])
def test_verls_ggpo_is_ggpo(dtype, tol, parts):
    uids, mask, rewards, scores, old, ref, lp = rollout(dtype)
    got, got_grad = verl_step(uids, mask, scores, old, ref, lp, parts)
    x = lp.clone().requires_grad_(True)
    want = rlfuse.ggpo_loss(x, ref, rewards, mask.bool(), group_size=M, beta=BETA).loss
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want.detach(), **TOL[tol])
    torch.testing.assert_close(got_grad, want_grad, **TOL[tol])


def test_a_wrong_beta_is_not_ggpo():
    """The test's own check: the estimator's β read from verl's config matters."""
    uids, mask, rewards, scores, old, ref, lp = rollout(torch.float64)
    estimator = core_algos.get_adv_estimator_fn("rlfuse_ggpo")
    tlr = verl_rewards(scores, old, ref, mask)
    right, _ = estimator(token_level_rewards=tlr, response_mask=mask, config=algorithm(),
                         index=uids)
    wrong, _ = estimator(token_level_rewards=tlr, response_mask=mask, index=uids,
                         config=algorithm(kl_ctrl=dict(type="fixed", kl_coef=2 * BETA)))
    assert not torch.allclose(right, wrong)


@pytest.mark.parametrize("case, match", [
    (dict(order="balanced"), "one run of equal size"),
    (dict(algorithm=dict(use_kl_in_reward=False)), "use_kl_in_reward=True"),
    (dict(algorithm=dict(kl_penalty="low_var_kl")), "kl_penalty=kl"),
    (dict(algorithm=dict(kl_ctrl=dict(type="adaptive", kl_coef=BETA))), "kl_ctrl.type=fixed"),
    (dict(mode="seq-mean-token-mean"), "loss_agg_mode='seq-mean-token-mean'"),
    (dict(weights=True), "rollout importance weights"),
])
def test_what_verl_cannot_carry_is_refused(case, match):
    uids, mask, rewards, scores, old, ref, lp = rollout(torch.float32)
    if case.get("order") == "balanced":     # trainer.balance_batch scatters the groups
        uids = uids[np.r_[1:B, 0]]
    with pytest.raises(ValueError, match=match):
        adv, _ = core_algos.get_adv_estimator_fn("rlfuse_ggpo")(
            token_level_rewards=verl_rewards(scores, old, ref, mask), response_mask=mask,
            config=algorithm(**case.get("algorithm", {})), index=uids)
        core_algos.get_policy_loss_fn("rlfuse_ggpo")(
            old, lp, adv, mask, loss_agg_mode=case.get("mode", "token-mean"),
            config=actor({}), rollout_is_weights=torch.ones_like(lp) if "weights" in case
            else None)
