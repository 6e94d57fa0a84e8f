"""Distillation: the divergence between a student's and a teacher's next-token distributions
(``rlfuse.divergences``), per token (``token_divergence``) and as a loss (``distill_loss``)."""
from __future__ import annotations

import functools
from typing import Dict, NamedTuple, Optional

import torch

from .._names import AGGREGATIONS
from .._types import LossOutput
from ..forms import TopK
from ..checks.policy import PolicyInfo, check_policy, check_policy_targets, check_weights
from ..checks.values import (check_choice, check_count, check_loss_scale, check_tensor,
                             check_token_tensors)
from ..divergences import Divergence, check_divergence
from ..scaleout import layout, vocab
from ..scaleout.vocab import vocab_group_size
from ..shared.aggregation import aggregation_weights


class DistillArgs(NamedTuple):
    """Checked arguments of a distillation: the student's ``PolicyInfo``, the bool mask."""

    info: PolicyInfo
    mask: torch.Tensor


def _named(name: str, check, *args):
    """``check(*args)`` with its errors naming ``name`` where they name ``policy``."""
    try:
        return check(*args)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace("policy", name)) from None


def _is_model(x) -> bool:
    """A model given as logits or a head (not a ``TopK`` teacher, not a tensor)."""
    return getattr(x, "kind", None) in ("logits", "head")


def _check_model(name: str, model, loss_shape) -> PolicyInfo:
    if getattr(model, "check_policy", None) is None:     # not a form of logits
        raise TypeError(f"{name}: expected rlfuse.Logits or rlfuse.LinearHead"
                        f"{' or rlfuse.TopK' if name == 'teacher' else ''}, got "
                        f"{type(model).__name__}")
    return _named(name, check_policy, model, loss_shape)


def _check_split(student, teacher, validate: bool) -> None:
    """A split vocabulary: a ``Logits`` / ``LinearHead`` teacher split over the student's group
    (a ``TopK`` teacher's ids are global), the shard sizes compared with ``validate``."""
    group = student.vocab_parallel_group
    if teacher.kind != "top_k":                 # a TopK teacher's ids are global
        other = teacher.vocab_parallel_group
        if other is None or other.group_name != getattr(group, "group_name", None):
            raise ValueError("teacher.vocab_parallel_group: expected the student's group (both "
                             "models' vocabularies split alike)")
    if validate and group is not None:
        vocab.check_shard_sizes(group, student.vocab_size, student.device)


def _check_packed(student, teacher, mask, validate: bool) -> None:
    """Packed rows: the student's and a ``Logits`` / ``LinearHead`` teacher's with the same
    ``index`` (compared with ``validate``: one host sync), the mask giving the ``[B, T]``."""
    if mask is None:
        raise ValueError("mask: packed rows (student.index) need the mask [B, T] their index "
                         "points into")
    if teacher.kind == "top_k":                 # per position: no rows of its own
        return
    if teacher.index is None or teacher.index.shape != student.index.shape:
        raise ValueError("teacher.index: expected the student's packed rows (the same index), "
                         f"got {'none' if teacher.index is None else tuple(teacher.index.shape)}")
    if validate and teacher.index is not student.index and \
            not torch.equal(teacher.index, student.index.to(teacher.index.device)):
        raise ValueError("teacher.index: expected the student's index (the same packed rows)")


def _check_top_k(teacher: TopK, info: PolicyInfo, vocab: int, mask, validate: bool) -> None:
    ids, logprobs = teacher.ids, teacher.logprobs
    check_tensor("teacher.ids", ids, device=info.device, floating=False)
    if ids.dim() != 3 or tuple(ids.shape[:2]) != info.shape or ids.shape[2] < 1:
        raise ValueError(f"teacher.ids: expected shape [B, T, k] with [B, T] = {info.shape}, "
                         f"got {tuple(ids.shape)}")
    check_tensor("teacher.logprobs", logprobs, shape=tuple(ids.shape), device=info.device,
                 floating=True)
    if validate:
        rows = mask.unsqueeze(-1).expand_as(ids)
        bad = ((ids < 0) | (ids >= vocab)) & rows
        if bool(bad.any()):
            raise ValueError(f"teacher.ids: ids must lie in [0, {vocab}); found "
                             f"{ids[bad][0].item()}")
        bad = ~(logprobs <= 0) & rows
        if bool(bad.any()):
            raise ValueError(f"teacher.logprobs: expected log-probs <= 0 at actor positions; "
                             f"found {logprobs[bad][0].item()}")


def check_distill_args(student, teacher, mask, divergence, *, validate: bool) -> DistillArgs:
    """The checks every distillation makes: the two models (the vocabularies equal, the same
    ``[B, T]``), the mask, the divergence."""
    top_k = getattr(teacher, "kind", None) == "top_k"
    check_divergence(divergence, top_k)
    packed = _is_model(student) and student.index is not None
    if packed:
        _check_packed(student, teacher, mask, validate)
    elif _is_model(teacher) and teacher.index is not None:
        raise ValueError("teacher.index: packed rows need the student's packed too")
    info = _check_model("student", student, getattr(mask, "shape", None) if packed else None)
    if student.vocab_parallel_group is not None:
        _check_split(student, teacher, validate)
    elif _is_model(teacher) and teacher.vocab_parallel_group is not None:
        raise ValueError("teacher.vocab_parallel_group: a split teacher needs the student split "
                         "over the same group")
    mask = check_token_tensors(mask, {}, shape=info.shape, device=info.device,
                               validate=validate)
    _named("student", check_policy_targets, student, mask, info.shape, False)
    vocab = student.vocab_size
    if top_k:       # global ids, over a split vocabulary too
        group = student.vocab_parallel_group
        _check_top_k(teacher, info, vocab * (1 if group is None else vocab_group_size(group)),
                     mask, validate)
    else:
        t_info = _check_model("teacher", teacher, mask.shape if packed else None)
        _named("teacher", check_policy_targets, teacher, mask, t_info.shape, False)
        if t_info.shape != info.shape or t_info.device != info.device:
            raise ValueError(f"teacher: expected the student's positions {info.shape} on "
                             f"{info.device}, got {t_info.shape} on {t_info.device}")
        if teacher.vocab_size != vocab:
            raise ValueError(f"teacher: the vocabularies must match; the student's has {vocab} "
                             f"ids, the teacher's {teacher.vocab_size}")
    return DistillArgs(info, mask)


def token_divergence(student, teacher, mask: Optional[torch.Tensor] = None,
                     divergence=None, *, validate: bool = True, return_metrics: bool = False, run):
    """The divergence of each position ``[B, T]`` (fp32; fp64 for fp64 inputs) between the
    student's and the teacher's next-token distributions, with its gradient to the student
    (for a trainer's own aggregation, e.g. verl's ``agg_loss``); 0 at masked positions. The
    arguments in ``distill_loss``'s order; the earlier order ``(student, teacher, divergence,
    mask=None)`` works too.

    Args:
        student: ``rlfuse.Logits`` or ``rlfuse.LinearHead`` (its ``targets [B, T]`` give the
            positions; their values are not read).
        teacher: ``rlfuse.Logits`` / ``rlfuse.LinearHead`` of the same vocabulary and positions
            (its own temperature, hidden width, bias, logit scale, softcap; never
            differentiated), or ``rlfuse.TopK(ids, logprobs)``.
        mask: ``[B, T]`` bool (or 0/1); None: every position.
        divergence: ``rlfuse.divergences.ForwardKL()``, ``ReverseKL()`` or ``JSD(beta)``.
        validate: check the mask's values and a ``TopK`` teacher's ids and log-probs (reads
            ``[B, T, k]`` data, one host sync).
        return_metrics: also return ``{name: [B, T]}`` (no gradient, 0 at masked positions):
            the student's ``entropy``, with a ``TopK`` teacher ``student_mass`` and
            ``teacher_mass`` (the probability mass on the teacher's ids).
    """
    if isinstance(mask, Divergence):              # the earlier order: divergence, then mask
        mask, divergence = divergence, mask
    with run.on(student, teacher) as (impl, student, teacher):
        if mask is None and getattr(student, "index", None) is not None:
            raise ValueError("mask: packed rows (student.index) need the mask [B, T] their "
                             "index points into")
        if mask is None:
            mask = torch.ones(_named("student", check_policy, student, None).shape,
                              dtype=torch.bool, device=student.targets.device)
        args = check_distill_args(student, teacher, mask, divergence, validate=validate)
        value, entropy, extras, _ = _divergence(impl, student, teacher, divergence, args.mask,
                                                validate)
        if not return_metrics:
            return value
        return value, {"entropy": entropy.detach(), **{k: v.detach() for k, v in extras.items()}}


def distill_loss(student, teacher, mask: torch.Tensor, divergence, *,
                 agg: str = "token-mean", num_tokens: Optional[float] = None,
                 loss_scale: float = 1.0, weights: Optional[torch.Tensor] = None,
                 validate: bool = True, run) -> LossOutput:
    """The divergence between a student's and a teacher's next-token distributions, aggregated
    over the actor tokens: on-policy distillation (TRL's ``DistillationTrainer`` and GKD with
    ``JSD(beta)``, verl's ``forward_kl_topk`` with a ``TopK`` teacher).

    Args:
        student, teacher, divergence: as in ``token_divergence``.
        mask: ``[B, T]`` bool (or 0/1), the positions that count.
        agg: ``token-mean`` (TRL's ``batchmean`` over the valid tokens), or another of
            ``policy_loss``'s aggregations (verl's ``agg_loss`` names).
        num_tokens: the token count ``token-mean`` divides by (TRL's ``num_items_in_batch``:
            the global batch's, for gradient accumulation); default: the local mask's sum.
        loss_scale: multiplies the loss and every gradient.
        weights: optional ``[B, T]`` per-token multipliers (>= 0).
        validate: as in ``token_divergence``, and the weights finite and >= 0.

    Returns:
        ``LossOutput(loss, metrics)``: ``entropy`` (the student's mean entropy over the mask,
        what TRL logs), ``loss_min`` / ``loss_max`` (the per-token divergence's range over
        the mask), with a ``TopK`` teacher ``student_mass`` / ``teacher_mass`` (the mean
        probability mass on the teacher's ids, verl's).
    """
    with run.on(student, teacher) as (impl, student, teacher):
        args = check_distill_args(student, teacher, mask, divergence, validate=validate)
        agg = check_choice("agg", agg, AGGREGATIONS)
        num_tokens = check_count("num_tokens", num_tokens, args.info.device, validate)
        scale = check_loss_scale(loss_scale)
        weights = check_weights(weights, args.info, args.mask, validate)
        token_weights = _token_weights(args.mask, agg, num_tokens, scale, weights)
        value, entropy, extras, loss = _divergence(impl, student, teacher, divergence,
                                                   args.mask, validate, token_weights)
        if loss is None:
            loss = (torch.where(args.mask, value.double(), 0.0) * token_weights).sum() \
                .to(value.dtype)
        return _loss(loss, value, entropy, extras, args.mask)


def _token_weights(mask, agg, num_tokens, scale, weights) -> torch.Tensor:
    """Each position's weight in the loss ``sum w value`` (fp64, 0 at masked positions): the
    aggregation's, the loss scale, the per-token weights. The loss is summed in fp64 and
    rounded once: the per-token values' exact aggregate."""
    w = aggregation_weights(mask, agg, torch.float64, num_tokens=num_tokens).unsqueeze(-1)
    w = scale * (w if weights is None else w * weights.double())
    return torch.where(mask, w, 0.0)


def _divergence(impl, student, teacher, divergence, mask, validate: bool,
                token_weights: Optional[torch.Tensor] = None):
    """``impl.token_divergence`` at the ``[B, T]`` positions, with the loss it gave for
    ``token_weights`` (or None); packed rows worked on as one batch of N rows
    (``layout.as_rows``, a ``TopK`` teacher's ``[B, T, k]`` read at each row's position) and
    placed at their positions after."""
    if student.index is None:
        return impl.token_divergence(student, teacher, divergence, mask, validate,
                                     token_weights)
    teacher = teacher.beside_rows(student.index)
    value, entropy, extras, _ = impl.token_divergence(
        layout.as_rows(student), teacher, divergence, layout.row_mask(student, mask), validate)
    place = functools.partial(layout.to_loss_layout, student, mask=mask)
    return place(value), place(entropy), {name: place(x) for name, x in extras.items()}, None


def _loss(loss, value, entropy, extras: Dict[str, torch.Tensor], mask) -> LossOutput:
    tokens = mask.sum().clamp_min(1).to(value.dtype)
    detached = value.detach()
    metrics = {"entropy": entropy.sum() / tokens,
               "loss_min": torch.where(mask, detached, torch.inf).amin(),
               "loss_max": torch.where(mask, detached, -torch.inf).amax(),
               **{name: x.sum() / tokens for name, x in extras.items()}}
    for name in ("loss_min", "loss_max"):    # no actor token: 0, as the other metrics
        metrics[name] = torch.where(mask.any(), metrics[name], 0.0)
    return LossOutput(loss, {k: v.detach() for k, v in metrics.items()})
