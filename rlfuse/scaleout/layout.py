"""The rows a policy's logits come in, and the ``[B, T]`` loss positions they go to.

A ``Logits`` / ``LinearHead`` over ``[B, S, ...]`` rows: the rows ``[offset, offset + T)``
predict the ``[B, T]`` targets, the kernels take the whole tensor and the offset. Packed
(padding-free) rows: ``[N, ...]`` rows of many sequences back to back, ``index [N]`` each row's
flat loss position ``b T + t`` or -1; they are worked on as one batch of ``N`` rows
(``as_rows``, ``row_mask``) and their results placed at their loss positions afterwards
(``to_loss_layout``). Nothing here syncs with the host but ``check_index`` (``validate``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def packed_index(cu_seqlens: Tensor, prompt_lengths: Tensor, response_length: int) -> Tensor:
    """The ``index`` of packed rows: row ``j`` of sequence ``b`` (``cu_seqlens[b] <= j <
    cu_seqlens[b + 1]``) predicts the token after it, which is response token ``t = j -
    cu_seqlens[b] + 1 - prompt_lengths[b]``; its index is ``b T + t`` for ``0 <= t < T``
    (``T = response_length``, the loss's ``[B, T]`` width), else -1 (prompt rows, the last row
    of a sequence, responses longer than T).

    Args:
        cu_seqlens: ``[B + 1]`` integer, the rows where each sequence starts (0 first, N last),
            as flash-attention's varlen layout has them.
        prompt_lengths: ``[B]`` integer, the prompt tokens of each sequence.
        response_length: T.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [B + 1], got "
                         f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    B = cu_seqlens.numel() - 1
    if tuple(prompt_lengths.shape) != (B,) or prompt_lengths.is_floating_point():
        raise ValueError(f"prompt_lengths: expected an integer tensor of shape ({B},), got "
                         f"{tuple(prompt_lengths.shape)} {prompt_lengths.dtype}")
    if isinstance(response_length, bool) or not isinstance(response_length, int) \
            or response_length < 0:
        raise ValueError(f"response_length: expected an int >= 0, got {response_length!r}")
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()) or int(cu[0]) != 0:
        raise ValueError("cu_seqlens: expected non-decreasing row offsets starting at 0")
    prompts = prompt_lengths.long().to(cu.device)
    if bool(((prompts < 0) | (prompts > lengths)).any()):
        raise ValueError(f"prompt_lengths: expected values in [0, the sequence's rows], got "
                         f"{prompt_lengths.tolist()} for {lengths.tolist()} rows")
    seq = torch.repeat_interleave(torch.arange(B, device=cu.device), lengths)
    rows = torch.arange(int(cu[-1]), device=cu.device)
    t = rows - cu[:-1][seq] + 1 - prompt_lengths.long().to(cu.device)[seq]
    last = rows == cu[1:][seq] - 1                      # predicts nothing of this sequence
    inside = (t >= 0) & (t < response_length) & ~last
    return torch.where(inside, seq * response_length + t, torch.full_like(t, -1))


def check_index(index: Tensor, positions: Optional[int],
                mask: Optional[Tensor] = None) -> None:
    """Values in ``[-1, positions)`` (``positions`` None: >= -1), no position twice, and with
    ``mask`` a row for every actor position (one without would count as log-prob 0, a
    probability of 1, in the loss); one host sync."""
    bad = index < -1
    if positions is not None:
        bad |= index >= positions
    if bool(bad.any()):
        expected = f"[-1, {positions}) (B T = {positions} loss positions" if positions \
            is not None else "[-1, B T) ("
        raise ValueError(f"policy.index: expected values in {expected}, -1: none), found "
                         f"{int(index[bad][0])}")
    used = index[index >= 0]
    if used.numel() != torch.unique(used).numel():
        raise ValueError("policy.index: a loss position appears twice")
    if mask is not None:
        covered = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
        covered[used.to(mask.device)] = True
        missing = (mask.reshape(-1) != 0) & ~covered
        if bool(missing.any()):
            b, t = divmod(int(missing.nonzero()[0]), mask.shape[-1])
            raise ValueError(f"policy.index: the actor position [{b}, {t}] (mask=True) has no "
                             f"row; expected a row for every actor position")


def packed_rows_mask(index: Tensor, mask: Optional[Tensor]) -> Tensor:
    """``[N]`` bool: the packed rows a loss position uses (index >= 0, unmasked there)."""
    used = index >= 0
    if mask is None:
        return used
    mask = mask if mask.dtype == torch.bool else mask != 0
    return used & mask.reshape(-1)[index.clamp_min(0)]


def scatter_rows(values: Tensor, index: Tensor, shape: Sequence[int]) -> Tensor:
    """``[B, T]`` (``shape``) from per-row ``values [N]`` placed at ``index``, differentiable in
    ``values``: rows at -1 are dropped (written to a spare last slot, without a host sync),
    positions no row fills are 0."""
    positions = 1
    for size in shape:
        positions *= size
    slot = torch.where(index >= 0, index, positions)
    out = values.new_zeros(positions + 1).index_put((slot,), values)
    return out[:positions].view(*shape)


def is_scaled_out(policy) -> bool:
    """A ``Logits`` / ``LinearHead`` with packed rows or a split vocabulary."""
    return getattr(policy, "index", None) is not None or \
        getattr(policy, "vocab_parallel_group", None) is not None


def as_rows(policy):
    """A packed policy as one batch of ``N`` rows (``[1, N, ...]``, targets ``[1, N]``), the
    layout the row machinery works on; other policies unchanged."""
    if policy.index is None:
        return policy
    return policy.with_rows(lambda x: x.unsqueeze(0))


def as_one_token_rows(policy, mask: Tensor, per_token: dict, per_row: dict):
    """Packed rows as a batch of ``N`` sequences of one token each (``[N, 1, ...]``), for the
    single pass: ``(policy, mask [N, 1], per_token, per_row)`` with the ``[B, T]`` tensors of
    ``per_token`` read at each row's loss position (``[N, 1]``) and the ``[B]`` ones of
    ``per_row`` at its sequence's (``[N]``); a row at -1 is masked (its gradient is 0). Token-
    local losses are the same per token in either layout; only ``[B, T]``-sized data moves."""
    T = mask.shape[1]
    pos = policy.index.clamp_min(0)
    sequence = pos // T
    new_mask = packed_rows_mask(policy.index, mask).unsqueeze(1)

    def at_token(x):
        if x is None:
            return None
        return (x.reshape(-1)[pos] if x.dim() == 2 else x[sequence]).unsqueeze(1)

    rows = {k: None if v is None else v[sequence] for k, v in per_row.items()}
    return policy.with_rows(lambda x: x.unsqueeze(1)), new_mask, {k: at_token(v) for k, v in per_token.items()}, rows


def row_mask(policy, mask: Optional[Tensor]) -> Optional[Tensor]:
    """The mask of ``as_rows(policy)``: ``[1, N]`` for packed rows (the rows a loss position
    uses), else ``mask``."""
    if policy.index is None:
        return mask
    return packed_rows_mask(policy.index, mask).unsqueeze(0)


def to_loss_layout(policy, values: Optional[Tensor], mask: Optional[Tensor]) -> Optional[Tensor]:
    """Per-row ``values [1, N]`` of a packed policy at their loss positions ``[B, T]`` (the
    mask's shape; per row ``[N]`` without a mask); others unchanged."""
    if policy.index is None or values is None:
        return values
    values = values.reshape(-1)
    if mask is None:
        return values
    return scatter_rows(values, policy.index, mask.shape)
