"""The building blocks of the argument checks (``_contract`` assembles them per function).

Every check reads only ``[B, T]``-sized data (never the logits' values) and raises a
``ValueError`` / ``TypeError`` that names the argument and what was expected.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_tensor(name: str, x, *, shape: Optional[Sequence[int]] = None,
                 device: Optional[torch.device] = None, floating: Optional[bool] = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {x.device}")
    if floating is True and x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a floating dtype (bf16/fp16/fp32/fp64), got {x.dtype}")
    if floating is False and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
        raise TypeError(f"{name}: expected an integer dtype, got {x.dtype}")


def check_positive(name: str, value, *, allow_inf: bool = False) -> float:
    """A number > 0 (finite unless ``allow_inf``); returns it as a Python float."""
    value = check_number(name, value)
    if not (value > 0) or (value == math.inf and not allow_inf):
        bound = "> 0" if allow_inf else "finite and > 0"
        raise ValueError(f"{name}: expected a value {bound}, got {value}")
    return value


def check_logits(logits) -> None:
    check_tensor("logits", logits, floating=True)
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected shape [B, T, V] or [N, V], got {tuple(logits.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: expected a vocabulary of at least one entry, got V = 0")


def check_no_overlap(name: str, x: torch.Tensor) -> None:
    """Distinct elements of ``x`` live in distinct memory, so writing into ``x`` in place cannot
    race between programs (an expanded or stride-0 view fails). Sufficient test: with the dims
    sorted by stride, each stride clears the extent of the smaller ones."""
    extent = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz > 1):
        if stride < extent:
            raise ValueError(f"{name}: inplace_backward=True writes the gradient into the "
                             f"logits' memory, but their elements overlap (shape "
                             f"{tuple(x.shape)}, strides {x.stride()}: an expanded view?); "
                             f"pass a tensor with memory of its own or inplace_backward=False")
        extent += (size - 1) * stride


def check_mask(mask, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """Returns the mask as bool; accepts bool or a numeric tensor of 0/1."""
    check_tensor("mask", mask, shape=shape, device=device)
    if mask.dtype == torch.bool:
        return mask
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("mask: expected a bool tensor or one holding only 0 and 1")
    return mask != 0


def check_targets(targets, shape: Sequence[int], vocab_size: int, device: torch.device,
                  mask: Optional[torch.Tensor]) -> None:
    """Integer ids of ``shape``; unmasked ones must lie in ``[0, vocab_size)``."""
    check_tensor("targets", targets, shape=shape, device=device, floating=False)
    bad = (targets < 0) | (targets >= vocab_size)
    if mask is not None:
        bad &= mask
    if bool(bad.any()):
        where = "unmasked " if mask is not None else ""
        raise ValueError(f"targets: {where}ids must lie in [0, {vocab_size}); "
                         f"found {int(targets[bad][0])}")


def check_group_size(group_size, batch: int, *, minimum: int = 1) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size: expected an int, got {type(group_size).__name__}")
    if group_size < minimum:
        raise ValueError(f"group_size: expected an int >= {minimum}, got {group_size}")
    if batch % group_size != 0:
        raise ValueError(f"group_size: the batch size B = {batch} must be a multiple of "
                         f"group_size = {group_size}")
    return group_size


def check_choice(name: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def check_number(name: str, value) -> float:
    """A real number (finite or not); returns it as a Python float. (Comparisons only, no
    ``math.isnan``: under ``torch.compile(dynamic=True)`` a float may be symbolic.)"""
    if isinstance(value, (bool, str, bytes)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None
    if value != value:
        raise ValueError(f"{name}: expected a number, got nan")
    return value


def check_nonnegative(name: str, value, *, allow_inf: bool = True) -> float:
    value = check_number(name, value)
    if value < 0 or (value == math.inf and not allow_inf):
        bound = ">= 0" if allow_inf else "finite and >= 0"
        raise ValueError(f"{name}: expected a value {bound}, got {value}")
    return value


def check_unit_interval(name: str, value) -> float:
    """A number in ``(0, 1]``."""
    value = check_number(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: expected a value in (0, 1], got {value}")
    return value


def check_finite(name: str, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> None:
    """``x`` is finite wherever ``mask`` is True (everywhere when ``mask`` is None)."""
    bad = ~torch.isfinite(x)
    if mask is not None:
        bad &= mask
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        scope = "at actor (mask=True) positions" if mask is not None else "everywhere"
        raise ValueError(f"{name}: expected finite values {scope}; found {x[where].item()} "
                         f"at index {list(where)}")


def check_actor_tokens(mask: torch.Tensor, group_size: int, *, what: str) -> None:
    """Every block of ``group_size`` consecutive rows of ``mask`` holds at least one actor token.

    ``what`` names the block in the message: ``"group"`` or ``"sequence"`` (``group_size=1``).
    """
    batch, time = mask.shape
    has_token = mask.reshape(batch // group_size, group_size * time).any(-1)
    if not bool(has_token.all()):
        k = int((~has_token).nonzero()[0])
        rows = (f"row {k}" if group_size == 1
                else f"rows {k * group_size}..{(k + 1) * group_size - 1}")
        raise ValueError(f"mask: {what} {k} ({rows}) has no actor token; every {what} needs "
                         f"at least one mask=True position")


def check_token_tensors(mask, tensors: Mapping[str, torch.Tensor], *, shape: Sequence[int],
                        device: torch.device, validate: bool = True) -> torch.Tensor:
    """Checks ``mask`` and the ``[B, T]`` float ``tensors`` (name -> tensor) that go with it;
    returns the mask as bool.

    Shapes, devices and dtypes are always checked (metadata only). With ``validate`` the values
    are checked too: the mask holds only 0/1 and every tensor is finite at the actor positions
    (masked positions may hold anything: NaN, -inf, padding).
    """
    if validate:
        mask = check_mask(mask, shape, device)
    else:
        check_tensor("mask", mask, shape=shape, device=device)
        mask = mask if mask.dtype == torch.bool else mask != 0
    for name, x in tensors.items():
        check_tensor(name, x, shape=shape, device=device, floating=True)
        if validate:
            check_finite(name, x, mask)
    return mask


def check_sequence_tensor(name: str, x, *, batch: int, device: torch.device,
                          validate: bool = True) -> None:
    """A per-sequence float tensor of shape ``(B,)``, finite when ``validate``."""
    check_tensor(name, x, shape=(batch,), device=device, floating=True)
    if validate:
        check_finite(name, x)
