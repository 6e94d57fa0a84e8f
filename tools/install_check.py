"""A user's install, checked (``make install-check``): in a fresh virtual environment where
torch's CPU build and then ``pip install .`` alone installed rlfuse, run from outside the
repository with ``TRITON_INTERPRET=1``. rlfuse is imported from the install (its ``py.typed``
there), the kernels run on CPU tensors through Triton's interpreter (numpy, a dependency), and
a fused loss from bf16 logits — PPO's clip, as TRL's GRPOTrainer runs it — gives the
reference's loss and gradient."""
from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("tools/install_check.py: run it with TRITON_INTERPRET=1 (the kernels on the CPU)")

import torch  # noqa: E402

import rlfuse  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    installed = Path(rlfuse.__file__).resolve().parent
    assert installed != REPO / "rlfuse", f"rlfuse imported from the repository: {installed}"
    assert (installed / "py.typed").is_file(), f"no py.typed in {installed}"
    from triton.runtime.interpreter import InterpretedFunction

    from rlfuse.kernels.lib import utils

    assert rlfuse.use_kernels("cpu") and isinstance(utils.load_tile, InterpretedFunction), \
        "the kernels do not run on the CPU"
    gen = torch.Generator().manual_seed(0)
    B, T, V = 4, 6, 97
    logits = (2 * torch.randn(B, T + 1, V, generator=gen)).to(torch.bfloat16)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.8
    old = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    old = (old + 0.05 * torch.randn(B, T, generator=gen)).clamp(max=0.0)
    advantages = torch.randn(B, generator=gen)
    results = []
    for lib in (rlfuse, rlfuse.reference):
        x = logits.clone().requires_grad_()
        out = lib.ppo_loss(lib.Logits(x, targets), old, advantages, mask, clip=(0.2, 0.28))
        out.loss.backward()
        results.append((out.loss.detach(), x.grad))
    (loss, grad), (ref_loss, ref_grad) = results
    # fp32 sums of the same terms in another order; the bf16 gradient rounded once on each side
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2 ** -7, atol=1e-6)
    print(f"rlfuse {rlfuse.__version__} from {installed}: the fused PPO loss on bf16 logits "
          f"({loss.item():.6f}) and its gradient are the reference's, through the interpreter")


if __name__ == "__main__":
    main()
