"""rlfuse in TRL: a GRPOTrainer whose loss is rlfuse's, from the last hidden state (and TRL's
DistillationTrainer with rlfuse's distillation loss: ``RLFuseDistillationTrainer``,
``RLFuseDistillationConfig``, ``integrations._trl_distill``).

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
- ``"ggpo"``: ``rlfuse.ggpo_loss`` as the paper trains (``integrations._trl_ggpo``), TRL's
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
"""
from __future__ import annotations

import contextlib
import copy
from typing import List

import torch
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, \
    unsplit_pixel_values_by_grid

import rlfuse
from rlfuse import objectives, terms
from rlfuse.integrations._models import add_head_forward, model_head, router_loss_problems
from rlfuse.integrations._trl_ggpo import (STEP_TOKENS, ggpo_rewards, loss_mask,
                                           shuffle_groups, with_step_tokens)
from rlfuse.integrations._trl_distill import (RLFuseDistillationConfig,
                                              RLFuseDistillationTrainer)
from rlfuse.integrations._trl_config import (TOKEN_COUNT_LOSS_TYPES, RLFuseGRPOConfig,
                                             as_rlfuse_config, unsupported_options)
from rlfuse.shared.aggregation import clamped_feedback, masked_mean

__all__ = ["RLFuseDistillationConfig", "RLFuseDistillationTrainer", "RLFuseGRPOConfig",
           "RLFuseGRPOTrainer"]


class RLFuseGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rlfuse's loss (see the module); ``teacher_model`` for GR-OPD."""

    def __init__(self, *args, teacher_model=None, **kwargs):
        policy = kwargs.get("model", args[0] if args else None)
        if len(args) > 2:
            args = args[:2] + (as_rlfuse_config(args[2], policy),) + args[3:]
            config = args[2]
        else:
            config = kwargs["args"] = as_rlfuse_config(kwargs.get("args"), policy)
        problems = unsupported_options(config, teacher_model)   # before any model is loaded
        if problems:
            raise ValueError("RLFuseGRPOTrainer cannot honour: " + "; ".join(problems))
        with _reference_from(policy):
            super().__init__(*args, **kwargs)
        problems = self._unsupported_model()
        if problems:
            raise ValueError("RLFuseGRPOTrainer cannot honour: " + "; ".join(problems))
        add_head_forward(self.accelerator.unwrap_model(self.model))
        self.teacher_model = teacher_model
        if teacher_model is not None:
            teacher_model.to(self.accelerator.device).eval().requires_grad_(False)
            add_head_forward(teacher_model)

    def _unsupported_model(self) -> List[str]:
        problems = []
        if self.aux_loss_enabled:
            problems += router_loss_problems(self.accelerator.unwrap_model(self.model))
        if self.is_fsdp_enabled and self.accelerator.state.fsdp_plugin.fsdp_version != 2:
            problems.append("FSDP1 (fsdp_config version 1, deprecated by transformers; torch's "
                            "FSDP1 runs on accelerators only, so it cannot be tested where the "
                            "trainer is: FSDP2 and DeepSpeed ZeRO-3 are supported)")
        return problems

    # ----------------------------------------------------------------------------------------
    # The policy
    # ----------------------------------------------------------------------------------------

    def _through_head(self, model, inputs, fn, router: bool = False):
        """``fn(head)`` inside ``model``'s forward (so that the wrappers of data parallelism see
        a forward), ``head`` the ``LinearHead`` of the last hidden state and the output head
        whose rows ``P - 1 ...`` predict the completion; with ``router``, ``(fn(head), the
        MoE router's load-balancing loss)``."""
        ids_and_mask = [torch.cat([inputs[f"prompt_{k}"], inputs[f"completion_{k}"]], dim=1)
                        for k in ("ids", "mask")]
        return self._head_call(model, *ids_and_mask, inputs["completion_ids"], fn, router)

    def _head_call(self, model, input_ids, attention, completion_ids, fn, router=False):
        """``_through_head`` of the sequences ``input_ids`` ending in ``completion_ids``."""
        head = model_head(self.accelerator.unwrap_model(model))
        offset = input_ids.shape[1] - completion_ids.shape[1] - 1

        def loss_of(hidden, weight, bias):
            # TRL's cast_lm_head_to_fp32: the head's matmuls in fp32 (its weight is fp32)
            return fn(rlfuse.LinearHead(
                hidden, weight, completion_ids, bias, self.temperature, offset=offset,
                chunk_tokens=self.args.rlfuse_chunk_tokens, **head,
                head_dtype=torch.float32 if self.args.cast_lm_head_to_fp32 else None,
                batch_invariant=self.args.rlfuse_batch_invariant))

        return model(input_ids=input_ids, attention_mask=attention, rlfuse_head=loss_of,
                     rlfuse_router=router)

    def _completion_logprobs(self, model, inputs) -> torch.Tensor:
        with torch.no_grad():
            return self._through_head(model, inputs,
                                      lambda head: rlfuse.policy_logprobs(head, validate=False))

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **multimodal):
        """TRL's old log-probs, with ``rlfuse_batch_invariant`` from the training pass's head
        in micro-batches of ``batch_size`` (each ratio exactly 1 on policy, whatever the
        micro-batches); TRL's own for another model, a multimodal batch or a router loss."""
        unwrap, size = self.accelerator.unwrap_model, batch_size or input_ids.shape[0]
        if not self.args.rlfuse_batch_invariant or compute_aux_loss or unwrap(model) is not \
                unwrap(self.model) or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                compute_aux_loss, **multimodal)
        with self.accelerator.autocast():
            parts = [self._head_call(
                model, input_ids[i:i + size], attention_mask[i:i + size],
                input_ids[i:i + size, -logits_to_keep:],
                lambda head: rlfuse.policy_logprobs(head, return_entropy=True, validate=False))
                for i in range(0, input_ids.shape[0], size)]
        return torch.cat([lp for lp, _ in parts]), \
            torch.cat([e for _, e in parts]) if compute_entropy else None, None

    # ----------------------------------------------------------------------------------------
    # Batches: GR-OPD's advantages per generation batch, GGPO's whole groups
    # ----------------------------------------------------------------------------------------

    def _calculate_rewards(self, *args, **kwargs):
        self._rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.args.rlfuse_loss == "ggpo":
            self._ggpo_batch(out)
        if self.args.rlfuse_loss == "gr_opd" and self.model.training:
            old = out.get("old_per_token_logps")
            if old is None:
                old = self._completion_logprobs(self.model, out)
            teacher = self._completion_logprobs(self.teacher_model, out)
            args = self.args
            out["old_per_token_logps"] = old
            out["teacher_per_token_logps"] = teacher
            out["advantages"] = rlfuse.gr_opd_advantages(
                old, teacher, out["completion_mask"].bool(), group_size=self.num_generations,
                gamma=args.rlfuse_gr_opd_gamma, lam=args.rlfuse_gr_opd_lam,
                feedback_clip=args.rlfuse_gr_opd_feedback_clip,
                adv_clip=args.rlfuse_gr_opd_adv_clip)
        return out

    def _ggpo_batch(self, out: dict) -> None:
        """GGPO's rewards as the advantages, the rows of the groups left out masked (they
        count for nothing, in the loss and its token count)."""
        train, rows = self.model.training, out["advantages"].shape[0]
        out["advantages"], kept, dropped = ggpo_rewards(
            self._rewards_per_func, self.reward_weights,
            self.num_generations if train else self.num_generations_eval,
            self.args.rlfuse_ggpo_mixed_groups_only,
            slice(self.accelerator.process_index * rows, (self.accelerator.process_index + 1) *
                  rows))
        out["completion_mask"] = out["completion_mask"] * kept[:, None]
        self._metrics["train" if train else "eval"]["rlfuse/ggpo_dropped_group_frac"].append(
            dropped)

    def _prepare_inputs(self, generation_batch):
        if self.args.rlfuse_loss != "ggpo" or not self.model.training:
            return super()._prepare_inputs(generation_batch)
        # TRL's buffering, with the rows shuffled by whole groups (GGPO couples a group) and
        # each micro-batch given its optimizer step's token count
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = split_pixel_values_by_grid(self._generate_and_score_completions(
                generation_batch))
            batch = shuffle_groups(batch, self.num_generations)
            batches = [unsplit_pixel_values_by_grid(b) for b in
                       split_tensor_dict(batch, self.args.steps_per_generation)]
            self._buffered_inputs = with_step_tokens(
                batches, self.args.gradient_accumulation_steps, loss_mask,
                lambda x: self.accelerator.reduce(x, reduction="sum"))
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    # ----------------------------------------------------------------------------------------
    # The loss
    # ----------------------------------------------------------------------------------------

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

    def _compute_loss(self, model, inputs):
        args = self.args
        train = self.model.training
        mode = "train" if train else "eval"
        mask = loss_mask(inputs)
        advantages = inputs["advantages"]
        old = inputs.get("old_per_token_logps")
        weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = inputs["importance_sampling_ratio"].expand(mask.shape)
        if args.rlfuse_loss == "ggpo":
            # the paper's normaliser: the tokens of the optimizer step's whole minibatch (a
            # batch the trainer did not prepare: its own, over the processes)
            tokens = inputs.get(STEP_TOKENS)
            if tokens is None:
                tokens = self.accelerator.reduce(mask.sum().float(), reduction="sum")
            tokens = tokens.clamp(min=1.0) / self.accelerator.num_processes
        else:
            agg = self._aggregation(inputs, mask, train)
        if args.rlfuse_loss == "gr_opd":   # GR-OPD's own aggregation over its advantages
            weights, agg = None, dict(agg="seq-mean-token-mean",
                                      loss_scale=agg.get("loss_scale", 1.0))

        def loss(policy):
            if args.rlfuse_loss == "ggpo":
                return rlfuse.ggpo_loss(
                    policy, inputs["ref_per_token_logps"], advantages, mask,
                    group_size=self.num_generations, beta=self.beta, num_tokens=tokens,
                    validate=False)
            return rlfuse.policy_loss(policy, old, advantages, mask, self._objective(),
                                      weights=weights, validate=False, **agg,
                                      **self._terms(inputs, old, train))

        if self.aux_loss_enabled:
            out, aux = self._through_head(model, inputs, loss, router=True)
        else:
            out = self._through_head(model, inputs, loss)
        metrics = dict(out.metrics)
        if args.rlfuse_loss == "gr_opd":
            metrics.update(gr_opd_metrics(inputs, mask, args.rlfuse_gr_opd_feedback_clip))
        self._log_rlfuse_metrics(mode, metrics, mask)
        self._entropy_controller(mode, out.loss, out.metrics, mask, train)
        if not self.aux_loss_enabled:
            return out.loss
        # TRL's router loss: its coefficient over the accumulation, added after the policy's
        normalizer = self.current_gradient_accumulation_steps if train else 1.0
        self._metrics[mode]["aux_loss"].append(
            self.accelerator.gather_for_metrics(aux.detach()).mean().item())
        return out.loss + self.router_aux_loss_coef * aux / normalizer

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


@contextlib.contextmanager
def _reference_from(policy):
    """While TRL builds its reference model: from a policy given as a module, a copy of the
    policy (TRL would reload it from ``config._name_or_path``, which a model built in memory
    does not have, and which need not hold the policy's weights)."""
    from trl.trainer import grpo_trainer

    if not isinstance(policy, torch.nn.Module) or hasattr(policy, "peft_config"):
        yield
        return
    original = grpo_trainer.create_model_from_path

    def copy_of_policy(model_id, **kwargs):
        reference = copy.deepcopy(policy)
        dtype = kwargs.get("dtype")
        return reference if dtype in (None, "auto") else reference.to(dtype)

    grpo_trainer.create_model_from_path = copy_of_policy
    try:
        yield
    finally:
        grpo_trainer.create_model_from_path = original


def gr_opd_metrics(inputs: dict, mask: torch.Tensor, feedback_clip: float) -> dict:
    """GR-OPD's own metrics of a micro-batch (``rlfuse.gr_opd_loss``'s): the mean and mean
    magnitude of its advantages, the mean clamped feedback of the teacher."""
    adv = inputs["advantages"].float()
    feedback = clamped_feedback(inputs["old_per_token_logps"].float(),
                                inputs["teacher_per_token_logps"].float(), mask, feedback_clip)
    return {"adv_mean": adv.mean(), "adv_abs_mean": adv.abs().mean(),
            "feedback_mean": masked_mean(feedback, mask)}
