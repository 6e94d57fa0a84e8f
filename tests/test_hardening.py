"""Regression tests for what the interpreter and the first suite hid: extreme values, mixed
dtypes, GPU argument passing, device guards, overlapping in-place buffers, large groups."""
import contextlib
import struct

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import rlfuse
from rlfuse import reference
from rlfuse.fused_losses import _op

from conftest import assert_three_way
from loss_harness import run_loss

LIBS = [rlfuse, reference]


# --------------------------------------------------------------------------------------------
# Overflow of a clipped bound
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["logprobs", "logits"])
def test_a_bound_beyond_the_dtype_is_not_a_silent_inf(form, device):
    """two_sided_log / atomic at delta/mu = 100: the fp64 bound e^100 is inf in fp32. The branch
    is decided against the bound in the compute dtype (inf: never clipped), so the unclipped
    r A = e^129 overflows and is refused, as the reference does; with validate=False the
    overflow metric says so."""
    B, T, V = 1, 2, 8
    mask = torch.tensor([[True, False]], device=device)
    old = torch.tensor([[-130.0, 0.0]], device=device)
    adv = torch.ones(B, device=device)
    if form == "logits":
        logits = torch.zeros(B, T, V, device=device)
        logits[0, 0, 3] = 5.0
        policy = rlfuse.Logits(logits.requires_grad_(), torch.full((B, T), 3, device=device))
        lp = torch.log_softmax(logits.detach()[0, 0], -1)[3]
    else:
        policy = torch.tensor([[-1.0, 0.0]], device=device, requires_grad=True)
        lp = -1.0
    assert float(lp) - (-130.0) > 100
    kw = dict(geometry="two_sided_log", topology="atomic", delta=1e-4)
    for lib in LIBS:
        with pytest.raises(ValueError, match="overflow"):
            lib.gppo_loss(policy, old, adv, mask, **kw)
        out = lib.gppo_loss(policy, old, adv, mask, validate=False, **kw)
        assert out.metrics["overflow"].item() == 1.0, lib.__name__


# --------------------------------------------------------------------------------------------
# Extreme logits
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, row", [
    (torch.float32, [1e38, 0.0, 1.0]),            # (m - m') s overflowed from a finite start
    (torch.float32, [-3.2e38, -3.3e38, -3.25e38]),  # every logit below the old stand-in
    (torch.bfloat16, [-3.2e38, -3.3e38, -3.0e38]),
    (torch.float64, [-1e300, -2e300, -1.5e300]),
    (torch.float64, [1e300, -1e300, 0.0]),
    (torch.float32, [float("-inf"), 0.0, float("-inf")]),
])
def test_extreme_logits(dtype, row, device):
    logits = torch.tensor([row], dtype=torch.float64).to(dtype)
    for target in range(3):
        y = torch.tensor([target])
        got = rlfuse.token_logprobs(logits.to(device), y.to(device), return_entropy=True)
        want = reference.token_logprobs(logits.double(), y, return_entropy=True)
        for g, w, name in zip(got, want, ("logp", "entropy")):
            g = g.cpu().double()
            assert torch.equal(torch.isfinite(g), torch.isfinite(w)), (name, g, w)
            assert torch.equal(g.isnan(), w.isnan()), (name, g, w)
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, equal_nan=True, msg=name)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
def test_masked_rows_of_garbage_get_zero_gradient(lib, bad, device):
    """Fully masked attention rows produce NaN logits: a masked row is never read, in either
    path (the reference masks rows before its log_softmax)."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 11, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    logits[~mask] = bad
    dev = device if lib is rlfuse else "cpu"
    x = logits.to(dev).requires_grad_(True)
    targets = torch.randint(0, 11, (2, 3), generator=gen).to(dev)
    lp, ent = lib.token_logprobs(x, targets, mask=mask.to(dev), return_entropy=True)
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask.to(dev)] == 0).all()
    old = torch.zeros(2, 3, dtype=torch.float64, device=dev)
    x.grad = None
    lib.gppo_loss(rlfuse.Logits(x, targets), old, torch.ones(2, dtype=torch.float64,
                                                                  device=dev),
                  mask.to(dev)).loss.backward()
    assert torch.isfinite(x.grad).all() and (x.grad[~mask.to(dev)] == 0).all()


# --------------------------------------------------------------------------------------------
# Mixed dtypes
# --------------------------------------------------------------------------------------------

def test_gr_opd_advantages_in_the_widest_dtype(device):
    """An fp64 policy with fp32 old / teacher log-probs: the advantages (a cancellation when the
    group's scores are close) are computed in fp64, in both paths."""
    gen = torch.Generator().manual_seed(2)
    B, T = 4, 7
    old = (-torch.rand(B, T, generator=gen) * 3).float()
    teacher = old + 1e-3 * torch.randn(B, T, generator=gen)   # scores close: A cancels
    mask = torch.ones(B, T, dtype=torch.bool)
    lp = (old.double() + 0.01).requires_grad_(True)
    exact = reference.gr_opd_advantages(old.double(), teacher.double(), mask, group_size=2)
    for lib, dev in ((rlfuse, device), (reference, "cpu")):
        out = lib.gr_opd_loss(lp.detach().to(dev).requires_grad_(), old.to(dev),
                              teacher.to(dev), mask.to(dev), group_size=2)
        assert out.loss.dtype == torch.float64
        torch.testing.assert_close(out.metrics["adv_mean"].cpu(), exact.mean(), rtol=1e-12,
                                   atol=1e-12)
        adv = lib.gr_opd_advantages(old.to(dev), teacher.double().to(dev), mask.to(dev),
                                    group_size=2)
        assert adv.dtype == torch.float64
        torch.testing.assert_close(adv.cpu(), exact, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Errors that name the argument
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
def test_clear_type_errors(lib, device):
    logits = torch.randn(2, 5, device=device)
    targets = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(TypeError, match="logits: expected a torch.Tensor"):
        lib.token_logprobs([[0.0, 1.0]], targets)
    for bad in ("1", [1.0], True):
        with pytest.raises(TypeError, match="temperature: expected a number"):
            lib.token_logprobs(logits, targets, temperature=bad)
        with pytest.raises(TypeError, match="temperature: expected a number"):
            lib.gppo_loss(rlfuse.Logits(logits[None], targets[None], bad),
                          torch.zeros(1, 2, device=device), torch.ones(1, device=device),
                          torch.ones(1, 2, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="delta: expected a number"):
        lib.gppo_bounds(torch.zeros(3, device=device), geometry="kl", topology="mc", delta="0.1")


# --------------------------------------------------------------------------------------------
# Device guard
# --------------------------------------------------------------------------------------------

def test_every_launch_runs_under_its_tensors_device(monkeypatch, device):
    """Triton launches on the current device: every op's implementation makes its tensors'
    device current first. Checked with a fake device context that records the device entered
    and a launcher that records the device current at each launch."""
    current = []
    launches = []

    @contextlib.contextmanager
    def fake_guard(dev):
        current.append(dev)
        try:
            yield
        finally:
            current.pop()

    def recording(run):
        def launch(self, *args, **kwargs):
            dev = next(a.device for a in args if isinstance(a, torch.Tensor))
            launches.append((self.__name__, current[-1] if current else None, dev))
            return run(self, *args, **kwargs)
        return launch

    if device.type == "cuda":
        pytest.skip("the interpreter's launcher is what is recorded")
    monkeypatch.setattr(_op, "device_guard", fake_guard)
    monkeypatch.setattr(InterpretedFunction, "run", recording(InterpretedFunction.run))

    gen = torch.Generator().manual_seed(3)
    B, T, V = 4, 3, 9
    logits = torch.randn(B, T, V, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -torch.rand(B, T, generator=gen)
    adv = torch.randn(B, generator=gen)
    lp = old.clone().requires_grad_(True)
    for policy in (lp, rlfuse.Logits(logits, targets)):
        rlfuse.ggpo_loss(policy, old, adv, mask, group_size=2, beta=0.5).loss.backward()
        rlfuse.gppo_loss(policy, old, adv, mask).loss.backward()
        rlfuse.gr_opd_loss(policy, old, old - 0.5, mask, group_size=2).loss.backward()
    rlfuse.token_logprobs(logits, targets, return_entropy=True)[1].sum().backward()
    rlfuse.gppo_bounds(old, geometry="kl", topology="binary", delta=0.1)
    rlfuse.gr_opd_advantages(old, old - 0.5, mask, group_size=2)
    kernels = {name for name, _, _ in launches}
    assert len(kernels) >= 10, kernels
    for name, guard, dev in launches:
        assert guard == dev, (name, guard, dev)


# --------------------------------------------------------------------------------------------
# In-place into overlapping memory
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lib", LIBS, ids=["fused", "reference"])
def test_inplace_into_overlapping_logits_is_refused(lib, device):
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


# --------------------------------------------------------------------------------------------
# GPU argument passing: a Python float reaches a GPU kernel as fp32
# --------------------------------------------------------------------------------------------

def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture
def floats_as_on_a_gpu(monkeypatch, device):
    """The interpreter passes Python floats on as fp64; a GPU launch rounds them to fp32. This
    fixture makes the interpreter do what the GPU does."""
    if device.type == "cuda":
        return
    run = InterpretedFunction.run

    def launch(self, *args, **kwargs):
        args = [_fp32(a) if type(a) is float else a for a in args]
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", launch)


@pytest.mark.parametrize("geometry, topology", [("chi2", "atomic"), ("kl", "binary"),
                                                ("hellinger", "binary"), ("tv", "mc")])
def test_bounds_take_delta_in_fp64_on_a_gpu(geometry, topology, floats_as_on_a_gpu, device,
                                            monkeypatch):
    """delta = 0.1 is not an fp32 number: the kernels take it as an fp64 pair (hi + lo), so the
    fp64 bounds match the fp64 reference to its own accuracy. The negative control passes delta
    as one float, rounded to fp32 on the way: the bounds are then off by ~1e-8."""
    old = torch.linspace(-12, -1e-3, 50, dtype=torch.float64)
    want = reference.gppo_bounds(old, geometry=geometry, topology=topology, delta=0.1)
    got = rlfuse.gppo_bounds(old.to(device), geometry=geometry, topology=topology, delta=0.1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-12, atol=1e-14)
    if device.type == "cuda":
        return
    from rlfuse.kernels import gppo

    monkeypatch.setattr(gppo, "fp64_parts", lambda x: (x, 0.0))
    got = rlfuse.gppo_bounds(old, geometry=geometry, topology=topology, delta=0.1)
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) > 1e-10


def test_fp64_loss_with_gpu_float_passing(floats_as_on_a_gpu, device):
    """GR-OPD's clip range eps = 0.2 reaches the region as an fp64 pair: the fp64 loss matches
    the fp64 reference exactly, with ratios at 1 + eps where fp32(0.2) would move the branch."""
    gen = torch.Generator().manual_seed(4)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    teacher = old - torch.rand(B, T, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    lp = old + torch.log1p(torch.tensor(0.2, dtype=torch.float64)) * (torch.rand(B, T) > 0.5)
    buffer = torch.cat([lp, lp[:, :1]], 1)
    args = (old, teacher, mask)
    fused = run_loss(rlfuse.gr_opd_loss, buffer, dtype=torch.float64, device=device, args=args,
                     group_size=2, gamma=1.0, lam=0.5)
    ref = run_loss(reference.gr_opd_loss, buffer, dtype=torch.float64, args=args, group_size=2,
                   gamma=1.0, lam=0.5)
    torch.testing.assert_close(fused[0].cpu(), ref[0], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(fused[2].cpu(), ref[2], rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------------------------
# Large groups
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [256, 1024])
def test_large_groups(group_size, device):
    """Groups of 256 and 1024 rows (the group kernels hold a whole group; their tile shrinks in
    time as the group grows): GGPO and GR-OPD advantages against float64."""
    gen = torch.Generator().manual_seed(group_size)
    B, T = group_size, 5
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    teacher = old - torch.rand(B, T, generator=gen, dtype=torch.float64)
    rewards = torch.rand(B, generator=gen, dtype=torch.float64)
    lp = torch.cat([old + 0.1, old[:, :1]], 1)
    for clip in (None, 0.05):
        fused = run_loss(rlfuse.ggpo_loss, lp, dtype=torch.float32, device=device,
                         args=(old.float(), rewards.float(), mask), group_size=group_size,
                         beta=0.5, clip_radius=clip)
        ref = run_loss(reference.ggpo_loss, lp, dtype=torch.float32,
                       args=(old.float(), rewards.float(), mask), group_size=group_size,
                       beta=0.5, clip_radius=clip)
        ref64 = run_loss(reference.ggpo_loss, lp, dtype=torch.float64,
                         args=(old, rewards, mask), group_size=group_size, beta=0.5,
                         clip_radius=clip)
        assert_three_way(fused[0].cpu(), ref[0], ref64[0], "loss")
        assert_three_way(fused[2].cpu(), ref[2], ref64[2], "gradient")
    adv = rlfuse.gr_opd_advantages(old.float().to(device), teacher.float().to(device),
                                   mask.to(device), group_size=group_size)
    assert_three_way(adv.cpu(), reference.gr_opd_advantages(old.float(), teacher.float(), mask,
                                                            group_size=group_size),
                     reference.gr_opd_advantages(old, teacher, mask, group_size=group_size),
                     "advantages")
