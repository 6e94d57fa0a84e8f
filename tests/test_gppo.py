"""Fused GPPO vs the reference vs float64: bounds, every cell, every aggregation, both forms."""
import itertools

import pytest
import torch

import rlfuse
from rlfuse import reference
from rlfuse._contract import AGGREGATIONS, GEOMETRIES, TOPOLOGIES

from conftest import fp32_exact
from loss_harness import check_three_way, constexpr_params, run_loss, token_inputs, with_garbage

CELLS = list(itertools.product(GEOMETRIES, TOPOLOGIES))
# mu = exp(old_lp) at both clamps, near them, and in between
MU = torch.tensor([1e-7, 1e-6, 3e-6, 1e-4, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1 - 1e-4,
                   1 - 3e-6, 1 - 1e-6], dtype=torch.float64)


@pytest.mark.parametrize("geometry, topology", CELLS)
def test_bounds_match_reference(geometry, topology, device):
    """The kernels' device function against the reference's float64 closed forms / bisection."""
    gen = torch.Generator().manual_seed(len(geometry) * 7 + len(topology))
    # mu log-uniform over [1e-6, 1], delta log-uniform over [1e-4, 2], plus fixed points
    old = torch.cat([MU.log(), -torch.rand(200, generator=gen, dtype=torch.float64) * 14])
    deltas = (1e-4 * 2e4 ** torch.rand(6, generator=gen, dtype=torch.float64)).tolist()
    for delta in map(fp32_exact, [1e-4, 0.04, 2.0] + deltas):
        lo, hi = rlfuse.gppo_bounds(old.to(device), geometry=geometry, topology=topology,
                                    delta=delta)
        rlo, rhi = reference.gppo_bounds(old, geometry=geometry, topology=topology, delta=delta)
        assert lo.dtype == hi.dtype == torch.float64
        # bounds are ratios around 1: relative accuracy, and absolute where 1 - x cancels
        torch.testing.assert_close(lo.cpu(), rlo, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(hi.cpu(), rhi, rtol=1e-9, atol=1e-12)
        lo32, hi32 = rlfuse.gppo_bounds(old.float().to(device), geometry=geometry,
                                        topology=topology, delta=delta)
        assert lo32.dtype == torch.float32
        rlo32, rhi32 = reference.gppo_bounds(old.float(), geometry=geometry, topology=topology,
                                             delta=delta)
        torch.testing.assert_close(lo32.cpu(), rlo32, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(hi32.cpu(), rhi32, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("geometry, topology", CELLS)
def test_bounds_widen_with_delta(geometry, topology, device):
    old = MU.log().to(device)
    prev_lo, prev_hi = torch.ones_like(old), torch.ones_like(old)
    for delta in (1e-4, 1e-3, 0.01, 0.04, 0.2, 1.0, 2.0):
        lo, hi = rlfuse.gppo_bounds(old, geometry=geometry, topology=topology, delta=delta)
        assert (lo <= prev_lo).all() and (hi >= prev_hi).all() and (lo <= 1).all()
        assert ((lo < prev_lo) | (lo == 0)).any() or ((hi > prev_hi) | hi.isinf()).any()
        prev_lo, prev_hi = lo, hi


def test_bounds_check_value(device):
    lo, hi = rlfuse.gppo_bounds(torch.tensor([0.1], dtype=torch.float64).log().to(device),
                                geometry="chi2", topology="atomic", delta=0.04)
    assert abs(lo.item() - 0.3675445) < 1e-7 and abs(hi.item() - 1.6324555) < 1e-7


def gppo_case(B, T, *, seed, spread=0.4, per_token_adv=False):
    gen, _, mask = token_inputs(B, T, seed=seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    lp_buffer = torch.cat([lp, lp[:, :1]], 1)
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    return lp_buffer, with_garbage(old, mask), adv, mask


def args_of(old, adv, mask, dtype):
    return (old.to(dtype), adv.to(dtype), mask)


@pytest.mark.parametrize("geometry, topology", CELLS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_logprobs_every_cell_and_aggregation(geometry, topology, agg, device):
    lp, old, adv, mask = gppo_case(4, 9, seed=3, per_token_adv=agg == "token-mean")
    check_three_way(rlfuse.gppo_loss, reference.gppo_loss, lp, dtype=torch.float32,
                    device=device, args=args_of(old, adv, mask, torch.float32),
                    args64=args_of(old, adv, mask, torch.float64),
                    metric_names=["clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl"],
                    geometry=geometry, topology=topology, delta=0.05, agg=agg)


@pytest.mark.parametrize("geometry, topology", [("chi2", "atomic"), ("kl", "binary"),
                                                ("two_sided_log", "binary"), ("tv", "mc")])
def test_float64_exact(geometry, topology, device):
    lp, old, adv, mask = gppo_case(4, 9, seed=4)
    kw = dict(geometry=geometry, topology=topology, delta=0.125)  # fp32-exact: conftest
    fused = run_loss(rlfuse.gppo_loss, lp, dtype=torch.float64, device=device,
                     args=(old, adv, mask), **kw)
    ref = run_loss(reference.gppo_loss, lp, dtype=torch.float64, args=(old, adv, mask), **kw)
    torch.testing.assert_close(fused[0].cpu(), ref[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(fused[2].cpu(), ref[2], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype, V", [(torch.bfloat16, 37), (torch.float32, 4099),
                                      (torch.bfloat16, 4099)])
@pytest.mark.parametrize("geometry, topology, agg", [
    ("chi2", "atomic", "token-mean"), ("kl", "binary", "seq-mean-token-mean"),
    ("hellinger", "mc", "seq-mean-token-sum-norm")])
def test_logits_single_pass(dtype, V, geometry, topology, agg, device):
    B, T = 4, 5
    gen = torch.Generator().manual_seed(V + len(geometry))
    logits = (torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 2).to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    targets[~mask] = V + 3
    lp = torch.log_softmax(logits[:, :-1] / 0.9, -1).gather(-1, targets.clamp(0, V - 1)[..., None])
    old = with_garbage(lp[..., 0] + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3,
                       mask)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    check_three_way(rlfuse.gppo_loss, reference.gppo_loss, logits, dtype=dtype, device=device,
                    logits_targets=targets, temperature=0.9,
                    args=args_of(old, adv, mask, torch.float32),
                    args64=args_of(old, adv, mask, torch.float64),
                    metric_scales={"approx_kl": lp.abs().max().item()},
                    geometry=geometry, topology=topology, delta=0.05, agg=agg)


def test_logits_upstream_gradient_and_inplace(device):
    """dlogits is written in the forward for an upstream gradient of 1 and rescaled after."""
    B, T, V = 2, 4, 50
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    old = (torch.randn(B, T, generator=gen, dtype=torch.float64) - 4).to(device)
    adv = torch.randn(B, generator=gen, dtype=torch.float64).to(device)
    grads = []
    for fn, inplace in ((rlfuse.gppo_loss, False), (rlfuse.gppo_loss, True),
                        (reference.gppo_loss, False)):
        x = logits.clone().requires_grad_(True)
        out = fn(rlfuse.Logits(x, targets, 1.0, inplace), old, adv, mask)
        (g,) = torch.autograd.grad(out.loss * -3.5, x)
        assert (g.data_ptr() == x.data_ptr()) == inplace  # inplace: into the logits' buffer
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[2], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grads[1], grads[2], rtol=1e-10, atol=1e-13)


def test_logprobs_upstream_gradient(device):
    """From log-probs the backward kernel multiplies by the upstream gradient (here != 1)."""
    lp, old, adv, mask = gppo_case(3, 6, seed=14)
    grads = []
    for fn, dev in ((rlfuse.gppo_loss, device), (reference.gppo_loss, "cpu")):
        x = lp[:, :-1].clone().to(dev).requires_grad_(True)
        out = fn(x, old.to(dev), adv.to(dev), mask.to(dev), delta=0.125)
        (g,) = torch.autograd.grad(out.loss * -3.5, x)
        grads.append(g.cpu())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def logits_case(B, T, V, *, seed, device):
    """fp32 (logits, targets, mask of ones, old_lp, per-sequence advantages) on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen).to(device)
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    old = (torch.randn(B, T, generator=gen) - 4).to(device)
    adv = torch.randn(B, generator=gen).to(device)
    return logits, targets, mask, old, adv


def test_logits_without_grad_reads_only(device):
    """Under no_grad the single pass computes the loss and writes no gradient."""
    logits, targets, mask, old, adv = logits_case(2, 3, 40, seed=13, device=device)
    with torch.no_grad():
        a = rlfuse.gppo_loss(rlfuse.Logits(logits, targets), old, adv, mask)
    b = reference.gppo_loss(rlfuse.Logits(logits.cpu(), targets.cpu()), old.cpu(), adv.cpu(),
                            mask.cpu())
    torch.testing.assert_close(a.loss.cpu(), b.loss, rtol=1e-6, atol=1e-7)


def test_logits_untouched_by_default(device):
    """Logits defaults to inplace_backward=False: the backward leaves the logits as they were."""
    logits, targets, mask, old, adv = logits_case(2, 3, 20, seed=21, device=device)
    x = logits.clone().requires_grad_(True)
    policy = rlfuse.Logits(x, targets)
    assert policy.inplace_backward is False
    rlfuse.gppo_loss(policy, old, adv, mask).loss.backward()
    assert torch.equal(x.detach(), logits) and x.grad.abs().max() > 0


@pytest.mark.parametrize("fn", [rlfuse.gppo_loss, reference.gppo_loss])
def test_token_mean_without_actor_tokens(fn, device):
    """token-mean divides by the batch's token count only: rows (here all of them) may have no
    actor token; the loss, gradient and metrics are then 0."""
    lp, old, adv, _ = gppo_case(2, 3, seed=22)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics, grad = run_loss(fn, lp, dtype=torch.float32, device=device,
                                   args=(old.float(), adv.float(), mask), agg="token-mean")
    assert loss.item() == 0 and (grad == 0).all()
    assert all(value.item() == 0 for value in metrics.values())


@pytest.mark.parametrize("log_ratio", [30.0, -30.0])
@pytest.mark.parametrize("geometry, topology", [("chi2", "atomic"), ("kl", "mc"),
                                                ("two_sided_log", "binary")])
def test_far_outside_region_is_finite(log_ratio, geometry, topology, device):
    lp, old, adv, mask = gppo_case(4, 6, seed=9)
    lp = torch.cat([torch.where(mask, old, 0.0) + log_ratio, lp[:, -1:]], 1)
    for sign in (1.0, -1.0):
        loss, metrics, grad = run_loss(rlfuse.gppo_loss, lp, dtype=torch.float32, device=device,
                                       args=(old.float(), sign * adv.abs().float(), mask),
                                       geometry=geometry, topology=topology)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("geometry, topology, sign", [("chi2", "atomic", -1.0),
                                                      ("kl", "mc", 1.0)])
def test_unclipped_overflow_raises(geometry, topology, sign, device):
    """Far above the region r A is kept by a negative advantage, and by a positive one under
    kl's infinite upper bound: exp(100) overflows fp32."""
    lp, old, adv, mask = gppo_case(2, 3, seed=10)
    lp = torch.cat([torch.where(mask, old, 0.0) + 100.0, lp[:, -1:]], 1)
    for fn in (rlfuse.gppo_loss, reference.gppo_loss):
        with pytest.raises(ValueError, match="overflow"):
            run_loss(fn, lp, dtype=torch.float32, device=device,
                     args=(old.float(), sign * adv.abs().float(), mask),
                     geometry=geometry, topology=topology)


@pytest.mark.parametrize("fn", [rlfuse.gppo_loss, reference.gppo_loss])
def test_unclipped_overflow_raises_from_logits(fn, device):
    """The single pass from logits refuses an overflowing r A as well: lp - old_lp = 100 - log 5
    with A < 0 (chi2 / atomic)."""
    logits = torch.zeros(2, 3, 5, device=device, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long, device=device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    old = torch.full((2, 3), -100.0, device=device)
    with pytest.raises(ValueError, match="overflow"):
        fn(rlfuse.Logits(logits, targets), old, -torch.ones(2, device=device), mask)


def test_global_counts(device):
    lp, old, adv, mask = gppo_case(6, 5, seed=11)
    for agg, kw in (("token-mean", dict(num_tokens=37)),
                    ("seq-mean-token-mean", dict(num_sequences=16)),
                    ("seq-mean-token-sum", dict(num_sequences=16)),
                    ("seq-mean-token-sum-norm", dict(num_sequences=16))):
        kw.update(agg=agg, delta=0.0625)  # fp32-exact: conftest
        a = run_loss(rlfuse.gppo_loss, lp, dtype=torch.float64, device=device,
                     args=(old, adv, mask), **kw)
        b = run_loss(reference.gppo_loss, lp, dtype=torch.float64, args=(old, adv, mask), **kw)
        torch.testing.assert_close(a[0].cpu(), b[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a[2].cpu(), b[2], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("fn", [rlfuse.gppo_bounds, reference.gppo_bounds])
def test_bounds_bad_input(fn):
    with pytest.raises(TypeError, match="old_logprobs"):
        fn(torch.zeros(3, dtype=torch.long), geometry="chi2", topology="atomic", delta=0.1)


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    a = rlfuse.group_advantages(r, group_size=3)
    torch.testing.assert_close(a.view(2, 3).sum(-1), torch.zeros(2))
    assert (a[3:] == 0).all()


def test_runtime_hyperparameters_are_not_constexpr():
    from rlfuse.kernels import gppo, surrogate

    for kernel in (surrogate._surrogate_fwd_kernel, surrogate._surrogate_bwd_kernel,
                   surrogate._surrogate_logits_kernel, gppo._gppo_bounds_kernel):
        assert constexpr_params(kernel) <= {"BLOCK", "BLOCK_T", "BLOCK_V", "GEOMETRY",
                                            "TOPOLOGY", "ACC", "WRITE_DLOGITS", "HAS_OLD",
                                            "SEQUENCE",
                                            # the single pass's launch configuration
                                            "PERSISTENT", "EVICT", "NUM_STAGES", "ORDER"}


BAD = [
    (dict(geometry="l2"), ValueError, "geometry.*'tv', 'chi2'"),
    (dict(topology="sphere"), ValueError, "topology.*'mc', 'atomic', 'binary'"),
    (dict(agg="mean"), ValueError, "agg.*token-mean"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(delta=-0.1), ValueError, "delta"),
    (dict(advantages=torch.zeros(3)), ValueError, "advantages"),
    (dict(advantages=torch.zeros(4, 3)), ValueError, "advantages"),
    (dict(old=torch.zeros(4, 6)), ValueError, "old_logprobs"),
    (dict(mask=torch.ones(4, 6, dtype=torch.bool)), ValueError, "mask"),
    (dict(num_tokens=-1), ValueError, "num_tokens"),
    (dict(num_sequences=0), ValueError, "num_sequences"),
    (dict(policy=rlfuse.Logits(torch.zeros(4, 5, 3), torch.zeros(4, 5, dtype=torch.long), -1.0)),
     ValueError, "temperature"),
    (dict(policy=rlfuse.Logits(torch.zeros(4, 5, 3), torch.full((4, 5), 3))), ValueError,
     "targets"),                                              # unmasked id == V
]


@pytest.mark.parametrize("bad, exc, match", BAD)
@pytest.mark.parametrize("fn", [rlfuse.gppo_loss, reference.gppo_loss])
def test_bad_input(fn, bad, exc, match):
    a = dict(policy=torch.zeros(4, 5), old=torch.zeros(4, 5) - 1, advantages=torch.zeros(4),
             mask=torch.ones(4, 5, dtype=torch.bool))
    a.update(bad)
    with pytest.raises(exc, match=match):
        fn(a.pop("policy"), a.pop("old"), a.pop("advantages"), a.pop("mask"), **a)


def test_module_wrapper(device):
    lp, old, adv, mask = gppo_case(4, 5, seed=12)
    module = rlfuse.GPPOLoss(geometry="hellinger", topology="binary", delta=0.1)
    args = (lp[:, :-1].float().to(device), old.float().to(device), adv.float().to(device),
            mask.to(device))
    a = module(*args)
    b = rlfuse.gppo_loss(*args, geometry="hellinger", topology="binary", delta=0.1)
    assert torch.equal(a.loss, b.loss)
