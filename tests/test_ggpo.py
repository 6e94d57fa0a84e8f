"""GGPO (``ggpo_loss``), both implementations.

The fused kernels against the reference and float64 (the three-way rule): both branches (direct,
clipped), the three policy forms (log-probs, ``Logits``, ``LinearHead``), large rewards over a
range of beta; and the fused path's own properties: the in-place logits gradient, reward shift
invariance, the coefficients, the upstream gradient, global token counts, runtime
hyper-parameters, the module wrapper.

Each implementation (``impl``: the kernels or the reference) against the SPEC's definition
written as a Python-float loop, and against its properties: the gap's sign and zero, reward
shift invariance per group, the clipped branch's clamped coefficients, gradcheck, global token
counts of micro-batches, garbage at masked positions, the empty batch, the dtypes of outputs,
bad input.
"""
import math

import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import APPROX, TOL, assert_three_way, fp32_exact, as_logprobs
from loss_harness import check_three_way, constexpr_params, run_loss, token_inputs, with_garbage



# --------------------------------------------------------------------------------------------
# Fused vs the reference vs float64
# --------------------------------------------------------------------------------------------

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
    """Log-probs: loss, gradient and metrics of the fused path within the three-way rule."""
    lp, ref, rewards, mask = ggpo_case(2 * group_size, 11, seed=group_size)
    check_three_way(rlfuse.ggpo_loss, reference.ggpo_loss, lp, dtype=dtype, device=device,
                    args=args_of(ref, rewards, mask, dtype),
                    args64=args_of(ref, rewards, mask, torch.float64),
                    metric_names=["gap", "q_max", "clip_frac", "seq_logratio_mean", "kl"],
                    group_size=group_size, beta=0.5, clip_radius=clip_radius)


@pytest.mark.parametrize("dtype, V", [(torch.bfloat16, 37), (torch.float32, 4099),
                                      (torch.bfloat16, 4099)])
@pytest.mark.parametrize("clip_radius", [None, 0.2])
def test_logits_matches_float64(dtype, V, clip_radius, device):
    """Logits (with a temperature): loss, dlogits and metrics within the three-way rule."""
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


HEAD_B, HEAD_S, HEAD_H, HEAD_V, HEAD_T, HEAD_OFFSET = 4, 8, 8, 37, 5, 2


def head_case(seed):
    """Hidden states [B, S, H] whose rows from ``HEAD_OFFSET`` on predict the T targets, an
    output head (weight, bias), and GGPO's other inputs (garbage at masked positions)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = HEAD_B, HEAD_T
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    return dict(hidden=torch.randn(B, HEAD_S, HEAD_H, generator=gen, dtype=torch.float64),
                weight=torch.randn(HEAD_V, HEAD_H, generator=gen, dtype=torch.float64) * 0.7,
                bias=torch.randn(HEAD_V, generator=gen, dtype=torch.float64) * 0.2,
                targets=torch.randint(0, HEAD_V, (B, T), generator=gen), mask=mask,
                ref=with_garbage(-torch.rand(B, T, generator=gen, dtype=torch.float64) * 4, mask),
                rewards=torch.randn(B, generator=gen, dtype=torch.float64))


def run_head(lib, case, dtype, device, *, chunk, clip_radius):
    """[loss, dhidden, dweight, dbias] and the metrics of one call with a ``LinearHead`` whose
    tensors are in ``dtype`` (the other inputs in the compute dtype), returned on the CPU."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    hidden, weight, bias = (case[k].to(dtype=dtype, device=device).clone().requires_grad_(True)
                            for k in ("hidden", "weight", "bias"))
    policy = lib.LinearHead(hidden, weight, case["targets"].to(device), bias, 0.8,
                            offset=HEAD_OFFSET, chunk_tokens=chunk)
    out = lib.ggpo_loss(policy, case["ref"].to(dtype=acc, device=device),
                        case["rewards"].to(dtype=acc, device=device), case["mask"].to(device),
                        group_size=2, beta=0.5, clip_radius=clip_radius)
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    values = [out.loss.detach().cpu()] + [g.cpu() for g in grads]
    return values, {k: v.detach().cpu() for k, v in out.metrics.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [3, 20, 64])    # does not divide N = 20; divides; one chunk
@pytest.mark.parametrize("clip_radius", [None, 0.2])
def test_linear_head_matches_float64(dtype, chunk, clip_radius, device):
    """LinearHead (chunked): loss, the gradients of hidden, weight and bias, and the metrics
    within the three-way rule."""
    case = head_case(1)
    kw = dict(chunk=chunk, clip_radius=clip_radius)
    fused, fused_metrics = run_head(rlfuse, case, dtype, device, **kw)
    ref, ref_metrics = run_head(reference, case, dtype, "cpu", **kw)
    ref64, ref64_metrics = run_head(reference, case, torch.float64, "cpu", **kw)
    for label, f, r, r64 in zip(("loss", "dhidden", "dweight", "dbias"), fused, ref, ref64):
        assert f.dtype == r.dtype, label
        assert_three_way(f, r, r64, label)
    assert set(fused_metrics) == set(ref64_metrics)
    # kl is a mean of e^d - d - 1 (d = ref - lp): a log-prob's error moves a term by e^d times
    # it, and a log-prob is held to its own scale, up to max |d|
    lp64 = reference.policy_logprobs(rlfuse.LinearHead(
        case["hidden"], case["weight"], case["targets"], case["bias"], 0.8, offset=HEAD_OFFSET))
    d_max = (case["ref"] - lp64)[case["mask"]].abs().max().item()
    scales = {"kl": ref64_metrics["kl"].item() * max(1.0, d_max)}
    for name, value in fused_metrics.items():
        assert value.dim() == 0 and value.dtype == torch.float32, name
        assert_three_way(value, ref_metrics[name], ref64_metrics[name], name,
                         scale=scales.get(name))


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_beta_range_large_rewards(beta, device):
    """R / beta up to ~1e4: the centred, max-subtracted form must not overflow."""
    lp, ref, rewards, mask = ggpo_case(8, 7, seed=11, reward_scale=100.0)
    fused, _ = check_three_way(rlfuse.ggpo_loss, reference.ggpo_loss, lp, dtype=torch.float32,
                               device=device, args=args_of(ref, rewards, mask, torch.float32),
                               args64=args_of(ref, rewards, mask, torch.float64),
                               group_size=4, beta=beta)
    assert torch.isfinite(fused[0]) and torch.isfinite(fused[2]).all()


# --------------------------------------------------------------------------------------------
# Properties of the fused path
# --------------------------------------------------------------------------------------------

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
    torch.testing.assert_close(grads[1], grads[0], **TOL["exact"])


def test_reward_shift_invariance(device):
    """A constant added to the rewards of a group changes neither the loss nor the gradient."""
    lp, ref, rewards, mask = ggpo_case(6, 9, seed=12)
    shift = torch.tensor([3.0, 3.0, 3.0, -40.0, -40.0, -40.0], dtype=torch.float64)
    kw = dict(dtype=torch.float64, device=device, group_size=3, beta=0.7)
    a = run_loss(rlfuse.ggpo_loss, lp, args=(ref, rewards, mask), **kw)
    b = run_loss(rlfuse.ggpo_loss, lp, args=(ref, rewards + shift, mask), **kw)
    torch.testing.assert_close(a[0], b[0], **TOL["fp64_sum"])
    torch.testing.assert_close(a[2], b[2], **TOL["fp64_sum"])


def test_infinite_radius_equals_direct_gradient(device):
    """clip_radius=inf gives the direct branch's gradient and clips nothing (fp32)."""
    lp, ref, rewards, mask = ggpo_case(6, 9, seed=13)
    kw = dict(dtype=torch.float32, device=device, group_size=3, beta=0.3,
              args=(ref.float(), rewards.float(), mask))
    direct = run_loss(rlfuse.ggpo_loss, lp, **kw)
    clipped = run_loss(rlfuse.ggpo_loss, lp, clip_radius=math.inf, **kw)
    torch.testing.assert_close(direct[2], clipped[2], **TOL["fp32_branches"])
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
                               **TOL["fp64_zero_sum"])


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
    torch.testing.assert_close(grads[0], grads[1], **TOL["fp64"])


@pytest.mark.parametrize("clip_radius", [None, 0.25])
def test_global_num_tokens_micro_batches_add_up(clip_radius, device):
    """With num_tokens the global count, the losses and gradients of two micro-batches add up to
    those of the batch; without it a micro-batch's loss is scaled by its own count."""
    lp, ref, rewards, mask = ggpo_case(8, 7, seed=15)
    kw = dict(dtype=torch.float64, device=device, group_size=2, beta=0.4,
              clip_radius=clip_radius, num_tokens=int(mask.sum()))
    full = run_loss(rlfuse.ggpo_loss, lp, args=(ref, rewards, mask), **kw)
    parts = [run_loss(rlfuse.ggpo_loss, lp[s], args=(ref[s], rewards[s], mask[s]), **kw)
             for s in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close(parts[0][0] + parts[1][0], full[0], **TOL["fp64_sum"])
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), full[2])
    local = run_loss(rlfuse.ggpo_loss, lp[:4], args=(ref[:4], rewards[:4], mask[:4]),
                     **{**kw, "num_tokens": None})
    scale = int(mask.sum()) / int(mask[:4].sum())
    torch.testing.assert_close(local[0], parts[0][0] * scale, **TOL["fp64_sum"])


def test_loss_is_nonnegative_and_zero_for_equal_adjusted_rewards(device):
    """The loss and the gap are >= 0, and the loss is 0 where the adjusted rewards are equal
    within each group."""
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
    from rlfuse.kernels.tokens import ggpo

    for kernel in (ggpo._ggpo_fwd_kernel, ggpo._ggpo_bwd_kernel):
        assert constexpr_params(kernel) <= {"BLOCK_M", "BLOCK_T", "HAS_CLIP", "ACC"}


def test_module_wrapper(device):
    """rlfuse.GGPOLoss returns the loss of ggpo_loss with the same hyper-parameters."""
    lp, ref, rewards, mask = ggpo_case(4, 5, seed=17)
    module = rlfuse.GGPOLoss(group_size=2, beta=0.5, clip_radius=0.3)
    args = (lp[:, :-1].float().to(device), ref.float().to(device), rewards.float().to(device),
            mask.to(device))
    a, b = module(*args), rlfuse.ggpo_loss(*args, group_size=2, beta=0.5, clip_radius=0.3)
    assert torch.equal(a.loss, b.loss)


# --------------------------------------------------------------------------------------------
# Each implementation against the definition and its properties
# --------------------------------------------------------------------------------------------

def _batch(G=3, m=4, T=6, seed=0, dtype=torch.float64, reward_scale=1.0, device="cpu"):
    """G groups of m sequences: log-probs, reference log-probs (NaN off the mask), rewards and a
    mask with at least one actor token per row, on ``device``."""
    g = torch.Generator().manual_seed(seed)
    B = G * m
    lp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    ref = as_logprobs(lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=g)] = True
    rewards = reward_scale * torch.randn(B, generator=g, dtype=torch.float64)
    ref = torch.where(mask, ref, torch.full_like(ref, float("nan")))    # garbage off the mask
    return tuple(x.to(dtype=dtype if x.is_floating_point() else x.dtype, device=device)
                 for x in (lp, ref, rewards, mask))


def _naive(lp, ref, rewards, mask, m, beta):
    """J_g, q, c from the SPEC's un-centred definitions, with Python floats (moderate inputs)."""
    lp, ref, rewards, mask = (x.cpu() for x in (lp, ref, rewards, mask))
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


def _grad(impl, lp, *args, **kwargs):
    """The output of ``impl.ggpo_loss`` and the gradient of its loss w.r.t. ``lp``."""
    x = lp.clone().requires_grad_(True)
    out = impl.ggpo_loss(x, *args, **kwargs)
    out.loss.backward()
    return out, x.grad


@pytest.mark.parametrize("m,beta", [(2, 0.5), (4, 0.1), (4, 2.0), (8, 1.0)])
def test_loss_and_gradient_match_definition(impl, m, beta, device):
    """Loss, gradient and every metric equal the SPEC's definition (a Python-float loop)."""
    beta = fp32_exact(beta)  # a float64 kernel run on a GPU sees beta rounded to fp32: conftest
    lp, ref, rewards, mask = _batch(G=3, m=m, seed=m, device=device)
    lp.requires_grad_(True)
    out = impl.ggpo_loss(lp, ref, rewards, mask, group_size=m, beta=beta)
    out.loss.backward()
    J, q, c, s, s_ref = _naive(lp.detach(), ref, rewards, mask, m, beta)
    t_tok = int(mask.sum())
    want = m * sum(J) / (beta * math.sqrt(m - 1) * t_tok)
    assert out.loss.item() == pytest.approx(want, **APPROX["fp64"])
    want_grad = -torch.tensor(c, dtype=torch.float64)[:, None] * mask.cpu() / t_tok
    torch.testing.assert_close(lp.grad.cpu(), want_grad, **TOL["fp64_definition_grad"])
    # metrics
    assert out.metrics["gap"].item() == pytest.approx(sum(J) / len(J) / beta, **APPROX["fp64"])
    assert out.metrics["q_max"].item() == pytest.approx(max(q), **APPROX["fp64"])
    assert out.metrics["clip_frac"].item() == 0.0
    assert out.metrics["seq_logratio_mean"].item() == pytest.approx(
        sum(a - b for a, b in zip(s, s_ref)) / len(s), **APPROX["fp64"])
    d = [r - p for p, r, on in zip(lp.detach().flatten().tolist(), ref.flatten().tolist(),
                                   mask.flatten().tolist()) if on]
    assert out.metrics["kl"].item() == pytest.approx(
        sum(math.exp(x) - x - 1 for x in d) / len(d), **APPROX["fp64"])


def test_coefficients_from_gradient_sum_to_zero_per_group(impl, device):
    """The gradient is -c_i M_it / T_tok: one coefficient per sequence, non-trivial, summing to
    zero in each group."""
    m = 4
    lp, ref, rewards, mask = _batch(G=4, m=m, seed=11, reward_scale=3.0, device=device)
    lp.requires_grad_(True)
    impl.ggpo_loss(lp, ref, rewards, mask, group_size=m, beta=0.3).loss.backward()
    t_tok = mask.sum()
    coeff = -lp.grad * t_tok                              # dL/dlp_it = -c_i M_it / T_tok
    assert bool((lp.grad[~mask] == 0).all())
    c = torch.stack([coeff[i][mask[i]][0] for i in range(len(rewards))])
    for i in range(len(rewards)):                         # one coefficient per sequence
        torch.testing.assert_close(coeff[i][mask[i]], c[i].expand(int(mask[i].sum())))
    assert c.abs().max() > 0.1                            # the groups do carry signal
    torch.testing.assert_close(c.view(-1, m).sum(-1),
                               torch.zeros(4, dtype=torch.float64, device=device),
                               **TOL["fp64_zero_sum"])


def test_gap_nonnegative_and_zero_iff_adjusted_rewards_equal(impl, device):
    """The loss and the gap are > 0 on random batches, and 0 (q uniform) where the adjusted
    rewards R_i are equal within each group."""
    m, beta = 4, fp32_exact(0.7)  # exact in a float64 kernel run on a GPU: conftest
    for seed in range(5):
        lp, ref, rewards, mask = _batch(G=3, m=m, seed=seed, device=device)
        out = impl.ggpo_loss(lp, ref, rewards, mask, group_size=m, beta=beta)
        assert out.loss.item() > 0 and out.metrics["gap"].item() > 0
    # rewards that make every R_i = r_i - beta (s_i - s_i^ref) equal inside each group
    s = torch.where(mask, lp, torch.zeros_like(lp)).sum(-1)
    s_ref = torch.where(mask, ref, torch.zeros_like(ref)).sum(-1)
    level = torch.tensor([1.0, -2.0, 5.0], dtype=torch.float64).repeat_interleave(m)
    equal = level.to(device) + beta * (s - s_ref)
    out = impl.ggpo_loss(lp, ref, equal, mask, group_size=m, beta=beta)
    assert abs(out.loss.item()) < 1e-14 and abs(out.metrics["gap"].item()) < 1e-14
    assert out.metrics["q_max"].item() == pytest.approx(1 / m, **APPROX["fp64"])


def test_reward_shift_invariance_per_group(impl, device):
    """A constant per group added to the rewards changes neither the loss nor the gradient; one
    member's shift alone does."""
    m = 3
    lp, ref, rewards, mask = _batch(G=4, m=m, seed=3, device=device)
    shift = torch.tensor([10.0, -7.5, 0.0, 123.0], dtype=torch.float64).repeat_interleave(m)
    results = []
    for r in (rewards, rewards + shift.to(device)):
        x = lp.clone().requires_grad_(True)
        out = impl.ggpo_loss(x, ref, r, mask, group_size=m, beta=0.4)
        out.loss.backward()
        results.append((out.loss.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    # a shift of one member alone is not a symmetry (the test can see a difference)
    x = lp.clone().requires_grad_(True)
    bumped = rewards.clone()
    bumped[0] += 1.0
    assert abs(impl.ggpo_loss(x, ref, bumped, mask, group_size=m, beta=0.4).loss.item()
               - results[0][0].item()) > 1e-3


def test_clip_radius_inf_has_the_direct_gradient(impl, device):
    """clip_radius=inf gives the direct branch's gradient and clips nothing (fp64)."""
    lp, ref, rewards, mask = _batch(G=3, m=4, seed=4, device=device)
    _, direct = _grad(impl, lp, ref, rewards, mask, group_size=4, beta=0.25)
    out, clipped = _grad(impl, lp, ref, rewards, mask, group_size=4, beta=0.25,
                         clip_radius=math.inf)
    torch.testing.assert_close(clipped, direct, **TOL["fp64_grad"])
    assert out.metrics["clip_frac"].item() == 0.0


def test_clipped_branch_uses_clamped_coefficients(impl, device):
    """The clipped branch: coefficients from the clamped log-ratios, surrogate loss -sum c s /
    T_tok, clip_frac the share of saturated tokens, which keep their gradient."""
    m, beta, rho = 4, 0.5, fp32_exact(0.2)  # exact in a float64 kernel run on a GPU: conftest
    lp, ref, rewards, mask = _batch(G=3, m=m, seed=5, device=device)
    out, grad = _grad(impl, lp, ref, rewards, mask, group_size=m, beta=beta, clip_radius=rho)
    d = torch.where(mask, (lp - ref).clamp(-rho, rho), torch.zeros_like(lp))
    logits = (rewards - beta * d.sum(-1)).view(-1, m) / beta
    q = torch.softmax(logits, -1).view(-1)
    c = (m * q - 1) / math.sqrt(m - 1)
    t_tok = mask.sum()
    torch.testing.assert_close(grad, -c[:, None] * mask / t_tok, **TOL["fp64_grad"])
    s = torch.where(mask, lp, torch.zeros_like(lp)).sum(-1)
    assert out.loss.item() == pytest.approx((-(c * s).sum() / t_tok).item(), **APPROX["fp64"])
    saturated = ((lp - ref).abs() > rho) & mask
    want_frac = saturated.sum() / t_tok
    assert out.metrics["clip_frac"].item() == pytest.approx(want_frac.item())
    # saturated tokens keep a gradient (no differentiation through the clamp)
    assert 0 < want_frac < 1 and bool((grad[saturated] != 0).all())
    # and the clamp matters: the direct branch differs
    _, direct = _grad(impl, lp, ref, rewards, mask, group_size=m, beta=beta)
    assert (direct - grad).abs().max() > 1e-3


def test_gradcheck_logprobs(impl, device):
    """gradcheck of the direct branch on log-probs (garbage off the mask)."""
    lp, ref, rewards, mask = _batch(G=2, m=3, T=4, seed=6, device=device)
    lp = torch.where(mask, lp, torch.full_like(lp, 1e4)).requires_grad_(True)  # garbage off mask
    assert torch.autograd.gradcheck(
        lambda x: impl.ggpo_loss(x, ref, rewards, mask, group_size=3, beta=0.3).loss, (lp,))


def test_gradcheck_clipped_branch_when_every_token_saturates(impl, device):
    """gradcheck of the clipped branch where every token saturates."""
    # With every |lp - ref| > rho the clamped d is locally constant, so the surrogate is an exact
    # function of lp whose derivative is -c~ M / T_tok: gradcheck applies.
    lp, ref, rewards, mask = _batch(G=2, m=3, T=4, seed=7, device=device)
    sign = torch.where(torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) > 0.5,
                       1.0, -1.0).to(dtype=torch.float64, device=device)
    lp = (ref.nan_to_num(0.0) + sign * 0.5).requires_grad_(True)
    f = lambda x: impl.ggpo_loss(x, ref, rewards, mask, group_size=3, beta=0.3,
                                 clip_radius=0.1).loss
    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_logits(impl, device):
    """gradcheck on Logits with a temperature (targets out of range off the mask)."""
    g = torch.Generator().manual_seed(8)
    B, T, V = 4, 3, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).to(device).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    targets[~mask] = 10 ** 6                                  # out of range off the mask is fine
    ref = as_logprobs(torch.randn(B, T, generator=g, dtype=torch.float64) - 2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    targets, mask, ref, rewards = (x.to(device) for x in (targets, mask, ref, rewards))
    f = lambda x: impl.ggpo_loss(impl.Logits(x, targets, 1.3), ref, rewards, mask,
                                 group_size=2, beta=0.5).loss
    # fast mode (a random projection of the Jacobian: two evaluations, not one per element)
    assert torch.autograd.gradcheck(f, (logits,), fast_mode=True)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_small_and_large_beta_with_large_rewards_stay_finite(impl, beta, device):
    """fp32 with rewards ~1e3: finite, and equal to the definition's loss and gradient."""
    # rewards of size 1e3 make R/beta ~ 1e5: exp would overflow even fp64 without centring.
    m = 4
    lp, ref, rewards, mask = _batch(G=3, m=m, seed=9, reward_scale=1000.0, device=device)
    lp32, ref32, rewards32 = lp.float(), ref.float(), rewards.float()
    out, grad = _grad(impl, lp32, ref32, rewards32, mask, group_size=m, beta=beta)
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    assert bool(torch.isfinite(grad).all())
    J, q, c, _, _ = _naive(lp32.double(), ref32.double(), rewards32.double(), mask, m, beta)
    t_tok = int(mask.sum())
    want = m * sum(J) / (beta * math.sqrt(m - 1) * t_tok)
    torch.testing.assert_close(out.loss.cpu(), torch.tensor(want, dtype=torch.float32))
    want_grad = -torch.tensor(c)[:, None] * mask.cpu() / t_tok
    torch.testing.assert_close(grad.cpu(), want_grad.float())


def test_num_tokens_global_micro_batches_add_up(impl, device):
    """With num_tokens the global count, the losses and gradients of micro-batches of whole
    groups add up to the batch's; without it they do not."""
    m = 3
    lp, ref, rewards, mask = _batch(G=4, m=m, seed=10, device=device)
    full, full_grad = _grad(impl, lp, ref, rewards, mask, group_size=m, beta=0.6)
    t_tok = mask.sum()
    total, grads = 0.0, []
    for rows in (slice(0, 3), slice(3, 9), slice(9, 12)):          # whole groups
        out, grad = _grad(impl, lp[rows], ref[rows], rewards[rows], mask[rows], group_size=m,
                          beta=0.6, num_tokens=t_tok)
        total += out.loss.item()
        grads.append(grad)
    assert total == pytest.approx(full.loss.item(), **APPROX["fp64"])
    torch.testing.assert_close(torch.cat(grads), full_grad, **TOL["fp64_grad"])
    # without the global count the micro-batch losses do not add up
    local = sum(impl.ggpo_loss(lp[r], ref[r], rewards[r], mask[r], group_size=m,
                               beta=0.6).loss.item()
                for r in (slice(0, 3), slice(3, 9), slice(9, 12)))
    assert abs(local - full.loss.item()) > 1e-3


@pytest.mark.parametrize("clip_radius", [None, 0.3])
def test_masked_garbage_does_not_leak(impl, clip_radius, device):
    """NaN and -inf at masked positions give exactly the results of zeros there, and a zero
    gradient there."""
    lp, ref, rewards, mask = _batch(G=2, m=4, seed=12, device=device)
    dirty_ref = torch.where(mask, ref, torch.full_like(ref, -math.inf))
    dirty_ref[0, ~mask[0]] = math.nan
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, math.nan))
    clean_ref = torch.where(mask, ref, torch.zeros_like(ref))
    a, grad_a = _grad(impl, dirty_lp, dirty_ref, rewards, mask, group_size=4, beta=0.5,
                      clip_radius=clip_radius)
    b, grad_b = _grad(impl, lp, clean_ref, rewards, mask, group_size=4, beta=0.5,
                      clip_radius=clip_radius)
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert torch.equal(grad_a, grad_b) and bool((grad_a[~mask] == 0).all())
    for k in a.metrics:
        assert a.metrics[k].item() == b.metrics[k].item(), k


def test_empty_batch(impl, device):
    """No sequences: loss and metrics 0, an empty gradient."""
    lp = torch.zeros(0, 5, device=device, requires_grad=True)
    out = impl.ggpo_loss(lp, torch.zeros(0, 5, device=device), torch.zeros(0, device=device),
                         torch.zeros(0, 5, dtype=torch.bool, device=device),
                         group_size=2, beta=1.0)
    out.loss.backward()
    assert out.loss.item() == 0 and lp.grad.shape == (0, 5)
    assert all(v.item() == 0 for v in out.metrics.values())


def test_dtypes_of_outputs(impl, device):
    """Loss and metrics are 0-dim fp32 (fp64 for fp64 inputs); the gradient has the input's
    dtype."""
    lp, ref, rewards, mask = _batch(seed=13, device=device)
    for dtype, want in [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)]:
        out, grad = _grad(impl, lp.to(dtype), ref.to(dtype), rewards.to(dtype), mask,
                          group_size=4, beta=0.5)
        assert out.loss.dtype == want and out.loss.dim() == 0 and grad.dtype == dtype
        assert all(v.dtype == want and v.dim() == 0 for v in out.metrics.values())


# --------------------------------------------------------------------------------------------
# Bad input, both implementations
# --------------------------------------------------------------------------------------------

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
def test_bad_input(impl, bad, exc, match, device):
    """A bad argument of an all-zero fp32 batch raises the error naming it."""
    a = dict(policy=torch.zeros(6, 5), ref=torch.zeros(6, 5), rewards=torch.zeros(6),
             mask=torch.ones(6, 5, dtype=torch.bool), group_size=3, beta=1.0, clip_radius=None,
             num_tokens=None)
    a = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    bad = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in bad.items()}
    if bad.pop("empty_group", False):
        a["mask"][3:] = False
    if bad.pop("nan_ref", False):
        a["ref"][1, 2] = float("nan")
    a.update(bad)
    with pytest.raises(exc, match=match):
        impl.ggpo_loss(a.pop("policy"), a.pop("ref"), a.pop("rewards"), a.pop("mask"), **a)


def _bad_ggpo_cases(impl, device):
    """(name, exception, message pattern, arguments, keywords) of each bad argument of a batch
    on ``device``: shapes, devices, dtypes, values, NaN at actor positions."""
    lp, ref, rewards, mask = _batch(G=2, m=3, T=4, seed=14, device=device)
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
        (impl.Logits(lp, torch.zeros(6, dtype=torch.long, device=device)), ref, rewards, mask), \
        base


BAD_PER_ARGUMENT = [case[0] for case in _bad_ggpo_cases(reference, "cpu")]


@pytest.mark.parametrize("name", BAD_PER_ARGUMENT)
def test_bad_input_per_argument(impl, name, device):
    """Each bad argument of a real batch (shape, device, dtype, value, NaN at an actor position)
    raises the error naming it, with the message's detail."""
    cases = {case[0]: case[1:] for case in _bad_ggpo_cases(impl, device)}
    exc, match, args, kwargs = cases[name]
    with pytest.raises(exc, match=match):
        impl.ggpo_loss(*args, **kwargs)
