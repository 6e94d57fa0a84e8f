"""GR-OPD: the ops ``gr_opd_advantages`` and ``gr_opd_loss``.

Both implementations (the kernels and the plain-torch reference, the ``impl`` fixture) against
Python-float loops of the advantages and of the loss: the discount over actor tokens, lambda,
identical scores, the metrics, precomputed advantages and micro-batches, garbage at masked
positions, gradcheck. The kernels against the reference and float64 (the three-way rule): the
advantages, the loss and its gradients from each policy form (log-probs, ``Logits``,
``LinearHead``). Both implementations refuse an overflowing ratio and bad input, and take an
empty batch.
"""
import inspect
import math

import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import APPROX, TOL, assert_three_way, fp32_exact, as_logprobs
from loss_harness import (RecomputedInBackward, check_three_way, constexpr_params, run_loss,
                          token_inputs, with_garbage)


# Hyper-parameters that reach a float64 kernel run unrounded (see conftest.fp32_exact): the
# kernels receive log(gamma), so gamma = exp(an fp32 number).
EXACT = dict(gamma=math.exp(-0.0625), std_eps=2.0 ** -20)

# The advantage hyper-parameters' defaults (both ops).
DEFAULTS = dict(gamma=0.99, lam=0.25, feedback_clip=5.0, adv_clip=5.0, std_eps=1e-6)


def hyper(**changes):
    """``DEFAULTS`` with ``changes``, each moved to the nearest value that a float64 kernel run
    receives unrounded (within ~1e-7 of it): gamma to exp(an fp32 number), the others to fp32
    numbers. Both implementations and the loops then use the same values."""
    hp = {k: fp32_exact(v) for k, v in dict(DEFAULTS, **changes).items()}
    log_gamma = fp32_exact(math.log(hp["gamma"]))
    hp["gamma"] = math.exp(log_gamma)
    assert fp32_exact(math.log(hp["gamma"])) == log_gamma
    return hp


# --------------------------------------------------------------------------------------------
# Inputs and oracles
# --------------------------------------------------------------------------------------------

def gr_opd_case(B, T, *, seed, spread=0.3):
    gen, _, mask = token_inputs(B, T, seed=seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    teacher = as_logprobs(old + torch.randn(B, T, generator=gen, dtype=torch.float64))
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    return torch.cat([lp, lp[:, :1]], 1), with_garbage(old, mask), with_garbage(teacher, mask), mask


def _batch(G=3, m=3, T=8, seed=0, dtype=torch.float64, scale=0.3, device="cpu"):
    """Responses of unequal lengths with holes inside them (masked positions between actor
    tokens), NaN at every masked position of the detached inputs; on ``device``."""
    g = torch.Generator().manual_seed(seed)
    B = G * m
    old = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    teacher = as_logprobs(old + torch.randn(B, T, generator=g, dtype=torch.float64))
    lp = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    nan = torch.full_like(old, math.nan)
    old, teacher = torch.where(mask, old, nan), torch.where(mask, teacher, nan)
    return tuple(x.to(dtype).to(device) for x in (lp, old, teacher)) + (mask.to(device),)


def _loop_advantages(old, teacher, mask, m, gamma, lam, feedback_clip, adv_clip, std_eps):
    """The SPEC's sequence credit with Python floats, one actor token at a time."""
    old, teacher, mask = old.cpu(), teacher.cpu(), mask.cpu()
    scores = []
    for i in range(mask.shape[0]):
        num = den = 0.0
        k = 0
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            k += 1                                           # t_k: k-th actor token, 1-based
            r = min(max(float(teacher[i, t]) - float(old[i, t]), -feedback_clip), feedback_clip)
            num += gamma ** (k - 1) * r
            den += gamma ** (k - 1)
        scores.append(num / den)
    adv = []
    for g in range(len(scores) // m):
        S = scores[g * m:(g + 1) * m]
        mu = sum(S) / m
        sigma = math.sqrt(sum((s - mu) ** 2 for s in S) / m)          # population std
        adv += [min(max((s - mu + lam * mu) / (sigma + std_eps), -adv_clip), adv_clip) for s in S]
    return adv, scores


def _loop_loss(lp, old, adv, mask, eps, num_sequences=None, per_response=True):
    """-(1/B) sum_i (1/T_i) sum_t min(rho A, clip(rho, 1-eps, 1+eps) A) and its gradient; with
    per_response=False the global token mean instead (the negative control)."""
    lp, old, mask = lp.cpu(), old.cpu(), mask.cpu()
    B, T = mask.shape
    n_seq = num_sequences if num_sequences is not None else B
    n_tok = int(mask.sum())
    loss, grad = 0.0, torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        length = int(mask[i].sum())
        for t in range(T):
            if not mask[i, t]:
                continue
            rho = math.exp(float(lp[i, t]) - float(old[i, t]))
            a = adv[i]
            unclipped, clipped = rho * a, min(max(rho, 1 - eps), 1 + eps) * a
            w = 1 / (n_seq * length) if per_response else 1 / n_tok
            loss -= w * min(unclipped, clipped)
            grad[i, t] = -w * rho * a if unclipped <= clipped else 0.0
    return loss, grad


# --------------------------------------------------------------------------------------------
# gr_opd_advantages
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma,lam", [(0.99, 0.25), (0.5, 0.0), (1.0, 0.25), (0.8, 1.0)])
def test_advantages_against_loop(gamma, lam, impl, device):
    """The advantages equal the loop's, detached, in float64; the data reach both clamps (the
    feedback's and the advantages')."""
    _, old, teacher, mask = _batch(seed=1, device=device)
    hp = hyper(gamma=gamma, lam=lam, feedback_clip=0.8, adv_clip=1.2, std_eps=1e-3)
    got = impl.gr_opd_advantages(old, teacher, mask, group_size=3, **hp)
    want, _ = _loop_advantages(old, teacher, mask, 3, **hp)
    torch.testing.assert_close(got.cpu(), torch.tensor(want, dtype=torch.float64), **TOL["fp64"])
    assert not got.requires_grad and got.dtype == torch.float64
    # the data exercises both clamps
    raw, _ = _loop_advantages(old, teacher, mask, 3,
                              **dict(hp, feedback_clip=math.inf, adv_clip=math.inf))
    clamped_feedback = ((teacher - old).abs() > hp["feedback_clip"]) & mask
    assert bool(clamped_feedback.any()) and max(abs(a) for a in raw) > hp["adv_clip"]
    assert min(abs(a) for a in raw) < hp["adv_clip"]


def test_discount_counts_actor_tokens_only(impl, device):
    """gamma discounts by the actor index k, not by the position t: the two differ on this data
    (holes in the mask), and the advantages are the loop's (by k)."""
    # Negative control for the loop above: a discount by absolute position t (not by the actor
    # index k) gives different scores on this data, so the holes in the mask are exercised.
    _, old, teacher, mask = _batch(seed=2, device=device)
    hp = hyper(gamma=0.5, lam=0.0, adv_clip=math.inf)
    gamma = hp["gamma"]
    _, scores = _loop_advantages(old, teacher, mask, 3, **hp)
    cpu_old, cpu_teacher, cpu_mask = old.cpu(), teacher.cpu(), mask.cpu()
    wrong = []
    for i in range(cpu_mask.shape[0]):
        w = [gamma ** t if cpu_mask[i, t] else 0.0 for t in range(cpu_mask.shape[1])]
        r = [float(cpu_teacher[i, t] - cpu_old[i, t]) if cpu_mask[i, t] else 0.0
             for t in range(cpu_mask.shape[1])]
        wrong.append(sum(a * b for a, b in zip(w, r)) / sum(w))
    assert max(abs(a - b) for a, b in zip(scores, wrong)) > 1e-3
    got = impl.gr_opd_advantages(old, teacher, mask, group_size=3, **hp)
    want, _ = _loop_advantages(old, teacher, mask, 3, **hp)
    torch.testing.assert_close(got.cpu(), torch.tensor(want, dtype=torch.float64),
                               **TOL["fp64_relative"])


def test_lambda_sets_the_group_mean(impl, device):
    """Unclamped, each group's mean advantage is lam mu / (sigma + std_eps): 0 for lam = 0."""
    _, old, teacher, mask = _batch(G=4, seed=3, device=device)
    hp = hyper(lam=0.0, adv_clip=math.inf)
    _, scores = _loop_advantages(old, teacher, mask, 3, **hp)
    S = torch.tensor(scores, dtype=torch.float64).view(4, 3)
    mu, sigma = S.mean(-1), S.std(-1, correction=0)
    for lam in (0.0, 0.25, 1.0):
        adv = impl.gr_opd_advantages(old, teacher, mask, group_size=3, **dict(hp, lam=lam))
        # lambda = 0: centred in every group; lambda > 0: mean pressure lam * mu / (sigma + eps)
        torch.testing.assert_close(adv.cpu().view(4, 3).mean(-1),
                                   lam * mu / (sigma + hp["std_eps"]), **TOL["fp64_chain"])
    assert mu.abs().min() > 1e-2                      # so lam visibly moves the means


def test_identical_scores_give_finite_advantages(impl, device):
    """sigma = 0 in every group: A = min(lam mu / std_eps, adv_clip), finite, also unclamped."""
    _, _, _, mask = _batch(G=2, seed=4, device=device)
    # multiples of 1/16 and a feedback of exactly 0.25: every S_i is exactly 0.25, sigma = 0
    old = -torch.randint(4, 64, mask.shape, generator=torch.Generator().manual_seed(4)) / 16
    old = old.to(torch.float64).to(device)
    teacher = old + 0.25
    for lam, adv_clip in [(0.25, 5.0), (0.0, 5.0), (0.25, math.inf)]:
        hp = hyper(lam=lam, adv_clip=adv_clip)
        adv = impl.gr_opd_advantages(old, teacher, mask, group_size=3, **hp)
        assert bool(torch.isfinite(adv).all())
        want = min(lam * 0.25 / hp["std_eps"], adv_clip)
        torch.testing.assert_close(adv.cpu(), torch.full_like(adv.cpu(), want),
                                   **TOL["fp64_relative"])


@pytest.mark.parametrize("group_size", [2, 3, 4])
@pytest.mark.parametrize("lam", [0.0, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_match_float64(group_size, lam, dtype, device):
    check_advantages(2 * group_size, 37, dtype, device, seed=group_size, group_size=group_size,
                     lam=lam, feedback_clip=0.75, **EXACT)


def check_advantages(B, T, dtype, device, *, seed, **kw):
    """Fused advantages in ``dtype`` within the three-way rule of the float64 reference."""
    _, old, teacher, mask = gr_opd_case(B, T, seed=seed)
    fused = rlfuse.gr_opd_advantages(old.to(dtype).to(device), teacher.to(dtype).to(device),
                                     mask.to(device), **kw)
    ref = reference.gr_opd_advantages(old.to(dtype), teacher.to(dtype), mask, **kw)
    ref64 = reference.gr_opd_advantages(old, teacher, mask, **kw)
    assert_three_way(fused.cpu(), ref, ref64, "advantages")


def test_advantages_clipped_on_both_sides(device):
    """A small adv_clip saturates advantages of both signs."""
    _, old, teacher, mask = gr_opd_case(8, 9, seed=6)
    kw = dict(group_size=4, lam=0.0, adv_clip=0.75, **EXACT)
    adv = rlfuse.gr_opd_advantages(old.to(device), teacher.to(device), mask.to(device), **kw)
    ref = reference.gr_opd_advantages(old, teacher, mask, **kw)
    assert (ref == 0.75).any() and (ref == -0.75).any()
    torch.testing.assert_close(adv.cpu(), ref, **TOL["fp64"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_discount_spans_time_blocks(dtype, device):
    """T beyond one time block of the group kernel: the actor index k carries across blocks."""
    from rlfuse.kernels.lib.utils import group_tile

    m, T = 16, 300
    assert group_tile(T, m)[1] < T
    check_advantages(m, T, dtype, device, seed=8, **dict(EXACT, group_size=m,
                     gamma=math.exp(-2.0 ** -7), feedback_clip=0.75))


def test_advantages_identical_scores(device):
    """sigma = 0: A = clamp(lam mu / std_eps), finite."""
    _, old, _, mask = gr_opd_case(4, 6, seed=5)
    old = old - 0.5
    teacher = old + 0.5
    adv = rlfuse.gr_opd_advantages(old.to(device), teacher.to(device), mask.to(device),
                                   group_size=2, lam=0.25)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.cpu(), torch.full((4,), 5.0, dtype=torch.float64))


# --------------------------------------------------------------------------------------------
# gr_opd_loss: against the loops, against the reference and float64 from each policy form
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", [0.2, 0.05])
def test_loss_against_loop_and_not_a_global_token_mean(eps, impl, device):
    """The loss and its gradient equal the loop's per-response mean (with the default
    hyper-parameters), which differs from the global token mean here; both PPO branches
    occur."""
    for fn in (impl.gr_opd_advantages, impl.gr_opd_loss):
        params = inspect.signature(fn).parameters
        assert {k: params[k].default for k in DEFAULTS} == DEFAULTS, fn.__name__
    lp, old, teacher, mask = _batch(seed=5, scale=0.4, device=device)
    lp.requires_grad_(True)
    hp = hyper()
    out = impl.gr_opd_loss(lp, old, teacher, mask, group_size=3, eps=eps, **hp)
    out.loss.backward()
    adv, _ = _loop_advantages(old, teacher, mask, 3, **hp)
    want, want_grad = _loop_loss(lp.detach(), old, adv, mask, eps)
    assert out.loss.item() == pytest.approx(want, **APPROX["fp64"])
    torch.testing.assert_close(lp.grad.cpu(), want_grad, **TOL["fp64_grad"])
    global_mean, _ = _loop_loss(lp.detach(), old, adv, mask, eps, per_response=False)
    lengths = mask.sum(-1)
    assert lengths.min() < lengths.max()
    assert abs(global_mean - want) > 1e-3 * abs(want)
    assert 0 < out.metrics["clip_frac"] < 1          # both PPO branches are present


def test_metrics(impl, device):
    """clip_frac (low, high and both), adv_mean, adv_abs_mean and feedback_mean against their
    definitions: detached scalars."""
    lp, old, teacher, mask = _batch(seed=6, scale=0.4, device=device)
    hp = hyper(feedback_clip=0.7)
    m = impl.gr_opd_loss(lp, old, teacher, mask, group_size=3, eps=0.1, **hp).metrics
    lp, old, teacher, mask = lp.cpu(), old.cpu(), teacher.cpu(), mask.cpu()
    adv, _ = _loop_advantages(old, teacher, mask, 3, **hp)
    adv_t = torch.tensor(adv, dtype=torch.float64)[:, None].expand_as(lp)
    rho = torch.exp(lp - old)
    clipped = ((adv_t > 0) & (rho > 1.1)) | ((adv_t < 0) & (rho < 0.9))
    assert m["clip_frac"].item() == pytest.approx((clipped & mask).sum().item() / mask.sum().item())
    low, high = (adv_t < 0) & (rho < 0.9), (adv_t > 0) & (rho > 1.1)
    assert m["clip_frac_low"].item() == pytest.approx((low & mask).sum().item() / mask.sum().item())
    assert m["clip_frac_high"].item() == pytest.approx(
        (high & mask).sum().item() / mask.sum().item())
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0
    assert m["adv_mean"].item() == pytest.approx(sum(adv) / len(adv), **APPROX["fp64_metric"])
    assert m["adv_abs_mean"].item() == pytest.approx(sum(map(abs, adv)) / len(adv),
                                                     **APPROX["fp64"])
    feedback = (teacher - old).clamp(-hp["feedback_clip"], hp["feedback_clip"])[mask]
    assert m["feedback_mean"].item() == pytest.approx(feedback.mean().item(), **APPROX["fp64"])
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_logprobs_matches_float64(dtype, lam, device):
    lp, old, teacher, mask = gr_opd_case(6, 11, seed=7)
    check_three_way(rlfuse.gr_opd_loss, reference.gr_opd_loss, lp, dtype=dtype, device=device,
                    args=(old.to(dtype), teacher.to(dtype), mask),
                    args64=(old, teacher, mask),
                    metric_names=["clip_frac", "clip_frac_low", "clip_frac_high", "adv_mean",
                                  "adv_abs_mean", "feedback_mean"],
                    group_size=3, lam=lam, eps=0.125, feedback_clip=0.75, **EXACT)


@pytest.mark.parametrize("dtype, V", [(torch.bfloat16, 37), (torch.bfloat16, 4099),
                                      (torch.float32, 4099)])
def test_logits_single_pass(dtype, V, device):
    B, T = 4, 5
    gen = torch.Generator().manual_seed(V)
    logits = (torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 2).to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    targets[~mask] = -1
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets.clamp(0)[..., None])[..., 0]
    old = with_garbage(as_logprobs(lp + torch.randn(B, T, generator=gen,
                                                    dtype=torch.float64) * 0.2), mask)
    teacher = with_garbage(as_logprobs(lp + torch.randn(B, T, generator=gen,
                                                        dtype=torch.float64)), mask)
    check_three_way(rlfuse.gr_opd_loss, reference.gr_opd_loss, logits, dtype=dtype,
                    device=device, logits_targets=targets,
                    args=(old.float(), teacher.float(), mask), args64=(old, teacher, mask),
                    group_size=2)


# A LinearHead policy: hidden states [B, S, H] and the output head [V, H] with a bias; the rows
# from HEAD_OFFSET on predict the T targets.
HEAD_B, HEAD_S, HEAD_H, HEAD_V, HEAD_T, HEAD_OFFSET = 4, 8, 8, 37, 5, 2


def head_case(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(HEAD_B, HEAD_T, generator=gen) > 0.3
    mask[:, 0] = True
    old = -torch.rand(HEAD_B, HEAD_T, generator=gen, dtype=torch.float64) * 4
    teacher = as_logprobs(old + torch.randn(HEAD_B, HEAD_T, generator=gen, dtype=torch.float64))
    return dict(
        hidden=torch.randn(HEAD_B, HEAD_S, HEAD_H, generator=gen, dtype=torch.float64),
        weight=torch.randn(HEAD_V, HEAD_H, generator=gen, dtype=torch.float64) * 0.7,
        bias=torch.randn(HEAD_V, generator=gen, dtype=torch.float64) * 0.2,
        targets=torch.randint(0, HEAD_V, (HEAD_B, HEAD_T), generator=gen), mask=mask,
        old=with_garbage(old, mask), teacher=with_garbage(teacher, mask))


def run_head(impl, case, dtype, device, *, chunk, **kw):
    """``([loss, dhidden, dweight, dbias], metrics)`` of one call on ``device`` from a LinearHead
    in ``dtype`` (temperature 0.8); old and teacher log-probs in the compute dtype."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    hidden, weight, bias = (case[k].to(dtype).to(device).clone().requires_grad_(True)
                            for k in ("hidden", "weight", "bias"))
    policy = impl.LinearHead(hidden, weight, case["targets"].to(device), bias, 0.8,
                             offset=HEAD_OFFSET, chunk_tokens=chunk)
    out = impl.gr_opd_loss(policy, case["old"].to(acc).to(device),
                           case["teacher"].to(acc).to(device), case["mask"].to(device), **kw)
    grads = torch.autograd.grad(out.loss, (hidden, weight, bias))
    return ([out.loss.detach().cpu()] + [g.cpu() for g in grads],
            {k: v.detach().cpu() for k, v in out.metrics.items()})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [3, 20, 64])    # chunks of 3 tokens, of 20 (B T), one of 64
def test_linear_head_matches_float64(dtype, chunk, device):
    """From a LinearHead (logits one chunk at a time): the loss, the gradients of hidden, weight
    and bias and the metrics within the three-way rule of the float64 reference."""
    case = head_case(13)
    kw = dict(group_size=2, lam=0.25, eps=0.125, feedback_clip=0.75, **EXACT)
    fused = run_head(rlfuse, case, dtype, device, chunk=chunk, **kw)
    ref = run_head(reference, case, dtype, "cpu", chunk=chunk, **kw)
    ref64 = run_head(reference, case, torch.float64, "cpu", chunk=chunk, **kw)
    for label, f, r, r64 in zip(("loss", "dhidden", "dweight", "dbias"), fused[0], ref[0],
                                ref64[0]):
        assert f.dtype == r.dtype, label
        assert_three_way(f, r, r64, label)
    assert set(fused[1]) == set(ref64[1])
    for name in fused[1]:
        assert fused[1][name].dim() == 0
        assert_three_way(fused[1][name], ref[1][name], ref64[1][name], name,
                         atol_dtype=torch.float32)


def test_precomputed_advantages_and_global_num_sequences(impl, device):
    """Advantages given equal those computed (the same loss); micro-batches of whole groups with
    the full batch's advantages and the global num_sequences add up to the full loss and
    gradient."""
    lp, old, teacher, mask = _batch(G=4, seed=7, device=device)
    adv = impl.gr_opd_advantages(old, teacher, mask, group_size=3)
    full_x = lp.clone().requires_grad_(True)
    full = impl.gr_opd_loss(full_x, old, teacher, mask, group_size=3)
    full.loss.backward()
    given = impl.gr_opd_loss(lp, old, teacher, mask, group_size=3, advantages=adv)
    assert given.loss.item() == full.loss.item()
    # micro-batches of whole groups, advantages from the full batch, the global B
    total, grads = 0.0, []
    for rows in (slice(0, 6), slice(6, 9), slice(9, 12)):
        x = lp[rows].clone().requires_grad_(True)
        out = impl.gr_opd_loss(x, old[rows], teacher[rows], mask[rows], group_size=3,
                               advantages=adv[rows], num_sequences=12)
        out.loss.backward()
        total += out.loss.item()
        grads.append(x.grad)
    assert total == pytest.approx(full.loss.item(), **APPROX["fp64"])
    torch.testing.assert_close(torch.cat(grads), full_x.grad, **TOL["fp64_grad"])


def test_precomputed_advantages_and_micro_batches(device):
    """Advantages once per rollout, then micro-batches with the global num_sequences add up."""
    lp, old, teacher, mask = gr_opd_case(8, 7, seed=9)
    adv = rlfuse.gr_opd_advantages(old.to(device), teacher.to(device), mask.to(device),
                                   group_size=4)
    full = run_loss(rlfuse.gr_opd_loss, lp, dtype=torch.float64, device=device,
                    args=(old, teacher, mask), group_size=4)
    parts = [run_loss(rlfuse.gr_opd_loss, lp[s], dtype=torch.float64, device=device,
                      args=(old[s], teacher[s], mask[s]), group_size=2, advantages=adv[s],
                      num_sequences=8)
             for s in (slice(0, 2), slice(2, 5), slice(5, 8))[:1] + (slice(2, 8),)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], full[0], **TOL["fp64"])
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), full[2])


def test_precomputed_advantages_same_loss_and_metrics(device):
    lp, old, teacher, mask = gr_opd_case(6, 7, seed=14)
    adv = rlfuse.gr_opd_advantages(old.to(device), teacher.to(device), mask.to(device),
                                   group_size=3)
    kw = dict(dtype=torch.float64, device=device, args=(old, teacher, mask), group_size=3)
    computed = run_loss(rlfuse.gr_opd_loss, lp, **kw)
    given = run_loss(rlfuse.gr_opd_loss, lp, advantages=adv, **kw)
    torch.testing.assert_close(given[0], computed[0], **TOL["fp64"])
    torch.testing.assert_close(given[2], computed[2], **TOL["fp64"])
    for name, value in computed[1].items():
        torch.testing.assert_close(given[1][name], value, **TOL["fp64"])


def test_per_response_mean_differs_from_token_mean(device):
    """Negative control: with unequal lengths the loss is not the global token mean."""
    lp, old, teacher, mask = gr_opd_case(4, 8, seed=10)
    mask[0, 2:] = False  # response 0 has 2 tokens, the others up to 8
    loss = run_loss(rlfuse.gr_opd_loss, lp, dtype=torch.float64, device=device,
                    args=(old, teacher, mask), group_size=2, eps=0.25, **EXACT)[0].cpu()
    adv = reference.gr_opd_advantages(old, teacher, mask, group_size=2, **EXACT)
    # PPO's [1 - eps, 1 + eps] is GPPO's tv / mc region with delta = eps / 2
    region = dict(geometry="tv", topology="mc", delta=0.125)
    token_mean = run_loss(reference.gppo_loss, lp, dtype=torch.float64,
                          args=(old, adv, mask), **region)[0]
    per_response = run_loss(reference.gppo_loss, lp, dtype=torch.float64,
                            args=(old, adv, mask), agg="seq-mean-token-mean", **region)[0]
    torch.testing.assert_close(loss, per_response, **TOL["fp64"])
    assert abs(loss.item() - token_mean.item()) > 1e-3


def test_masked_garbage_does_not_leak(impl, device):
    """NaN and -inf at masked positions of the policy, old and teacher log-probs give the same
    loss, gradient (zero there) and metrics as zeros there."""
    lp, old, teacher, mask = _batch(seed=8, device=device)
    dirty_teacher = torch.where(mask, teacher, torch.full_like(teacher, -math.inf))
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, math.nan)).requires_grad_(True)
    clean_old = torch.where(mask, old, torch.zeros_like(old))
    clean_teacher = torch.where(mask, teacher, torch.zeros_like(teacher))
    a = impl.gr_opd_loss(dirty_lp, old, dirty_teacher, mask, group_size=3)  # old NaN off mask
    a.loss.backward()
    x = lp.clone().requires_grad_(True)
    b = impl.gr_opd_loss(x, clean_old, clean_teacher, mask, group_size=3)
    b.loss.backward()
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert torch.equal(dirty_lp.grad, x.grad) and bool((x.grad[~mask] == 0).all())
    for k in a.metrics:
        assert a.metrics[k].item() == b.metrics[k].item(), k


def test_gradcheck_logprobs(impl, device):
    """The gradient w.r.t. the log-probs agrees with finite differences."""
    lp, old, teacher, mask = _batch(G=2, m=2, T=5, seed=9, scale=0.5, device=device)
    lp = lp.requires_grad_(True)
    f = lambda x: impl.gr_opd_loss(x, old, teacher, mask, group_size=2, eps=0.15).loss
    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_logits(impl, device):
    """The gradient w.r.t. the logits (temperature 0.9) agrees with finite differences. The
    fused loss, through ``RecomputedInBackward``, on rows 0 and 3 with 3 logits per token: gradcheck
    evaluates it twice per logit, ~0.4 s each in the interpreter."""
    g = torch.Generator().manual_seed(10)
    B, T, V = 4, 3, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    targets[~mask] = -1
    old = as_logprobs(torch.randn(B, T, generator=g, dtype=torch.float64) - 1.5)
    teacher = as_logprobs(torch.randn(B, T, generator=g, dtype=torch.float64) - 1.5)
    if impl is rlfuse:
        rows, V = [0, 3], 3
        logits, targets = logits[rows, :, :V], targets[rows].remainder(V)
        mask, old, teacher = mask[rows], old[rows], teacher[rows]
        targets[~mask] = -1
    logits = logits.to(device).requires_grad_(True)
    targets, mask, old, teacher = (t.to(device) for t in (targets, mask, old, teacher))
    f = lambda x: impl.gr_opd_loss(impl.Logits(x, targets, 0.9), old, teacher, mask,
                                   group_size=2, eps=0.3).loss
    if impl is rlfuse:
        f = lambda x, loss=f: RecomputedInBackward.apply(x, loss)
    assert torch.autograd.gradcheck(f, (logits,))


# --------------------------------------------------------------------------------------------
# Refusals, the empty batch, bad input
# --------------------------------------------------------------------------------------------

def test_overflow_raises(impl, device):
    """A ratio that overflows fp32 on the unclipped branch (A < 0) is refused."""
    lp, old, teacher, mask = gr_opd_case(2, 3, seed=11)
    lp = torch.cat([torch.where(mask, old, 0.0) + 100.0, lp[:, -1:]], 1)
    adv = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="overflow"):
        run_loss(impl.gr_opd_loss, lp, dtype=torch.float32, device=device,
                 args=(old.float(), teacher.float(), mask), group_size=2,
                 advantages=adv.float())


@pytest.mark.parametrize("dtype,overflowing,representable", [
    (torch.bfloat16, 100.0, 30.0),     # computed in fp32: e^100 > 3.4e38
    (torch.float32, 100.0, 30.0),
    (torch.float64, 1000.0, 100.0),    # computed in fp64: e^100 fits, e^1000 does not
])
def test_overflow_of_the_unclipped_negative_branch_raises(dtype, overflowing, representable,
                                                          impl, device):
    """The unclipped branch (A < 0, ratio above the region) raises where exp(log-ratio)
    overflows the compute dtype and is finite where it fits; the clipped branches never
    exponentiate, so any log-ratio is finite there."""
    mask = torch.ones(2, 2, dtype=torch.bool, device=device)
    old = torch.full((2, 2), math.log(0.3), dtype=dtype, device=device)
    adv = torch.tensor([-1.0, 1.0], dtype=dtype, device=device)
    for shift, fails in [(overflowing, True), (representable, False)]:
        lp = old + torch.tensor([[shift, 0.0], [shift, 0.0]], dtype=dtype, device=device)
        lp.requires_grad_(True)
        if fails:
            with pytest.raises(ValueError, match="policy.*overflow"):
                impl.gr_opd_loss(lp, old, old, mask, group_size=1, advantages=adv)
        else:
            out = impl.gr_opd_loss(lp, old, old, mask, group_size=1, advantages=adv)
            out.loss.backward()
            assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all())
            assert lp.grad[0, 0] != 0                     # the unclipped branch, A < 0
    # the clipped branches never exponentiate: any log-ratio is finite there
    shift = torch.tensor([[-5000.0, 0.0], [5000.0, 0.0]], dtype=dtype, device=device)
    lp = (old + shift).requires_grad_(True)
    out = impl.gr_opd_loss(lp, old, old, mask, group_size=1, advantages=adv)
    out.loss.backward()
    assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all())
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0
    assert out.metrics["clip_frac"].item() == 0.5


def test_empty_batch(impl, device):
    """B = 0: a zero loss with a gradient of the policy's shape, zero metrics."""
    lp = torch.zeros(0, 5, device=device, requires_grad=True)
    out = impl.gr_opd_loss(lp, torch.zeros(0, 5, device=device), torch.zeros(0, 5, device=device),
                           torch.zeros(0, 5, dtype=torch.bool, device=device), group_size=2)
    out.loss.backward()
    assert out.loss.item() == 0 and lp.grad.shape == (0, 5)
    assert all(v.item() == 0 for v in out.metrics.values())


BAD = [
    (dict(group_size=3), ValueError, "group_size"),
    (dict(gamma=0.0), ValueError, "gamma"),
    (dict(gamma=1.5), ValueError, "gamma"),
    (dict(eps=0.0), ValueError, "eps"),
    (dict(old=torch.zeros(4, 6)), ValueError, "old_logprobs"),
    (dict(teacher=torch.zeros(3, 5)), ValueError, "teacher_logprobs"),
    (dict(advantages=torch.zeros(3)), ValueError, "advantages"),
    (dict(empty_response=True), ValueError, "mask"),
]


@pytest.mark.parametrize("bad, exc, match", BAD)
def test_bad_input(impl, bad, exc, match, device):
    """The loss refuses each bad argument of a float32 batch of 4 responses (groups of 2)."""
    a = dict(policy=torch.zeros(4, 5), old=torch.zeros(4, 5) - 1, teacher=torch.zeros(4, 5) - 2,
             mask=torch.ones(4, 5, dtype=torch.bool), group_size=2)
    bad = dict(bad)
    if bad.pop("empty_response", False):
        a["mask"][1] = False
    a.update(bad)
    a = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    with pytest.raises(exc, match=match):
        impl.gr_opd_loss(a.pop("policy"), a.pop("old"), a.pop("teacher"), a.pop("mask"), **a)


def _bad_gr_opd_cases():
    lp, old, teacher, mask = _batch(G=2, m=3, T=5, seed=11)
    empty = mask.clone()
    empty[4] = False
    nan_teacher = teacher.clone()
    nan_teacher[mask] = math.nan
    args = (lp, old, teacher, mask)
    k = dict(group_size=3)
    yield "B%m", ValueError, "group_size.*multiple", args, dict(group_size=4)
    yield "m0", ValueError, "group_size", args, dict(group_size=0)
    yield "old-shape", ValueError, "old_logprobs", (lp, old[:, 1:], teacher, mask), k
    yield "old-device", ValueError, "old_logprobs", (lp, old.to("meta"), teacher, mask), k
    yield "old-int", TypeError, "old_logprobs", (lp, old.long(), teacher, mask), k
    yield "teacher-shape", ValueError, "teacher_logprobs", (lp, old, teacher[:5], mask), k
    yield "teacher-device", ValueError, "teacher_logprobs", (lp, old, teacher.to("meta"), mask), k
    yield "teacher-nan", ValueError, "teacher_logprobs", (lp, old, nan_teacher, mask), k
    yield "mask-shape", ValueError, "mask", (lp, old, teacher, mask[:, :4]), k
    yield "policy-shape", ValueError, "policy", (lp[:, :, None], old, teacher, mask), k
    yield "empty-response", ValueError, "mask.*sequence 4", (lp, old, teacher, empty), k
    yield "gamma0", ValueError, "gamma", args, dict(k, gamma=0.0)
    yield "gamma>1", ValueError, "gamma", args, dict(k, gamma=1.01)
    yield "gamma-", ValueError, "gamma", args, dict(k, gamma=-0.5)
    yield "eps0", ValueError, "eps", args, dict(k, eps=0.0)
    yield "eps-", ValueError, "eps", args, dict(k, eps=-0.2)
    yield "feedback_clip-", ValueError, "feedback_clip", args, dict(k, feedback_clip=-1.0)
    yield "adv_clip-", ValueError, "adv_clip", args, dict(k, adv_clip=-0.1)
    yield "std_eps0", ValueError, "std_eps", args, dict(k, std_eps=0.0)
    yield "lam-type", TypeError, "lam", args, dict(k, lam="0.25")
    yield "adv-shape", ValueError, "advantages", args, dict(k, advantages=torch.zeros(5))
    yield "adv-nan", ValueError, "advantages", args, \
        dict(k, advantages=torch.full((6,), math.nan, dtype=torch.float64))
    yield "num_sequences", ValueError, "num_sequences", args, dict(k, num_sequences=0)


def _on(x, device):
    """A tensor moved to ``device`` (one on the meta device stays there); anything else as is."""
    return x.to(device) if isinstance(x, torch.Tensor) and not x.is_meta else x


@pytest.mark.parametrize("name,exc,match,args,kwargs", list(_bad_gr_opd_cases()),
                         ids=[c[0] for c in _bad_gr_opd_cases()])
def test_bad_input_each_argument(name, exc, match, args, kwargs, impl, device):
    """The loss refuses each bad argument, shape, device, dtype, value and hyper-parameter of
    a float64 batch of 6 responses (groups of 3) with the error that names it."""
    args = [_on(a, device) for a in args]
    kwargs = {key: _on(v, device) for key, v in kwargs.items()}
    with pytest.raises(exc, match=match):
        impl.gr_opd_loss(*args, **kwargs)


def test_bad_advantages_input(impl, device):
    """gr_opd_advantages refuses a batch not made of whole groups, mismatched shapes, gamma > 1
    and a response without actor tokens."""
    _, old, teacher, mask = _batch(G=2, m=3, T=5, seed=12, device=device)
    with pytest.raises(ValueError, match="group_size.*multiple"):
        impl.gr_opd_advantages(old, teacher, mask, group_size=4)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        impl.gr_opd_advantages(old, teacher[:, :4], mask, group_size=3)
    with pytest.raises(ValueError, match="old_logprobs"):
        impl.gr_opd_advantages(old[0], teacher, mask, group_size=3)
    with pytest.raises(ValueError, match="gamma"):
        impl.gr_opd_advantages(old, teacher, mask, group_size=3, gamma=2.0)
    with pytest.raises(ValueError, match="mask.*sequence 0"):
        impl.gr_opd_advantages(old, teacher, torch.zeros_like(mask), group_size=3)


# --------------------------------------------------------------------------------------------
# The kernel and the module
# --------------------------------------------------------------------------------------------

def test_runtime_hyperparameters_are_not_constexpr():
    from rlfuse.kernels.tokens import gr_opd

    assert constexpr_params(gr_opd._gr_opd_adv_kernel) <= {"BLOCK_M", "BLOCK_T", "ACC"}


def test_module_wrapper(device):
    lp, old, teacher, mask = gr_opd_case(4, 5, seed=12)
    module = rlfuse.GROPDLoss(group_size=2, eps=0.3)
    args = (lp[:, :-1].float().to(device), old.float().to(device), teacher.float().to(device),
            mask.to(device))
    assert torch.equal(module(*args).loss, rlfuse.gr_opd_loss(*args, group_size=2, eps=0.3).loss)
