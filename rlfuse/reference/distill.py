"""The divergences between a student and a teacher (``rlfuse.divergences``), per token, from both
models' whole next-token distributions: the definition of ``distill_loss`` and
``token_divergence``. The teacher is never differentiated.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from .._types import compute_dtype
from ..divergences import ForwardKL
from .divergence_functions import divergence_function, weighted
from ..scaleout import vocab


def window_log_softmax(policy, mask: Tensor) -> Tensor:
    """``log_softmax(z)`` ``[B, T, V]`` of the window rows of a ``Logits`` / ``LinearHead`` in
    the compute dtype (``z``: its logits, scaled and softcapped by a head, over its temperature),
    masked rows' logits taken as 0 (they may hold anything)."""
    rows = policy.as_logits()
    T = rows.targets.shape[1]
    z = rows.logits[:, rows.offset:rows.offset + T]
    if rows.vocab_parallel_group is not None:     # a split vocabulary: the whole rows
        z = vocab.GatherVocab.apply(z, rows.vocab_parallel_group)
    z = torch.where(mask.unsqueeze(-1), z.to(compute_dtype(z.dtype)), 0.0)
    return torch.log_softmax(z / rows.temperature, dim=-1)


def at_actor_positions(mask: Tensor, value: Tensor, entropy: Tensor, extras: Dict[str, Tensor]
                       ) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """The value (differentiable), entropy and extras ``[B, T]`` at the actor positions, 0
    elsewhere (whatever they hold there)."""
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    return (torch.where(mask, value, zero), torch.where(mask, entropy.detach(), zero),
            {k: torch.where(mask, v.detach(), zero) for k, v in extras.items()})


def top_k_divergence(s_k: Tensor, t_k: Tensor, divergence: ForwardKL
                     ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """verl's ``forward_kl_topk`` from the student's log-probs ``s_k`` at the teacher's ids
    (under its full softmax) and the teacher's ``t_k`` ``[B, T, k]``: the value and the
    ``student_mass`` / ``teacher_mass`` metrics."""
    t_k = t_k.to(s_k.dtype)
    masses = {"student_mass": s_k.exp().sum(-1), "teacher_mass": t_k.exp().sum(-1)}
    if divergence.min_logprob is not None:
        s_k, t_k = s_k.clamp_min(divergence.min_logprob), t_k.clamp_min(divergence.min_logprob)
    return (t_k.exp() * (t_k - s_k)).sum(-1).clamp_min(0.0), masses


def token_divergence(student, teacher, divergence, mask: Tensor, validate: bool = False,
                     token_weights: Optional[Tensor] = None
                     ) -> Tuple[Tensor, Tensor, Dict[str, Tensor], None]:
    """``(divergence [B, T], the student's entropy [B, T], {name: [B, T]}, None)`` (the extras:
    a ``TopK`` teacher's ``student_mass`` and ``teacher_mass``), 0 at masked positions, on
    checked arguments (``validate`` and ``token_weights`` change nothing here: the loss is
    the caller's)."""
    s = window_log_softmax(student, mask)
    entropy = -weighted(s.exp(), s)
    if teacher.kind == "top_k":
        value, extras = top_k_divergence(s.gather(-1, teacher.ids.long()), teacher.logprobs,
                                         divergence)
    else:
        with torch.no_grad():
            t = window_log_softmax(teacher, mask).to(s.dtype)
        function, params = divergence.terms()
        value, extras = divergence_function(function)(s, t, params), {}
    return (*at_actor_positions(mask, value, entropy, extras), None)
