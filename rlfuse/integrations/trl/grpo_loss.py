"""TRL's settings of ``rlfuse.integrations.trl``'s GRPO trainer as the arguments of rlfuse's
loss: the aggregation of ``loss_type``, the objective of ``rlfuse_loss``, TRL's terms and masks,
and TRL's entropy bonus with its adaptive coefficient (methods of ``RLFuseGRPOTrainer``)."""
from __future__ import annotations

import torch

from rlfuse import objectives, terms
from rlfuse.integrations.trl.grpo_config import TOKEN_COUNT_LOSS_TYPES


class GRPOLossSettings:
    """``RLFuseGRPOTrainer``'s loss arguments from TRL's settings (a base of the trainer)."""

    def _aggregation(self, inputs, mask: torch.Tensor, train: bool) -> dict:
        """TRL's normaliser of ``loss_type`` as rlfuse's ``agg``, counts and ``loss_scale``."""
        accumulation = self.current_gradient_accumulation_steps if train else 1
        if self.loss_type in ("grpo", "sapo"):
            return dict(agg="seq-mean-token-mean", loss_scale=1.0 / accumulation)
        if self.loss_type == "luspo":   # LUSPO's own: the token sum of each row, then the mean
            return dict(loss_scale=1.0 / accumulation)
        if self.loss_type == "bnpo":
            return dict(agg="token-mean", loss_scale=1.0 / accumulation)
        if self.loss_type == "dr_grpo":
            return dict(agg="token-mean", loss_scale=1.0 / accumulation,
                        num_tokens=float(mask.shape[0] * self.max_completion_length))
        # dapo, cispo, vespo: the generation batch's tokens, per process and accumulation window
        tokens = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if train:
            tokens = tokens * self.current_gradient_accumulation_steps / \
                self.args.steps_per_generation
        return dict(agg="token-mean", num_tokens=tokens.to(torch.float32))

    def _objective(self):
        """The rlfuse objective of ``rlfuse_loss``: GPPO's, GR-OPD's (the clip over its
        advantages, unclamped) or that of TRL's ``loss_type`` and its settings."""
        args, level = self.args, self.importance_sampling_level
        eps = (self.epsilon_low, self.epsilon_high)
        if args.rlfuse_loss == "gppo":
            return objectives.GPPO(args.rlfuse_geometry, args.rlfuse_topology,
                                   args.rlfuse_delta, args.rlfuse_dual_clip)
        if args.rlfuse_loss == "gr_opd":
            return objectives.Clip(clip=eps, ratio_cap=args.delta, log_ratio_clamp=None)
        if self.loss_type == "cispo":
            return objectives.CISPOTRL(epsilon_high=self.epsilon_high, ratio_level=level)
        if self.loss_type == "sapo":
            return objectives.SAPOTRL(tau_pos=args.sapo_temperature_pos,
                                      tau_neg=args.sapo_temperature_neg, ratio_level=level)
        if self.loss_type == "vespo":
            return objectives.VESPO(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg,
                                    args.vespo_lambda_neg)
        if self.loss_type == "luspo":
            return objectives.LUSPO(clip=eps, ratio_cap=args.delta, ratio_level=level)
        if level == "sequence":
            return objectives.GSPOTRL(clip=eps, ratio_cap=args.delta)
        return objectives.Clip(clip=eps, dual_clip=args.rlfuse_dual_clip, ratio_cap=args.delta)

    def _terms(self, inputs, old, train: bool) -> dict:
        """TRL's KL penalty (``beta``, ``use_bias_correction_kl``), entropy bonus
        (``entropy_coef``), top-entropy mask and off-policy sequence mask as rlfuse's terms."""
        args, out = self.args, {}
        if self.beta != 0.0:
            out.update(ref_logprobs=inputs["ref_per_token_logps"], kl=terms.KLPenalty(
                self.beta, "k3", clamp=False,
                importance_weighted=bool(args.use_bias_correction_kl)))
        # TRL's bonus: the mean entropy over the tokens it acts on, over the accumulation (the
        # loss scale carries it for the loss types that divide by it); a coefficient of 0 without
        # one, for TRL's entropy metric (the entropy rides in the same pass)
        accumulation = self.current_gradient_accumulation_steps if train else 1
        scale = 1.0 / accumulation if self.loss_type in TOKEN_COUNT_LOSS_TYPES else 1.0
        out["entropy"] = terms.EntropyBonus(self._entropy_coef_applied() * scale,
                                            agg="token-mean")
        if self.top_entropy_quantile < 1.0:
            group = torch.distributed.group.WORLD if self.accelerator.num_processes > 1 else None
            out["entropy_mask"] = terms.TopEntropyMask(self.top_entropy_quantile, group)
        if self.off_policy_mask_threshold is not None:
            out["off_policy_mask"] = terms.OffPolicyMask(
                self.off_policy_mask_threshold, inputs.get("sampling_per_token_logps", old))
        return out

    def _entropy_coef_applied(self) -> float:
        """TRL's coefficient of this step: the static one, or the adaptive one while the last
        step's entropy is at most ``entropy_target`` (0 otherwise)."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
            return 0.0
        return self.entropy_coef

    def _entropy_controller(self, mode: str, loss, metrics, mask, train: bool) -> None:
        """TRL's bookkeeping of the entropy bonus: ``policy_loss`` (the loss without the bonus,
        as TRL logs it), the adaptive controller's window and update, ``entropy_coef``."""
        if not self._entropy_bonus_enabled:
            return
        accumulation = self.current_gradient_accumulation_steps if train else 1
        count = mask.sum().to(torch.float32)
        if "entropy_kept" in metrics:      # the tokens the bonus acts on: the entropy mask's
            mean, count = metrics["entropy_kept"], metrics["entropy_mask_frac"] * count
        else:
            mean = metrics["entropy"]
        policy = loss.detach() + self._entropy_coef_applied() * mean / accumulation
        if self.loss_type not in TOKEN_COUNT_LOSS_TYPES:   # TRL logs it before the accumulation
            policy = policy * accumulation
        self._metrics[mode]["policy_loss"].append(
            self.accelerator.gather(policy.detach()).nanmean().item())
        if self.use_adaptive_entropy and train:
            stats = torch.stack([mean * count, count]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                args = self.args
                if world <= args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta,
                                            args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta,
                                            args.entropy_coef_min)
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if train and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
