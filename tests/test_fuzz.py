"""Randomised parity: every loss in both policy forms against float64, over dtypes, layouts,
masks, logit scales, upstream scales and hyper-parameter edges (hypothesis, bounded in time).

The bar is the three-way rule of conftest: the fused error may exceed the error plain torch
commits in the same dtype by a small factor, plus a few units of rounding (atol) of the terms
that cancel in the result (``scale``), derived per result from float64 quantities:
- a loss of the surrogate family: sum_bt w_b |J_bt| (its terms, r A of either sign, cancel),
  with GR-OPD's advantages widened by their own conditioning (a group of close scores);
- GGPO: sqrt(m - 1) max|lp| + max|r| / (beta sqrt(m - 1)), the sensitivity of the loss to the
  sums of log-probs and to the rewards over beta;
- dlogits: max |dL/dlp| / tau (the gradient g (1[v = y] - p) / tau cancels at p -> 1), and for
  the entropy's gradient |dL/dH| (1/e + log V) / tau (p |log p| <= 1/e, p H <= log V);
- log-probs, entropy, mean log-ratios: the log-probs' magnitude.
"""
import math

import torch

import rlfuse
from rlfuse import objectives, reference, terms
from rlfuse.shared.aggregation import aggregation_weights
from rlfuse._names import AGGREGATIONS, GEOMETRIES, TOPOLOGIES
from rlfuse.reference.token_functions import clip as clipped_surrogate

from conftest import assert_three_way, fp32_exact, integration
from loss_harness import check_against_shifted_oracle, check_three_way, with_garbage

integration("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FUZZ = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])

dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


@st.composite
def batches(draw, *, min_group=1):
    """(B, T, m, mask, generator): groups of m rows, masks from sparse to full (at least one
    actor token per row, which every loss's defaults accept)."""
    m = draw(st.integers(min_group, 4))
    B = m * draw(st.integers(1, 3))
    T = draw(st.integers(1, 7))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 16)))
    mask = torch.rand(B, T, generator=gen) >= draw(st.sampled_from([0.0, 0.3, 0.9]))
    mask[torch.arange(B), torch.randint(0, T, (B,), generator=gen)] = True
    return B, T, m, mask, gen


@st.composite
def policies(draw, B, T, gen, mask):
    """A policy: log-probs, or logits of an odd or block-crossing vocabulary at several scales
    and temperatures. Returns (buffer [B, T+1(, V)] in float64, targets or None, dtype,
    temperature, float64 log-probs [B, T])."""
    dtype = draw(dtypes)
    if draw(st.booleans()):
        buffer = -torch.rand(B, T + 1, generator=gen, dtype=torch.float64) * 6
        buffer = buffer.to(dtype).double()   # float64 sees the same rounded inputs
        return buffer, None, dtype, 1.0, buffer[:, :-1]
    V = draw(st.sampled_from([1, 7, 37, 2049, 4099]))
    logit_scale = draw(st.sampled_from([1.0, 30.0, 1e3]))
    temperature = fp32_exact(draw(st.sampled_from([0.25, 1.0, 4.0])))
    logits = torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * logit_scale
    logits = logits.to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[~mask] = -100                    # masked targets out of range: never read
    lp = reference.token_logprobs(logits[:, :-1], targets, temperature=temperature, mask=mask)
    return logits, targets, dtype, temperature, lp


def draw_case(data, *, min_group=1):
    """(B, T, m, mask, generator, policy) of a batch and a policy over it."""
    B, T, m, mask, gen = data.draw(batches(min_group=min_group))
    return B, T, m, mask, gen, data.draw(policies(B, T, gen, mask))


def logprobs_like(gen, mask):
    """Detached log-probs in [-6, 0] with NaN at masked positions (never to be read)."""
    return with_garbage(-torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 6, mask)


def loss_gradient_scale(ref_fn, lp64, temperature, from_logits, args64, **kw):
    """max |dL/dlp| (float64), over tau for a policy given as logits."""
    lp = lp64.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ref_fn(lp, *args64, **kw).loss, lp)
    scale = g.abs().max().item()
    return scale / temperature if from_logits else scale


def surrogate_scale(lp64, old, adv, mask, lo, hi, agg, **counts):
    """sum_bt w_b |J_bt| in float64: the size of the terms a surrogate loss adds up."""
    adv = adv.unsqueeze(-1).expand(mask.shape) if adv.dim() == 1 else adv
    old = torch.where(mask, old, 0.0)
    inf = float("inf")
    sur = clipped_surrogate(torch.where(mask, lp64 - old, 0.0), lp64, old,
                            torch.where(mask, adv, 0.0), lo, hi, mask, (inf, inf), inf)
    weights = aggregation_weights(mask, agg, torch.float64, **counts)
    return (sur.value.abs().sum(-1) * weights).sum().item()


def run(fused_fn, ref_fn, policy, args64, *, loss_scale, metric_scales, grad_kw=None, **kw):
    """``grad_kw``: the arguments whose loss's gradient is the gradient's scale (default
    ``kw``)."""
    buffer, targets, dtype, temperature, lp64 = policy
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    args = tuple(a.to(acc) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args64)
    grad_scale = loss_gradient_scale(ref_fn, lp64, temperature, targets is not None, args64,
                                     **(kw if grad_kw is None else grad_kw))
    check_three_way(fused_fn, ref_fn, buffer, dtype=dtype, device=DEVICE, args=args,
                    args64=args64, logits_targets=targets, temperature=temperature,
                    metric_scales=metric_scales, loss_scale=max(1.0, loss_scale),
                    grad_scale=max(1e-30, grad_scale), **kw)


@FUZZ
@given(data=st.data())
def test_token_logprobs_at_any_scale(data):
    """Log-probs, entropies and the logits' gradient at logits from ordinary to the dtype's
    largest, a common offset of any size, any temperature in [0.3, 3], against the fp64 oracle
    of the shifted rows."""
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    B, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    V = data.draw(st.sampled_from([1, 7, 37, 2049]))
    top = torch.finfo(dtype).max
    scale = data.draw(st.sampled_from([1.0, 1e4, 1e12, 1e30, top / 4]))
    offset = data.draw(st.sampled_from([0.0, 1e6, 1e30, -1e30, top / 2]))
    temperature = data.draw(st.floats(0.3, 3.0))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    x = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * scale + offset
    x = x.clamp(-top, top).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    weights = torch.randn(2, B, T, generator=gen, dtype=torch.float64)
    check_against_shifted_oracle(x, targets, temperature, weights, DEVICE,
                                 f"{dtype} scale {scale:.3g} offset {offset:.3g} "
                                 f"tau {temperature}")


@FUZZ
@given(data=st.data())
def test_ggpo(data):
    B, T, m, mask, gen, policy = draw_case(data, min_group=2)
    ref = logprobs_like(gen, mask)
    rewards = torch.randn(B, generator=gen, dtype=torch.float64) * data.draw(
        st.sampled_from([1.0, 100.0]))
    beta = fp32_exact(data.draw(st.sampled_from([0.01, 0.5, 10.0])))
    lp_max = torch.where(mask, policy[4], 0.0).abs().max().item() + 6
    loss_scale = (math.sqrt(m - 1) * lp_max
                  + rewards.abs().max().item() / (beta * math.sqrt(m - 1)))
    run(rlfuse.ggpo_loss, reference.ggpo_loss, policy, (ref, rewards, mask),
        loss_scale=loss_scale, metric_scales={"seq_logratio_mean": lp_max * T,
                                              "gap": loss_scale},
        group_size=m, beta=beta,
        clip_radius=data.draw(st.sampled_from([None, 0.125, float("inf")])))


@FUZZ
@given(data=st.data())
def test_gppo(data):
    B, T, m, mask, gen, policy = draw_case(data)
    old = logprobs_like(gen, mask)
    per_token = data.draw(st.booleans())
    adv = torch.randn((B, T) if per_token else (B,), generator=gen, dtype=torch.float64)
    region = dict(geometry=data.draw(st.sampled_from(GEOMETRIES)),
                  topology=data.draw(st.sampled_from(TOPOLOGIES)),
                  delta=fp32_exact(data.draw(st.sampled_from([1e-4, 0.04, 2.0]))))
    agg = data.draw(st.sampled_from(AGGREGATIONS))
    lo, hi = reference.gppo_bounds(torch.where(mask, old, 0.0), **region)
    lp_max = torch.where(mask, policy[4], 0.0).abs().max().item() + 6
    run(rlfuse.gppo_loss, reference.gppo_loss, policy, (old, adv, mask),
        loss_scale=surrogate_scale(policy[4], old, adv, mask, lo, hi, agg),
        metric_scales={"approx_kl": lp_max}, agg=agg, validate=False, **region)


@FUZZ
@given(data=st.data())
def test_ppo(data):
    B, T, m, mask, gen, policy = draw_case(data)
    on_policy = data.draw(st.booleans())
    old = None if on_policy else logprobs_like(gen, mask)
    adv = torch.randn((B, T) if data.draw(st.booleans()) else (B,), generator=gen,
                      dtype=torch.float64)
    weights = torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 \
        if data.draw(st.booleans()) else None
    eps = (fp32_exact(data.draw(st.sampled_from([0.1, 0.2]))),
           fp32_exact(data.draw(st.sampled_from([0.2, 0.28, 0.9]))))
    dual = data.draw(st.sampled_from([None, fp32_exact(3.0)]))
    level = data.draw(st.sampled_from(["token", "sequence"]))
    agg = data.draw(st.sampled_from(AGGREGATIONS))
    lp64 = policy[4]
    base = lp64.detach() if old is None else old
    if level == "sequence":   # every token of a row takes its mean log-ratio
        lr = torch.where(mask, lp64 - base, 0.0).sum(-1, keepdim=True) / mask.sum(-1,
                                                                               keepdim=True)
        ratio_lp = torch.where(mask, base + lr, 0.0)
    else:
        ratio_lp = lp64
    lo = torch.full_like(lp64, 1 - eps[0])
    w_adv = adv if weights is None else (adv.unsqueeze(-1) if adv.dim() == 1 else adv) * weights
    lp_max = torch.where(mask, lp64, 0.0).abs().max().item() + 6
    run(rlfuse.ppo_loss, reference.ppo_loss, policy, (old, adv, mask),
        loss_scale=surrogate_scale(ratio_lp, base, w_adv, mask, lo,
                                   torch.full_like(lp64, 1 + eps[1]), agg) + 1,
        metric_scales={"approx_kl": lp_max}, clip=eps, dual_clip=dual, ratio_level=level,
        agg=agg, weights=weights, validate=False)


@FUZZ
@given(data=st.data())
def test_gr_opd(data):
    B, T, m, mask, gen, policy = draw_case(data)
    old, teacher = logprobs_like(gen, mask), logprobs_like(gen, mask)
    kw = dict(group_size=m, eps=fp32_exact(data.draw(st.sampled_from([0.01, 0.25, 0.9]))),
              gamma=fp32_exact(data.draw(st.sampled_from([0.5, 1.0]))),
              lam=fp32_exact(data.draw(st.sampled_from([0.0, 0.25]))))
    adv = reference.gr_opd_advantages(old, teacher, mask, group_size=m, gamma=kw["gamma"],
                                      lam=kw["lam"])
    # A = (S - (1 - lam) mean S) / (std S + eps): an error d in the scores S moves A by up to
    # (2 + |A|) d / std, so A's own scale is (2 + max|A|) max|S| / std
    feedback = torch.where(mask, (teacher - old).clamp(-5, 5), 0.0)
    weight = torch.where(mask, kw["gamma"] ** (mask.cumsum(-1) - 1.0), 0.0)
    scores = (weight * feedback).sum(-1) / weight.sum(-1)
    std = scores.reshape(-1, m).std(-1, correction=0).min().item() + 1e-6
    adv_scale = (2 + adv.abs().max().item()) * (scores.abs().max().item() + 1) / std
    lo = torch.full_like(old, max(1 - kw["eps"], 0.0))
    # the terms and the gradient with |A| widened by its own error (same sign: the same
    # branches)
    widened = adv + adv.sign() * adv_scale
    loss_scale = surrogate_scale(policy[4], old, widened, mask, lo, 2 - lo,
                                 "seq-mean-token-mean")
    run(rlfuse.gr_opd_loss, reference.gr_opd_loss, policy, (old, teacher, mask),
        loss_scale=loss_scale, metric_scales={"feedback_mean": 6.0, "adv_mean": adv_scale,
                                              "adv_abs_mean": adv_scale},
        grad_kw=dict(kw, advantages=widened), **kw)


@FUZZ
@given(data=st.data())
def test_upstream_scale_and_entropy(data):
    """token_logprobs with entropy, both upstream gradients at scales from 1e-4 to 2^16."""
    B, T, m, mask, gen = data.draw(batches())
    logits, targets, dtype, temperature, lp64 = data.draw(
        policies(B, T, gen, mask).filter(lambda p: p[1] is not None))
    # fp16 holds gradients up to 65504: a loss scaler's 2^16 multiplies a mean over many tokens,
    # here a sum, so fp16 takes its largest scale 2^10
    top = 2.0 ** (10 if dtype == torch.float16 else 16)
    g_lp, g_ent = (data.draw(st.sampled_from([1e-4, -1.0, 3.5, top])) for _ in range(2))
    results = []
    for lib, dt, dev in ((rlfuse, dtype, DEVICE), (reference, dtype, "cpu"),
                         (reference, torch.float64, "cpu")):
        x = logits[:, :-1].to(dt).to(dev).requires_grad_(True)
        lp, ent = lib.token_logprobs(x, targets.to(dev), mask=mask.to(dev),
                                     temperature=temperature, return_entropy=True)
        (grad,) = torch.autograd.grad(g_lp * lp.sum() + g_ent * ent.sum(), x)
        results.append([t.detach().cpu() for t in (lp, ent, grad)])
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    V = logits.shape[-1]
    scales = (lp64.abs().max().item() + 1, lp64.abs().max().item() + 1,
              (abs(g_lp) + abs(g_ent) * (1 / math.e + math.log(V))) / temperature)
    for i, name in enumerate(("logp", "entropy", "dlogits")):
        assert_three_way(*(r[i] for r in results), name, atol_dtype=acc if i < 2 else dtype,
                         scale=max(1.0, scales[i]) if i < 2 else scales[i])


X = fp32_exact
# Every objective with fp32-exact parameters (Clip-Cov cuts every candidate token: its draw
# then chooses nothing, and the three runs of a case agree without sharing a generator).
FUZZ_OBJECTIVES = [
    lambda: objectives.Clip(clip=(X(0.2), X(0.28)), dual_clip=X(3.0), ratio_cap=X(1.75)),
    lambda: objectives.GPPO(geometry="kl", topology="binary", delta=X(0.04)),
    lambda: objectives.CISPO(clip=(X(0.2), X(0.28))),
    lambda: objectives.CISPOTRL(epsilon_high=X(1.25)),
    lambda: objectives.CISPOTRL(epsilon_high=X(1.25), ratio_level="sequence"),
    lambda: objectives.SAPO(tau_pos=1.0, tau_neg=X(1.0625)),
    lambda: objectives.SAPOTRL(tau_pos=X(0.75), tau_neg=X(1.0625), ratio_level="sequence"),
    lambda: objectives.GPG(),
    lambda: objectives.DRO(dro_beta=X(0.375)),
    lambda: objectives.DPPOTV(clip=(X(0.05), X(0.08)), truncation=X(1.5)),
    lambda: objectives.DPPOKL(clip=(X(0.02), X(0.04)), truncation=X(1.5)),
    lambda: objectives.GSPO(clip=(X(0.02), X(0.03))),
    lambda: objectives.GSPOTRL(clip=(X(0.02), X(0.03))),
    lambda: objectives.LUSPO(clip=(X(0.02), X(0.03))),
    lambda: objectives.GeoMean(clip=(X(0.2), X(0.3))),
    lambda: objectives.VESPO(),
    lambda: objectives.ClipCov(clip=(X(0.2), X(0.28)), clip_cov_ratio=1.0, clip_cov_lb=-1.0,
                               clip_cov_ub=1.0),
    lambda: objectives.KLCov(kl_cov_ratio=0.25, ppo_kl_coef=X(0.5)),
]


@FUZZ
@given(data=st.data())
def test_policy_loss(data):
    """Any objective with any terms (KL of every estimator, plain or importance-weighted; from
    logits the entropy bonus and the top-entropy mask; the off-policy mask), any aggregation of
    the objective and of each term."""
    B, T, m, mask, gen, policy = draw_case(data)
    from_logits = policy[1] is not None
    old, ref = logprobs_like(gen, mask), logprobs_like(gen, mask)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    objective = data.draw(st.sampled_from(FUZZ_OBJECTIVES))()
    kw = dict(objective=objective, validate=False)
    if objective.agg is None:   # else the objective's aggregation is its own
        kw["agg"] = data.draw(st.sampled_from(AGGREGATIONS))
    aggs = [kw.get("agg", objective.agg)]
    term_agg = st.sampled_from((None,) + AGGREGATIONS)
    kl_coef = ent_coef = 0.0
    if data.draw(st.booleans()):
        kl_coef = X(data.draw(st.sampled_from([0.01, 0.5])))
        d_max = torch.where(mask, policy[4] - ref, 0.0).abs().max().item()
        estimator = data.draw(st.sampled_from(["k1", "abs", "k2", "k3", "k3+", "abs+"]))
        kw.update(ref_logprobs=ref, kl=terms.KLPenalty(
            # TRL's unclamped k3 overflows past |lp - ref| ~ 700 (its own result is inf)
            kl_coef, estimator, clamp=data.draw(st.booleans()) or d_max > 30,
            importance_weighted=data.draw(st.booleans()), agg=data.draw(term_agg)))
        aggs.append(kw["kl"].agg)
    if from_logits and data.draw(st.booleans()):
        ent_coef = X(data.draw(st.sampled_from([0.01, 0.5])))
        kw["entropy"] = terms.EntropyBonus(ent_coef, agg=data.draw(term_agg))
        aggs.append(kw["entropy"].agg)
        if data.draw(st.booleans()):
            kw["entropy_mask"] = terms.TopEntropyMask(X(data.draw(st.sampled_from([0.25, 1.0]))))
    if data.draw(st.booleans()):
        kw["off_policy_mask"] = terms.OffPolicyMask(X(0.5), logprobs_like(gen, mask))
    # the terms the loss adds (they cancel): per token the objective's |A| (1 + r + s)
    # (1 + |lp|) and its log-ratio penalties, the KL terms (e^|d| bounds k3 and its weight) and
    # the entropy (at most log V), each weighted by its row's aggregation weight
    lp64 = policy[4]
    d_old = torch.where(mask, lp64 - old, 0.0)
    d_ref = torch.where(mask, lp64 - ref, 0.0).abs()
    seq = (d_old.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)).clamp(-20, 20).exp()
    per_token = (adv[:, None].abs() * (1 + d_old.clamp(-20, 20).exp() + seq)
                 * (1 + lp64.abs().where(mask, 0.0)) + d_old ** 2 + d_old.abs()
                 + kl_coef * d_ref.clamp(max=30).exp() * (1 + d_old.clamp(-20, 20).exp() + seq)
                 + ent_coef * math.log(max(policy[0].shape[-1], 2)))
    weights = torch.stack([aggregation_weights(mask, agg, torch.float64)
                           for agg in aggs if agg is not None]).amax(0)
    loss_scale = (torch.where(mask, per_token, 0.0).sum(-1) * weights).sum().item()
    # |dL/dlp| of the objective and KL (from log-probs), and the entropy's through the softmax
    grad_kw = {k: v for k, v in kw.items() if k not in ("entropy", "entropy_mask")}
    grad_scale = loss_gradient_scale(reference.policy_loss, lp64, policy[3], from_logits,
                                     (old, adv, mask), **grad_kw)
    grad_scale += ent_coef * weights.max().item() * (1 / math.e + math.log(
        max(policy[0].shape[-1], 2))) / policy[3]
    lp_max = torch.where(mask, lp64, 0.0).abs().max().item() + 6
    buffer, targets, dtype, temperature, _ = policy
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    check_three_way(rlfuse.policy_loss, reference.policy_loss, buffer, dtype=dtype,
                    device=DEVICE, args=(old.to(acc), adv.to(acc), mask),
                    args64=(old, adv, mask), logits_targets=targets, temperature=temperature,
                    metric_scales={"approx_kl": lp_max, "kl": loss_scale / max(kl_coef, 1e-3),
                                   "ratio_mean": loss_scale, "phi_mean": loss_scale},
                    loss_scale=max(1.0, loss_scale), grad_scale=max(1e-30, grad_scale), **kw)
