"""Upstream gradients other than 1 and repeated backwards, for every loss and policy form."""
import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import FP16_ACCUMULATION, TOL, assert_three_way

B, T, V, M = 4, 6, 53, 2


def make_case(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old = -(lp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)).abs()
    return dict(logits=logits, targets=targets, mask=mask, old=old, ref=old - 0.1,
                teacher=old - 0.5, adv=torch.randn(B, generator=gen, dtype=torch.float64),
                rewards=(torch.rand(B, generator=gen) > 0.5).double())


LOSSES = {
    "ggpo": lambda lib, pol, c, **kw: lib.ggpo_loss(pol, c["ref"], c["rewards"], c["mask"],
                                                     group_size=M, beta=0.5, **kw),
    "gppo": lambda lib, pol, c, **kw: lib.gppo_loss(pol, c["old"], c["adv"], c["mask"], **kw),
    "gr_opd": lambda lib, pol, c, **kw: lib.gr_opd_loss(pol, c["old"], c["teacher"], c["mask"],
                                                         group_size=M, **kw),
}


def on(case, device):
    return {k: v.to(device) for k, v in case.items()}


def grad_of(lib, name, case, dtype, form, scale, device="cpu", **kw):
    case = on(case, device)
    leaf = (case["logits"] if form == "logits" else case["old"] + 0.05).to(dtype)
    leaf = leaf.clone().requires_grad_(True)
    pol = rlfuse.Logits(leaf, case["targets"]) if form == "logits" else leaf
    loss = LOSSES[name](lib, pol, case, **kw).loss
    (grad,) = torch.autograd.grad(loss * scale, leaf)
    return grad.cpu()


@pytest.mark.parametrize("scale", [1.0, -3.5, 1e-4, 2.0 ** 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_upstream_scale_from_logits(name, dtype, scale, device):
    """The gradient is formed at the true upstream scale before its one rounding to the logits'
    dtype: fp16 under a loss scaler's 2^16 with a large global token count keeps the entries
    that would underflow at scale 1 (they are ~1e-10 here), and 1e-4 does not overflow."""
    case = make_case(1)
    kw = {"num_sequences": 2e4} if name == "gr_opd" else {"num_tokens": 2e5}  # global counts
    fused = grad_of(rlfuse, name, case, dtype, "logits", scale, device, **kw)
    ref = grad_of(reference, name, case, dtype, "logits", scale, **kw)
    ref64 = grad_of(reference, name, case, torch.float64, "logits", scale, **kw)
    assert fused.dtype == dtype
    assert_three_way(fused, ref, ref64, f"dlogits x{scale}", scale=ref64.abs().max().item())
    if dtype == torch.float16 and scale == 2.0 ** 16:
        tiny = (ref64.abs() > 0) & (ref64.abs() * 2 ** -16 < 6e-8)  # underflow at scale 1
        assert tiny.any() and (fused[tiny] != 0).all()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", ["gppo", "gr_opd"])
def test_single_pass_backward_runs_once(name, inplace, device):
    """The single pass hands its gradient buffer out in the first backward (a buffer of its
    own, or the logits' in place); a second backward raises instead of returning a wrongly
    scaled gradient, and the gradient the caller holds is left as it was."""
    case = on(make_case(2), device)
    leaf = case["logits"].float().requires_grad_(True)
    loss = LOSSES[name](rlfuse, rlfuse.Logits(leaf, case["targets"], 1.0, inplace), case).loss
    (first,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    held = first.clone()
    with pytest.raises(RuntimeError, match="backpropagated twice"):
        torch.autograd.grad(loss * 2, leaf)
    assert torch.equal(first, held)


@pytest.mark.parametrize("name, form, dtype", [
    ("ggpo", "logits", torch.float32), ("ggpo", "logprobs", torch.float32),
    ("gppo", "logprobs", torch.float32), ("gr_opd", "logprobs", torch.float32),
    ("gppo", "logits", torch.float16), ("gr_opd", "logits", torch.float16)])
def test_repeated_backward_accumulates(name, form, dtype, device):
    """Every other path computes each backward from saved statistics: backward, then twice the
    loss backward again, accumulates three times the gradient (up to the rounding of each
    backward's gradient to the leaf's dtype: two fp16 subnormal steps)."""
    case = on(make_case(3), device)
    leaf = (case["logits"] if form == "logits" else case["old"] + 0.05).to(dtype)
    leaf = leaf.clone().requires_grad_(True)
    pol = rlfuse.Logits(leaf, case["targets"]) if form == "logits" else leaf
    loss = LOSSES[name](rlfuse, pol, case).loss
    loss.backward(retain_graph=True)
    once = leaf.grad.clone()
    (loss * 2).backward()
    fp16 = dtype == torch.float16
    torch.testing.assert_close(leaf.grad, 3 * once, **(FP16_ACCUMULATION if fp16 else TOL["exact"]))
