"""The small value types of the public API."""
from __future__ import annotations

from typing import Dict, NamedTuple

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Where rlfuse accumulates: fp64 when any of the inputs is fp64 (for gradcheck), fp32
    otherwise."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


class LossOutput(NamedTuple):
    """What every loss returns: the scalar ``loss`` (0-dim fp32, differentiable) and detached
    0-dim ``metrics``."""

    loss: torch.Tensor
    metrics: Dict[str, torch.Tensor]


class SequenceCounts(NamedTuple):
    """The counts of whole sequences of which a rank holds chunks (context parallelism): each
    sequence's actor tokens ``[B]`` (summed over the ranks) and the sequences' padded length."""

    tokens: torch.Tensor
    length: int
