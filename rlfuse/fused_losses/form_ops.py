"""Each policy form's fused ops: what the losses ask of a policy, one class per form of logits
(``LogitsOps``, ``HeadOps``), found by the form's ``kind`` (``of``), and the log-probs of any
policy's window (``window_logprobs``: its rows, packed rows as one batch of N, each rank's own
rows of a split as every rank's, then the loss layout):

- ``logprobs``: the log-probs (and entropy) of its rows over the whole vocabulary, or over a
  split one (its ``vocab_parallel_group``);
- ``single_pass``: whether a token-local loss runs in one pass over its logits, and that pass
  (the surrogate kernels with the gradient written in the forward);
- ``divergence``, ``top_k_logprobs``: as a distillation's student, its divergence to a teacher
  of logits or a head, its log-probs at a ``TopK`` teacher's ids;
- ``teacher_logits``, ``teacher_rows``: as a teacher, its window's logits, its rows for the
  student's chunks.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.lib.head_functions import HeadParams
from ..scaleout import layout
from ..scaleout.vocab import check_shard_sizes
from ._op import input_names
from .logits.distill import distill_loss_op, distill_op, vocab_split_distill_op
from .head.head_matmuls import chunk_logits
from .head.linear_distill import linear_distill_loss_op, linear_distill_op
from .head.linear_head import (chunk_tokens_for, head_fields, linear_logprobs_op,
                               linear_surrogate_op)
from .logits.logprobs import batched_rows, token_logprobs_op
from .surrogate import InPlaceSinglePass, surrogate_logits_inplace_op, surrogate_logits_op
from .top_k import linear_logprobs_at_op, logprobs_at_op
from .logits.vocab_split import vocab_split_linear_logprobs_op, vocab_split_logprobs_op


def _group_name(policy) -> str:
    group = policy.vocab_parallel_group
    return "" if group is None else group.group_name


def _detached(teacher):
    """The teacher with its tensors detached (it is never differentiated)."""
    return teacher._replace(**{f: getattr(teacher, f).detach() for f in
                               ("logits", "hidden", "weight", "bias")
                               if isinstance(getattr(teacher, f, None), Tensor)})


class LogitsOps:
    """A ``Logits`` policy's fused ops: its rows in memory, read by the row kernels."""

    @staticmethod
    def logprobs_call(rows, mask: Optional[Tensor], *, gather: bool,
                      return_entropy: bool) -> Callable:
        """The op call whose first two outputs are ``(logp, entropy or empty)`` ``[B, T]`` of
        ``[B, S, V]`` rows (``gather`` is a head's)."""
        fields = dict(logits=rows.logits, targets=rows.targets, mask=mask,
                      temperature=float(rows.temperature), with_entropy=bool(return_entropy),
                      inplace_backward=bool(rows.inplace_backward), offset=int(rows.offset),
                      batch_invariant=bool(rows.batch_invariant))
        if rows.vocab_parallel_group is not None:
            return partial(vocab_split_logprobs_op, **fields, group_name=_group_name(rows))
        return partial(token_logprobs_op, **fields)

    @staticmethod
    def can_single_pass(policy) -> bool:
        """Over a split vocabulary a row's gradient needs the group's logsumexp, known only
        after an all-gather of every shard's statistics: two passes."""
        return policy.vocab_parallel_group is None

    @staticmethod
    def single_pass_call(policy, mask: Tensor, tokens: dict, terms: dict, surrogate: dict,
                         validate: bool, row_blocks: int) -> Callable:
        """The op call whose first two outputs are ``(loss, sums)`` of the single pass over the
        logits (``surrogate_logits_op``; with ``inplace_backward``, the gradient written over
        the logits themselves)."""
        logits, targets, _ = batched_rows(policy.logits, policy.targets, mask)
        write = policy.logits.requires_grad and torch.is_grad_enabled()
        inputs = dict(logits=logits, targets=targets, **tokens, **terms,
                      temperature=float(policy.temperature), **surrogate,
                      offset=int(policy.offset))
        if write and policy.inplace_backward and logits is policy.logits:
            return partial(InPlaceSinglePass.apply,
                           *(inputs[name] for name in input_names(surrogate_logits_inplace_op)))
        return partial(surrogate_logits_op, **inputs, write_dlogits=write)

    @staticmethod
    def divergence_call(student, teacher, function: str, params, mask: Tensor, validate: bool,
                        token_weights: Optional[Tensor]) -> Tuple[Callable, bool]:
        """``(call, with_loss)``: the op call whose outputs begin ``(value, entropy)``, or with
        ``with_loss`` ``(loss, value, entropy)``, beside a teacher of logits or a head: the two
        passes (``distill_op``), or with ``token_weights`` the loss's single pass when the
        student's gradient is wanted (``distill_loss_op``); over a split vocabulary
        ``vocab_split_distill_op``."""
        if student.logits.stride(-1) != 1:
            # the kernels read a row's logits at unit stride (the gradient flows through the copy)
            student = student._replace(logits=student.logits.contiguous())
        teacher = _detached(teacher)
        t_head = HeadParams.of(teacher)
        t_logits, t_offset = of(teacher).teacher_logits(teacher, mask.shape[1])
        models = (student.logits, t_logits, mask)
        heads = dict(temperature=float(student.temperature),
                     teacher_temperature=t_head.temperature, offset=int(student.offset),
                     teacher_offset=t_offset, function=function, params=list(params),
                     teacher_logit_scale=t_head.logit_scale, teacher_softcap=t_head.softcap)
        if student.vocab_parallel_group is not None:
            return partial(vocab_split_distill_op, *models, **heads,
                           group_name=_group_name(student)), False
        if token_weights is not None and _single_pass(student.logits):
            return partial(distill_loss_op, *models, token_weights, **heads), True
        return partial(distill_op, *models, **heads), False

    @staticmethod
    def top_k_logprobs(student, ids: Tensor, mask: Tensor, validate: bool
                       ) -> Tuple[Tensor, Tensor]:
        """``(log-probs [B, T, k] at ids, entropy [B, T])`` under the student's whole softmax."""
        if student.logits.stride(-1) != 1:
            student = student._replace(logits=student.logits.contiguous())
        s_k, entropy, _ = logprobs_at_op(student.logits, ids, mask, float(student.temperature),
                                         int(student.offset), _group_name(student))
        return s_k, entropy

    @staticmethod
    def teacher_logits(teacher, T: int) -> Tuple[Tensor, int]:
        """``(logits, offset)`` whose rows ``[offset, offset + T)`` are the teacher's window."""
        return teacher.logits, int(teacher.offset)

    @staticmethod
    def teacher_rows(teacher) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(rows, weight, bias)`` of the teacher beside a student head's chunks: its logits."""
        return teacher.logits, None, None


class HeadOps:
    """A ``LinearHead`` policy's fused ops: its logits formed chunk by chunk (``HeadChunks``),
    never an ``[N, V]`` tensor."""

    @staticmethod
    def logprobs_call(rows, mask: Optional[Tensor], *, gather: bool,
                      return_entropy: bool) -> Callable:
        """The op call whose first two outputs are ``(logp, entropy or empty)`` ``[B, T]`` of
        ``[B, S, H]`` rows (``gather``: the chunks hold the actor rows only)."""
        chunk = chunk_tokens_for(rows.weight, rows.chunk_tokens, rows.targets.numel())
        fields = dict(hidden=rows.hidden, weight=rows.weight, bias=rows.bias,
                      targets=rows.targets, mask=mask, **head_fields(rows),
                      offset=int(rows.offset), chunk_tokens=chunk, gather=gather,
                      with_entropy=bool(return_entropy),
                      batch_invariant=bool(rows.batch_invariant))
        if rows.vocab_parallel_group is not None:
            return partial(vocab_split_linear_logprobs_op, **fields,
                           group_name=_group_name(rows), row_blocks=rows.row_blocks)
        return partial(linear_logprobs_op, **fields)

    @staticmethod
    def can_single_pass(policy) -> bool:
        """Over a split vocabulary too: each chunk's statistics gathered before its gradient
        is written."""
        return True

    @staticmethod
    def single_pass_call(policy, mask: Tensor, tokens: dict, terms: dict, surrogate: dict,
                         validate: bool, row_blocks: int) -> Callable:
        """The op call whose first two outputs are ``(loss, sums)`` of the single pass over the
        head's chunks (``linear_surrogate_op``), the gradients of the hidden states, weight and
        bias formed in the forward."""
        grad = torch.is_grad_enabled()
        needs = [grad and t is not None and t.requires_grad
                 for t in (policy.hidden, policy.weight, policy.bias)]
        chunk = chunk_tokens_for(policy.weight, policy.chunk_tokens, policy.targets.numel())
        group = policy.vocab_parallel_group
        if validate and group is not None:
            check_shard_sizes(group, policy.weight.shape[0], policy.targets.device)
        return partial(linear_surrogate_op, policy.hidden, policy.weight, policy.bias,
                       policy.targets, **tokens, **terms, **head_fields(policy), **surrogate,
                       offset=int(policy.offset), chunk_tokens=chunk, gather=validate,
                       needs=needs, group_name=_group_name(policy), row_blocks=row_blocks)

    @staticmethod
    def divergence_call(student, teacher, function: str, params, mask: Tensor, validate: bool,
                        token_weights: Optional[Tensor]) -> Tuple[Callable, bool]:
        """``(call, with_loss)``: the op call whose outputs begin ``(value, entropy)``, or with
        ``with_loss`` ``(loss, value, entropy)``, beside a teacher of logits or a head, chunk
        by chunk (``linear_distill_op``), or with ``token_weights`` the loss's single pass
        (``linear_distill_loss_op``; not over a split vocabulary)."""
        teacher = _detached(teacher)
        t_head = HeadParams.of(teacher)
        t_rows, t_weight, t_bias = of(teacher).teacher_rows(teacher)
        group = student.vocab_parallel_group
        fields = dict(
            **head_fields(student), teacher_temperature=t_head.temperature,
            teacher_logit_scale=t_head.logit_scale, teacher_softcap=t_head.softcap,
            offset=int(student.offset), teacher_offset=int(teacher.offset), function=function,
            params=list(params),
            chunk_tokens=chunk_tokens_for(student.weight, student.chunk_tokens, mask.numel()),
            gather=validate, batch_invariant=bool(student.batch_invariant))
        models = (student.hidden, student.weight, student.bias, t_rows, t_weight, t_bias, mask)
        if token_weights is not None and group is None:
            needs = [x is not None and x.requires_grad
                     for x in (student.hidden, student.weight, student.bias)]
            return partial(linear_distill_loss_op, *models, token_weights, **fields,
                           needs=needs), True
        return partial(linear_distill_op, *models, **fields,
                       group_name=_group_name(student)), False

    @staticmethod
    def top_k_logprobs(student, ids: Tensor, mask: Tensor, validate: bool
                       ) -> Tuple[Tensor, Tensor]:
        """``(log-probs [B, T, k] at ids, entropy [B, T])`` under the student's whole softmax,
        chunk by chunk."""
        s_k, entropy, _ = linear_logprobs_at_op(
            student.hidden, student.weight, student.bias, ids, mask, **head_fields(student),
            offset=int(student.offset),
            chunk_tokens=chunk_tokens_for(student.weight, student.chunk_tokens, mask.numel()),
            gather=validate, batch_invariant=bool(student.batch_invariant),
            group_name=_group_name(student))
        return s_k, entropy

    @staticmethod
    def teacher_logits(teacher, T: int) -> Tuple[Tensor, int]:
        """``(logits, 0)``: a teacher head's raw logits of its window ``[B, T, V]``, formed
        once."""
        window = teacher.hidden[:, int(teacher.offset):int(teacher.offset) + T]
        logits = chunk_logits(window.reshape(-1, window.shape[-1]), teacher.weight, teacher.bias,
                              bool(teacher.batch_invariant))
        return logits.view(*window.shape[:2], -1), 0

    @staticmethod
    def teacher_rows(teacher) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """``(rows, weight, bias)`` of the teacher beside a student head's chunks: its hidden
        states and head."""
        return teacher.hidden, teacher.weight, teacher.bias


FORMS: Dict[str, type] = {"logits": LogitsOps, "head": HeadOps}


def of(policy):
    """The fused ops of ``policy``'s form."""
    return FORMS[policy.kind]


def window_logprobs(policy, mask: Optional[Tensor], *, validate: bool,
                    return_entropy: bool = False) -> Tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[B, T]`` (entropy empty unless ``return_entropy``) of a ``Logits``
    or ``LinearHead`` policy, whose arguments the caller has checked; packed rows at their loss
    positions (``[N]`` without a mask). ``validate``: a ``LinearHead`` forms the logits of the
    actor rows only (reads the mask on the host), and a split vocabulary's shard sizes are
    compared first (one collective)."""
    over_ranks = policy.every_ranks_rows(mask)
    if over_ranks is not None:    # each rank's own rows: every rank's at once
        head, head_mask, own = over_ranks
        logp, entropy = window_logprobs(head, head_mask, validate=validate,
                                        return_entropy=return_entropy)
        return own(logp), own(entropy) if return_entropy else logp.new_empty(0)
    group = policy.vocab_parallel_group
    if validate and group is not None:
        check_shard_sizes(group, policy.vocab_size, policy.targets.device)
    if policy.index is None:
        logp, entropy = of(policy).logprobs_call(policy, mask, gather=validate,
                                                 return_entropy=return_entropy)()[:2]
        return logp, entropy
    # packed rows: as one batch of N rows, then at their loss positions
    rows, rows_mask = layout.as_rows(policy), layout.row_mask(policy, mask)
    logp, entropy = of(policy).logprobs_call(rows, rows_mask, gather=validate,
                                             return_entropy=return_entropy)()[:2]
    return (layout.to_loss_layout(policy, logp, mask),
            layout.to_loss_layout(policy, entropy, mask) if return_entropy else entropy)


def learner_logprobs(policy, mask: Tensor, *, validate: bool, return_entropy: bool = False):
    """The learner log-probs ``[B, T]`` of any policy form (checked by the loss), with
    ``return_entropy`` ``(logp, entropy)`` (entropy None for ``[B, T]`` log-probs); the loss's
    gradient reaches logits or head through one backward pass over them."""
    if not isinstance(policy, Tensor):      # a form: its log-probs to compute
        logp, entropy = window_logprobs(policy, mask, validate=validate,
                                        return_entropy=return_entropy)
        return (logp, entropy) if return_entropy else logp
    return (policy, None) if return_entropy else policy


def _single_pass(logits: Tensor) -> bool:
    """Whether a loss from the student's ``logits`` runs as a single pass: when their gradient
    is wanted, and not in fp16, whose range would lose the small gradients a loss scaler's
    upstream 2^16 is meant to keep (the two passes form them at the true upstream scale)."""
    return logits.requires_grad and torch.is_grad_enabled() and logits.dtype != torch.float16
