"""Tests of the reference GPPO loss, its trust-region bounds and GRPO group advantages."""
import math
import statistics

import pytest
import torch

from rlfuse.reference import Logits, gppo_bounds, gppo_loss, group_advantages

GEOMETRIES = ["tv", "chi2", "hellinger", "kl", "two_sided_log"]
TOPOLOGIES = ["mc", "atomic", "binary"]
CELLS = [(g, t) for g in GEOMETRIES for t in TOPOLOGIES]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


# --------------------------------------------------------------------------------------------
# An independent trust region: bisection of D(r) = delta written from the SPEC's integrands
# --------------------------------------------------------------------------------------------

def _integrand(geometry, r, log_r):
    # f(r); kl and two_sided_log take log r directly so that r = 0 / r = inf stay exact.
    return {"tv": lambda: 0.5 * (r - 1).abs(),
            "chi2": lambda: (r - 1) ** 2,
            "hellinger": lambda: (r.sqrt() - 1) ** 2,
            "kl": lambda: -log_r,
            "two_sided_log": lambda: log_r.abs()}[geometry]()


def _divergence(geometry, topology, mu, t):
    """D(r) at r = exp(t), from the SPEC: mc f(r), atomic mu f(r), binary
    mu f(r) + (1 - mu) f((1 - mu r)/(1 - mu))."""
    r = t.exp()
    own = _integrand(geometry, r, t)
    if topology == "mc":
        return own
    if topology == "atomic":
        return mu * own
    pi = (mu * r).clamp(max=1.0)                        # the domain ends at pi = 1 (r = 1/mu)
    log_q = torch.log1p(-pi) - torch.log1p(-mu)         # log((1 - mu r)/(1 - mu))
    return mu * own + (1 - mu) * _integrand(geometry, log_q.exp(), log_q)


T_FAR = 1e7  # |log r| bracket: beyond every root for mu >= 1e-6, delta <= 2 (largest: delta/mu)


def _bisect_bounds(geometry, topology, mu, delta, steps=200):
    """[lo, hi] of {r : D(r) <= delta} by bisection in t = log r on [-T_FAR, 0] and
    [0, t_max] (t_max = -log mu for binary, the domain edge). Returns (lo, hi, t_lo, t_hi)."""
    def solve(inside, outside):
        for _ in range(steps):
            mid = 0.5 * (inside + outside)
            out = _divergence(geometry, topology, mu, mid) > delta
            inside, outside = torch.where(out, inside, mid), torch.where(out, mid, outside)
        return inside

    t_max = -mu.log() if topology == "binary" else torch.full_like(mu, T_FAR)
    t_lo = solve(torch.zeros_like(mu), torch.full_like(mu, -T_FAR))
    t_hi = solve(torch.zeros_like(mu), t_max)
    return t_lo.exp(), t_hi.exp(), t_lo, t_hi


def _mu_grid():
    """mu across the whole clamp range, both ends included and crossed."""
    g = torch.Generator().manual_seed(0)
    log_uniform = torch.exp(torch.empty(48, dtype=torch.float64).uniform_(
        math.log(1e-6), 0.0, generator=g))
    near_one = 1 - torch.exp(torch.empty(12, dtype=torch.float64).uniform_(
        math.log(1e-6), math.log(1e-2), generator=g))
    edges = torch.tensor([1e-9, 1e-6, 1.5e-6, 1e-5, 0.1, 0.5, 1 - 1e-6, 1 - 1e-9, 1 - 2e-6],
                         dtype=torch.float64)
    mu = torch.cat([log_uniform, near_one, edges]).clamp(max=1 - 1e-12)
    return mu


DELTAS = [1e-4, 3e-3, 0.04, 0.3, 1.0, 2.0]


@pytest.mark.parametrize("geometry,topology", CELLS)
def test_bounds_match_bisection(geometry, topology):
    mu_raw = _mu_grid()
    mu = mu_raw.clamp(1e-6, 1 - 1e-6)                  # the SPEC's clamp
    for delta in DELTAS:
        lo, hi = gppo_bounds(mu_raw.log(), geometry=geometry, topology=topology, delta=delta)
        want_lo, want_hi, t_lo, t_hi = _bisect_bounds(geometry, topology, mu, delta)
        # Where the region reaches r = 0 (D(0) <= delta), the bound is exactly 0; where it is
        # unbounded (or beyond fp64), exactly +inf.
        reaches_zero = t_lo == -T_FAR
        assert torch.equal(lo[reaches_zero], torch.zeros_like(lo[reaches_zero])), delta
        assert torch.equal(torch.isinf(hi), torch.isinf(want_hi)), delta
        finite = ~torch.isinf(want_hi)
        # rtol 1e-6 is the contract; atol 1e-12 covers the cancellation in 1 - x near a zero lower
        # bound (e.g. 1 - sqrt(delta/mu) with delta/mu ~ 1), ~1e-16 in fp64 on both sides.
        torch.testing.assert_close(lo, want_lo, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(hi[finite], want_hi[finite], rtol=1e-6, atol=0.0)
        if geometry in ("kl", "two_sided_log"):
            # exponential-type bounds may be far below 1e-12: compare them relatively in log space
            tiny = (want_lo > 1e-300) & (lo > 0)
            torch.testing.assert_close(lo[tiny].log(), t_lo[tiny], rtol=0.0, atol=1e-6)


def test_bisection_oracle_sees_the_domain_edge():
    # Sanity of the oracle itself: chi2/binary at mu = 0.5, delta = 2 has its quadratic root at
    # 1 + sqrt(2) > 1/mu = 2; the region stops at the domain edge r = 1/mu.
    mu = torch.tensor([0.5], dtype=torch.float64)
    _, hi, _, _ = _bisect_bounds("chi2", "binary", mu, 2.0)
    torch.testing.assert_close(hi, torch.tensor([2.0], dtype=torch.float64))


def test_check_value_chi2_atomic():
    old = torch.tensor([math.log(0.1)], dtype=torch.float64)
    lo, hi = gppo_bounds(old, geometry="chi2", topology="atomic", delta=0.04)
    assert abs(lo.item() - 0.3675445) < 5e-8
    assert abs(hi.item() - 1.6324555) < 5e-8


@pytest.mark.parametrize("geometry,topology", CELLS)
def test_region_widens_with_delta(geometry, topology):
    old = _mu_grid().log()
    deltas = [1e-4, 1e-3, 1e-2, 0.04, 0.1, 0.5, 1.0, 2.0]
    bounds = [gppo_bounds(old, geometry=geometry, topology=topology, delta=d) for d in deltas]
    for (lo_a, hi_a), (lo_b, hi_b) in zip(bounds, bounds[1:]):
        assert bool((lo_b <= lo_a).all()) and bool((hi_b >= hi_a).all())
    lo_first, hi_first = bounds[0]
    lo_last, hi_last = bounds[-1]
    assert bool((lo_last < lo_first).any())
    if geometry == "kl" and topology != "binary":
        assert bool(torch.isinf(hi_first).all())            # kl: no upper bound off binary
    else:
        assert bool((hi_last > hi_first).any())
    assert bool((lo_first < 1).all()) and bool((hi_first > 1).all())


def test_bounds_dtype():
    old = torch.full((2, 3), math.log(0.3))
    for dtype, want in [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                        (torch.float64, torch.float64)]:
        lo, hi = gppo_bounds(old.to(dtype), geometry="kl", topology="binary", delta=0.1)
        assert lo.dtype == want and hi.dtype == want and lo.shape == (2, 3)


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------

def _batch(B=6, T=7, seed=0, dtype=torch.float64, scale=0.4, adv_2d=False):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    lp = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    shape = (B, T) if adv_2d else (B,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    old = torch.where(mask, old, torch.full_like(old, float("nan")))  # garbage off the mask
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask


def _loop_loss(lp, old, adv, mask, geometry, topology, delta, agg,
               num_tokens=None, num_sequences=None):
    """-agg(min(r A, clip(r, l, u) A)) with Python floats, and d loss / d lp, from the SPEC and
    verl's agg_loss."""
    lo, hi = gppo_bounds(old, geometry=geometry, topology=topology, delta=delta)
    B, T = mask.shape
    J = [[0.0] * T for _ in range(B)]
    dJ = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            a = float(adv[i] if adv.dim() == 1 else adv[i, t])
            r = math.exp(float(lp[i, t]) - float(old[i, t]))
            l, u = float(lo[i, t]), float(hi[i, t])
            clipped = min(max(r, l), u)
            J[i][t] = min(r * a, clipped * a)
            dJ[i][t] = r * a if r * a <= clipped * a else 0.0
    lengths = [int(mask[i].sum()) for i in range(B)]
    n_tok = num_tokens if num_tokens is not None else sum(lengths)
    n_seq = num_sequences if num_sequences is not None else B
    weight = [[0.0] * T for _ in range(B)]          # d agg / d J_it
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                weight[i][t] = {"token-mean": 1 / n_tok,
                                "seq-mean-token-mean": 1 / (lengths[i] * n_seq),
                                "seq-mean-token-sum": 1 / n_seq,
                                "seq-mean-token-sum-norm": 1 / (T * n_seq)}[agg]
    loss = -sum(weight[i][t] * J[i][t] for i in range(B) for t in range(T))
    grad = torch.tensor([[-weight[i][t] * dJ[i][t] for t in range(T)] for i in range(B)],
                        dtype=torch.float64)
    return loss, grad


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("counts", [None, (40.0, 9.0)])
def test_aggregation_against_loop(agg, counts):
    lp, old, adv, mask = _batch(seed=1)
    lp.requires_grad_(True)
    num_tokens, num_sequences = counts if counts else (None, None)
    out = gppo_loss(lp, old, adv, mask, agg=agg, num_tokens=num_tokens,
                    num_sequences=num_sequences)
    want, want_grad = _loop_loss(lp.detach(), old, adv, mask, "chi2", "atomic", 0.04, agg,
                                 num_tokens, num_sequences)
    out.loss.backward()
    assert abs(out.loss.item() - want) <= 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("geometry,topology", CELLS)
def test_every_cell_against_loop(geometry, topology):
    lp, old, adv, mask = _batch(seed=2, scale=0.8, adv_2d=True)
    lp.requires_grad_(True)
    out = gppo_loss(lp, old, adv, mask, geometry=geometry, topology=topology, delta=0.1)
    want, want_grad = _loop_loss(lp.detach(), old, adv, mask, geometry, topology, 0.1,
                                 "token-mean")
    out.loss.backward()
    assert abs(out.loss.item() - want) <= 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-12, atol=1e-15)


def test_loop_sees_clipping():
    # The data above does exercise both clipped branches and the unclipped one.
    lp, old, adv, mask = _batch(seed=2, scale=0.8, adv_2d=True)
    m = gppo_loss(lp, old, adv, mask, geometry="chi2", topology="atomic", delta=0.1).metrics
    assert 0 < m["clip_frac_low"] and 0 < m["clip_frac_high"]
    assert m["clip_frac_low"] + m["clip_frac_high"] < 1


def test_branch_decision_at_the_bounds():
    # log-ratios 1e-9 inside / outside log l and log u (l, u from gppo_bounds): the clipped
    # branch (zero gradient) is taken exactly outside.
    old = torch.full((4, 2), math.log(0.1), dtype=torch.float64)
    lo, hi = gppo_bounds(old, geometry="chi2", topology="atomic", delta=0.04)
    step = torch.tensor([-1e-9, 1e-9], dtype=torch.float64)
    log_ratio = torch.stack([lo[0].log() + step, hi[0].log() + step,
                             lo[0].log() + step, hi[0].log() + step])
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    lp = (old + log_ratio).requires_grad_(True)
    out = gppo_loss(lp, old, adv, torch.ones(4, 2, dtype=torch.bool))
    out.loss.backward()
    # row 0: A < 0 below l is clipped; row 1: A > 0 above u is clipped; rows 2-3 never clip
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] != 0
    assert lp.grad[1, 0] != 0 and lp.grad[1, 1] == 0
    assert bool((lp.grad[2:] != 0).all())
    assert out.metrics["clip_frac_low"].item() == 1 / 8
    assert out.metrics["clip_frac_high"].item() == 1 / 8


def test_empty_batch_and_all_masked():
    for B, T in [(0, 5), (3, 4)]:
        lp = torch.zeros(B, T, requires_grad=True)
        for agg in AGGS:
            mask = torch.zeros(B, T, dtype=torch.bool)
            out = gppo_loss(lp, torch.zeros(B, T), torch.zeros(B), mask, agg=agg,
                            validate=agg != "seq-mean-token-mean")
            out.loss.backward()
            assert out.loss.item() == 0 and bool((lp.grad == 0).all())
            assert all(v.item() == 0 for v in out.metrics.values())


def test_metrics():
    lp, old, adv, mask = _batch(seed=3, scale=0.8)
    m = gppo_loss(lp, old, adv, mask, geometry="tv", topology="binary", delta=0.05).metrics
    lo, hi = gppo_bounds(old, geometry="tv", topology="binary", delta=0.05)
    a = adv[:, None].expand_as(lp)
    r = torch.exp(lp - old)
    n = mask.sum()
    assert m["clip_frac_low"].item() == pytest.approx(((a < 0) & (r < lo) & mask).sum() / n)
    assert m["clip_frac_high"].item() == pytest.approx(((a > 0) & (r > hi) & mask).sum() / n)
    assert m["ratio_mean"].item() == pytest.approx(r[mask].mean().item(), rel=1e-12)
    assert m["approx_kl"].item() == pytest.approx((old - lp)[mask].mean().item(), rel=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_advantages_per_sequence_equal_broadcast():
    lp, old, adv, mask = _batch(seed=4)
    one = gppo_loss(lp, old, adv, mask)
    two = gppo_loss(lp, old, adv[:, None].expand_as(lp).contiguous(), mask)
    assert one.loss.item() == two.loss.item()


@pytest.mark.parametrize("geometry,topology", [("chi2", "atomic"), ("kl", "binary"),
                                               ("hellinger", "mc"), ("two_sided_log", "binary")])
def test_gradcheck_logprobs(geometry, topology):
    lp, old, adv, mask = _batch(B=4, T=5, seed=5, scale=0.6, adv_2d=True)
    lp.requires_grad_(True)

    def f(x):
        return gppo_loss(x, old, adv, mask, geometry=geometry, topology=topology,
                         delta=0.1, agg="seq-mean-token-mean").loss

    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_logits():
    g = torch.Generator().manual_seed(6)
    B, T, V = 4, 3, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    targets[~mask] = -100                                   # out of range off the mask is fine
    old = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    old = old.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    adv = torch.randn(B, generator=g, dtype=torch.float64)

    def f(x):
        return gppo_loss(Logits(x, targets, temperature=0.7), old, adv, mask,
                         geometry="kl", topology="atomic", delta=0.2).loss

    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_log_ratios_finite(dtype):
    # +-30: every branch is finite in fp32 (e^30 ~ 1e13). +-1000: the clipped branch only.
    old = torch.full((4, 2), math.log(0.2))
    shift = torch.tensor([[30.0, -30.0], [30.0, -30.0], [1000.0, -1000.0], [-1000.0, 1000.0]])
    adv = torch.tensor([1.0, -1.0, 1.0, 0.0])
    # row 2: A > 0, +1000 -> clipped high; -1000 -> r A = 0. row 3: A = 0 -> J = 0.
    lp = (old + shift).to(dtype).requires_grad_(True)
    mask = torch.ones(4, 2, dtype=torch.bool)
    for geometry, topology in [("chi2", "atomic"), ("two_sided_log", "mc"), ("tv", "binary")]:
        lp.grad = None
        out = gppo_loss(lp, old.to(dtype), adv.to(dtype), mask, geometry=geometry,
                        topology=topology, delta=0.04)
        out.loss.backward()
        assert out.loss.dtype == torch.float32 and lp.grad.dtype == dtype
        assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all())
        assert lp.grad[2, 0] == 0 and lp.grad[3].abs().sum() == 0


def test_unrepresentable_unclipped_ratio_raises():
    # A < 0 with log-ratio +200: the unclipped branch r A is selected and overflows fp32.
    old = torch.full((1, 2), math.log(0.2))
    lp = old + torch.tensor([[200.0, 0.0]])
    with pytest.raises(ValueError, match="policy.*overflow"):
        gppo_loss(lp, old, torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool))
    # kl has no upper bound, so a positive advantage is unclipped as well
    with pytest.raises(ValueError, match="policy.*overflow"):
        gppo_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                  geometry="kl")


def test_masked_garbage_does_not_leak():
    lp, old, adv, mask = _batch(seed=7, adv_2d=True)
    lp.requires_grad_(True)
    clean_old = torch.where(mask, old, torch.zeros_like(old))
    clean_adv = torch.where(mask, adv, torch.zeros_like(adv))
    dirty_adv = torch.where(mask, adv, torch.full_like(adv, float("-inf")))
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, 1e30))
    a = gppo_loss(dirty_lp, old, dirty_adv, mask, agg="seq-mean-token-mean")
    a.loss.backward()
    grad_dirty = lp.grad.clone()
    lp.grad = None
    b = gppo_loss(lp, clean_old, clean_adv, mask, agg="seq-mean-token-mean")
    b.loss.backward()
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert torch.equal(grad_dirty, lp.grad) and bool((lp.grad[~mask] == 0).all())
    for k in a.metrics:
        assert a.metrics[k].item() == b.metrics[k].item(), k


@pytest.mark.parametrize("agg", AGGS)
def test_global_counts_add_up_over_micro_batches(agg):
    lp, old, adv, mask = _batch(B=8, seed=8)
    full = gppo_loss(lp, old, adv, mask, agg=agg).loss
    n_tok, n_seq = float(mask.sum()), 8.0
    parts = sum(gppo_loss(lp[s], old[s], adv[s], mask[s], agg=agg, num_tokens=n_tok,
                          num_sequences=n_seq).loss for s in (slice(0, 3), slice(3, 8)))
    torch.testing.assert_close(parts, full, rtol=1e-13, atol=0.0)


def test_dtypes_of_outputs():
    lp, old, adv, mask = _batch(seed=9)
    for dtype, want in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float16, torch.float32), (torch.float64, torch.float64)]:
        x = lp.to(dtype).requires_grad_(True)
        out = gppo_loss(x, old.to(dtype), adv.to(dtype), mask)
        out.loss.backward()
        assert out.loss.dtype == want and out.loss.dim() == 0 and x.grad.dtype == dtype
        assert all(v.dtype == want for v in out.metrics.values())


# --------------------------------------------------------------------------------------------
# group_advantages
# --------------------------------------------------------------------------------------------

def _loop_group_advantages(rewards, m, eps, normalize_std):
    out = []
    for g in range(len(rewards) // m):
        group = rewards[g * m:(g + 1) * m]
        mean, std = (0.0, 1.0) if m == 1 else (statistics.fmean(group), statistics.stdev(group))
        out += [(r - mean) / (std + eps) if normalize_std else r - mean for r in group]
    return out


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_advantages_against_loop(m, normalize_std):
    g = torch.Generator().manual_seed(m)
    rewards = torch.randn(16, generator=g, dtype=torch.float64)
    rewards[:m] = 1.0                                           # one group of equal rewards
    got = group_advantages(rewards, group_size=m, eps=1e-4, normalize_std=normalize_std)
    want = _loop_group_advantages(rewards.tolist(), m, 1e-4, normalize_std)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-14)


def test_group_advantages_binary_rewards_fp32():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    got = group_advantages(rewards, group_size=4)
    assert got.dtype == torch.float32
    want = _loop_group_advantages(rewards.tolist(), 4, 1e-6, True)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _bad_gppo_cases():
    lp, old, adv, mask = _batch(B=4, T=5, seed=10)
    nan_adv = adv.clone()
    nan_adv[1] = float("nan")
    nan_old = old.clone()
    nan_old[mask] = float("nan")
    yield "geometry", ValueError, "geometry.*'tv', 'chi2', 'hellinger', 'kl', 'two_sided_log'", \
        (lp, old, adv, mask), dict(geometry="js")
    yield "topology", ValueError, "topology.*'mc', 'atomic', 'binary'", \
        (lp, old, adv, mask), dict(topology="exact")
    yield "agg", ValueError, "agg.*'token-mean', 'seq-mean-token-mean'", \
        (lp, old, adv, mask), dict(agg="sum")
    yield "delta0", ValueError, "delta", (lp, old, adv, mask), dict(delta=0.0)
    yield "delta-", ValueError, "delta", (lp, old, adv, mask), dict(delta=-0.1)
    yield "delta-nan", ValueError, "delta", (lp, old, adv, mask), dict(delta=float("nan"))
    yield "old-shape", ValueError, "old_logprobs", (lp, old[:, :4], adv, mask), {}
    yield "old-dtype", TypeError, "old_logprobs", (lp, old.long(), adv, mask), {}
    yield "old-device", ValueError, "old_logprobs", (lp, old.to("meta"), adv, mask), {}
    yield "old-nan", ValueError, "old_logprobs", (lp, nan_old, adv, mask), {}
    yield "mask-shape", ValueError, "mask", (lp, old, adv, mask[:3]), {}
    yield "mask-values", ValueError, "mask", (lp, old, adv, mask.long() * 2), {}
    yield "mask-device", ValueError, "mask", (lp, old, adv, mask.to("meta")), {}
    yield "adv-device", ValueError, "advantages", (lp, old, adv.to("meta"), mask), {}
    yield "adv-shape", ValueError, "advantages", (lp, old, adv[:3], mask), {}
    yield "adv-shape-2d", ValueError, "advantages", (lp, old, adv[None], mask), {}
    yield "adv-type", TypeError, "advantages", (lp, old, adv.tolist(), mask), {}
    yield "adv-nan", ValueError, "advantages", (lp, old, nan_adv, mask), {}
    yield "policy-shape", ValueError, "policy", (lp[None], old, adv, mask), {}
    yield "policy-type", TypeError, "policy", (lp.tolist(), old, adv, mask), {}
    yield "policy-int", TypeError, "policy", (lp.long(), old, adv, mask), {}
    yield "num_tokens", ValueError, "num_tokens", (lp, old, adv, mask), dict(num_tokens=0)
    yield "num_sequences", ValueError, "num_sequences", (lp, old, adv, mask), \
        dict(num_sequences=-2, agg="seq-mean-token-sum")


@pytest.mark.parametrize("name,exc,match,args,kwargs", list(_bad_gppo_cases()),
                         ids=[c[0] for c in _bad_gppo_cases()])
def test_bad_input(name, exc, match, args, kwargs):
    with pytest.raises(exc, match=match):
        gppo_loss(*args, **kwargs)


def test_bad_bounds_and_group_advantages_input():
    old = torch.zeros(3)
    with pytest.raises(ValueError, match="geometry.*'kl'"):
        gppo_bounds(old, geometry="KL", topology="mc", delta=0.1)
    with pytest.raises(ValueError, match="topology.*'binary'"):
        gppo_bounds(old, geometry="kl", topology="bin", delta=0.1)
    with pytest.raises(ValueError, match="delta"):
        gppo_bounds(old, geometry="kl", topology="mc", delta=0.0)
    with pytest.raises(TypeError, match="old_logprobs"):
        gppo_bounds([0.0], geometry="kl", topology="mc", delta=0.1)
    rewards = torch.ones(6)
    with pytest.raises(ValueError, match="group_size.*multiple"):
        group_advantages(rewards, group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(rewards, group_size=0)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(rewards, group_size=3, eps=0.0)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(rewards[None], group_size=3)
    with pytest.raises(ValueError, match="rewards"):
        group_advantages(torch.tensor([1.0, float("nan")]), group_size=2)
