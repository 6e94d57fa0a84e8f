"""The metrics of ``rlfuse.integrations.trl``'s GRPO trainer: the loss's own as
``rlfuse/<name>`` and under TRL's names as TRL forms them, and GR-OPD's."""
from __future__ import annotations

import torch

import rlfuse
from rlfuse.shared.aggregation import clamped_feedback, masked_mean


class GRPOMetrics:
    """``RLFuseGRPOTrainer``'s logging of the loss's metrics (a base of the trainer)."""

    def _log_rlfuse_metrics(self, mode: str, metrics, mask: torch.Tensor) -> None:
        """The loss's metrics as ``rlfuse/<name>`` (each process's value, their mean) and under
        TRL's names as TRL forms them: means over every process's tokens (over its sequences
        for a sequence-level ratio and VESPO's per-sequence weight), extremes over every
        process's sequences."""
        gather = self.accelerator.gather
        # whether rlfuse's kernels ran (1) or its plain-torch reference (0)
        self._metrics[mode]["rlfuse/fused"].append(float(rlfuse.use_kernels(mask.device)))
        for name, value in metrics.items():
            self._metrics[mode][f"rlfuse/{name}"].append(gather(value.detach()).nanmean().item())
        tokens = mask.sum().to(torch.float32)
        sequences = torch.tensor(float(mask.shape[0]), device=mask.device)
        sequence_level = self.args.rlfuse_loss == "ppo" and \
            self.importance_sampling_level == "sequence"

        def log(name: str, mean: torch.Tensor, count: torch.Tensor) -> None:
            total = torch.where(count > 0, mean.detach().float() * count, 0.0)
            totals = self.accelerator.reduce(torch.stack([total, count]), reduction="sum")
            self._metrics[mode][name].append((totals[0] / totals[1].clamp(min=1.0)).item())

        for ours, theirs, count in (("kl", "kl", tokens), ("entropy", "entropy", tokens),
                                    ("phi_mean", "vespo/phi_seq_mean", sequences)):
            if ours in metrics:
                log(theirs, metrics[ours], count)
        # a sequence-level ratio's flags: TRL's mean is over the sequences
        clipped, shares = (sequences, "_seq_mean") if sequence_level else (tokens, "")
        if self.args.rlfuse_loss == "ppo" and self.loss_type == "cispo":
            log("cispo_clip_ratio", metrics["clip_frac_high" + shares], clipped)
        elif "clip_frac_low" in metrics:
            low, high = (metrics[f"clip_frac_{side}" + shares] for side in ("low", "high"))
            for name, value in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high),
                                ("clip_ratio/region_mean", low + high)):
                log(name, value, clipped)
            # TRL's extremes over every process's sequences: the extremes of each process's own
            if "clip_frac_low_seq_min" in metrics:
                self._metrics[mode]["clip_ratio/low_min"].append(
                    gather(metrics["clip_frac_low_seq_min"].detach()).min().item())
                self._metrics[mode]["clip_ratio/high_max"].append(
                    gather(metrics["clip_frac_high_seq_max"].detach()).max().item())


def gr_opd_metrics(inputs: dict, mask: torch.Tensor, feedback_clip: float) -> dict:
    """GR-OPD's own metrics of a micro-batch (``rlfuse.gr_opd_loss``'s): the mean and mean
    magnitude of its advantages, the mean clamped feedback of the teacher."""
    adv = inputs["advantages"].float()
    feedback = clamped_feedback(inputs["old_per_token_logps"].float(),
                                inputs["teacher_per_token_logps"].float(), mask, feedback_clip)
    return {"adv_mean": adv.mean(), "adv_abs_mean": adv.abs().mean(),
            "feedback_mean": masked_mean(feedback, mask)}
