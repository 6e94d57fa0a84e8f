"""GPPO's ``gppo_bounds`` and ``gppo_loss``, both implementations (the fused kernels and the
reference) in one file.

Against independent oracles, each test run on either implementation (the ``impl`` fixture): the
trust-region bounds against a bisection of D(r) = delta written from the SPEC's integrands, the
loss and its gradient against a Python-float loop (every cell, every aggregation, global counts),
the branch decision at the bounds, metrics, gradcheck, garbage at masked positions, extreme
ratios, output dtypes and bad input. Fused against the reference and float64 (the three-way rule
of conftest): the bounds, every cell and aggregation, and the three policy forms (log-probs,
``Logits``, ``LinearHead``).
"""
import itertools
import math

import pytest
import torch

import rlfuse
from rlfuse import reference
from rlfuse._names import AGGREGATIONS, GEOMETRIES, TOPOLOGIES

from conftest import APPROX, TOL, assert_three_way, fp32_exact, as_logprobs
from loss_harness import (RecomputedInBackward, check_three_way, constexpr_params, run_loss,
                          token_inputs, with_garbage)


CELLS = list(itertools.product(GEOMETRIES, TOPOLOGIES))
# the aggregations the loop oracle writes out (verl's agg_loss)
LOOP_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# mu = exp(old_lp) at both clamps, near them, and in between
MU = torch.tensor([1e-7, 1e-6, 3e-6, 1e-4, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1 - 1e-4,
                   1 - 3e-6, 1 - 1e-6], dtype=torch.float64)


def gppo_case(B, T, *, seed, spread=0.4, per_token_adv=False):
    """(a float64 log-prob buffer [B, T + 1], old_lp with NaN off the mask, advantages, mask)."""
    gen, _, mask = token_inputs(B, T, seed=seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    lp_buffer = torch.cat([lp, lp[:, :1]], 1)
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    return lp_buffer, with_garbage(old, mask), adv, mask


def args_of(old, adv, mask, dtype):
    """The loss's arguments after the policy: old_lp and advantages in ``dtype``, the mask."""
    return (old.to(dtype), adv.to(dtype), mask)


# --------------------------------------------------------------------------------------------
# The bounds: an independent trust region, bisection of D(r) = delta from the SPEC's integrands
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
def test_bounds_match_bisection(geometry, topology, impl, device):
    """fp64 bounds against the bisection oracle over mu's whole clamp range: exactly 0 where the
    region reaches r = 0, exactly +inf where it is unbounded, else within the contract's rtol."""
    mu_raw = _mu_grid()
    mu = mu_raw.clamp(1e-6, 1 - 1e-6)                  # the SPEC's clamp
    for delta in DELTAS:
        lo, hi = impl.gppo_bounds(mu_raw.log().to(device), geometry=geometry, topology=topology,
                                  delta=delta)
        lo, hi = lo.cpu(), hi.cpu()
        want_lo, want_hi, t_lo, t_hi = _bisect_bounds(geometry, topology, mu, delta)
        # Where the region reaches r = 0 (D(0) <= delta), the bound is exactly 0; where it is
        # unbounded (or beyond fp64), exactly +inf.
        reaches_zero = t_lo == -T_FAR
        assert torch.equal(lo[reaches_zero], torch.zeros_like(lo[reaches_zero])), delta
        assert torch.equal(torch.isinf(hi), torch.isinf(want_hi)), delta
        finite = ~torch.isinf(want_hi)
        # rtol 1e-6 is the contract; atol 1e-12 covers the cancellation in 1 - x near a zero lower
        # bound (e.g. 1 - sqrt(delta/mu) with delta/mu ~ 1), ~1e-16 in fp64 on both sides.
        torch.testing.assert_close(lo, want_lo, **TOL["bisection"])
        torch.testing.assert_close(hi[finite], want_hi[finite], **TOL["bisection_hi"])
        if geometry in ("kl", "two_sided_log"):
            # exponential-type bounds may be far below 1e-12: compare them relatively in log space
            tiny = (want_lo > 1e-300) & (lo > 0)
            torch.testing.assert_close(lo[tiny].log(), t_lo[tiny], **TOL["bisection_log"])


def test_bisection_oracle_sees_the_domain_edge():
    """The oracle itself: chi2/binary at mu = 0.5, delta = 2 has its quadratic root at
    1 + sqrt(2) > 1/mu = 2; the region stops at the domain edge r = 1/mu."""
    mu = torch.tensor([0.5], dtype=torch.float64)
    _, hi, _, _ = _bisect_bounds("chi2", "binary", mu, 2.0)
    torch.testing.assert_close(hi, torch.tensor([2.0], dtype=torch.float64))


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
        torch.testing.assert_close(lo.cpu(), rlo, **TOL["bounds_fp64"])
        torch.testing.assert_close(hi.cpu(), rhi, **TOL["bounds_fp64"])
        lo32, hi32 = rlfuse.gppo_bounds(old.float().to(device), geometry=geometry,
                                        topology=topology, delta=delta)
        assert lo32.dtype == torch.float32
        rlo32, rhi32 = reference.gppo_bounds(old.float(), geometry=geometry, topology=topology,
                                             delta=delta)
        torch.testing.assert_close(lo32.cpu(), rlo32, **TOL["bounds_fp32"])
        torch.testing.assert_close(hi32.cpu(), rhi32, **TOL["bounds_fp32"])


def test_bounds_check_value(device):
    """The fused chi2/atomic bounds at mu = 0.1, delta = 0.04: 1 -+ sqrt(delta / mu)."""
    lo, hi = rlfuse.gppo_bounds(torch.tensor([0.1], dtype=torch.float64).log().to(device),
                                geometry="chi2", topology="atomic", delta=0.04)
    assert abs(lo.item() - 0.3675445) < 1e-7 and abs(hi.item() - 1.6324555) < 1e-7


def test_check_value_chi2_atomic(impl, device):
    """chi2/atomic at mu = 0.1, delta = 0.04: the closed form 1 -+ sqrt(delta / mu) to 5e-8."""
    old = torch.tensor([math.log(0.1)], dtype=torch.float64, device=device)
    lo, hi = impl.gppo_bounds(old, geometry="chi2", topology="atomic", delta=0.04)
    assert abs(lo.item() - 0.3675445) < 5e-8
    assert abs(hi.item() - 1.6324555) < 5e-8


@pytest.mark.parametrize("geometry, topology", CELLS)
def test_bounds_widen_with_delta(geometry, topology, device):
    """The fused bounds at the fixed mu points: [lo, hi] grows with delta, strictly somewhere
    at every step (or has reached 0 / inf), and lo <= 1."""
    old = MU.log().to(device)
    prev_lo, prev_hi = torch.ones_like(old), torch.ones_like(old)
    for delta in (1e-4, 1e-3, 0.01, 0.04, 0.2, 1.0, 2.0):
        lo, hi = rlfuse.gppo_bounds(old, geometry=geometry, topology=topology, delta=delta)
        assert (lo <= prev_lo).all() and (hi >= prev_hi).all() and (lo <= 1).all()
        assert ((lo < prev_lo) | (lo == 0)).any() or ((hi > prev_hi) | hi.isinf()).any()
        prev_lo, prev_hi = lo, hi


@pytest.mark.parametrize("geometry,topology", CELLS)
def test_region_widens_with_delta(geometry, topology, impl, device):
    """Over the mu grid the region is monotone in delta and grows between the smallest and the
    largest delta; lo < 1 < hi (kl off binary: no upper bound at all)."""
    old = _mu_grid().log().to(device)
    deltas = [1e-4, 1e-3, 1e-2, 0.04, 0.1, 0.5, 1.0, 2.0]
    bounds = [impl.gppo_bounds(old, geometry=geometry, topology=topology, delta=d)
              for d in deltas]
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


def test_bounds_dtype(impl, device):
    """Bounds come in the compute dtype (fp32 for bf16 / fp32, fp64 for fp64), in the input's
    shape."""
    old = torch.full((2, 3), math.log(0.3))
    for dtype, want in [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                        (torch.float64, torch.float64)]:
        lo, hi = impl.gppo_bounds(old.to(dtype).to(device), geometry="kl", topology="binary",
                                  delta=0.1)
        assert lo.dtype == want and hi.dtype == want and lo.shape == (2, 3)


def test_bounds_bad_input(impl):
    """Integer old log-probs are refused with a TypeError that names them."""
    with pytest.raises(TypeError, match="old_logprobs"):
        impl.gppo_bounds(torch.zeros(3, dtype=torch.long), geometry="chi2", topology="atomic",
                         delta=0.1)


def test_bounds_bad_arguments(impl, device):
    """Unknown geometry / topology names (case matters), delta = 0 and a list of old log-probs
    are refused, each error naming the argument."""
    old = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="geometry.*'kl'"):
        impl.gppo_bounds(old, geometry="KL", topology="mc", delta=0.1)
    with pytest.raises(ValueError, match="topology.*'binary'"):
        impl.gppo_bounds(old, geometry="kl", topology="bin", delta=0.1)
    with pytest.raises(ValueError, match="delta"):
        impl.gppo_bounds(old, geometry="kl", topology="mc", delta=0.0)
    with pytest.raises(TypeError, match="old_logprobs"):
        impl.gppo_bounds([0.0], geometry="kl", topology="mc", delta=0.1)


def test_runtime_hyperparameters_are_not_constexpr():
    """delta and the other run-time hyper-parameters are kernel arguments, not constexprs (one
    compilation serves every value)."""
    from rlfuse.kernels.lib import regions as gppo
    from rlfuse.kernels.rows import surrogate

    for kernel in (surrogate._surrogate_fwd_kernel, surrogate._surrogate_bwd_kernel,
                   surrogate._surrogate_logits_kernel, gppo._gppo_bounds_kernel):
        assert constexpr_params(kernel) <= {"BLOCK", "BLOCK_T", "BLOCK_V", "OBJECTIVE", "GEOMETRY",
                                            "TOPOLOGY", "ACC", "WRITE_DLOGITS", "HAS_OLD",
                                            "RATIO", "KL", "FLAGS",
                                            # the single pass's launch configuration
                                            "EVICT", "NUM_STAGES", "ORDER"}


# --------------------------------------------------------------------------------------------
# The loss against a Python-float loop, branches, metrics, gradients, masked garbage, dtypes
# --------------------------------------------------------------------------------------------

def _batch(B=6, T=7, seed=0, dtype=torch.float64, scale=0.4, adv_2d=False, device="cpu"):
    """(lp, old_lp with NaN off the mask, advantages, mask) on ``device``; at least one actor
    token per row."""
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.98 + 0.01)
    lp = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.35
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    shape = (B, T) if adv_2d else (B,)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    old = torch.where(mask, old, torch.full_like(old, float("nan")))  # garbage off the mask
    return tuple(x.to(dtype=dtype if x.is_floating_point() else x.dtype, device=device)
                 for x in (lp, old, adv, mask))


def _loop_loss(lp, old, adv, mask, geometry, topology, delta, agg,
               num_tokens=None, num_sequences=None):
    """-agg(min(r A, clip(r, l, u) A)) with Python floats, and d loss / d lp, from the SPEC and
    verl's agg_loss (l, u: the reference's bounds; CPU tensors)."""
    lo, hi = reference.gppo_bounds(old, geometry=geometry, topology=topology, delta=delta)
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


@pytest.mark.parametrize("agg", LOOP_AGGS)
@pytest.mark.parametrize("counts", [None, (40.0, 9.0)])
def test_aggregation_against_loop(agg, counts, impl, device):
    """fp64 loss and gradient of every aggregation (with the batch's counts and with global
    ones) against the loop, chi2/atomic at the default delta."""
    lp, old, adv, mask = _batch(seed=1, device=device)
    lp.requires_grad_(True)
    num_tokens, num_sequences = counts if counts else (None, None)
    out = impl.gppo_loss(lp, old, adv, mask, agg=agg, num_tokens=num_tokens,
                         num_sequences=num_sequences)
    want, want_grad = _loop_loss(lp.detach().cpu(), old.cpu(), adv.cpu(), mask.cpu(), "chi2",
                                 "atomic", 0.04, agg, num_tokens, num_sequences)
    out.loss.backward()
    assert abs(out.loss.item() - want) <= 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(lp.grad.cpu(), want_grad, **TOL["fp64_grad"])


@pytest.mark.parametrize("geometry,topology", CELLS)
def test_every_cell_against_loop(geometry, topology, impl, device):
    """fp64 loss and gradient of every cell (per-token advantages, token-mean) against the
    loop."""
    lp, old, adv, mask = _batch(seed=2, scale=0.8, adv_2d=True, device=device)
    lp.requires_grad_(True)
    out = impl.gppo_loss(lp, old, adv, mask, geometry=geometry, topology=topology, delta=0.1)
    want, want_grad = _loop_loss(lp.detach().cpu(), old.cpu(), adv.cpu(), mask.cpu(), geometry,
                                 topology, 0.1, "token-mean")
    out.loss.backward()
    assert abs(out.loss.item() - want) <= 1e-12 * max(1.0, abs(want))
    torch.testing.assert_close(lp.grad.cpu(), want_grad, **TOL["fp64_grad"])


def test_loop_sees_clipping(impl, device):
    """The data of the loop tests exercises both clipped branches and the unclipped one."""
    lp, old, adv, mask = _batch(seed=2, scale=0.8, adv_2d=True, device=device)
    m = impl.gppo_loss(lp, old, adv, mask, geometry="chi2", topology="atomic", delta=0.1).metrics
    assert 0 < m["clip_frac_low"] and 0 < m["clip_frac_high"]
    assert m["clip_frac_low"] + m["clip_frac_high"] < 1


def test_branch_decision_at_the_bounds(impl, device):
    """Log-ratios 1e-9 inside / outside log l and log u (l, u from the implementation's
    gppo_bounds): the clipped branch (zero gradient) is taken exactly outside."""
    old = torch.full((4, 2), math.log(0.1), dtype=torch.float64, device=device)
    lo, hi = impl.gppo_bounds(old, geometry="chi2", topology="atomic", delta=0.04)
    step = torch.tensor([-1e-9, 1e-9], dtype=torch.float64, device=device)
    log_ratio = torch.stack([lo[0].log() + step, hi[0].log() + step,
                             lo[0].log() + step, hi[0].log() + step])
    adv = torch.tensor([-1.0, 1.0, 1.0, -1.0], dtype=torch.float64, device=device)
    lp = (old + log_ratio).requires_grad_(True)
    out = impl.gppo_loss(lp, old, adv, torch.ones(4, 2, dtype=torch.bool, device=device))
    out.loss.backward()
    # row 0: A < 0 below l is clipped; row 1: A > 0 above u is clipped; rows 2-3 never clip
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] != 0
    assert lp.grad[1, 0] != 0 and lp.grad[1, 1] == 0
    assert bool((lp.grad[2:] != 0).all())
    assert out.metrics["clip_frac_low"].item() == 1 / 8
    assert out.metrics["clip_frac_high"].item() == 1 / 8


def test_empty_batch_and_all_masked(impl, device):
    """An empty batch and a batch without actor tokens: loss, gradient and metrics are 0 under
    every aggregation."""
    for B, T in [(0, 5), (3, 4)]:
        lp = torch.zeros(B, T, device=device, requires_grad=True)
        for agg in LOOP_AGGS:
            mask = torch.zeros(B, T, dtype=torch.bool, device=device)
            out = impl.gppo_loss(lp, torch.zeros(B, T, device=device),
                                 torch.zeros(B, device=device), mask, agg=agg,
                                 validate=agg != "seq-mean-token-mean")
            out.loss.backward()
            assert out.loss.item() == 0 and bool((lp.grad == 0).all())
            assert all(v.item() == 0 for v in out.metrics.values())


def test_token_mean_without_actor_tokens(impl, device):
    """token-mean divides by the batch's token count only: rows (here all of them) may have no
    actor token; the loss, gradient and metrics are then 0."""
    lp, old, adv, _ = gppo_case(2, 3, seed=22)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss, metrics, grad = run_loss(impl.gppo_loss, lp, dtype=torch.float32, device=device,
                                   args=(old.float(), adv.float(), mask), agg="token-mean")
    assert loss.item() == 0 and (grad == 0).all()
    assert all(value.item() == 0 for value in metrics.values())


def test_metrics(impl, device):
    """The clip fractions, the mean ratio and approx_kl recomputed from the bounds and the
    ratios at actor tokens."""
    lp, old, adv, mask = _batch(seed=3, scale=0.8, device=device)
    m = impl.gppo_loss(lp, old, adv, mask, geometry="tv", topology="binary", delta=0.05).metrics
    lo, hi = impl.gppo_bounds(old, geometry="tv", topology="binary", delta=0.05)
    a = adv[:, None].expand_as(lp)
    r = torch.exp(lp - old)
    n = mask.sum()
    assert m["clip_frac_low"].item() == pytest.approx(
        (((a < 0) & (r < lo) & mask).sum() / n).item())
    assert m["clip_frac_high"].item() == pytest.approx(
        (((a > 0) & (r > hi) & mask).sum() / n).item())
    assert m["ratio_mean"].item() == pytest.approx(r[mask].mean().item(), **APPROX["fp64"])
    assert m["approx_kl"].item() == pytest.approx((old - lp)[mask].mean().item(), **APPROX["fp64"])
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_advantages_per_sequence_equal_broadcast(impl, device):
    """[B] advantages give exactly the loss of the same advantages broadcast to [B, T]."""
    lp, old, adv, mask = _batch(seed=4, device=device)
    one = impl.gppo_loss(lp, old, adv, mask)
    two = impl.gppo_loss(lp, old, adv[:, None].expand_as(lp).contiguous(), mask)
    assert one.loss.item() == two.loss.item()


# gradcheck makes two calls per input element, and the interpreter takes 0.1 to 2 s per fused
# call: there the fused gradient is checked by finite differences at one row of the input (with
# actor tokens and a masked position; the log-probs' row 1 clipped low and high, and not, in
# chi2, kl and two_sided_log), the reference's at every element.
FUSED_GRADCHECK_ROWS = {"logprobs": [1], "logits": [3]}


def _gradcheck_rows(impl, device, form):
    """The rows at which ``impl``'s gradient is checked: all (None) but in the interpreter."""
    return FUSED_GRADCHECK_ROWS[form] if impl is rlfuse and device.type == "cpu" else None


def _gradcheck(f, x, rows=None):
    """torch.autograd.gradcheck of ``f`` at ``x``; with ``rows``, w.r.t. ``x[rows]`` only (the
    other rows held at their values)."""
    if rows is None:
        return torch.autograd.gradcheck(f, (x,))
    index = torch.tensor(rows, device=x.device)
    base = x.detach()
    part = base[index].clone().requires_grad_(True)
    # fast mode in the interpreter (a random projection of the Jacobian: two evaluations)
    return torch.autograd.gradcheck(lambda p: f(base.index_put((index,), p)), (part,),
                                    fast_mode=True)


@pytest.mark.parametrize("geometry,topology", [("chi2", "atomic"), ("kl", "binary"),
                                               ("hellinger", "mc"), ("two_sided_log", "binary")])
def test_gradcheck_logprobs(geometry, topology, impl, device):
    """The gradient w.r.t. fp64 log-probs against finite differences (the fused one in the
    interpreter at FUSED_GRADCHECK_ROWS)."""
    lp, old, adv, mask = _batch(B=4, T=5, seed=5, scale=0.6, adv_2d=True, device=device)
    lp.requires_grad_(True)

    def f(x):
        return impl.gppo_loss(x, old, adv, mask, geometry=geometry, topology=topology,
                              delta=0.1, agg="seq-mean-token-mean").loss

    assert _gradcheck(f, lp, _gradcheck_rows(impl, device, "logprobs"))


def test_gradcheck_logits(impl, device):
    """The gradient w.r.t. fp64 logits (temperature 0.7, out-of-range targets off the mask)
    against finite differences (the fused one in the interpreter at FUSED_GRADCHECK_ROWS)."""
    g = torch.Generator().manual_seed(6)
    B, T, V = 4, 3, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    logits = logits.to(device).requires_grad_(True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    targets[~mask] = -100                                   # out of range off the mask is fine
    old = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    old = old.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    targets, mask, old, adv = (x.to(device) for x in (targets, mask, old, adv))

    def f(x):
        return impl.gppo_loss(impl.Logits(x, targets, temperature=0.7), old, adv, mask,
                              geometry="kl", topology="atomic", delta=0.2).loss

    if impl is rlfuse:
        def f(x, f=f):
            return RecomputedInBackward.apply(x, f)

    assert _gradcheck(f, logits, _gradcheck_rows(impl, device, "logits"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_log_ratios_finite(dtype, impl, device):
    """Log-ratios of +-30 (every branch finite in fp32, e^30 ~ 1e13) and +-1000 (the clipped
    branch only): a finite fp32 loss and gradient; the clipped and A = 0 tokens get none."""
    old = torch.full((4, 2), math.log(0.2), device=device)
    shift = torch.tensor([[30.0, -30.0], [30.0, -30.0], [1000.0, -1000.0], [-1000.0, 1000.0]],
                         device=device)
    adv = torch.tensor([1.0, -1.0, 1.0, 0.0], device=device)
    # row 2: A > 0, +1000 -> clipped high; -1000 -> r A = 0. row 3: A = 0 -> J = 0.
    lp = (old + shift).to(dtype).requires_grad_(True)
    mask = torch.ones(4, 2, dtype=torch.bool, device=device)
    for geometry, topology in [("chi2", "atomic"), ("two_sided_log", "mc"), ("tv", "binary")]:
        lp.grad = None
        out = impl.gppo_loss(lp, old.to(dtype), adv.to(dtype), mask, geometry=geometry,
                             topology=topology, delta=0.04)
        out.loss.backward()
        assert out.loss.dtype == torch.float32 and lp.grad.dtype == dtype
        assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all())
        assert lp.grad[2, 0] == 0 and lp.grad[3].abs().sum() == 0


@pytest.mark.parametrize("log_ratio", [30.0, -30.0])
@pytest.mark.parametrize("geometry, topology", [("chi2", "atomic"), ("kl", "mc"),
                                                ("two_sided_log", "binary")])
def test_far_outside_region_is_finite(log_ratio, geometry, topology, device):
    """The fused fp32 loss, gradient and metrics stay finite at log-ratios of +-30, for either
    sign of the advantage."""
    lp, old, adv, mask = gppo_case(4, 6, seed=9)
    lp = torch.cat([torch.where(mask, old, 0.0) + log_ratio, lp[:, -1:]], 1)
    for sign in (1.0, -1.0):
        loss, metrics, grad = run_loss(rlfuse.gppo_loss, lp, dtype=torch.float32, device=device,
                                       args=(old.float(), sign * adv.abs().float(), mask),
                                       geometry=geometry, topology=topology)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_unrepresentable_unclipped_ratio_raises(impl, device):
    """A < 0 with log-ratio +200: the unclipped branch r A is selected and overflows fp32, a
    ValueError naming the policy; under kl (no upper bound) a positive advantage as well."""
    old = torch.full((1, 2), math.log(0.2), device=device)
    lp = old + torch.tensor([[200.0, 0.0]], device=device)
    mask = torch.ones(1, 2, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="policy.*overflow"):
        impl.gppo_loss(lp, old, torch.tensor([-1.0], device=device), mask)
    # kl has no upper bound, so a positive advantage is unclipped as well
    with pytest.raises(ValueError, match="policy.*overflow"):
        impl.gppo_loss(lp, old, torch.tensor([1.0], device=device), mask, geometry="kl")


@pytest.mark.parametrize("geometry, topology, sign", [("chi2", "atomic", -1.0),
                                                      ("kl", "mc", 1.0)])
def test_unclipped_overflow_raises(geometry, topology, sign, impl, device):
    """Far above the region r A is kept by a negative advantage, and by a positive one under
    kl's infinite upper bound: exp(100) overflows fp32."""
    lp, old, adv, mask = gppo_case(2, 3, seed=10)
    lp = torch.cat([torch.where(mask, old, 0.0) + 100.0, lp[:, -1:]], 1)
    with pytest.raises(ValueError, match="overflow"):
        run_loss(impl.gppo_loss, lp, dtype=torch.float32, device=device,
                 args=(old.float(), sign * adv.abs().float(), mask),
                 geometry=geometry, topology=topology)


def test_unclipped_overflow_raises_from_logits(impl, device):
    """The single pass from logits refuses an overflowing r A as well: lp - old_lp = 100 - log 5
    with A < 0 (chi2 / atomic)."""
    logits = torch.zeros(2, 3, 5, device=device, requires_grad=True)
    targets = torch.zeros(2, 3, dtype=torch.long, device=device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)
    old = torch.full((2, 3), -100.0, device=device)
    with pytest.raises(ValueError, match="overflow"):
        impl.gppo_loss(impl.Logits(logits, targets), old, -torch.ones(2, device=device), mask)


def test_masked_garbage_does_not_leak(impl, device):
    """NaN old log-probs, -inf advantages and 1e30 log-probs off the mask change neither the
    loss, nor the gradient (0 off the mask), nor the metrics."""
    lp, old, adv, mask = _batch(seed=7, adv_2d=True, device=device)
    lp.requires_grad_(True)
    clean_old = torch.where(mask, old, torch.zeros_like(old))
    clean_adv = torch.where(mask, adv, torch.zeros_like(adv))
    dirty_adv = torch.where(mask, adv, torch.full_like(adv, float("-inf")))
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, 1e30))
    a = impl.gppo_loss(dirty_lp, old, dirty_adv, mask, agg="seq-mean-token-mean")
    a.loss.backward()
    grad_dirty = lp.grad.clone()
    lp.grad = None
    b = impl.gppo_loss(lp, clean_old, clean_adv, mask, agg="seq-mean-token-mean")
    b.loss.backward()
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert torch.equal(grad_dirty, lp.grad) and bool((lp.grad[~mask] == 0).all())
    for k in a.metrics:
        assert a.metrics[k].item() == b.metrics[k].item(), k


@pytest.mark.parametrize("agg", LOOP_AGGS)
def test_global_counts_add_up_over_micro_batches(agg, impl, device):
    """With the whole batch's token and sequence counts, the losses of two micro-batches add up
    to the whole batch's loss."""
    lp, old, adv, mask = _batch(B=8, seed=8, device=device)
    full = impl.gppo_loss(lp, old, adv, mask, agg=agg).loss
    n_tok, n_seq = float(mask.sum()), 8.0
    parts = sum(impl.gppo_loss(lp[s], old[s], adv[s], mask[s], agg=agg, num_tokens=n_tok,
                               num_sequences=n_seq).loss for s in (slice(0, 3), slice(3, 8)))
    torch.testing.assert_close(parts, full, **TOL["fp64_micro_batches"])


def test_dtypes_of_outputs(impl, device):
    """The loss and metrics are 0-dim in the compute dtype (fp32, fp64 for fp64); the gradient
    in the log-probs' dtype."""
    lp, old, adv, mask = _batch(seed=9, device=device)
    for dtype, want in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                        (torch.float16, torch.float32), (torch.float64, torch.float64)]:
        x = lp.to(dtype).requires_grad_(True)
        out = impl.gppo_loss(x, old.to(dtype), adv.to(dtype), mask)
        out.loss.backward()
        assert out.loss.dtype == want and out.loss.dim() == 0 and x.grad.dtype == dtype
        assert all(v.dtype == want for v in out.metrics.values())


# --------------------------------------------------------------------------------------------
# Fused against the reference and float64: every cell and aggregation, the three policy forms
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry, topology", CELLS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_logprobs_every_cell_and_aggregation(geometry, topology, agg, device):
    """From fp32 log-probs: loss, gradient and metrics of every cell and aggregation under the
    three-way rule."""
    lp, old, adv, mask = gppo_case(4, 9, seed=3, per_token_adv=agg == "token-mean")
    check_three_way(rlfuse.gppo_loss, reference.gppo_loss, lp, dtype=torch.float32,
                    device=device, args=args_of(old, adv, mask, torch.float32),
                    args64=args_of(old, adv, mask, torch.float64),
                    metric_names=["clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl"],
                    geometry=geometry, topology=topology, delta=0.05, agg=agg)


@pytest.mark.parametrize("geometry, topology", [("chi2", "atomic"), ("kl", "binary"),
                                                ("two_sided_log", "binary"), ("tv", "mc")])
def test_float64_exact(geometry, topology, device):
    """From fp64 log-probs the fused loss and gradient equal the reference's to rounding."""
    lp, old, adv, mask = gppo_case(4, 9, seed=4)
    kw = dict(geometry=geometry, topology=topology, delta=0.125)  # fp32-exact: conftest
    fused = run_loss(rlfuse.gppo_loss, lp, dtype=torch.float64, device=device,
                     args=(old, adv, mask), **kw)
    ref = run_loss(reference.gppo_loss, lp, dtype=torch.float64, args=(old, adv, mask), **kw)
    torch.testing.assert_close(fused[0].cpu(), ref[0], **TOL["fp64"])
    torch.testing.assert_close(fused[2].cpu(), ref[2], **TOL["fp64"])


@pytest.mark.parametrize("dtype, V", [(torch.bfloat16, 37), (torch.float32, 4099),
                                      (torch.bfloat16, 4099)])
@pytest.mark.parametrize("geometry, topology, agg", [
    ("chi2", "atomic", "token-mean"), ("kl", "binary", "seq-mean-token-mean"),
    ("hellinger", "mc", "seq-mean-token-sum-norm")])
def test_logits_single_pass(dtype, V, geometry, topology, agg, device):
    """From Logits (the single pass; out-of-range targets off the mask): loss, gradient and
    metrics under the three-way rule."""
    B, T = 4, 5
    gen = torch.Generator().manual_seed(V + len(geometry))
    logits = (torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 2).to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    targets[~mask] = V + 3
    lp = torch.log_softmax(logits[:, :-1] / 0.9, -1).gather(-1, targets.clamp(0, V - 1)[..., None])
    old = with_garbage(as_logprobs(lp[..., 0] + torch.randn(B, T, generator=gen,
                                                         dtype=torch.float64) * 0.3),
                       mask)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    check_three_way(rlfuse.gppo_loss, reference.gppo_loss, logits, dtype=dtype, device=device,
                    logits_targets=targets, temperature=0.9,
                    args=args_of(old, adv, mask, torch.float32),
                    args64=args_of(old, adv, mask, torch.float64),
                    metric_scales={"approx_kl": lp.abs().max().item()},
                    geometry=geometry, topology=topology, delta=0.05, agg=agg)


# LinearHead: hidden [B, S, H], weight [V, H], bias [V]; hidden row HEAD_OFFSET + t predicts
# targets[:, t]
HEAD_B, HEAD_S, HEAD_H, HEAD_V, HEAD_OFFSET, HEAD_T = 4, 8, 8, 37, 2, 5
HEAD_TEMPERATURE = 0.8


def linear_head_case(seed, dtype, *, per_token_adv):
    """float64 head tensors (exact in ``dtype``), targets (out of range off the mask), the float64
    log-probs of the rounded head, old_lp near them (NaN off the mask), advantages, mask."""
    B, S, H, V, T = HEAD_B, HEAD_S, HEAD_H, HEAD_V, HEAD_T
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    hidden = torch.randn(B, S, H, generator=gen, dtype=torch.float64).to(dtype).double()
    weight = (torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.7).to(dtype).double()
    bias = (torch.randn(V, generator=gen, dtype=torch.float64) * 0.2).to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    logits = hidden[:, HEAD_OFFSET:HEAD_OFFSET + T] @ weight.T + bias
    lp = torch.log_softmax(logits / HEAD_TEMPERATURE, -1).gather(-1, targets[..., None])[..., 0]
    targets[~mask] = V + 3
    old = with_garbage(as_logprobs(lp + torch.randn(B, T, generator=gen, dtype=torch.float64)
                                   * 0.3), mask)
    adv = torch.randn((B, T) if per_token_adv else (B,), generator=gen, dtype=torch.float64)
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, lp=lp, old=old, adv=adv,
                mask=mask)


def run_linear_head(fn, case, dtype, device, *, chunk, **kw):
    """(loss, metrics, [dhidden, dweight, dbias]) of ``fn`` on a LinearHead whose tensors are in
    ``dtype`` (old_lp and advantages in the compute dtype), all returned on the CPU."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    hidden, weight, bias = (case[k].detach().clone().to(dtype=dtype, device=device)
                            .requires_grad_(True) for k in ("hidden", "weight", "bias"))
    policy = rlfuse.LinearHead(hidden, weight, case["targets"].to(device), bias, HEAD_TEMPERATURE,
                               offset=HEAD_OFFSET, chunk_tokens=chunk)
    old = None if case["old"] is None else case["old"].to(dtype=acc, device=device)
    out = fn(policy, old, case["adv"].to(dtype=acc, device=device), case["mask"].to(device), **kw)
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    return (out.loss.detach().cpu(), {k: v.detach().cpu() for k, v in out.metrics.items()},
            [g.cpu() for g in grads])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("geometry, topology, agg", [
    ("chi2", "atomic", "token-mean"), ("kl", "binary", "seq-mean-token-mean"),
    ("hellinger", "mc", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("chunk", [3, 64])        # does not divide N = 20; one chunk
def test_linear_head_matches_float64(dtype, geometry, topology, agg, chunk, device):
    """From a LinearHead (hidden states, weight, bias; out-of-range targets off the mask): loss,
    the gradients of hidden, weight and bias, and the metrics under the three-way rule."""
    case = linear_head_case(len(geometry) + chunk, dtype, per_token_adv=agg == "token-mean")
    kw = dict(geometry=geometry, topology=topology, delta=0.05, agg=agg)
    fused = run_linear_head(rlfuse.gppo_loss, case, dtype, device, chunk=chunk, **kw)
    ref = run_linear_head(reference.gppo_loss, case, dtype, "cpu", chunk=chunk, **kw)
    ref64 = run_linear_head(reference.gppo_loss, case, torch.float64, "cpu", chunk=chunk, **kw)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert fused[0].dtype == acc and fused[0].dim() == 0
    assert_three_way(fused[0], ref[0], ref64[0], "loss")
    for label, f, r, r64 in zip(("dhidden", "dweight", "dbias"), fused[2], ref[2], ref64[2]):
        assert f.dtype == r.dtype == dtype, label
        assert_three_way(f, r, r64, label)
    assert set(fused[1]) == set(ref64[1]) >= {"clip_frac_low", "clip_frac_high", "ratio_mean",
                                               "approx_kl"}
    scales = {"approx_kl": case["lp"].abs().max().item()}
    for name in fused[1]:
        assert fused[1][name].dim() == 0
        assert_three_way(fused[1][name], ref[1][name], ref64[1][name], name, atol_dtype=acc,
                         scale=scales.get(name))


@pytest.mark.parametrize("geometry", ["kl", "two_sided_log"])
@pytest.mark.parametrize("form", ["logits", "head"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_root_found_cells_from_rows(geometry, form, on_policy, device):
    """The binary kl and two_sided_log cells from Logits and a LinearHead in fp64, whose row
    kernel reads the bounds found once per token beforehand (off policy) or takes [1, 1] on
    policy (r = 1): loss, metrics and gradient equal the reference's to fp64 rounding, with
    tokens clipped on both sides off policy."""
    case = linear_head_case(11, torch.float64, per_token_adv=True)
    if on_policy:
        case["old"] = None
    kw = dict(geometry=geometry, topology="binary", delta=0.02)
    if form == "head":
        fused, ref = (run_linear_head(fn, case, torch.float64, dev, chunk=7, **kw)
                      for fn, dev in ((rlfuse.gppo_loss, device), (reference.gppo_loss, "cpu")))
        fused, ref = (r[:2] + (r[2][0],) for r in (fused, ref))
    else:
        # one row past the window: run_loss's pad
        logits = (case["hidden"][:, HEAD_OFFSET:HEAD_OFFSET + HEAD_T + 1] @ case["weight"].T
                  + case["bias"])
        args = (case["old"], case["adv"], case["mask"])
        fused, ref = (run_loss(fn, logits, dtype=torch.float64, device=dev, args=args,
                               logits_targets=case["targets"], temperature=HEAD_TEMPERATURE, **kw)
                      for fn, dev in ((rlfuse.gppo_loss, device), (reference.gppo_loss, "cpu")))
    torch.testing.assert_close(fused[0].cpu(), ref[0], **TOL["fp64"])
    torch.testing.assert_close(fused[2].cpu(), ref[2], **TOL["fp64"])
    assert set(fused[1]) == set(ref[1])
    for name in fused[1]:
        torch.testing.assert_close(fused[1][name].cpu(), ref[1][name], **TOL["fp64"])
    clipped = fused[1]["clip_frac_low"] + fused[1]["clip_frac_high"]
    assert (clipped == 0) if on_policy else (fused[1]["clip_frac_low"] > 0 <
                                               fused[1]["clip_frac_high"])


def test_logits_upstream_gradient_and_inplace(device):
    """dlogits is written in the forward for an upstream gradient of 1 and rescaled after."""
    B, T, V = 2, 4, 50
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    old = as_logprobs(torch.randn(B, T, generator=gen, dtype=torch.float64) - 4).to(device)
    adv = torch.randn(B, generator=gen, dtype=torch.float64).to(device)
    grads = []
    for fn, inplace in ((rlfuse.gppo_loss, False), (rlfuse.gppo_loss, True),
                        (reference.gppo_loss, False)):
        x = logits.clone().requires_grad_(True)
        out = fn(rlfuse.Logits(x, targets, 1.0, inplace), old, adv, mask)
        (g,) = torch.autograd.grad(out.loss * -3.5, x)
        assert (g.data_ptr() == x.data_ptr()) == inplace  # inplace: into the logits' buffer
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[2], **TOL["fp64_logits_grad"])
    torch.testing.assert_close(grads[1], grads[2], **TOL["fp64_logits_grad"])


def test_logprobs_upstream_gradient(device):
    """From log-probs the backward kernel multiplies by the upstream gradient (here != 1)."""
    lp, old, adv, mask = gppo_case(3, 6, seed=14)
    grads = []
    for fn, dev in ((rlfuse.gppo_loss, device), (reference.gppo_loss, "cpu")):
        x = lp[:, :-1].clone().to(dev).requires_grad_(True)
        out = fn(x, old.to(dev), adv.to(dev), mask.to(dev), delta=0.125)
        (g,) = torch.autograd.grad(out.loss * -3.5, x)
        grads.append(g.cpu())
    torch.testing.assert_close(grads[0], grads[1], **TOL["fp64"])


def logits_case(B, T, V, *, seed, device):
    """fp32 (logits, targets, mask of ones, old_lp, per-sequence advantages) on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen).to(device)
    targets = torch.randint(0, V, (B, T), generator=gen).to(device)
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    old = as_logprobs(torch.randn(B, T, generator=gen) - 4).to(device)
    adv = torch.randn(B, generator=gen).to(device)
    return logits, targets, mask, old, adv


def test_logits_without_grad_reads_only(device):
    """Under no_grad the single pass computes the loss and writes no gradient."""
    logits, targets, mask, old, adv = logits_case(2, 3, 40, seed=13, device=device)
    with torch.no_grad():
        a = rlfuse.gppo_loss(rlfuse.Logits(logits, targets), old, adv, mask)
    b = reference.gppo_loss(rlfuse.Logits(logits.cpu(), targets.cpu()), old.cpu(), adv.cpu(),
                            mask.cpu())
    torch.testing.assert_close(a.loss.cpu(), b.loss, **TOL["fp32"])


def test_logits_untouched_by_default(device):
    """Logits defaults to inplace_backward=False: the backward leaves the logits as they were."""
    logits, targets, mask, old, adv = logits_case(2, 3, 20, seed=21, device=device)
    x = logits.clone().requires_grad_(True)
    policy = rlfuse.Logits(x, targets)
    assert policy.inplace_backward is False
    rlfuse.gppo_loss(policy, old, adv, mask).loss.backward()
    assert torch.equal(x.detach(), logits) and x.grad.abs().max() > 0


def test_global_counts(device):
    """fp64 with global token / sequence counts under every aggregation: the fused loss and
    gradient equal the reference's to rounding."""
    lp, old, adv, mask = gppo_case(6, 5, seed=11)
    for agg, kw in (("token-mean", dict(num_tokens=37)),
                    ("seq-mean-token-mean", dict(num_sequences=16)),
                    ("seq-mean-token-sum", dict(num_sequences=16)),
                    ("seq-mean-token-sum-norm", dict(num_sequences=16))):
        kw.update(agg=agg, delta=0.0625)  # fp32-exact: conftest
        a = run_loss(rlfuse.gppo_loss, lp, dtype=torch.float64, device=device,
                     args=(old, adv, mask), **kw)
        b = run_loss(reference.gppo_loss, lp, dtype=torch.float64, args=(old, adv, mask), **kw)
        torch.testing.assert_close(a[0].cpu(), b[0], **TOL["fp64"])
        torch.testing.assert_close(a[2].cpu(), b[2], **TOL["fp64"])


def test_module_wrapper(device):
    """GPPOLoss(...)(...) is gppo_loss with the module's hyper-parameters."""
    lp, old, adv, mask = gppo_case(4, 5, seed=12)
    module = rlfuse.GPPOLoss(geometry="hellinger", topology="binary", delta=0.1)
    args = (lp[:, :-1].float().to(device), old.float().to(device), adv.float().to(device),
            mask.to(device))
    a = module(*args)
    b = rlfuse.gppo_loss(*args, geometry="hellinger", topology="binary", delta=0.1)
    assert torch.equal(a.loss, b.loss)


# --------------------------------------------------------------------------------------------
# Bad input to the loss
# --------------------------------------------------------------------------------------------

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
def test_bad_input(impl, bad, exc, match):
    """Bad hyper-parameters, shapes and Logits on otherwise valid [4, 5] inputs: the error names
    the argument."""
    a = dict(policy=torch.zeros(4, 5), old=torch.zeros(4, 5) - 1, advantages=torch.zeros(4),
             mask=torch.ones(4, 5, dtype=torch.bool))
    a.update(bad)
    with pytest.raises(exc, match=match):
        impl.gppo_loss(a.pop("policy"), a.pop("old"), a.pop("advantages"), a.pop("mask"), **a)


def _bad_gppo_cases(device="cpu"):
    """(name, exception, match, args, kwargs): one bad argument each, on a batch on ``device``."""
    lp, old, adv, mask = _batch(B=4, T=5, seed=10, device=device)
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


@pytest.mark.parametrize("name", [case[0] for case in _bad_gppo_cases()])
def test_bad_input_every_argument(name, impl, device):
    """Every argument of gppo_loss checked on a real batch (values, shapes, dtypes, devices,
    types, NaN at actor tokens): the exception's type, and a message naming the argument."""
    _, exc, match, args, kwargs = {c[0]: c for c in _bad_gppo_cases(device)}[name]
    with pytest.raises(exc, match=match):
        impl.gppo_loss(*args, **kwargs)
