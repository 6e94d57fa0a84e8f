"""rlfuse in TRL's distillation: a ``DistillationTrainer`` whose loss is rlfuse's.

    from rlfuse.integrations.trl import RLFuseDistillationConfig, RLFuseDistillationTrainer
    args = RLFuseDistillationConfig(output_dir=..., beta=0.5, temperature=0.9)
    trainer = RLFuseDistillationTrainer(model=student, teacher_model=teacher, args=args,
                                        train_dataset=data)

The trainer generates and reads both models' last hidden states as TRL 1.16 does; its loss is
``rlfuse.distill_loss`` with ``divergences.JSD(beta)`` (``beta``: 0 forward KL, 1 reverse KL)
between the student's and the teacher's ``rlfuse.LinearHead`` (each with its own bias, hidden
width, logit scale and softcap, read from the model and checked against its own logits; the
config's ``temperature`` on both), in place of TRL's ``_chunked_divergence_loss``: the same
loss (``sum / num_items_in_batch``), gradients and ``entropy`` metric, without either model's
``[N, V]`` logits. ``rlfuse_chunk_tokens``: positions per chunk of the heads (None: rlfuse's
default, about ``N H / V``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from trl import DistillationConfig, DistillationTrainer

import rlfuse
from rlfuse.divergences import JSD
from rlfuse.integrations.model_heads import model_head

__all__ = ["RLFuseDistillationConfig", "RLFuseDistillationTrainer", "chunked_divergence_loss"]

# The multimodal fields TRL's trainer passes to both backbones.
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes",
                    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclasses.dataclass
class RLFuseDistillationConfig(DistillationConfig):
    """TRL's ``DistillationConfig``, ``rlfuse_chunk_tokens``: the heads' positions per chunk
    (None: rlfuse's default), and ``rlfuse_batch_invariant``: both heads batch-invariant
    (``LinearHead(..., batch_invariant=True)``: each position's divergence and hidden-state
    gradient the same bits whatever else the batch holds)."""

    rlfuse_chunk_tokens: Optional[int] = None
    rlfuse_batch_invariant: bool = False


def _whole(weight, bias, dtype):
    """A head's weight and bias as plain tensors (an FSDP2 DTensor gathered once, its weight in
    the hidden states' dtype, as TRL does)."""
    if isinstance(weight, torch.distributed.tensor.DTensor):
        weight = weight.full_tensor().to(dtype)
        if bias is not None:
            bias = bias.full_tensor()
    return weight, bias


def chunked_divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight,
                            teacher_lm_head_weight, completion_mask, beta: float,
                            num_items_in_batch=None, student_lm_head_bias=None,
                            teacher_lm_head_bias=None, student_logit_scale: float = 1.0,
                            teacher_logit_scale: float = 1.0,
                            student_final_logit_softcapping: Optional[float] = None,
                            teacher_final_logit_softcapping: Optional[float] = None,
                            temperature: float = 1.0, chunk_tokens: Optional[int] = None,
                            batch_invariant: bool = False):
    """TRL 1.16's ``_chunked_divergence_loss`` (same arguments and results: the loss, the sum of
    the student's per-token entropy, the number of valid positions) by ``rlfuse.distill_loss``:
    the generalized JSD of ``beta`` over ``completion_mask``'s positions, ``sum /
    num_items_in_batch`` (None: over the local valid positions); ``chunk_tokens``,
    ``batch_invariant``: ``LinearHead``'s."""
    w_s, b_s = _whole(student_lm_head_weight, student_lm_head_bias,
                      student_hidden_states.dtype)
    w_t, b_t = _whole(teacher_lm_head_weight, teacher_lm_head_bias,
                      teacher_hidden_states.dtype)
    mask = completion_mask != 0
    n_valid = mask.sum()
    positions = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    student = rlfuse.LinearHead(student_hidden_states, w_s, positions, bias=b_s,
                                temperature=temperature, logit_scale=student_logit_scale,
                                softcap=student_final_logit_softcapping,
                                chunk_tokens=chunk_tokens, batch_invariant=batch_invariant)
    teacher = rlfuse.LinearHead(teacher_hidden_states.detach(), w_t.detach(), positions,
                                bias=None if b_t is None else b_t.detach(),
                                temperature=temperature, logit_scale=teacher_logit_scale,
                                softcap=teacher_final_logit_softcapping,
                                batch_invariant=batch_invariant)
    num_tokens = n_valid.clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(num_tokens, torch.Tensor):
        num_tokens = num_tokens.to(mask.device)
    out = rlfuse.distill_loss(student, teacher, mask, JSD(beta), num_tokens=num_tokens)
    return out.loss, out.metrics["entropy"] * n_valid.clamp(min=1), n_valid


class RLFuseDistillationTrainer(DistillationTrainer):
    """TRL's ``DistillationTrainer`` with rlfuse's loss (``chunked_divergence_loss``); both
    models' heads are read (``model_head``) when it is built."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for model in (self.model, self.teacher_model):
            model_head(self.accelerator.unwrap_model(model))

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        keep = inputs["completion_ids"].size(1)
        multimodal = {k: inputs[k] for k in _MULTIMODAL_KEYS if k in inputs}
        student_hidden = self._get_last_hidden_state(unwrapped_student, input_ids,
                                                     attention_mask, keep, **multimodal)
        self.teacher_model.eval()
        unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
        with torch.no_grad():
            teacher_hidden = self._forward_redirection(
                self.teacher_model, unwrapped_teacher, self._get_last_hidden_state,
                unwrapped_teacher, input_ids, attention_mask, keep, **multimodal)
        heads = [(model.get_output_embeddings(), model_head(model))
                 for model in (unwrapped_student, unwrapped_teacher)]
        (s_head, s_fields), (t_head, t_fields) = heads
        if s_head.weight.device != t_head.weight.device:
            raise ValueError(f"teacher_model: its output head is on {t_head.weight.device}, the "
                             f"student's on {s_head.weight.device}; place both on one device")
        device = s_head.weight.device
        # whether rlfuse's kernels ran (1) or its plain-torch reference (0)
        self._metrics["train" if self.model.training else "eval"]["rlfuse/fused"].append(
            float(rlfuse.use_kernels(device)))
        loss, entropy_sum, n_valid = chunked_divergence_loss(
            student_hidden.to(device), teacher_hidden.to(device), s_head.weight, t_head.weight,
            loss_mask.to(device), self.beta, num_items_in_batch=num_items_in_batch,
            student_lm_head_bias=s_head.bias, teacher_lm_head_bias=t_head.bias,
            student_logit_scale=s_fields["logit_scale"],
            teacher_logit_scale=t_fields["logit_scale"],
            student_final_logit_softcapping=s_fields["softcap"],
            teacher_final_logit_softcapping=t_fields["softcap"], temperature=self.temperature,
            chunk_tokens=getattr(self.args, "rlfuse_chunk_tokens", None),
            batch_invariant=getattr(self.args, "rlfuse_batch_invariant", False))
        return loss, entropy_sum.detach(), n_valid
