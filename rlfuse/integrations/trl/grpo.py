"""``RLFuseGRPOTrainer``: TRL's ``GRPOTrainer`` with rlfuse's loss (``rlfuse.integrations.trl``
says which): its construction and what it refuses of the model, the policy through the model's
head, the batches (GR-OPD's advantages per generation batch, GGPO's whole groups) and the loss;
its settings as the loss's arguments in ``grpo_loss``, its metrics in ``grpo_metrics``."""
from __future__ import annotations

import contextlib
import copy
from typing import List

import torch
from trl import GRPOTrainer
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, \
    unsplit_pixel_values_by_grid

import rlfuse
from rlfuse.integrations.model_heads import add_head_forward, model_head, router_loss_problems
from rlfuse.integrations.trl.grpo_config import as_rlfuse_config, unsupported_options
from rlfuse.integrations.trl.ggpo import (STEP_TOKENS, ggpo_rewards, loss_mask, shuffle_groups,
                                          with_step_tokens)
from rlfuse.integrations.trl.grpo_loss import GRPOLossSettings
from rlfuse.integrations.trl.grpo_metrics import GRPOMetrics, gr_opd_metrics

__all__ = ["RLFuseGRPOTrainer"]


class RLFuseGRPOTrainer(GRPOLossSettings, GRPOMetrics, GRPOTrainer):
    """``GRPOTrainer`` with rlfuse's loss (see ``rlfuse.integrations.trl``); ``teacher_model``
    for GR-OPD."""

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
