"""GR-OPD in verl (the real package): ``python -m rlfuse.integrations.verl_gr_opd``'s config
(verl's own, composed by hydra), its reference worker holding the teacher (verl's worker, built
and run as verl's trainer runs it), verl's KL in the reward and verl's ``compute_advantage`` with
the ``rlfuse_gr_opd`` estimator, the loss from verl's registry over micro-batches — against
``rlfuse.gr_opd_advantages`` and ``rlfuse.gr_opd_loss`` with the teacher's log-probs themselves
— and what the recipe refuses."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, TOL, integration, process_env  # noqa: E402

core_algos = integration("verl.trainer.ppo.core_algos")
hydra = integration("hydra")
from hydra import compose, initialize_config_module  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import ray_trainer  # noqa: E402
from verl.utils.config import validate_config  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

import rlfuse  # noqa: E402
from rlfuse.integrations import verl_gr_opd  # noqa: E402
from rlfuse.integrations.verl import gr_opd as gr_opd_in_verl  # noqa: E402

M, GROUPS, T = 3, 4, 7
B = M * GROUPS
SIZES = ["actor_rollout_ref.rollout.n=3", "data.train_batch_size=4", "trainer.n_gpus_per_node=1",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"]


def recipe(*overrides, teacher="/models/teacher", checked=True):
    """verl's whole config as ``verl_gr_opd`` composes it (``checked``: after its checks, as the
    runner hands it to verl's trainer)."""
    extra = [f"algorithm.rlfuse_gr_opd.teacher={teacher}"] if teacher else []
    with initialize_config_module(config_module="rlfuse.integrations.verl",
                                  version_base=None):
        config = compose("rlfuse_gr_opd", overrides=[*SIZES, *extra, *overrides])
    if checked:
        verl_gr_opd.check_recipe(config)
    return config


def rollout(dtype, seed=0):
    """Whole groups in verl's order: uids, mask (rows of 1 to T tokens), the old, the teacher's
    and the learner's log-probs."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T) < torch.randint(1, T + 1, (B,), generator=gen)[:, None]).long()
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    teacher = (old + torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    lp = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=0)
    uids = np.repeat(np.array([f"u{g}" for g in range(GROUPS)], dtype=object), M)
    return uids, mask, old.to(dtype), teacher.to(dtype), lp.to(dtype)


def verl_advantages(config, uids, mask, old, teacher):
    """verl's trainer from the reference log-probs on: no task reward, its KL in the reward
    (``apply_kl_penalty`` with its controller), its ``compute_advantage``."""
    algorithm = config.algorithm
    data = DataProto.from_dict({"response_mask": mask, "old_log_probs": old,
                                "ref_log_prob": teacher,
                                "token_level_scores": torch.zeros_like(old)},
                               non_tensors={"uid": uids})
    data, _ = ray_trainer.apply_kl_penalty(data, core_algos.get_kl_controller(algorithm.kl_ctrl),
                                           kl_penalty=algorithm.kl_penalty)
    data = ray_trainer.compute_advantage(
        data, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n, config=algorithm)
    assert torch.equal(data.batch["advantages"], data.batch["returns"])
    return data.batch["advantages"]


def actor(low=0.2, high=0.28):
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=M, rollout_n=M,
                       ppo_mini_batch_size=B, clip_ratio_low=low, clip_ratio_high=high,
                       global_batch_info={"dp_size": 1, "global_batch_size": B})


def verl_loss(adv, mask, old, lp, parts, config=None):
    """The registered loss over ``parts`` micro-batches, summed, and its gradient."""
    loss_fn = core_algos.get_policy_loss_fn("rlfuse_gr_opd")
    x = lp.clone().requires_grad_(True)
    total = 0.0
    for rows in torch.arange(B).chunk(parts):
        loss, metrics = loss_fn(old[rows], x[rows], adv[rows], mask[rows].to(lp.dtype),
                                loss_agg_mode="seq-mean-token-mean", config=config or actor())
        total = total + loss
        assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/rlfuse_overflow",
                                "actor/rlfuse_fused"}
    (grad,) = torch.autograd.grad(total, x)
    return total.detach(), grad


def gr_opd(mask, old, teacher, lp, **settings):
    x = lp.clone().requires_grad_(True)
    out = rlfuse.gr_opd_loss(x, old, teacher, mask.bool(), group_size=M, eps=(0.2, 0.28),
                             **settings)
    (grad,) = torch.autograd.grad(out.loss, x)
    return out.loss.detach(), grad, out.metrics


@pytest.mark.parametrize("dtype, tol", [(torch.float64, "fp64_chain"),
                                        (torch.float32, "fp32_chain")], ids=["fp64", "fp32"])
@pytest.mark.parametrize("parts", [1, 3], ids=["one_batch", "micro_batches"])
def test_verls_gr_opd_is_gr_opd(dtype, tol, parts):
    """verl's token rewards are GR-OPD's feedback to the bit, so its advantages are
    ``gr_opd_advantages``' bits; the loss over any micro-batches is ``gr_opd_loss``."""
    uids, mask, old, teacher, lp = rollout(dtype)
    adv = verl_advantages(recipe(), uids, mask, old, teacher)
    want = rlfuse.gr_opd_advantages(old, teacher, mask.bool(), group_size=M)
    assert torch.equal(adv, want[:, None].to(dtype) * mask)
    got, got_grad = verl_loss(adv, mask, old, lp, parts)
    loss, grad, metrics = gr_opd(mask, old, teacher, lp)
    assert metrics["clip_frac_low"] > 0 and metrics["clip_frac_high"] > 0
    torch.testing.assert_close(got, loss, **TOL[tol])
    torch.testing.assert_close(got_grad, grad, **TOL[tol])


def test_rows_in_any_order():
    """verl's ``balance_batch`` reorders the rows: the groups are the uids' rows wherever
    they are."""
    uids, mask, old, teacher, lp = rollout(torch.float64, seed=1)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(2))
    adv = verl_advantages(recipe(), uids[perm.numpy()], mask[perm], old[perm], teacher[perm])
    want = rlfuse.gr_opd_advantages(old, teacher, mask.bool(), group_size=M)
    torch.testing.assert_close(adv, (want[:, None] * mask)[perm], **TOL["fp64_sum"])


def test_settings_reach_the_advantages():
    """``algorithm.rlfuse_gr_opd``'s settings are ``gr_opd_advantages``' (each binding here:
    they differ from the defaults' result)."""
    settings = dict(gamma=0.9, lam=0.5, feedback_clip=0.75, adv_clip=1.25, std_eps=1e-3)
    config = recipe(*[f"algorithm.rlfuse_gr_opd.{k}={v}" for k, v in settings.items()])
    uids, mask, old, teacher, lp = rollout(torch.float64, seed=3)
    adv = verl_advantages(config, uids, mask, old, teacher)
    want = rlfuse.gr_opd_advantages(old, teacher, mask.bool(), group_size=M, **settings)
    assert torch.equal(adv, want[:, None] * mask)
    default = rlfuse.gr_opd_advantages(old, teacher, mask.bool(), group_size=M)
    assert not torch.allclose(want, default)
    for name, value in settings.items():     # each one alone changes the result
        alone = rlfuse.gr_opd_advantages(old, teacher, mask.bool(), group_size=M,
                                         **{name: value})
        assert not torch.equal(alone, default), name


@pytest.mark.parametrize("case, match", [
    (dict(checked=False), "does not hold the teacher"),
    (dict(overrides=["algorithm.kl_ctrl.kl_coef=0.5"]), "kl_coef=0.5"),
    (dict(overrides=["algorithm.use_kl_in_reward=False"]), "use_kl_in_reward=True"),
    (dict(overrides=["algorithm.kl_penalty=low_var_kl"]), "kl_penalty=kl"),
    (dict(overrides=["+algorithm.rlfuse_gr_opd.gama=0.9"]), "unknown settings"),
    (dict(rows=B - 1), "every uid needs as many rows"),
    (dict(rows=None), "needs the rows' uids"),
])
def test_what_the_estimator_refuses(case, match):
    uids, mask, old, teacher, _ = rollout(torch.float32)
    config = recipe(*case.get("overrides", ()), checked=case.get("checked", True))
    rows = case.get("rows", B)
    fn = core_algos.get_adv_estimator_fn("rlfuse_gr_opd")
    with pytest.raises(ValueError, match=match):
        fn(token_level_rewards=teacher[:rows] - old[:rows], response_mask=mask[:rows],
           config=config.algorithm, index=None if rows is None else uids[:rows])


@pytest.mark.parametrize("case, match", [
    (dict(mode="token-mean"), "loss_agg_mode='token-mean'"),
    (dict(weights=True), "rollout importance weights"),
    (dict(config=None), "needs verl's actor config"),
])
def test_what_the_loss_refuses(case, match):
    uids, mask, old, teacher, lp = rollout(torch.float32)
    with pytest.raises(ValueError, match=match):
        core_algos.get_policy_loss_fn("rlfuse_gr_opd")(
            old, lp, teacher - old, mask, loss_agg_mode=case.get("mode", "seq-mean-token-mean"),
            config=case.get("config", actor()),
            rollout_is_weights=torch.ones_like(lp) if "weights" in case else None)


def test_recipe_is_verls_config_with_gr_opd():
    """The composed config passes verl's own checks; the runner's checks add the teacher's
    stamp and the reward function of no task reward, which verl's own loader loads."""
    config = recipe(checked=False)
    validate_config(config=config, use_reference_policy=True, use_critic=False)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "rlfuse_gr_opd"
    assert config.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-mean"
    assert config.algorithm.rlfuse_gr_opd.gamma == 0.99 and not config.trainer.use_v1
    node = config.algorithm.rlfuse_gr_opd    # the yaml's defaults are gr_opd_advantages'
    assert {k: node[k] for k in gr_opd_in_verl.ADVANTAGE_DEFAULTS} == \
        gr_opd_in_verl.ADVANTAGE_DEFAULTS
    verl_gr_opd.check_recipe(config)
    assert config.algorithm.rlfuse_gr_opd.reference == "teacher"
    from verl.trainer.ppo.reward import get_custom_reward_fn
    reward = get_custom_reward_fn(config)
    assert reward(data_source="x", solution_str="y", ground_truth="z", extra_info={}) == 0.0


@pytest.mark.parametrize("case, match", [
    (dict(teacher=None), "teacher: the teacher model"),
    (dict(overrides=["actor_rollout_ref.model.lora_rank=8"]), "LoRA"),
    (dict(overrides=["actor_rollout_ref.actor.use_kl_loss=True"]), "use_kl_loss"),
    (dict(overrides=["reward.reward_model.enable=True"]), "reward_model.enable"),
    (dict(overrides=["reward.custom_reward_function.path=/my/reward.py"]), "no task reward"),
    (dict(overrides=["algorithm.adv_estimator=grpo"]), "adv_estimator='grpo'"),
    (dict(overrides=["trainer.use_v1=True"]), "use_v1=True"),
])
def test_what_the_recipe_refuses(case, match):
    config = recipe(*case.get("overrides", ()), teacher=case.get("teacher", "/models/t"),
                    checked=False)
    with pytest.raises(ValueError, match=match):
        verl_gr_opd.check_recipe(config)


def test_runner_puts_the_teacher_in_the_reference_worker():
    """verl's legacy runner's roles: the actor and rollout in verl's worker, the reference
    apart in ``TeacherReferenceWorker`` with the teacher, both in verl's global pool."""
    from verl.trainer.ppo.ray_trainer import Role
    from verl.workers.engine_workers import ActorRolloutRefWorker

    config = recipe(teacher="/models/the-teacher")
    runner = verl_gr_opd.GROPDTaskRunner()
    actor_cls, _ = runner.add_actor_rollout_worker(config)
    runner.add_ref_policy_worker(config, actor_cls)
    roles = runner.role_worker_mapping
    assert set(roles) == {Role.ActorRollout, Role.RefPolicy}
    assert roles[Role.ActorRollout].__ray_actor_class__ is ActorRolloutRefWorker
    ref = roles[Role.RefPolicy].__ray_actor_class__
    assert issubclass(ref, verl_gr_opd.TeacherReferenceWorker)
    assert ref.teacher == "/models/the-teacher"
    assert runner.mapping == {Role.ActorRollout: "global_pool", Role.RefPolicy: "global_pool"}
    runner.init_resource_pool_mgr(config)


def _worker(which):
    proc = subprocess.run([sys.executable, "tests/verl_teacher_worker.py", which], cwd=ROOT,
                          env=process_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {k: v if isinstance(v, str) else torch.tensor(v)
            for k, v in json.loads(proc.stdout.splitlines()[-1]).items()}


def test_reference_worker_holds_the_teacher():
    """verl's worker built as ``TeacherReferenceWorker`` loads the teacher's weights with the
    student's tokenizer and gives the teacher's log-probs on the student's tokens; verl's own
    worker, the student's (the test's own check)."""
    ours, stock = _worker("--teacher"), _worker("--stock")
    assert (ours["weights"], ours["tokenizer"]) == ("/teacher", "/student")
    assert (stock["weights"], stock["tokenizer"]) == ("/student", "/student")
    for out, model, other in ((ours, "teacher", "student"), (stock, "student", "teacher")):
        torch.testing.assert_close(out["ref"], out[model], **TOL["fp32_matmul"])
        assert ((out["ref"] - out[other]).abs() * out["mask"]).max() > 0.1


def test_module_runs_as_verls_main():
    """``python -m rlfuse.integrations.verl_gr_opd --cfg job`` composes the config (hydra)."""
    proc = subprocess.run([sys.executable, "-m", "rlfuse.integrations.verl_gr_opd", "--cfg",
                           "job", "algorithm.rlfuse_gr_opd.teacher=/models/t"], cwd=ROOT,
                          env=process_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss_mode: rlfuse_gr_opd" in proc.stdout and "teacher: /models/t" in proc.stdout


def test_the_workers_import_registers_both():
    """A worker imports ``actor_rollout_ref.model.external_lib`` (``rlfuse.integrations.verl``)
    alone: the estimator and the loss are then in verl's registries."""
    code = ("import rlfuse.integrations.verl\n"
            "from verl.trainer.ppo import core_algos as c\n"
            "c.get_adv_estimator_fn('rlfuse_gr_opd'), c.get_policy_loss_fn('rlfuse_gr_opd')\n"
            "modules = __import__('sys').modules\n"
            "assert 'rlfuse.integrations.verl_gr_opd' not in modules\n"
            "assert 'rlfuse.integrations.verl.gr_opd_runner' not in modules")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=process_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert recipe().actor_rollout_ref.model.external_lib == "rlfuse.integrations.verl"
