"""The checks of a loss's policy and of the ``[B, T]`` tensors beside it (``check_loss_policy``,
``check_advantages``, ``check_weights``), and those the policy forms share (``rlfuse.forms``:
each form checks itself with them) — a window of a whole output with ``offset``, packed rows
with ``index``, a head's tensors, the targets. ``check_policy`` and ``check_policy_targets`` take
any policy: learner log-probs ``[B, T]`` are checked here, a form by its own methods.

Only metadata and ``[B, T]``-sized data are read (the targets and the index with ``validate``);
nothing here communicates: the shard sizes of a split vocabulary are compared by the scale-out
code that uses them (``scaleout.vocab.check_shard_sizes``).
"""
from __future__ import annotations

import math
import collections
from typing import NamedTuple, Optional, Tuple

import torch

from .._types import compute_dtype
from .values import (check_chunk_tokens, check_finite, check_positive, check_targets,
                     check_tensor, check_token_tensors)
from ..scaleout.dtensor import is_dtensor
from ..scaleout.layout import check_index, packed_rows_mask


class PolicyInfo(NamedTuple):
    """What the losses need to know about ``policy`` before computing its log-probs."""

    shape: Tuple[int, ...]       # (B, T) of the loss positions
    device: torch.device
    compute_dtype: torch.dtype   # fp64 for fp64 inputs, fp32 otherwise


def policy_device(policy) -> Optional[torch.device]:
    """The device of a policy (log-probs or a form) or of a tensor; None for anything else (the
    checks then say what was expected)."""
    device = getattr(policy, "device", None)
    return device if isinstance(device, torch.device) else None


def check_window(targets, offset, *, batch: int, rows: int, device) -> None:
    """``targets [B, T]`` (integers) predicted by the rows ``[offset, offset + T)`` of ``rows``
    positions."""
    check_tensor("policy.targets", targets, device=device, floating=False)
    if targets.dim() != 2 or targets.shape[0] != batch:
        raise ValueError(f"policy.targets: expected shape [B, T] with B = {batch} (the "
                         f"policy's batch), got {tuple(targets.shape)}")
    T = targets.shape[1]
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"policy.offset: expected an int, got {type(offset).__name__}")
    if offset < 0 or offset + T > rows:
        raise ValueError(f"policy.offset: the rows [offset, offset + T) = [{offset}, "
                         f"{offset + T}) must lie within the policy's {rows} positions")


def check_head_tensors(hidden, weight, bias, *, prefix: str = "", cast: bool = False,
                       hint: str = "") -> None:
    """A head's ``weight [V, H]`` and ``bias [V]`` (or None) against its checked ``hidden [...,
    H]``: shapes, devices, floating dtypes, the hidden states' dtype unless ``cast`` (a
    ``LinearHead`` with a ``head_dtype``); names in messages prefixed by ``prefix``, a dtype
    message followed by ``hint``."""
    check_tensor(f"{prefix}weight", weight, device=hidden.device, floating=True)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"{prefix}weight: expected shape [V, H] with H = {hidden.shape[-1]} "
                         f"(the hidden size) and V >= 1, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype and not cast:
        raise TypeError(f"{prefix}weight: expected the hidden states' dtype {hidden.dtype}"
                        f"{hint}, got {weight.dtype}")
    if bias is not None:
        check_tensor(f"{prefix}bias", bias, shape=(weight.shape[0],), device=hidden.device,
                     floating=True)
        if bias.dtype != hidden.dtype and not cast:
            raise TypeError(f"{prefix}bias: expected the hidden states' dtype {hidden.dtype}"
                            f"{hint}, got {bias.dtype}")


def check_head(head, dims: int) -> None:
    """A ``LinearHead``'s tensors and options: ``hidden`` of ``dims`` dimensions (3: ``[B, S,
    H]``, 2: packed ``[N, H]``)."""
    hidden, weight, bias = head.hidden, head.weight, head.bias
    check_tensor("policy.hidden", hidden, floating=True)
    if hidden.dim() != dims:
        expected = "[B, S, H]" if dims == 3 else "[N, H] (packed rows, with index)"
        raise ValueError(f"policy.hidden: expected shape {expected}, got "
                         f"{tuple(hidden.shape)}")
    check_head_tensors(hidden, weight, bias, prefix="policy.", cast=head.head_dtype is not None,
                       hint=" (or a head_dtype for both)")
    check_chunk_tokens("policy.chunk_tokens", head.chunk_tokens)
    check_positive("policy.logit_scale", head.logit_scale)
    if head.softcap is not None:
        check_positive("policy.softcap", head.softcap)
    check_head_dtype(head.head_dtype)
    for flag in ("sequence_parallel", "batch_invariant"):
        check_bool(f"policy.{flag}", getattr(head, flag))


def check_bool(name: str, value) -> None:
    """A flag that changes what runs: a bool, not something truthy."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def check_head_dtype(dtype) -> None:
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                           torch.float64):
        raise TypeError(f"policy.head_dtype: expected None or a floating dtype "
                        f"(bf16/fp16/fp32/fp64), got {dtype!r}")


def check_packed(rows: torch.Tensor, policy, loss_shape) -> Tuple[int, ...]:
    """Packed rows ``rows [N, ...]`` (checked) with ``policy``'s ``targets [N]`` and ``index
    [N]`` (int64), no offset; returns the loss positions: ``loss_shape`` (the mask's), else
    ``(N,)``."""
    N = rows.shape[0]
    check_tensor("policy.targets", policy.targets, shape=(N,), device=rows.device,
                 floating=False)
    check_tensor("policy.index", policy.index, shape=(N,), device=rows.device, floating=False)
    if policy.index.dtype != torch.int64:
        raise TypeError(f"policy.index: expected int64, got {policy.index.dtype}")
    if policy.offset != 0:
        raise ValueError(f"policy.offset: packed rows (index) take no offset, got "
                         f"{policy.offset!r}")
    if loss_shape is not None and len(loss_shape) != 2:
        raise ValueError(f"mask: expected shape [B, T] (the loss positions index points "
                         f"into), got {tuple(loss_shape)}")
    return tuple(loss_shape) if loss_shape is not None else (N,)


def no_dtensor(x):
    """``x`` as it is, unless it is a bare DTensor (logits or log-probs): a ValueError saying
    how to pass one."""
    if is_dtensor(x):
        raise ValueError("policy: a DTensor: pass logits sharded on the vocabulary as "
                         "rlfuse.Logits(logits, targets), or log-probs as a plain tensor "
                         "(to_local())")
    return x


def check_policy(policy, loss_shape: Optional[Tuple[int, ...]] = None) -> PolicyInfo:
    """A policy is learner log-probs ``[B, T]`` (floating tensor), or a form whose rows predict
    ``[B, T]`` targets (``rlfuse.Logits``, ``rlfuse.LinearHead``: their ``check_policy``), or
    packed rows with ``index`` into ``loss_shape`` (the mask's shape; ``(N,)`` without one).
    Only metadata is read here; the targets' and index's values are checked with the mask
    (``check_policy_targets``)."""
    if isinstance(policy, torch.Tensor):
        no_dtensor(policy)
        check_tensor("policy", policy, floating=True)
        if policy.dim() != 2:
            raise ValueError(f"policy: expected learner log-probs of shape [B, T] (or "
                             f"rlfuse.Logits / rlfuse.LinearHead), got shape "
                             f"{tuple(policy.shape)}")
        return PolicyInfo(tuple(policy.shape), policy.device, compute_dtype(policy.dtype))
    check = getattr(policy, "check_policy", None)
    if check is None:
        raise TypeError(f"policy: expected a [B, T] tensor of log-probs, rlfuse.Logits or "
                        f"rlfuse.LinearHead, got {type(policy).__name__}")
    return check(loss_shape)


def check_policy_targets(policy, mask: Optional[torch.Tensor], shape, validate: bool) -> None:
    """A form's temperature and targets (its ``check_targets``); nothing for log-probs."""
    check = getattr(policy, "check_targets", None)
    if check is not None:
        check(mask, shape, validate)


def check_form_targets(policy, vocab: int, mask: Optional[torch.Tensor], shape,
                       validate: bool) -> None:
    """The temperature and the targets of a form over ``vocab`` ids (the whole vocabulary of a
    ``vocab_parallel_group``): integer ``shape`` (packed: ``[N]``, and the index); with
    ``validate``, in range where unmasked (everywhere without a mask)."""
    check_positive("policy.temperature", policy.temperature)
    device = policy.device
    if policy.index is not None:
        shape = tuple(policy.targets.shape)
        if validate:
            check_index(policy.index, math.prod(mask.shape) if mask is not None else None, mask)
            mask = packed_rows_mask(policy.index, mask) if mask is not None \
                else policy.index >= 0
    if validate:
        check_targets(policy.targets, shape, vocab, device, mask)
    else:
        check_tensor("targets", policy.targets, shape=shape, device=device, floating=False)


def check_loss_policy(policy, mask, tensors, validate: bool):
    """The policy, the bool mask and the ``[B, T]`` float ``tensors`` (name -> tensor, None
    left out) of a loss; returns ``(info, mask)``."""
    shape = getattr(mask, "shape", None)
    if not isinstance(policy, torch.Tensor) and getattr(policy, "index", None) is not None:
        # a form's packed rows
        shape = packed_loss_shape(mask, tensors)
    info = check_policy(policy, shape)
    mask = check_token_tensors(mask, {k: v for k, v in tensors.items() if v is not None},
                               shape=info.shape, device=info.device, validate=validate)
    return info, mask


def packed_loss_shape(mask, tensors):
    """Packed rows have no ``[B, T]`` of their own: the shape most of the mask and ``tensors``
    share; with no majority the mask's, after an error naming the mask and the first tensor
    of another shape (either may be the wrong one)."""
    named = {"mask": mask, **{k: v for k, v in tensors.items() if v is not None}}
    shapes = {k: tuple(v.shape) for k, v in named.items() if isinstance(v, torch.Tensor)}
    if len(set(shapes.values())) <= 1 or "mask" not in shapes:
        return shapes.get("mask")
    counts = collections.Counter(shapes.values())
    shape, count = counts.most_common(1)[0]
    if 2 * count > len(shapes):
        return shape
    other = next(k for k, v in shapes.items() if v != shapes["mask"])
    raise ValueError(f"mask, {other}: shapes {shapes['mask']} and {shapes[other]} differ (packed "
                     f"rows take the loss's [B, T] from the mask and its [B, T] inputs alike)")


def check_advantages(advantages, info: PolicyInfo, mask, validate: bool) -> torch.Tensor:
    """``[B]``, ``[B, 1]`` or ``[B, T]`` advantages (finite at actor tokens with ``validate``);
    returns them as ``[B]`` or ``[B, T]``."""
    batch, shape = info.shape[0], info.shape
    check_tensor("advantages", advantages, device=info.device, floating=True)
    if tuple(advantages.shape) not in ((batch,), (batch, 1), shape):
        raise ValueError(f"advantages: expected shape ({batch},), ({batch}, 1) or {shape}, got "
                         f"{tuple(advantages.shape)}")
    if advantages.dim() == 2 and advantages.shape[1] == 1 and shape[1] != 1:
        advantages = advantages[:, 0]
    if validate:
        per_token = advantages.unsqueeze(-1).expand(shape) if advantages.dim() == 1 \
            else advantages
        check_finite("advantages", per_token, mask)
    return advantages


def check_weights(weights, info: PolicyInfo, mask, validate: bool) -> Optional[torch.Tensor]:
    """Optional ``[B, T]`` per-token multipliers, finite and >= 0 at actor tokens."""
    if weights is None:
        return None
    check_tensor("weights", weights, shape=info.shape, device=info.device, floating=True)
    if validate:
        check_finite("weights", weights, mask)
        bad = (weights < 0) & mask
        if bool(bad.any()):
            raise ValueError(f"weights: expected values >= 0 at actor (mask=True) positions; "
                             f"found {weights[bad][0].item()}")
    return weights
