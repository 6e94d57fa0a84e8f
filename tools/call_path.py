"""How long a call's path is: the rlfuse modules outside ``kernels/`` whose Python code a
public call runs (forward and backward), and how many rlfuse frames deep its first kernel
launch is. The measure of a short path between the public function and the kernel.

    TRITON_INTERPRET=1 python -m tools.call_path

runs the three calls of ``CALLS`` on small CPU tensors through the interpreter and prints, for
each, the modules in the order they first ran and the frames at its first launch.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple

import torch

import rlfuse
from rlfuse.divergences import JSD

PACKAGE = Path(rlfuse.__file__).resolve().parent
KERNELS = PACKAGE / "kernels"


class CallPath(NamedTuple):
    modules: List[str]          # rlfuse modules outside kernels/ that ran, in first-run order
    first_launch: List[str]     # the rlfuse frames (module.function) at the first launch


def _module(filename: str):
    """The module path of an rlfuse file (``api/ggpo.py``), None for another file."""
    path = Path(filename).resolve()
    if PACKAGE not in path.parents:
        return None
    return path.relative_to(PACKAGE).as_posix()


def trace(call: Callable[[], torch.Tensor]) -> CallPath:
    """``call()``'s forward and its result's backward, traced."""
    from triton.runtime.interpreter import InterpretedFunction

    modules: Dict[str, None] = {}
    first_launch: List[str] = []

    def profile(frame, event, arg):
        if event == "call":
            name = _module(frame.f_code.co_filename)
            if name is not None and not name.startswith("kernels/"):
                modules.setdefault(name, None)

    run = InterpretedFunction.run

    def launch(self, *args, **kwargs):
        if not first_launch:
            frame = sys._getframe(1)
            while frame is not None:
                name = _module(frame.f_code.co_filename)
                if name is not None:
                    first_launch.append(f"{name[:-3]}.{frame.f_code.co_name}")
                frame = frame.f_back
            first_launch.reverse()
        return run(self, *args, **kwargs)

    InterpretedFunction.run = launch
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        call().backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        InterpretedFunction.run = run
    return CallPath(list(modules), first_launch)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, T, V, H = 4, 5, 64, 16
    hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    logits = torch.randn(B, T, V, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -torch.rand(B, T, generator=g)
    return hidden, weight, logits, targets, mask, old, torch.randn(B, generator=g)


def _ggpo_head():
    hidden, weight, _, targets, mask, old, rewards = _inputs()
    return rlfuse.ggpo_loss(rlfuse.LinearHead(hidden, weight, targets), old, rewards, mask,
                            group_size=2, beta=0.5).loss


def _distill_heads():
    hidden, weight, _, targets, mask, *_ = _inputs()
    teacher = rlfuse.LinearHead(hidden.detach() + 1, weight.detach(), targets)
    return rlfuse.distill_loss(rlfuse.LinearHead(hidden, weight, targets), teacher, mask,
                               JSD(0.5)).loss


def _clip_logits():
    _, _, logits, targets, mask, old, advantages = _inputs()
    return rlfuse.policy_loss(rlfuse.Logits(logits, targets), old, advantages, mask,
                              "clip").loss


CALLS = {"ggpo_loss(LinearHead)": _ggpo_head,
         "distill_loss(LinearHead, LinearHead, JSD)": _distill_heads,
         "policy_loss(Logits, 'clip')": _clip_logits}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("python -m tools.call_path: set TRITON_INTERPRET=1 (the kernels interpreted)")
    for name, call in CALLS.items():
        path = trace(call)
        print(f"{name}: {len(path.modules)} modules outside kernels/, "
              f"{len(path.first_launch)} rlfuse frames at the first launch")
        print("  modules: " + ", ".join(path.modules))
        print("  first launch: " + " -> ".join(path.first_launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
