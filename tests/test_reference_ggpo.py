"""Tests of the reference GGPO loss (stable Gibbs gap)."""
import math

import pytest
import torch

from rlfuse.reference import Logits, ggpo_loss


def _batch(G=3, m=4, T=6, seed=0, dtype=torch.float64, reward_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    B = G * m
    lp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    rewards = reward_scale * torch.randn(B, generator=g, dtype=torch.float64)
    ref = torch.where(mask, ref, torch.full_like(ref, float("nan")))    # garbage off the mask
    return lp.to(dtype), ref.to(dtype), rewards.to(dtype), mask


def _naive(lp, ref, rewards, mask, m, beta):
    """J_g, q, c from the SPEC's un-centred definitions, with Python floats (moderate inputs)."""
    B = len(rewards)
    s = [sum(float(lp[i, t]) for t in range(lp.shape[1]) if mask[i, t]) for i in range(B)]
    s_ref = [sum(float(ref[i, t]) for t in range(lp.shape[1]) if mask[i, t]) for i in range(B)]
    R = [float(rewards[i]) - beta * (s[i] - s_ref[i]) for i in range(B)]
    J, q = [], []
    for g in range(B // m):
        Rg = R[g * m:(g + 1) * m]
        top = max(Rg)                        # only to keep exp in range; the formula is unchanged
        lme = top + beta * math.log(sum(math.exp((x - top) / beta) for x in Rg) / m)
        J.append(lme - sum(Rg) / m)
        z = sum(math.exp((x - top) / beta) for x in Rg)
        q += [math.exp((x - top) / beta) / z for x in Rg]
    c = [(m * qi - 1) / math.sqrt(m - 1) for qi in q]
    return J, q, c, s, s_ref


@pytest.mark.parametrize("m,beta", [(2, 0.5), (4, 0.1), (4, 2.0), (8, 1.0)])
def test_loss_and_gradient_match_definition(m, beta):
    lp, ref, rewards, mask = _batch(G=3, m=m, seed=m)
    lp.requires_grad_(True)
    out = ggpo_loss(lp, ref, rewards, mask, group_size=m, beta=beta)
    out.loss.backward()
    J, q, c, s, s_ref = _naive(lp.detach(), ref, rewards, mask, m, beta)
    t_tok = int(mask.sum())
    want = m * sum(J) / (beta * math.sqrt(m - 1) * t_tok)
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    want_grad = -torch.tensor(c, dtype=torch.float64)[:, None] * mask / t_tok
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-10, atol=1e-14)
    # metrics
    assert out.metrics["gap"].item() == pytest.approx(sum(J) / len(J) / beta, rel=1e-12)
    assert out.metrics["q_max"].item() == pytest.approx(max(q), rel=1e-12)
    assert out.metrics["clip_frac"].item() == 0.0
    assert out.metrics["seq_logratio_mean"].item() == pytest.approx(
        sum(a - b for a, b in zip(s, s_ref)) / len(s), rel=1e-12)


def test_coefficients_from_gradient_sum_to_zero_per_group():
    m = 4
    lp, ref, rewards, mask = _batch(G=4, m=m, seed=11, reward_scale=3.0)
    lp.requires_grad_(True)
    ggpo_loss(lp, ref, rewards, mask, group_size=m, beta=0.3).loss.backward()
    t_tok = mask.sum()
    coeff = -lp.grad * t_tok                              # dL/dlp_it = -c_i M_it / T_tok
    assert bool((lp.grad[~mask] == 0).all())
    c = torch.stack([coeff[i][mask[i]][0] for i in range(len(rewards))])
    for i in range(len(rewards)):                         # one coefficient per sequence
        torch.testing.assert_close(coeff[i][mask[i]], c[i].expand(int(mask[i].sum())))
    assert c.abs().max() > 0.1                            # the groups do carry signal
    torch.testing.assert_close(c.view(-1, m).sum(-1), torch.zeros(4, dtype=torch.float64),
                               rtol=0, atol=1e-12)


def test_gap_nonnegative_and_zero_iff_adjusted_rewards_equal():
    m, beta = 4, 0.7
    for seed in range(5):
        lp, ref, rewards, mask = _batch(G=3, m=m, seed=seed)
        out = ggpo_loss(lp, ref, rewards, mask, group_size=m, beta=beta)
        assert out.loss.item() > 0 and out.metrics["gap"].item() > 0
    # rewards that make every R_i = r_i - beta (s_i - s_i^ref) equal inside each group
    s = torch.where(mask, lp, torch.zeros_like(lp)).sum(-1)
    s_ref = torch.where(mask, ref, torch.zeros_like(ref)).sum(-1)
    level = torch.tensor([1.0, -2.0, 5.0], dtype=torch.float64).repeat_interleave(m)
    equal = level + beta * (s - s_ref)
    out = ggpo_loss(lp, ref, equal, mask, group_size=m, beta=beta)
    assert abs(out.loss.item()) < 1e-14 and abs(out.metrics["gap"].item()) < 1e-14
    assert out.metrics["q_max"].item() == pytest.approx(1 / m, rel=1e-12)


def test_reward_shift_invariance_per_group():
    m = 3
    lp, ref, rewards, mask = _batch(G=4, m=m, seed=3)
    shift = torch.tensor([10.0, -7.5, 0.0, 123.0], dtype=torch.float64).repeat_interleave(m)
    results = []
    for r in (rewards, rewards + shift):
        x = lp.clone().requires_grad_(True)
        out = ggpo_loss(x, ref, r, mask, group_size=m, beta=0.4)
        out.loss.backward()
        results.append((out.loss.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    # a shift of one member alone is not a symmetry (the test can see a difference)
    x = lp.clone().requires_grad_(True)
    bumped = rewards.clone()
    bumped[0] += 1.0
    assert abs(ggpo_loss(x, ref, bumped, mask, group_size=m, beta=0.4).loss.item()
               - results[0][0].item()) > 1e-3


def _grad(lp, *args, **kwargs):
    x = lp.clone().requires_grad_(True)
    out = ggpo_loss(x, *args, **kwargs)
    out.loss.backward()
    return out, x.grad


def test_clip_radius_inf_has_the_direct_gradient():
    lp, ref, rewards, mask = _batch(G=3, m=4, seed=4)
    _, direct = _grad(lp, ref, rewards, mask, group_size=4, beta=0.25)
    out, clipped = _grad(lp, ref, rewards, mask, group_size=4, beta=0.25, clip_radius=math.inf)
    torch.testing.assert_close(clipped, direct, rtol=1e-12, atol=1e-15)
    assert out.metrics["clip_frac"].item() == 0.0


def test_clipped_branch_uses_clamped_coefficients():
    m, beta, rho = 4, 0.5, 0.2
    lp, ref, rewards, mask = _batch(G=3, m=m, seed=5)
    out, grad = _grad(lp, ref, rewards, mask, group_size=m, beta=beta, clip_radius=rho)
    d = torch.where(mask, (lp - ref).clamp(-rho, rho), torch.zeros_like(lp))
    logits = (rewards - beta * d.sum(-1)).view(-1, m) / beta
    q = torch.softmax(logits, -1).view(-1)
    c = (m * q - 1) / math.sqrt(m - 1)
    t_tok = mask.sum()
    torch.testing.assert_close(grad, -c[:, None] * mask / t_tok, rtol=1e-12, atol=1e-15)
    s = torch.where(mask, lp, torch.zeros_like(lp)).sum(-1)
    assert out.loss.item() == pytest.approx((-(c * s).sum() / t_tok).item(), rel=1e-12)
    saturated = ((lp - ref).abs() > rho) & mask
    want_frac = saturated.sum() / t_tok
    assert out.metrics["clip_frac"].item() == pytest.approx(want_frac.item())
    # saturated tokens keep a gradient (no differentiation through the clamp)
    assert 0 < want_frac < 1 and bool((grad[saturated] != 0).all())
    # and the clamp matters: the direct branch differs
    _, direct = _grad(lp, ref, rewards, mask, group_size=m, beta=beta)
    assert (direct - grad).abs().max() > 1e-3


def test_gradcheck_logprobs():
    lp, ref, rewards, mask = _batch(G=2, m=3, T=4, seed=6)
    lp = torch.where(mask, lp, torch.full_like(lp, 1e4)).requires_grad_(True)  # garbage off mask
    assert torch.autograd.gradcheck(
        lambda x: ggpo_loss(x, ref, rewards, mask, group_size=3, beta=0.3).loss, (lp,))


def test_gradcheck_clipped_branch_when_every_token_saturates():
    # With every |lp - ref| > rho the clamped d is locally constant, so the surrogate is an exact
    # function of lp whose derivative is -c~ M / T_tok: gradcheck applies.
    lp, ref, rewards, mask = _batch(G=2, m=3, T=4, seed=7)
    sign = torch.where(torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) > 0.5,
                       1.0, -1.0).to(torch.float64)
    lp = (ref.nan_to_num(0.0) + sign * 0.5).requires_grad_(True)
    f = lambda x: ggpo_loss(x, ref, rewards, mask, group_size=3, beta=0.3, clip_radius=0.1).loss
    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_logits():
    g = torch.Generator().manual_seed(8)
    B, T, V = 4, 3, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    targets[~mask] = 10 ** 6                                  # out of range off the mask is fine
    ref = torch.randn(B, T, generator=g, dtype=torch.float64) - 2
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    f = lambda x: ggpo_loss(Logits(x, targets, 1.3), ref, rewards, mask,
                            group_size=2, beta=0.5).loss
    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_small_and_large_beta_with_large_rewards_stay_finite(beta):
    # rewards of size 1e3 make R/beta ~ 1e5: exp would overflow even fp64 without centring.
    m = 4
    lp, ref, rewards, mask = _batch(G=3, m=m, seed=9, reward_scale=1000.0)
    lp32, ref32, rewards32 = lp.float(), ref.float(), rewards.float()
    out, grad = _grad(lp32, ref32, rewards32, mask, group_size=m, beta=beta)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert bool(torch.isfinite(grad).all())
    J, q, c, _, _ = _naive(lp32.double(), ref32.double(), rewards32.double(), mask, m, beta)
    t_tok = int(mask.sum())
    want = m * sum(J) / (beta * math.sqrt(m - 1) * t_tok)
    torch.testing.assert_close(out.loss, torch.tensor(want, dtype=torch.float32))
    want_grad = -torch.tensor(c)[:, None] * mask / t_tok
    torch.testing.assert_close(grad, want_grad.float())


def test_num_tokens_global_micro_batches_add_up():
    m = 3
    lp, ref, rewards, mask = _batch(G=4, m=m, seed=10)
    full, full_grad = _grad(lp, ref, rewards, mask, group_size=m, beta=0.6)
    t_tok = mask.sum()
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 9), slice(9, 12)):          # whole groups
        out, grad = _grad(lp[rows], ref[rows], rewards[rows], mask[rows], group_size=m,
                          beta=0.6, num_tokens=t_tok)
        total += out.loss.item()
        grads.append(grad)
    assert total == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-15)
    # without the global count the micro-batch losses do not add up
    local = sum(ggpo_loss(lp[r], ref[r], rewards[r], mask[r], group_size=m, beta=0.6).loss.item()
                for r in (slice(0, 3), slice(3, 9), slice(9, 12)))
    assert abs(local - full.loss.item()) > 1e-3


@pytest.mark.parametrize("clip_radius", [None, 0.3])
def test_masked_garbage_does_not_leak(clip_radius):
    lp, ref, rewards, mask = _batch(G=2, m=4, seed=12)
    dirty_ref = torch.where(mask, ref, torch.full_like(ref, -math.inf))
    dirty_ref[0, ~mask[0]] = math.nan
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, math.nan))
    clean_ref = torch.where(mask, ref, torch.zeros_like(ref))
    a, grad_a = _grad(dirty_lp, dirty_ref, rewards, mask, group_size=4, beta=0.5,
                      clip_radius=clip_radius)
    b, grad_b = _grad(lp, clean_ref, rewards, mask, group_size=4, beta=0.5,
                      clip_radius=clip_radius)
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert torch.equal(grad_a, grad_b) and bool((grad_a[~mask] == 0).all())
    for k in a.metrics:
        assert a.metrics[k].item() == b.metrics[k].item(), k


def test_empty_batch():
    lp = torch.zeros(0, 5, requires_grad=True)
    out = ggpo_loss(lp, torch.zeros(0, 5), torch.zeros(0), torch.zeros(0, 5, dtype=torch.bool),
                    group_size=2, beta=1.0)
    out.loss.backward()
    assert out.loss.item() == 0 and lp.grad.shape == (0, 5)
    assert all(v.item() == 0 for v in out.metrics.values())


def test_dtypes_of_outputs():
    lp, ref, rewards, mask = _batch(seed=13)
    for dtype, want in [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)]:
        out, grad = _grad(lp.to(dtype), ref.to(dtype), rewards.to(dtype), mask,
                          group_size=4, beta=0.5)
        assert out.loss.dtype == want and out.loss.dim() == 0 and grad.dtype == dtype
        assert all(v.dtype == want and v.dim() == 0 for v in out.metrics.values())


def _bad_ggpo_cases():
    lp, ref, rewards, mask = _batch(G=2, m=3, T=4, seed=14)
    empty_group = mask.clone()
    empty_group[3:6] = False
    nan_ref = ref.clone()
    nan_ref[mask] = math.nan
    base = dict(group_size=3, beta=0.5)
    args = (lp, ref, rewards, mask)
    yield "B%m", ValueError, "group_size.*multiple", args, dict(base, group_size=4)
    yield "m<2", ValueError, "group_size.*>= 2", (lp[:5], ref[:5], rewards[:5], mask[:5]), \
        dict(base, group_size=1)
    yield "m-type", TypeError, "group_size", (lp, ref, rewards, mask), dict(base, group_size=3.0)
    yield "beta0", ValueError, "beta", (lp, ref, rewards, mask), dict(base, beta=0.0)
    yield "beta-", ValueError, "beta", (lp, ref, rewards, mask), dict(base, beta=-1.0)
    yield "beta-inf", ValueError, "beta", (lp, ref, rewards, mask), dict(base, beta=math.inf)
    yield "clip0", ValueError, "clip_radius", (lp, ref, rewards, mask), dict(base, clip_radius=0.0)
    yield "clip-", ValueError, "clip_radius", (lp, ref, rewards, mask), dict(base, clip_radius=-1)
    yield "ref-shape", ValueError, "ref_logprobs", (lp, ref[:, :3], rewards, mask), base
    yield "ref-device", ValueError, "ref_logprobs", (lp, ref.to("meta"), rewards, mask), base
    yield "ref-int", TypeError, "ref_logprobs", (lp, ref.long(), rewards, mask), base
    yield "ref-nan", ValueError, "ref_logprobs", (lp, nan_ref, rewards, mask), base
    yield "rewards-shape", ValueError, "rewards", (lp, ref, rewards[:5], mask), base
    yield "rewards-device", ValueError, "rewards", (lp, ref, rewards.to("meta"), mask), base
    yield "rewards-int", TypeError, "rewards", (lp, ref, rewards.long(), mask), base
    yield "rewards-nan", ValueError, "rewards", (lp, ref, rewards * math.nan, mask), base
    yield "mask-shape", ValueError, "mask", (lp, ref, rewards, mask[:, :3]), base
    yield "mask-device", ValueError, "mask", (lp, ref, rewards, mask.to("meta")), base
    yield "mask-values", ValueError, "mask", (lp, ref, rewards, mask.long() - 1), base
    yield "empty-group", ValueError, "mask.*group 1", (lp, ref, rewards, empty_group), base
    yield "num_tokens0", ValueError, "num_tokens", args, dict(base, num_tokens=0)
    yield "num_tokens-", ValueError, "num_tokens", args, dict(base, num_tokens=-3)
    yield "policy-shape", ValueError, "policy", (lp[0], ref, rewards, mask), base
    yield "policy-type", TypeError, "policy", (None, ref, rewards, mask), base
    yield "logits-shape", ValueError, "policy.logits", \
        (Logits(lp, torch.zeros(6, dtype=torch.long)), ref, rewards, mask), base


@pytest.mark.parametrize("name,exc,match,args,kwargs", list(_bad_ggpo_cases()),
                         ids=[c[0] for c in _bad_ggpo_cases()])
def test_bad_input(name, exc, match, args, kwargs):
    with pytest.raises(exc, match=match):
        ggpo_loss(*args, **kwargs)
