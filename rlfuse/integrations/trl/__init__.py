"""rlfuse in TRL: a GRPOTrainer whose loss is rlfuse's, from the last hidden state (and TRL's
DistillationTrainer with rlfuse's distillation loss: ``RLFuseDistillationTrainer``,
``RLFuseDistillationConfig``, ``integrations.trl.distill``).

    from rlfuse.integrations.trl import RLFuseGRPOConfig, RLFuseGRPOTrainer
    args = RLFuseGRPOConfig(output_dir=..., rlfuse_loss="ppo", loss_type="dapo", epsilon_high=0.28)
    trainer = RLFuseGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data)

The trainer computes the loss as TRL does up to the per-token log-probs, which it never forms:
the policy is ``rlfuse.LinearHead`` over the model's last hidden state and its output head, so
no ``[B, T, V]`` logits exist, and the loss is

- ``rlfuse_loss="ppo"``: ``rlfuse.policy_loss``, TRL's own loss for every ``loss_type``
  (grpo, bnpo, dr_grpo, dapo, cispo, sapo, vespo, luspo, with their settings),
  ``epsilon`` / ``epsilon_high``, ``importance_sampling_level`` token or sequence, ``delta``,
  the KL penalty (``beta``, ``use_bias_correction_kl``), the entropy bonus (``entropy_coef``),
  ``top_entropy_quantile``, ``off_policy_mask_threshold``, gradient accumulation and the vLLM
  importance-sampling correction;
- ``"gppo"``: ``rlfuse.policy_loss`` with ``objectives.GPPO`` (``rlfuse_geometry``,
  ``rlfuse_topology``, ``rlfuse_delta``) and the aggregation of ``loss_type``, with any of
  TRL's terms and masks (``beta``, ``entropy_coef``, ``use_adaptive_entropy``,
  ``top_entropy_quantile``, ``off_policy_mask_threshold``);
- ``"ggpo"``: ``rlfuse.ggpo_loss`` as the paper trains (``integrations.trl.ggpo``), TRL's
  ``beta`` its β, the reference model its reference, refreshed by a copy every
  ``ref_model_sync_steps`` (the config's defaults for GGPO);
- ``"gr_opd"``: GR-OPD's loss (``rlfuse.gr_opd_loss``'s step: ``rlfuse.policy_loss`` with the
  clip over its advantages, ``seq-mean-token-mean``) with the advantages of
  ``rlfuse.gr_opd_advantages`` from the ``teacher_model`` replayed on the student's
  completions, computed once per generation batch (whole groups) before it is split; TRL's
  terms, masks and ``delta`` as with ``"ppo"``, and GR-OPD's metrics (``adv_mean``,
  ``adv_abs_mean``, ``feedback_mean``). GGPO takes none of them (refused: its β and reference
  already are its KL term).

Options it cannot honour raise a ``ValueError`` at construction, listing each. Metrics keep
TRL's names (``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``,
``cispo_clip_ratio``, ``vespo/phi_seq_mean``, ``kl``, ``entropy``),
plus ``rlfuse/<name>`` for each of the loss's own metrics.

The package: ``grpo`` (the trainer), ``grpo_config`` (its config, what it refuses),
``grpo_loss`` (TRL's settings as the loss's arguments), ``grpo_metrics`` (its metrics),
``ggpo`` (GGPO's batches), ``distill`` (the distillation trainer and its config).
"""
from .distill import RLFuseDistillationConfig, RLFuseDistillationTrainer
from .grpo import RLFuseGRPOTrainer
from .grpo_config import RLFuseGRPOConfig

__all__ = ["RLFuseDistillationConfig", "RLFuseDistillationTrainer", "RLFuseGRPOConfig",
           "RLFuseGRPOTrainer"]
