"""Prompts: fixed-length byte windows of the Zen of Python (the text of Python's own ``this``)."""
from __future__ import annotations

import codecs
import contextlib
import io

import torch

EVAL_PROMPTS = 32


def zen_of_python() -> str:
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    return codecs.decode(this.s, "rot13")


def prompt_windows(length: int, *, split: str) -> torch.Tensor:
    """Byte windows ``[N, length]`` (int64): every window of the first 80% of the text for
    ``split="train"``, ``EVAL_PROMPTS`` evenly spaced windows of the last 20% for
    ``split="eval"``."""
    data = zen_of_python().replace("\n", " ").encode("ascii")
    cut = int(0.8 * len(data))
    part = data[:cut] if split == "train" else data[cut:]
    windows = torch.tensor(list(part), dtype=torch.long).unfold(0, length, 1)
    if split == "eval":
        windows = windows[torch.linspace(0, len(windows) - 1, EVAL_PROMPTS).long()]
    return windows
