"""verl's legacy runner for GR-OPD (``python -m rlfuse.integrations.verl_gr_opd`` runs it): its
reference worker is verl's worker loaded with the teacher's weights (verl's own loads the
actor's), apart from the actor and rollout worker, and the checks of verl's whole config that
GR-OPD needs (``check_recipe``). The token rewards are then GR-OPD's feedback
``teacher_lp − old_lp`` (``gr_opd``).
"""
from __future__ import annotations

import copy

import ray
from omegaconf import OmegaConf, open_dict
from verl.trainer.main_ppo_v0 import TaskRunner
from verl.trainer.ppo.ray_trainer import Role
from verl.workers.engine_workers import ActorRolloutRefWorker

from . import gr_opd   # the estimator, in the driver's process (the loss: in each worker,
                       # by the config's actor_rollout_ref.model.external_lib)

__all__ = ["GROPDTaskRunner", "NAME", "TeacherReferenceWorker", "check_recipe",
           "teacher_reference_worker"]

NAME = gr_opd.NAME


class TeacherReferenceWorker(ActorRolloutRefWorker):
    """verl's worker in the role ``ref`` with the teacher's weights (``teacher``, a class
    attribute: :func:`teacher_reference_worker`) in place of the actor's, read with the
    student's tokenizer; everything else as verl's ``actor_rollout_ref.ref`` settings say."""

    teacher: str = ""

    def __init__(self, config, role: str, **kwargs):
        if role != str(Role.RefPolicy) or not self.teacher:
            raise ValueError(f"TeacherReferenceWorker: role={role!r}, teacher={self.teacher!r} "
                             f"(the reference worker, with a teacher)")
        config = copy.deepcopy(config)
        with open_dict(config):
            model = config.model
            model.tokenizer_path = model.get("tokenizer_path") or model.path
            model.path, model.hf_config_path = self.teacher, None
        super().__init__(config, role, **kwargs)


def teacher_reference_worker(teacher: str) -> type:
    """:class:`TeacherReferenceWorker` loading ``teacher`` (a path or a hub name)."""
    return type("TeacherReferenceWorker", (TeacherReferenceWorker,), {"teacher": str(teacher)})


def check_recipe(config) -> None:
    """What GR-OPD needs of verl's whole config, refused with the reason; then the teacher's
    stamp that ``rlfuse_gr_opd``'s estimator reads."""
    node = config.algorithm.get(NAME)
    if node is None or OmegaConf.is_missing(node, "teacher") or not node.get("teacher"):
        raise ValueError(f"algorithm.{NAME}.teacher: the teacher model (a path or a hub name) "
                         f"is required")
    model, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    lora = model.get("lora_rank", 0) > 0 or (model.get("lora") or {}).get("rank", 0) > 0 or \
        model.get("lora_adapter_path") is not None
    reward = config.reward.custom_reward_function
    refused = {
        "LoRA (verl's reference is then the actor without its adapters, never the teacher)":
            lora,
        "actor.use_kl_loss (the reference is the teacher)": actor.get("use_kl_loss", False),
        "reward.reward_model.enable (GR-OPD takes no task reward)":
            config.reward.reward_model.get("enable", False),
        f"reward.custom_reward_function={reward.path}:{reward.name} (GR-OPD takes no task "
        f"reward: {':'.join(gr_opd.NO_TASK_REWARD)})":
            (reward.path, reward.name) != gr_opd.NO_TASK_REWARD,
        f"algorithm.adv_estimator={config.algorithm.adv_estimator!r} (expected {NAME})":
            config.algorithm.adv_estimator != NAME,
        "trainer.use_v1=True (the runner is verl's legacy one: the v1 trainer builds its own "
        "workers)": config.trainer.get("use_v1", False),
    }
    reasons = [reason for reason, on in refused.items() if on]
    if reasons:
        raise ValueError(f"{NAME}: cannot train with " + "; ".join(reasons))
    with open_dict(config):
        key, value = gr_opd.TEACHER_STAMP
        node[key] = value


class GROPDTaskRunner(TaskRunner.__ray_actor_class__):
    """verl's legacy task runner with the actor and the teacher's reference worker apart."""

    def add_ref_policy_worker(self, config, ref_policy_cls):
        if Role.ActorRolloutRef in self.role_worker_mapping:
            self.role_worker_mapping[Role.ActorRollout] = \
                self.role_worker_mapping.pop(Role.ActorRolloutRef)
            self.mapping[Role.ActorRollout] = self.mapping.pop(Role.ActorRolloutRef)
        teacher = config.algorithm[NAME].teacher
        self.role_worker_mapping[Role.RefPolicy] = ray.remote(teacher_reference_worker(teacher))
        self.mapping[Role.RefPolicy] = "global_pool"

    def run(self, config):
        check_recipe(config)
        super().run(config)
