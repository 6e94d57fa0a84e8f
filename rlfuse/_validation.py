"""Argument checks shared by the fused and the reference paths.

Every check reads only ``[B, T]``-sized data (never the logits' values) and raises a
``ValueError`` / ``TypeError`` that names the argument and what was expected.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

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
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None
    if not (value > 0) or (math.isinf(value) and not allow_inf):
        bound = "> 0" if allow_inf else "finite and > 0"
        raise ValueError(f"{name}: expected a value {bound}, got {value}")
    return value


def check_logits(logits) -> None:
    check_tensor("logits", logits, floating=True)
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected shape [B, T, V] or [N, V], got {tuple(logits.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: expected a vocabulary of at least one entry, got V = 0")


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


def check_logprob_args(logits, targets, temperature, mask) -> Optional[torch.Tensor]:
    """Checks the arguments of ``token_logprobs``; returns the mask as bool (or None)."""
    check_logits(logits)
    check_positive("temperature", temperature)
    shape = tuple(logits.shape[:-1])
    if mask is not None:
        mask = check_mask(mask, shape, logits.device)
    check_targets(targets, shape, logits.shape[-1], logits.device, mask)
    return mask
