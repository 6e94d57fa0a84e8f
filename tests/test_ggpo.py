"""Fused GGPO vs the reference vs float64, both branches, both policy forms."""
import math

import pytest
import torch

import rlfuse
from rlfuse import reference

from loss_harness import check_three_way, constexpr_params, run_loss, token_inputs, with_garbage


def ggpo_case(B, T, *, seed, reward_scale=1.0):
    gen, lp_buffer, mask = token_inputs(B, T, seed=seed)
    ref = with_garbage(-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3, mask)
    rewards = torch.randn(B, generator=gen, dtype=torch.float64) * reward_scale
    return lp_buffer, ref, rewards, mask


def args_of(ref, rewards, mask, dtype):
    return (ref.to(dtype), rewards.to(dtype), mask)


@pytest.mark.parametrize("group_size", [2, 3, 8])
@pytest.mark.parametrize("clip_radius", [None, 0.25, math.inf])  # fp32-exact: conftest
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_matches_float64(group_size, clip_radius, dtype, device):
    lp, ref, rewards, mask = ggpo_case(2 * group_size, 11, seed=group_size)
    check_three_way(rlfuse.ggpo_loss, reference.ggpo_loss, lp, dtype=dtype, device=device,
                    args=args_of(ref, rewards, mask, dtype),
                    args64=args_of(ref, rewards, mask, torch.float64),
                    metric_names=["gap", "q_max", "clip_frac", "seq_logratio_mean"],
                    group_size=group_size, beta=0.5, clip_radius=clip_radius)


@pytest.mark.parametrize("dtype, V", [(torch.bfloat16, 37), (torch.float32, 4099),
                                      (torch.bfloat16, 4099)])
@pytest.mark.parametrize("clip_radius", [None, 0.2])
def test_logits_matches_float64(dtype, V, clip_radius, device):
    B, T = 4, 5
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 2
    logits = logits.to(dtype).double()  # the float64 run sees the same rounded logits
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    targets[~mask] = -100
    ref = with_garbage(-torch.rand(B, T, generator=gen, dtype=torch.float64) * 8, mask)
    rewards = torch.randn(B, generator=gen, dtype=torch.float64)
    check_three_way(rlfuse.ggpo_loss, reference.ggpo_loss, logits, dtype=dtype, device=device,
                    logits_targets=targets, temperature=0.8,
                    args=args_of(ref, rewards, mask, torch.float32),
                    args64=args_of(ref, rewards, mask, torch.float64),
                    group_size=2, beta=0.1, clip_radius=clip_radius)


def test_logits_inplace_backward(device):
    """Logits(inplace_backward=True): dlogits is written into the logits' own buffer, unchanged."""
    B, T, V = 4, 3, 20
    gen = torch.Generator().manual_seed(23)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    _, ref, rewards, mask = ggpo_case(B, T, seed=23)
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_(True)
        out = rlfuse.ggpo_loss(rlfuse.Logits(x, targets, 1.0, inplace), ref.to(device),
                               rewards.to(device), mask.to(device), group_size=2, beta=0.5)
        (g,) = torch.autograd.grad(out.loss, x)
        assert (g.data_ptr() == x.data_ptr()) == inplace
        grads.append(g)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_beta_range_large_rewards(beta, device):
    """R / beta up to ~1e4: the centred, max-subtracted form must not overflow."""
    lp, ref, rewards, mask = ggpo_case(8, 7, seed=11, reward_scale=100.0)
    fused, _ = check_three_way(rlfuse.ggpo_loss, reference.ggpo_loss, lp, dtype=torch.float32,
                               device=device, args=args_of(ref, rewards, mask, torch.float32),
                               args64=args_of(ref, rewards, mask, torch.float64),
                               group_size=4, beta=beta)
    assert torch.isfinite(fused[0]) and torch.isfinite(fused[2]).all()


def test_reward_shift_invariance(device):
    lp, ref, rewards, mask = ggpo_case(6, 9, seed=12)
    shift = torch.tensor([3.0, 3.0, 3.0, -40.0, -40.0, -40.0], dtype=torch.float64)
    kw = dict(dtype=torch.float64, device=device, group_size=3, beta=0.7)
    a = run_loss(rlfuse.ggpo_loss, lp, args=(ref, rewards, mask), **kw)
    b = run_loss(rlfuse.ggpo_loss, lp, args=(ref, rewards + shift, mask), **kw)
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a[2], b[2], rtol=1e-12, atol=1e-12)


def test_infinite_radius_equals_direct_gradient(device):
    lp, ref, rewards, mask = ggpo_case(6, 9, seed=13)
    kw = dict(dtype=torch.float32, device=device, group_size=3, beta=0.3,
              args=(ref.float(), rewards.float(), mask))
    direct = run_loss(rlfuse.ggpo_loss, lp, **kw)
    clipped = run_loss(rlfuse.ggpo_loss, lp, clip_radius=math.inf, **kw)
    torch.testing.assert_close(direct[2], clipped[2], rtol=1e-6, atol=1e-9)
    assert clipped[1]["clip_frac"] == 0


def test_coefficients_sum_to_zero_per_group(device):
    """dL/dlp_it = -c_i M_it / T_tok, and sum_i c_i = 0 in each group."""
    lp, ref, rewards, mask = ggpo_case(8, 6, seed=14)
    _, _, grad = run_loss(rlfuse.ggpo_loss, lp, dtype=torch.float64, device=device,
                          args=(ref, rewards, mask), group_size=4, beta=0.5)
    grad = grad[:, :-1].cpu()
    assert (grad[~mask] == 0).all()
    c = -grad[:, 0] * mask.sum()  # column 0 is an actor token in every row
    torch.testing.assert_close(grad, torch.where(mask, -c[:, None] / mask.sum(), 0.0))
    torch.testing.assert_close(c.view(2, 4).sum(-1), torch.zeros(2, dtype=torch.float64),
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize("clip_radius", [None, 0.25])
def test_upstream_gradient_scales_the_gradient(clip_radius, device):
    """The backward multiplies by the upstream gradient (here != 1), as the reference's does."""
    lp, ref, rewards, mask = ggpo_case(4, 6, seed=18)
    grads = []
    for fn, dev in ((rlfuse.ggpo_loss, device), (reference.ggpo_loss, "cpu")):
        x = lp[:, :-1].clone().to(dev).requires_grad_(True)
        out = fn(x, ref.to(dev), rewards.to(dev), mask.to(dev), group_size=2, beta=0.5,
                 clip_radius=clip_radius)
        (g,) = torch.autograd.grad(out.loss * -3.5, x)
        grads.append(g.cpu())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("clip_radius", [None, 0.25])
def test_global_num_tokens_micro_batches_add_up(clip_radius, device):
    lp, ref, rewards, mask = ggpo_case(8, 7, seed=15)
    kw = dict(dtype=torch.float64, device=device, group_size=2, beta=0.4,
              clip_radius=clip_radius, num_tokens=int(mask.sum()))
    full = run_loss(rlfuse.ggpo_loss, lp, args=(ref, rewards, mask), **kw)
    parts = [run_loss(rlfuse.ggpo_loss, lp[s], args=(ref[s], rewards[s], mask[s]), **kw)
             for s in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], full[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), full[2])
    local = run_loss(rlfuse.ggpo_loss, lp[:4], args=(ref[:4], rewards[:4], mask[:4]),
                     **{**kw, "num_tokens": None})
    scale = int(mask.sum()) / int(mask[:4].sum())
    torch.testing.assert_close(local[0], parts[0][0] * scale, rtol=1e-12, atol=1e-12)


def test_loss_is_nonnegative_and_zero_for_equal_adjusted_rewards(device):
    lp, ref, rewards, mask = ggpo_case(4, 5, seed=16)
    out = rlfuse.ggpo_loss(lp[:, :-1].to(device), ref.to(device), rewards.to(device),
                           mask.to(device), group_size=2, beta=1.0)
    assert out.loss >= 0 and out.metrics["gap"] >= 0
    # R_i = r_i - beta (s_i - s_ref_i) equal within each group: J = 0
    s = torch.where(mask, lp[:, :-1], 0.0).sum(-1) - torch.where(mask, ref, 0.0).sum(-1)
    equal = rlfuse.ggpo_loss(lp[:, :-1].to(device), ref.to(device), (s + 2.0).to(device),
                             mask.to(device), group_size=2, beta=1.0)
    assert abs(equal.loss.item()) < 1e-12


def test_runtime_hyperparameters_are_not_constexpr():
    """beta and clip_radius (and every shape) are runtime arguments: no recompilation."""
    from rlfuse.kernels import ggpo

    for kernel in (ggpo._ggpo_fwd_kernel, ggpo._ggpo_bwd_kernel):
        assert constexpr_params(kernel) <= {"BLOCK_M", "BLOCK_T", "HAS_CLIP", "ACC"}


BAD = [
    (dict(group_size=4), ValueError, "group_size"),          # B = 6 is not a multiple
    (dict(group_size=1), ValueError, "group_size"),
    (dict(group_size=2.0), TypeError, "group_size"),
    (dict(beta=0.0), ValueError, "beta"),
    (dict(beta=-1.0), ValueError, "beta"),
    (dict(clip_radius=0.0), ValueError, "clip_radius"),
    (dict(num_tokens=0), ValueError, "num_tokens"),
    (dict(ref=torch.zeros(6, 4)), ValueError, "ref_logprobs"),
    (dict(rewards=torch.zeros(5)), ValueError, "rewards"),
    (dict(rewards=torch.zeros(6, dtype=torch.long)), TypeError, "rewards"),
    (dict(mask=torch.ones(6, 4, dtype=torch.bool)), ValueError, "mask"),
    (dict(policy=torch.zeros(6, 5, 2)), ValueError, "policy"),
    (dict(policy="lp"), TypeError, "policy"),
    (dict(empty_group=True), ValueError, "mask"),             # a group with no actor token
    (dict(nan_ref=True), ValueError, "ref_logprobs"),         # NaN at an actor position
]


@pytest.mark.parametrize("bad, exc, match", BAD)
@pytest.mark.parametrize("fn", [rlfuse.ggpo_loss, reference.ggpo_loss])
def test_bad_input(fn, bad, exc, match):
    a = dict(policy=torch.zeros(6, 5), ref=torch.zeros(6, 5), rewards=torch.zeros(6),
             mask=torch.ones(6, 5, dtype=torch.bool), group_size=3, beta=1.0, clip_radius=None,
             num_tokens=None)
    bad = dict(bad)
    if bad.pop("empty_group", False):
        a["mask"][3:] = False
    if bad.pop("nan_ref", False):
        a["ref"][1, 2] = float("nan")
    a.update(bad)
    with pytest.raises(exc, match=match):
        fn(a.pop("policy"), a.pop("ref"), a.pop("rewards"), a.pop("mask"), **a)


def test_module_wrapper(device):
    lp, ref, rewards, mask = ggpo_case(4, 5, seed=17)
    module = rlfuse.GGPOLoss(group_size=2, beta=0.5, clip_radius=0.3)
    args = (lp[:, :-1].float().to(device), ref.float().to(device), rewards.float().to(device),
            mask.to(device))
    a, b = module(*args), rlfuse.ggpo_loss(*args, group_size=2, beta=0.5, clip_radius=0.3)
    assert torch.equal(a.loss, b.loss)
