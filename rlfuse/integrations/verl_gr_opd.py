"""GR-OPD trained by verl 0.9.1, its teacher in verl's reference worker::

    python -m rlfuse.integrations.verl_gr_opd algorithm.rlfuse_gr_opd.teacher=<teacher> \\
        actor_rollout_ref.model.path=<student> data.train_files=... <any verl setting>

verl's PPO trainer (``verl/rlfuse_gr_opd.yaml``: verl's ``ppo_trainer`` with the
``rlfuse_gr_opd`` advantage estimator and policy loss, verl's KL in the reward with a coefficient
of 1, no task reward) run by verl's own legacy runner, with one change no verl setting makes: its
reference worker is verl's worker loaded with the teacher's weights (verl's own loads the
actor's). The token rewards are then GR-OPD's feedback ``teacher_lp − old_lp``
(``verl.gr_opd``). This module is the entry point; the runner is ``verl.gr_opd_runner``.
"""
from __future__ import annotations

import hydra
import ray

from .verl.gr_opd_runner import (NAME, GROPDTaskRunner, TeacherReferenceWorker,  # noqa: F401
                                 check_recipe, teacher_reference_worker)

__all__ = ["GROPDTaskRunner", "NAME", "TeacherReferenceWorker", "check_recipe", "main",
           "teacher_reference_worker"]


@hydra.main(config_path="verl", config_name="rlfuse_gr_opd", version_base=None)
def main(config) -> None:
    """verl's ``main_ppo`` with :class:`GROPDTaskRunner`."""
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    check_recipe(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    run_ppo(config, task_runner_class=ray.remote(num_cpus=1)(GROPDTaskRunner))


if __name__ == "__main__":
    main()
