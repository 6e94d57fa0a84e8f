"""The building blocks of the argument checks (``policy`` and ``losses`` assemble them).

Every check reads only metadata and ``[B, T]``-sized data (never the logits' values) and raises
a ``ValueError`` / ``TypeError`` that names the argument and what was expected. The checks of
values (``validate=True``) sync with the host; with ``validate=False`` only metadata is read.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Optional, Sequence, Tuple

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
    (masked positions may hold anything: NaN, -inf, padding), and the log-probs among them
    (``LOGPROB_INPUTS``) are <= 0 there; ``sampling_logprobs`` may be NaN there (a token the
    inference engine could not score: the off-policy mask counts it as 0, as TRL does).
    """
    if validate:
        mask = check_mask(mask, shape, device)
    else:
        check_tensor("mask", mask, shape=shape, device=device)
        mask = as_bool_mask(mask)
    for name, x in tensors.items():
        check_tensor(name, x, shape=shape, device=device, floating=True)
        if validate:
            check_finite(name, torch.where(x.isnan(), 0.0, x) if name in NAN_AS_ZERO else x,
                         mask)
            if name in LOGPROB_INPUTS:
                check_logprobs(name, x, mask)
    return mask


LOGPROB_INPUTS = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "sampling_logprobs")
NAN_AS_ZERO = ("sampling_logprobs",)


def check_logprobs(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Log-probs are <= 0 at the actor positions (probabilities passed for log-probs are not)."""
    bad = (x > 0) & mask
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: expected log-probabilities (<= 0) at actor (mask=True) "
                         f"positions; found {x[where].item()} at index {list(where)} (were "
                         f"probabilities passed?)")


def check_sequence_tensor(name: str, x, *, batch: int, device: torch.device,
                          validate: bool = True) -> None:
    """A per-sequence float tensor of shape ``(B,)``, finite when ``validate``."""
    check_tensor(name, x, shape=(batch,), device=device, floating=True)
    if validate:
        check_finite(name, x)


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def check_count(name: str, value, device: torch.device, validate: bool):
    """A global count: None (the local one), a number > 0, or a 0-dim tensor on ``device``
    (e.g. all-reduced over a process group: never read on the host unless ``validate``)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, shape=(), device=device)
        if validate and not bool(value > 0):
            raise ValueError(f"{name}: expected a count > 0, got {value.item()}")
        return value
    return check_positive(name, value)


def check_chunk_tokens(name: str, value) -> None:
    """None (the default chunking) or an int > 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name}: expected None or an int > 0, got {value!r}")


def check_loss_scale(loss_scale) -> float:
    """A finite number that multiplies the loss and every gradient."""
    value = check_number("loss_scale", loss_scale)
    if abs(value) == math.inf:
        raise ValueError(f"loss_scale: expected a finite number, got {value}")
    return value


def check_sides(name: str, value, check: Callable) -> Tuple[float, float]:
    """One value or a ``(low, high)`` pair, each side checked by ``check(name, side)``."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{name}: expected a number or a (low, high) pair, got {value!r}")
        return check(f"{name}[0]", value[0]), check(f"{name}[1]", value[1])
    value = check(name, value)
    return value, value


def _check_clip_low(name: str, value) -> float:
    value = check_number(name, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name}: expected a clip range in (0, 1], got {value}")
    return value


def _check_clip_high(name: str, value) -> float:
    value = check_number(name, value)
    if not 0.0 < value < math.inf:
        raise ValueError(f"{name}: expected a clip range finite and > 0, got {value}")
    return value


def check_clip(name: str, clip) -> Tuple[float, float]:
    """PPO's ``eps`` or ``(eps_low, eps_high)``: the region ``[1 - eps_low, 1 + eps_high]``,
    ``eps_low`` in (0, 1] and ``eps_high`` finite and > 0 (one ``eps``: both, in (0, 1])."""
    if isinstance(clip, (tuple, list)) and len(clip) == 2:
        return _check_clip_low(f"{name}[0]", clip[0]), _check_clip_high(f"{name}[1]", clip[1])
    return check_sides(name, clip, _check_clip_low)


def check_dual_clip(dual_clip, name: str = "dual_clip") -> float:
    """None (no dual clip: inf) or a finite ``c > 1``."""
    if dual_clip is None:
        return math.inf
    value = check_number(name, dual_clip)
    if not 1.0 < value < math.inf:
        raise ValueError(f"{name}: expected None or a finite value > 1, got {value}")
    return value


def raise_on_overflow(count: torch.Tensor, dtype: torch.dtype) -> None:
    """The surrogate losses' refusal of an unrepresentable ``r A`` (``count``: the tokens where
    the selected unclipped ``r A`` overflowed ``dtype``). One host sync, so it runs only when
    the loss validates; otherwise the count becomes the ``overflow`` metric."""
    n = int(count.item())
    if n:
        raise ValueError(
            f"policy: the unclipped surrogate r*A overflows {dtype} at {n} actor token(s) "
            f"(log-ratio lp - old_lp too large); the importance ratio is not representable, "
            f"refusing to return inf/NaN (validate=False reports it as the 'overflow' metric)")
