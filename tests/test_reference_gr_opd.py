"""Tests of the reference GR-OPD advantages and loss."""
import math

import pytest
import torch

from rlfuse.reference import Logits, gr_opd_advantages, gr_opd_loss


def _batch(G=3, m=3, T=8, seed=0, dtype=torch.float64, scale=0.3):
    """Responses of unequal lengths with holes inside them (masked positions between actor
    tokens), NaN at every masked position of the detached inputs."""
    g = torch.Generator().manual_seed(seed)
    B = G * m
    old = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    teacher = old + torch.randn(B, T, generator=g, dtype=torch.float64)
    lp = old + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    nan = torch.full_like(old, math.nan)
    old, teacher = torch.where(mask, old, nan), torch.where(mask, teacher, nan)
    return lp.to(dtype), old.to(dtype), teacher.to(dtype), mask


def _loop_advantages(old, teacher, mask, m, gamma, lam, feedback_clip, adv_clip, std_eps):
    """The SPEC's sequence credit with Python floats, one actor token at a time."""
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


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.25), (0.5, 0.0), (1.0, 0.25), (0.8, 1.0)])
def test_advantages_against_loop(gamma, lam):
    _, old, teacher, mask = _batch(seed=1)
    got = gr_opd_advantages(old, teacher, mask, group_size=3, gamma=gamma, lam=lam,
                            feedback_clip=0.8, adv_clip=1.2, std_eps=1e-3)
    want, _ = _loop_advantages(old, teacher, mask, 3, gamma, lam, 0.8, 1.2, 1e-3)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12,
                               atol=1e-14)
    assert not got.requires_grad and got.dtype == torch.float64
    # the data exercises both clamps
    raw, _ = _loop_advantages(old, teacher, mask, 3, gamma, lam, math.inf, math.inf, 1e-3)
    clamped_feedback = ((teacher - old).abs() > 0.8) & mask
    assert bool(clamped_feedback.any()) and max(abs(a) for a in raw) > 1.2
    assert min(abs(a) for a in raw) < 1.2


def test_discount_counts_actor_tokens_only():
    # Negative control for the loop above: a discount by absolute position t (not by the actor
    # index k) gives different scores on this data, so the holes in the mask are exercised.
    _, old, teacher, mask = _batch(seed=2)
    _, scores = _loop_advantages(old, teacher, mask, 3, 0.5, 0.0, 5.0, 5.0, 1e-6)
    wrong = []
    for i in range(mask.shape[0]):
        w = [0.5 ** t if mask[i, t] else 0.0 for t in range(mask.shape[1])]
        r = [float(teacher[i, t] - old[i, t]) if mask[i, t] else 0.0 for t in range(mask.shape[1])]
        wrong.append(sum(a * b for a, b in zip(w, r)) / sum(w))
    assert max(abs(a - b) for a, b in zip(scores, wrong)) > 1e-3
    got = gr_opd_advantages(old, teacher, mask, group_size=3, gamma=0.5, lam=0.0,
                            adv_clip=math.inf)
    want, _ = _loop_advantages(old, teacher, mask, 3, 0.5, 0.0, 5.0, math.inf, 1e-6)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def test_lambda_sets_the_group_mean():
    _, old, teacher, mask = _batch(G=4, seed=3)
    _, scores = _loop_advantages(old, teacher, mask, 3, 0.99, 0.0, 5.0, math.inf, 1e-6)
    S = torch.tensor(scores, dtype=torch.float64).view(4, 3)
    mu, sigma = S.mean(-1), S.std(-1, correction=0)
    for lam in (0.0, 0.25, 1.0):
        adv = gr_opd_advantages(old, teacher, mask, group_size=3, lam=lam, adv_clip=math.inf)
        # lambda = 0: centred in every group; lambda > 0: mean pressure lam * mu / (sigma + eps)
        torch.testing.assert_close(adv.view(4, 3).mean(-1), lam * mu / (sigma + 1e-6),
                                   rtol=1e-10, atol=1e-12)
    assert mu.abs().min() > 1e-2                      # so lam visibly moves the means


def test_identical_scores_give_finite_advantages():
    _, _, _, mask = _batch(G=2, seed=4)
    # multiples of 1/16 and a feedback of exactly 0.25: every S_i is exactly 0.25, sigma = 0
    old = -torch.randint(1, 64, mask.shape, generator=torch.Generator().manual_seed(4)) / 16
    old = old.to(torch.float64)
    teacher = old + 0.25
    for lam, adv_clip in [(0.25, 5.0), (0.0, 5.0), (0.25, math.inf)]:
        adv = gr_opd_advantages(old, teacher, mask, group_size=3, lam=lam, adv_clip=adv_clip)
        assert bool(torch.isfinite(adv).all())
        want = min(lam * 0.25 / 1e-6, adv_clip)
        torch.testing.assert_close(adv, torch.full_like(adv, want), rtol=1e-12, atol=0)


@pytest.mark.parametrize("eps", [0.2, 0.05])
def test_loss_against_loop_and_not_a_global_token_mean(eps):
    lp, old, teacher, mask = _batch(seed=5, scale=0.4)
    lp.requires_grad_(True)
    out = gr_opd_loss(lp, old, teacher, mask, group_size=3, eps=eps)
    out.loss.backward()
    adv, _ = _loop_advantages(old, teacher, mask, 3, 0.99, 0.25, 5.0, 5.0, 1e-6)
    want, want_grad = _loop_loss(lp.detach(), old, adv, mask, eps)
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(lp.grad, want_grad, rtol=1e-12, atol=1e-15)
    global_mean, _ = _loop_loss(lp.detach(), old, adv, mask, eps, per_response=False)
    lengths = mask.sum(-1)
    assert lengths.min() < lengths.max()
    assert abs(global_mean - want) > 1e-3 * abs(want)
    assert 0 < out.metrics["clip_frac"] < 1          # both PPO branches are present


def test_metrics():
    lp, old, teacher, mask = _batch(seed=6, scale=0.4)
    m = gr_opd_loss(lp, old, teacher, mask, group_size=3, eps=0.1, feedback_clip=0.7).metrics
    adv, _ = _loop_advantages(old, teacher, mask, 3, 0.99, 0.25, 0.7, 5.0, 1e-6)
    adv_t = torch.tensor(adv, dtype=torch.float64)[:, None].expand_as(lp)
    rho = torch.exp(lp - old)
    clipped = ((adv_t > 0) & (rho > 1.1)) | ((adv_t < 0) & (rho < 0.9))
    assert m["clip_frac"].item() == pytest.approx((clipped & mask).sum().item() / mask.sum().item())
    assert m["adv_mean"].item() == pytest.approx(sum(adv) / len(adv), rel=1e-12, abs=1e-15)
    assert m["adv_abs_mean"].item() == pytest.approx(sum(map(abs, adv)) / len(adv), rel=1e-12)
    feedback = (teacher - old).clamp(-0.7, 0.7)[mask]
    assert m["feedback_mean"].item() == pytest.approx(feedback.mean().item(), rel=1e-12)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_precomputed_advantages_and_global_num_sequences():
    lp, old, teacher, mask = _batch(G=4, seed=7)
    adv = gr_opd_advantages(old, teacher, mask, group_size=3)
    full_x = lp.clone().requires_grad_(True)
    full = gr_opd_loss(full_x, old, teacher, mask, group_size=3)
    full.loss.backward()
    given = gr_opd_loss(lp, old, teacher, mask, group_size=3, advantages=adv)
    assert given.loss.item() == full.loss.item()
    # micro-batches of whole groups, advantages from the full batch, the global B
    total, grads = 0.0, []
    for rows in (slice(0, 6), slice(6, 9), slice(9, 12)):
        x = lp[rows].clone().requires_grad_(True)
        out = gr_opd_loss(x, old[rows], teacher[rows], mask[rows], group_size=3,
                          advantages=adv[rows], num_sequences=12)
        out.loss.backward()
        total += out.loss.item()
        grads.append(x.grad)
    assert total == pytest.approx(full.loss.item(), rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full_x.grad, rtol=1e-12, atol=1e-15)


def test_masked_garbage_does_not_leak():
    lp, old, teacher, mask = _batch(seed=8)
    dirty_teacher = torch.where(mask, teacher, torch.full_like(teacher, -math.inf))
    dirty_lp = torch.where(mask, lp, torch.full_like(lp, math.nan)).requires_grad_(True)
    clean_old = torch.where(mask, old, torch.zeros_like(old))
    clean_teacher = torch.where(mask, teacher, torch.zeros_like(teacher))
    a = gr_opd_loss(dirty_lp, old, dirty_teacher, mask, group_size=3)     # old is NaN off mask
    a.loss.backward()
    x = lp.clone().requires_grad_(True)
    b = gr_opd_loss(x, clean_old, clean_teacher, mask, group_size=3)
    b.loss.backward()
    assert torch.isfinite(a.loss) and a.loss.item() == b.loss.item()
    assert torch.equal(dirty_lp.grad, x.grad) and bool((x.grad[~mask] == 0).all())
    for k in a.metrics:
        assert a.metrics[k].item() == b.metrics[k].item(), k


def test_gradcheck_logprobs():
    lp, old, teacher, mask = _batch(G=2, m=2, T=5, seed=9, scale=0.5)
    lp = lp.requires_grad_(True)
    f = lambda x: gr_opd_loss(x, old, teacher, mask, group_size=2, eps=0.15).loss
    assert torch.autograd.gradcheck(f, (lp,))


def test_gradcheck_logits():
    g = torch.Generator().manual_seed(10)
    B, T, V = 4, 3, 5
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool)
    targets[~mask] = -1
    old = torch.randn(B, T, generator=g, dtype=torch.float64) - 1.5
    teacher = torch.randn(B, T, generator=g, dtype=torch.float64) - 1.5
    f = lambda x: gr_opd_loss(Logits(x, targets, 0.9), old, teacher, mask, group_size=2,
                              eps=0.3).loss
    assert torch.autograd.gradcheck(f, (logits,))


@pytest.mark.parametrize("dtype,overflowing,representable", [
    (torch.bfloat16, 100.0, 30.0),     # computed in fp32: e^100 > 3.4e38
    (torch.float32, 100.0, 30.0),
    (torch.float64, 1000.0, 100.0),    # computed in fp64: e^100 fits, e^1000 does not
])
def test_overflow_of_the_unclipped_negative_branch_raises(dtype, overflowing, representable):
    mask = torch.ones(2, 2, dtype=torch.bool)
    old = torch.full((2, 2), math.log(0.3), dtype=dtype)
    adv = torch.tensor([-1.0, 1.0], dtype=dtype)
    for shift, fails in [(overflowing, True), (representable, False)]:
        lp = old + torch.tensor([[shift, 0.0], [shift, 0.0]], dtype=dtype)
        lp.requires_grad_(True)
        if fails:
            with pytest.raises(ValueError, match="policy.*overflow"):
                gr_opd_loss(lp, old, old, mask, group_size=1, advantages=adv)
        else:
            out = gr_opd_loss(lp, old, old, mask, group_size=1, advantages=adv)
            out.loss.backward()
            assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all())
            assert lp.grad[0, 0] != 0                     # the unclipped branch, A < 0
    # the clipped branches never exponentiate: any log-ratio is finite there
    lp = (old + torch.tensor([[-5000.0, 0.0], [5000.0, 0.0]], dtype=dtype)).requires_grad_(True)
    out = gr_opd_loss(lp, old, old, mask, group_size=1, advantages=adv)
    out.loss.backward()
    assert torch.isfinite(out.loss) and bool(torch.isfinite(lp.grad).all())
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0
    assert out.metrics["clip_frac"].item() == 0.5


def test_empty_batch():
    lp = torch.zeros(0, 5, requires_grad=True)
    out = gr_opd_loss(lp, torch.zeros(0, 5), torch.zeros(0, 5),
                      torch.zeros(0, 5, dtype=torch.bool), group_size=2)
    out.loss.backward()
    assert out.loss.item() == 0 and lp.grad.shape == (0, 5)
    assert all(v.item() == 0 for v in out.metrics.values())


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


@pytest.mark.parametrize("name,exc,match,args,kwargs", list(_bad_gr_opd_cases()),
                         ids=[c[0] for c in _bad_gr_opd_cases()])
def test_bad_input(name, exc, match, args, kwargs):
    with pytest.raises(exc, match=match):
        gr_opd_loss(*args, **kwargs)


def test_bad_advantages_input():
    _, old, teacher, mask = _batch(G=2, m=3, T=5, seed=12)
    with pytest.raises(ValueError, match="group_size.*multiple"):
        gr_opd_advantages(old, teacher, mask, group_size=4)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        gr_opd_advantages(old, teacher[:, :4], mask, group_size=3)
    with pytest.raises(ValueError, match="old_logprobs"):
        gr_opd_advantages(old[0], teacher, mask, group_size=3)
    with pytest.raises(ValueError, match="gamma"):
        gr_opd_advantages(old, teacher, mask, group_size=3, gamma=2.0)
    with pytest.raises(ValueError, match="mask.*sequence 0"):
        gr_opd_advantages(old, teacher, torch.zeros_like(mask), group_size=3)
