"""Fused ``token_divergence``: a student's divergence to a teacher, by the student's form's ops
(``form_ops``): beside a teacher of logits or a head, its ``divergence``; beside a ``TopK``
teacher, its log-probs at the teacher's ids (``top_k``'s ops, over a split vocabulary too),
then verl's top-k forward KL on those ``[B, T, k]`` (``reference.distill``)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from ..reference import distill as twin
from .form_ops import of


def token_divergence(student, teacher, divergence, mask: Tensor, validate: bool = False,
                     token_weights: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Tensor, Dict[str, Tensor], Optional[Tensor]]:
    """``reference.distill.token_divergence`` on the kernels; ``validate``: a ``LinearHead``
    student forms the logits of the actor positions only (reads the mask on the host). With
    ``token_weights`` (each position's weight in a loss) a ``LinearHead`` student beside a
    whole model's teacher gives that loss from its single pass (``linear_distill_loss``), and a
    ``Logits`` student with a gradient from its single pass (``distill_loss_op``)."""
    ops = of(student)
    if teacher.kind == "top_k":
        ids = torch.where(mask.unsqueeze(-1), teacher.ids, 0).long()   # masked: never read
        s_k, entropy = ops.top_k_logprobs(student, ids, mask, validate)
        value, extras = twin.top_k_divergence(s_k, teacher.logprobs.detach(), divergence)
        return (*twin.at_actor_positions(mask, value, entropy, extras), None)
    function, params = divergence.terms()
    call, with_loss = ops.divergence_call(student, teacher, function, params, mask, validate,
                                          token_weights)
    out = call()
    if with_loss:
        return out[1], out[2], {}, out[0]
    return out[0], out[1], {}, None
