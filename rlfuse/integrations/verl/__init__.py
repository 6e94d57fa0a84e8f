"""rlfuse in verl: importing this module registers policy losses in verl's registry.

    import rlfuse.integrations.verl   # e.g. through VERL_USE_EXTERNAL_MODULES
    # actor_rollout_ref.actor.policy_loss.loss_mode = rlfuse_<mode>

Every verl 0.9.1 ``loss_mode`` has its ``rlfuse_<mode>``: ``rlfuse_vanilla`` (also
``rlfuse_ppo``), ``rlfuse_dppo_tv``, ``rlfuse_dppo_kl``, ``rlfuse_gspo``, ``rlfuse_sapo``,
``rlfuse_gpg``, ``rlfuse_clip_cov``, ``rlfuse_kl_cov``, ``rlfuse_geo_mean``, ``rlfuse_dro``,
``rlfuse_cispo`` and ``rlfuse_bypass_mode``, each ``rlfuse.policy_loss`` with the objective
verl's mode computes, read from the same config fields (``clip_ratio*``, ``tau_pos`` /
``tau_neg``, ``policy_loss.clip_cov_*``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta``,
``rollout_correction``, ``global_batch_info``) and returning verl's metric names, plus
``actor/rlfuse_overflow`` where the objective can overflow. ``rlfuse_gppo`` is
``rlfuse.gppo_loss`` with the seed's region (chi2 / atomic / delta 0.04); :func:`register_gppo`
registers other regions under other names. ``rlfuse_ggpo`` is GGPO as an advantage estimator
and a policy loss over verl's KL in the reward (``ggpo``), ``rlfuse_gr_opd`` GR-OPD's
(``gr_opd``, trained by ``python -m rlfuse.integrations.verl_gr_opd``, whose reference
worker holds the teacher). :func:`kl_penalty` is verl's ``kl_penalty`` by
``rlfuse.kl_penalty``. The losses take verl's ``[B, T]`` log-probs; the import also makes
``fused_kernels_backend="rlfuse"`` a backend of verl's fused-kernel forward, which computes
those log-probs and the entropy from the last hidden state (``backend``), and
:func:`linear_cross_entropy` is verl's tensor-parallel call over rlfuse's vocabulary split, and
:func:`patch_megatron` routes verl's Megatron fused forward through it.

Where verl draws at random (``clip_cov``), rlfuse draws the same numbers from the same
generator (torch's default one): a run seeded as verl's takes verl's choice. ``bypass_mode``
computes its importance weights and rejection mask with verl's own
``compute_rollout_correction_and_rejection_mask`` (``[B, T]`` data, no gradient).

Differences from verl, all to fp32 rounding: verl exponentiates a log-ratio clamped to +-20
where rlfuse selects the branch in log space and exponentiates only the selected one (the
values are equal wherever verl's are finite); verl's ``seq-mean-token-mean`` divides each row
by ``T_i + 1e-8``, rlfuse by ``T_i``.

The package: ``losses`` (the losses of verl's modes, GPPO's, :func:`kl_penalty`), ``ggpo`` and
``gr_opd`` (GGPO's and GR-OPD's estimators and losses), ``aggregation`` (what the losses share:
verl's aggregation and clip), ``backend`` (the fused-kernel backend, the Megatron call) and
``gr_opd_runner`` (verl's runner for GR-OPD, with its config ``rlfuse_gr_opd.yaml``; imported by
``python -m rlfuse.integrations.verl_gr_opd``, not by this package).
"""
from __future__ import annotations

from . import ggpo, gr_opd  # noqa: F401  (GGPO's and GR-OPD's estimators, losses)
from .aggregation import verl_aggregation
from .backend import (BACKEND, install, linear_cross_entropy, log_probs_and_entropy,
                      patch_forward_with_backends, patch_megatron)
from .losses import MODES, kl_penalty, register_gppo  # noqa: F401  (registers verl's modes)

__all__ = ["BACKEND", "MODES", "kl_penalty", "linear_cross_entropy", "log_probs_and_entropy",
           "patch_forward_with_backends", "patch_megatron", "register_gppo", "verl_aggregation"]

install()
