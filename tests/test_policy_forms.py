"""Policy forms: a model's whole output with ``Logits(..., offset=)``, ``loss_scale``, and what
each form allocates (recorded by a TorchDispatchMode over forward and backward)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rlfuse
from rlfuse import reference

from conftest import TOL, assert_three_way

B, S, V, M = 4, 9, 37, 2     # logits [B, S, V]: a model's output over prompt + response
OFFSET, T = 3, 5             # rows 3..7 predict the 5 targets; rows 0..2 and 8 are unused


def make_case(seed, device, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    logits = (torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2).to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    lp = torch.log_softmax(logits[:, OFFSET:OFFSET + T], -1).gather(-1, targets[..., None])[..., 0]
    old = -(lp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).abs()
    case = dict(logits=logits, targets=targets, mask=mask, old=old, ref=old - 0.2,
                teacher=old - 0.5, adv=torch.randn(B, generator=gen, dtype=torch.float64),
                rewards=(torch.rand(B, generator=gen) > 0.5).double())
    return {k: v.to(device) for k, v in case.items()}


LOSSES = {
    "ggpo": lambda lib, pol, c, **kw: lib.ggpo_loss(pol, c["ref"], c["rewards"], c["mask"],
                                                     group_size=M, beta=0.5, **kw),
    "gppo": lambda lib, pol, c, **kw: lib.gppo_loss(pol, c["old"], c["adv"], c["mask"],
                                                     geometry="tv", topology="binary", **kw),
    "gr_opd": lambda lib, pol, c, **kw: lib.gr_opd_loss(pol, c["old"], c["teacher"], c["mask"],
                                                         group_size=M, **kw),
}


def run(lib, name, case, dtype, *, whole=True, inplace=False, scale=1.0, **kw):
    """(loss, metrics, gradient w.r.t. the whole [B, S, V] logits)."""
    leaf = case["logits"].to(dtype).clone().requires_grad_(True)
    if whole:
        policy = rlfuse.Logits(leaf, case["targets"], 0.8, inplace, offset=OFFSET)
    else:
        policy = rlfuse.Logits(leaf[:, OFFSET:OFFSET + T], case["targets"], 0.8, inplace)
    cast = {k: v.to(torch.float64 if dtype == torch.float64 else torch.float32)
            if v.is_floating_point() else v for k, v in case.items()}
    out = LOSSES[name](lib, policy, cast, **kw)
    (grad,) = torch.autograd.grad(out.loss * scale, leaf)
    return out.loss.detach().cpu(), {k: v.cpu() for k, v in out.metrics.items()}, grad.cpu()


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_whole_output_with_offset(name, dtype, inplace, device):
    """The whole output with an offset: the loss and the window's gradient are those of the
    window, every other row's gradient is exactly 0 — against float64."""
    case = make_case(1, device)
    fused = run(rlfuse, name, case, dtype, inplace=inplace)
    ref = run(reference, name, case, dtype)
    ref64 = run(reference, name, case, torch.float64)
    window = run(rlfuse, name, case, dtype, whole=False)
    assert_three_way(fused[0], ref[0], ref64[0], "loss")
    assert_three_way(fused[2], ref[2], ref64[2], "gradient")
    outside = torch.ones(S, dtype=torch.bool)
    outside[OFFSET:OFFSET + T] = False
    assert (fused[2][:, outside] == 0).all()
    assert torch.equal(fused[0], window[0])
    assert torch.equal(fused[2][:, OFFSET:OFFSET + T], window[2][:, OFFSET:OFFSET + T])


def test_offset_checks(impl, device):
    case = make_case(2, device)
    for offset, error in ((S - T + 1, ValueError), (-1, ValueError), (1.0, TypeError)):
        policy = rlfuse.Logits(case["logits"], case["targets"], offset=offset)
        with pytest.raises(error, match="policy.offset"):
            LOSSES["gppo"](impl, policy, case)
    with pytest.raises(ValueError, match="policy.targets"):
        LOSSES["gppo"](impl, rlfuse.Logits(case["logits"], case["targets"][:2]), case)


@pytest.mark.parametrize("form", ["logprobs", "logits"])
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_scale(name, form, device):
    """loss_scale multiplies the loss and the gradient (folded into the kernels): equal to the
    loss times the scale, in either policy form, for the reference alike."""
    case = make_case(3, device)
    results = []
    for lib in (rlfuse, reference):
        for kw, scale in (({"loss_scale": 0.25}, 1.0), ({}, 0.25)):
            leaf = (case["logits"] if form == "logits" else case["old"] + 0.05).float()
            leaf = leaf.clone().requires_grad_(True)
            policy = rlfuse.Logits(leaf, case["targets"], offset=OFFSET) if form == "logits" \
                else leaf
            cast = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
            out = LOSSES[name](lib, policy, cast, **kw)
            (grad,) = torch.autograd.grad(out.loss * scale, leaf)
            results.append(((out.loss * scale).detach().cpu(), grad.cpu(), out.metrics))
    for loss, grad, metrics in results[1:]:
        torch.testing.assert_close(loss, results[0][0], **TOL["fp32_reduce"])
        torch.testing.assert_close(grad, results[0][1], **TOL["fp32_reduce"])
        assert metrics.keys() == results[0][2].keys()
    for lib in (rlfuse, reference):
        with pytest.raises(ValueError, match="loss_scale"):
            LOSSES[name](lib, case["old"].float().requires_grad_(), case, loss_scale=float("inf"))


class Allocations(TorchDispatchMode):
    """Every tensor an op returns while the mode is on, as (op, numel, storage pointer)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), t.numel(), t.untyped_storage().data_ptr()))
        return out

    def buffers_of_at_least(self, numel):
        return {(op, ptr) for op, n, ptr in self.outputs if n >= numel}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_whole_output_allocates_one_gradient_buffer(name, device):
    """Forward and backward of each loss on a model's whole output: exactly one logits-sized
    buffer is allocated (the gradient), none for a slice (the sliced policy of earlier
    versions made autograd allocate a zero-filled [B, S, V] buffer and copy into it)."""
    case = make_case(4, device)
    cast = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
    counts = {}
    for whole in (True, False):
        leaf = cast["logits"].clone().requires_grad_(True)
        with Allocations() as allocs:
            policy = (rlfuse.Logits(leaf, case["targets"], offset=OFFSET) if whole
                      else rlfuse.Logits(leaf[:, OFFSET:OFFSET + T], case["targets"]))
            LOSSES[name](rlfuse, policy, cast).loss.backward()
        counts[whole] = len({p for _, p in allocs.buffers_of_at_least(B * T * V)})
    assert counts[True] == 1, counts
    assert counts[False] >= 2, counts   # the slice's backward: the negative control


def test_inplace_into_overlapping_logits_is_refused(impl, device):
    lib = impl
    base = torch.randn(1, 3, 7, device=device)
    expanded = base.expand(4, 3, 7).requires_grad_(False)
    targets = torch.zeros(4, 3, dtype=torch.long, device=device)
    mask = torch.ones(4, 3, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="logits: inplace_backward=True.*overlap"):
        lib.token_logprobs(expanded, targets, inplace_backward=True)
    with pytest.raises(ValueError, match="policy.logits: inplace_backward=True.*overlap"):
        lib.gppo_loss(rlfuse.Logits(expanded, targets, 1.0, True),
                      torch.zeros(4, 3, device=device), torch.ones(4, device=device), mask)
    lib.token_logprobs(expanded, targets)                     # reading an expanded view is fine
    full = torch.randn(4, 5, 7, device=device)
    lib.token_logprobs(full[:, :3], targets, inplace_backward=True)   # a slice has its memory


@pytest.mark.parametrize("call", ["ppo", "policy_loss"])
def test_inplace_single_pass_declares_its_write(call, device):
    """``inplace_backward=True`` with a single-pass loss overwrites the logits with their
    gradient during the call: their version moves, so a consumer that saved them before raises
    in its backward instead of differentiating through overwritten values; alone, the gradient
    is the one of ``inplace_backward=False``."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 11, generator=gen).to(device)
    ids = torch.randint(0, 11, (2, 3), generator=gen).to(device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    old = -torch.rand(2, 3, generator=gen).to(device)
    adv = torch.randn(2, generator=gen).to(device)

    def loss(logits, inplace):
        policy = rlfuse.Logits(logits, ids, inplace_backward=inplace)
        if call == "ppo":
            return rlfuse.ppo_loss(policy, old, adv, mask).loss
        return rlfuse.policy_loss(policy, old, adv, mask, "cispo",
                                  entropy=rlfuse.terms.EntropyBonus(0.1)).loss

    grads = []
    for inplace in (False, True):
        leaf = x.clone().requires_grad_(True)
        logits = leaf * 1.0
        version = logits._version
        out = loss(logits, inplace)
        assert (logits._version > version) == inplace    # declared by the call itself
        out.backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0], **TOL["exact"])
    leaf = x.clone().requires_grad_(True)
    logits = leaf * 1.0
    other = (logits * logits).sum()                 # saves the logits before the call
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss(logits, True) + other).backward()
