"""The PPO family and the surrogate options: ppo_loss against float64 and against the formulas
TRL and verl write; GPPO's and GR-OPD's new options; empty responses; bad input."""
import itertools

import pytest
import torch

import rlfuse
from rlfuse import reference
from rlfuse._names import AGGREGATIONS

from conftest import TOL, assert_three_way, fp32_exact, as_logprobs

B, T, V, H = 4, 6, 37, 8


def make_case(seed, device="cpu", *, empty_row=False):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.25
    mask[:, 0] = True
    if empty_row:
        mask[2] = False
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    old = as_logprobs(lp + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64))
    case = dict(logits=logits, targets=targets, mask=mask, lp=lp,
                old=torch.where(mask, old, torch.full_like(old, float("nan"))),
                adv=torch.randn(B, generator=gen, dtype=torch.float64),
                adv_tok=torch.randn(B, T, generator=gen, dtype=torch.float64),
                weights=torch.rand(B, T, generator=gen, dtype=torch.float64) * 2,
                hidden=torch.randn(B, T, H, generator=gen, dtype=torch.float64),
                weight=torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.7)
    return {k: v.to(device) for k, v in case.items()}


def run(lib, case, form, dtype, device, **kw):
    """(loss, metrics, gradient w.r.t. the policy's leaf) of ppo_loss."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    c = {k: v.to(device) for k, v in case.items()}
    leaf = {"logprobs": c["lp"], "logits": c["logits"], "head": c["hidden"]}[form]
    leaf = leaf.to(dtype).clone().requires_grad_(True)
    if form == "logits":
        policy = rlfuse.Logits(leaf, c["targets"])
    elif form == "head":
        policy = rlfuse.LinearHead(leaf, c["weight"].to(dtype), c["targets"], chunk_tokens=5)
    else:
        policy = leaf
    kw = {k: v.to(device).to(acc) if isinstance(v, torch.Tensor) and v.is_floating_point()
          else v for k, v in kw.items()}
    old = kw.pop("old", c["old"].to(acc))
    adv = kw.pop("adv", c["adv"].to(acc))
    out = lib.ppo_loss(policy, old, adv, c["mask"], **kw)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach().cpu(), {k: v.cpu() for k, v in out.metrics.items()}, grad.cpu()


OPTIONS = {
    "clip": dict(clip=0.2),
    "clip_higher": dict(clip=(0.2, 0.28)),
    "dual_clip": dict(clip=(0.1, 0.3), dual_clip=3.0),
    "sequence": dict(ratio_level="sequence", clip=(0.1, 0.2)),
    "on_policy": dict(old=None),
    "weights": dict(weights="weights", agg="seq-mean-token-mean"),
    "per_token_adv": dict(adv="adv_tok", agg="seq-mean-token-sum"),
    "adv_b1": dict(adv="adv_b1", agg="seq-mean-token-sum-norm", loss_scale=0.5),
}


def options(name, case):
    kw = dict(OPTIONS[name])
    for key in ("weights", "adv"):
        if isinstance(kw.get(key), str):
            kw[key] = case["adv"][:, None] if kw[key] == "adv_b1" else case[kw[key]]
    return kw


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("form, dtype", [("logprobs", torch.float32), ("logits", torch.bfloat16),
                                         ("logits", torch.float32), ("head", torch.float32)])
def test_matches_float64(option, form, dtype, device):
    case = make_case(1)
    kw = options(option, case)
    fused = run(rlfuse, case, form, dtype, device, **kw)
    ref = run(reference, case, form, dtype, "cpu", **kw)
    ref64 = run(reference, case, form, torch.float64, "cpu", **kw)
    assert_three_way(fused[0], ref[0], ref64[0], "loss")
    assert_three_way(fused[2], ref[2], ref64[2], "gradient")
    assert fused[1].keys() == ref64[1].keys() == {"clip_frac_low", "clip_frac_high",
                                                  "clip_frac_low_seq_min",
                                                  "clip_frac_high_seq_max",
                                                  "clip_frac_low_seq_mean",
                                                  "clip_frac_high_seq_mean", "dual_clip_frac",
                                                  "ratio_mean", "approx_kl", "overflow"}
    for name in fused[1]:
        assert_three_way(fused[1][name], ref[1][name], ref64[1][name], name,
                         atol_dtype=torch.float32, scale=8.0 if name == "approx_kl" else None)


@pytest.mark.parametrize("form", ["logprobs", "logits", "head"])
def test_float64_exact_all_options(form, device):
    case = make_case(2)
    kw = dict(clip=(fp32_exact(0.1), fp32_exact(0.3)), dual_clip=fp32_exact(2.5),
              weights=case["weights"], agg="seq-mean-token-mean")
    for extra in ({}, {"ratio_level": "sequence"}, {"old": None}):
        fused = run(rlfuse, case, form, torch.float64, device, **kw, **extra)
        ref = run(reference, case, form, torch.float64, "cpu", **kw, **extra)
        torch.testing.assert_close(fused[0], ref[0], **TOL["fp64"])
        torch.testing.assert_close(fused[2], ref[2], **TOL["fp64"])


def trl_verl_loss(lp, old, adv, mask, *, eps_low, eps_high, dual_clip=None, level="token",
                  weights=None):
    """The per-token PPO loss as TRL's GRPOTrainer and verl's vanilla policy loss write it
    (their formulas, plain torch), aggregated by a per-sequence mean then a mean over rows."""
    log_ratio = torch.where(mask, lp - old, 0.0)
    if level == "sequence":
        log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    adv = adv.unsqueeze(-1)
    loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if dual_clip is not None:   # verl: clip_pg_losses2 = min(-A c, max(pg_losses, pg_losses2))
        loss = torch.where(adv < 0, torch.min(-adv * dual_clip, loss), loss)
    if weights is not None:
        loss = loss * weights
    loss = torch.where(mask, loss.expand(mask.shape), 0.0)
    return ((loss.sum(-1) / mask.sum(-1).clamp(min=1.0))).mean()

@pytest.mark.parametrize("form", ["logprobs", "logits", "head"])
def test_one_road(form, impl, device):
    """ppo_loss, gppo_loss and GR-OPD's loss step are policy_loss with Clip / GSPOTRL, GPPO and
    Clip(log_ratio_clamp=None): the same ops, bit for bit the same loss, gradient and
    metrics."""
    from rlfuse import objectives as O

    dev = device if impl is rlfuse else "cpu"
    case = make_case(9)
    leaf_of = {"logprobs": "lp", "logits": "logits", "head": "hidden"}[form]

    def call(fn, *args, **kw):
        leaf = case[leaf_of].float().to(dev).requires_grad_(True)
        targets = case["targets"].to(dev)
        policy = {"logprobs": leaf, "logits": impl.Logits(leaf, targets),
                  "head": impl.LinearHead(leaf, case["weight"].float().to(dev), targets,
                                          chunk_tokens=5)}[form]
        out = fn(policy, case["old"].float().to(dev), case["adv"].float().to(dev),
                 case["mask"].to(dev), *args, **kw)
        return out.loss, out.metrics, torch.autograd.grad(out.loss, leaf)[0]

    w = case["weights"].float().to(dev)
    pairs = [
        (call(impl.ppo_loss, clip=(0.2, 0.28), dual_clip=3.0, weights=w, agg="token-sum"),
         call(impl.policy_loss, O.Clip(clip=(0.2, 0.28), dual_clip=3.0), weights=w,
              agg="token-sum")),
        (call(impl.ppo_loss, clip=0.1, ratio_level="sequence"),
         call(impl.policy_loss, O.GSPOTRL(clip=0.1))),
        (call(impl.gppo_loss, geometry="kl", topology="binary", delta=(0.05, 0.1),
              agg="seq-mean-token-mean"),
         call(impl.policy_loss, O.GPPO("kl", "binary", (0.05, 0.1)),
              agg="seq-mean-token-mean"))]
    adv = impl.gr_opd_advantages(case["old"].float().to(dev), case["old"].float().to(dev) - 0.3,
                                 case["mask"].to(dev), group_size=2)
    case["adv"] = adv.double().cpu()
    gr_opd = call(lambda pol, old, a, mask: impl.gr_opd_loss(
        pol, old, old - 0.3, mask, group_size=2, eps=(0.2, 0.28), advantages=a))
    step = call(impl.policy_loss, O.Clip(clip=(0.2, 0.28), log_ratio_clamp=None),
                agg="seq-mean-token-mean")
    for a, b in pairs:
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)
        assert a[1].keys() == b[1].keys()
        for name in a[1]:
            torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(gr_opd[0], step[0], rtol=0, atol=0)
    torch.testing.assert_close(gr_opd[2], step[2], rtol=0, atol=0)
    for name in ("clip_frac_low", "clip_frac_high", "overflow"):
        torch.testing.assert_close(gr_opd[1][name], step[1][name], rtol=0, atol=0, msg=name)



@pytest.mark.parametrize("level, dual, weighted", [("token", None, False), ("token", 3.0, True),
                                                   ("sequence", None, False)])
def test_the_formulas_trainers_write(level, dual, weighted, device):
    """An independent oracle: TRL's and verl's own formulas in plain torch."""
    case = make_case(3)
    lp = case["lp"].clone().requires_grad_(True)
    old = torch.where(case["mask"], case["old"], 0.0)
    weights = case["weights"] if weighted else None
    want = trl_verl_loss(lp, old, case["adv"], case["mask"], eps_low=0.2, eps_high=0.28,
                         dual_clip=dual, level=level, weights=weights)
    (want_grad,) = torch.autograd.grad(want, lp)
    for lib, dev in ((rlfuse, device), (reference, "cpu")):
        x = case["lp"].to(dev).clone().requires_grad_(True)
        out = lib.ppo_loss(x, case["old"].to(dev), case["adv"].to(dev), case["mask"].to(dev),
                           clip=(0.2, 0.28), dual_clip=dual, ratio_level=level,
                           weights=None if weights is None else weights.to(dev),
                           agg="seq-mean-token-mean")
        (grad,) = torch.autograd.grad(out.loss, x)
        torch.testing.assert_close(out.loss.cpu(), want, **TOL["fp64"])
        torch.testing.assert_close(grad.cpu(), want_grad, **TOL["fp64"])


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_empty_responses_count_as_zero(agg, impl, device):
    """A response without actor tokens (TRL's mask_truncated_completions) contributes 0 and
    counts in the default num_sequences, in GPPO and PPO; GR-OPD keeps its error (its sequence
    score is undefined)."""
    case = make_case(4, empty_row=True)
    dev = device if impl is rlfuse else "cpu"
    c = {k: v.to(dev) for k, v in case.items()}
    rows = torch.tensor([0, 1, 3], device=dev)
    kept = {k: v[rows] for k, v in c.items() if v.dim() and v.shape[0] == B}
    for fn in (impl.ppo_loss, impl.gppo_loss):
        x = c["lp"].clone().requires_grad_(True)
        loss = fn(x, c["old"], c["adv"], c["mask"], agg=agg).loss
        (grad,) = torch.autograd.grad(loss, x)
        assert torch.isfinite(loss) and (grad[2] == 0).all()
        # the same as the three other rows alone, with the count of four
        count = {"num_sequences": float(B)} if agg != "token-mean" else {}
        ref = fn(kept["lp"], kept["old"], kept["adv"], kept["mask"], agg=agg, **count).loss
        torch.testing.assert_close(loss, ref, **TOL["fp64"])
    with pytest.raises(ValueError, match="mask.*sequence 2"):
        impl.gr_opd_loss(c["lp"], c["old"], c["old"] - 0.5, c["mask"], group_size=2)


@pytest.mark.parametrize("form", ["logprobs", "logits"])
def test_a_zero_weight_does_not_hide_an_overflow(form, impl, device):
    """A token whose unclipped r A overflows (lp - old = 100, A < 0; GPPO's clip, which clamps
    nothing) under a weight of 0 (TRL's vLLM importance-sampling masks set such weights): the
    weight multiplies the token's objective, as in TRL, so the overflow stays one: with
    validate=True the loss raises, with validate=False it is NaN (inf times 0, TRL's own
    result) and the overflow metric says so. ppo_loss clamps the log-ratio at +-20 as verl:
    no overflow there."""
    dev = device if impl is rlfuse else "cpu"
    mask = torch.ones(1, 3, dtype=torch.bool, device=dev)
    old = torch.full((1, 3), -101.0, device=dev)
    adv = -torch.ones(1, device=dev)
    weights = torch.tensor([[0.0, 1.0, 1.0]], device=dev)
    if form == "logits":
        logits = torch.zeros(1, 3, 1, device=dev, requires_grad=True)   # lp = 0 everywhere
        policy = impl.Logits(logits, torch.zeros(1, 3, dtype=torch.long, device=dev))
        old = old.clone()
        old[0, 1:] = -0.1
    else:
        policy = torch.tensor([[-1.0, -0.5, -0.5]], device=dev, requires_grad=True)
        old[0, 1:] = -0.6
    with pytest.raises(ValueError, match="overflow"):
        impl.gppo_loss(policy, old, adv, mask, weights=weights)
    out = impl.gppo_loss(policy, old, adv, mask, weights=weights, validate=False)
    assert torch.isnan(out.loss) and out.metrics["overflow"] == 1
    out = impl.ppo_loss(policy, old, adv, mask, weights=weights)
    assert torch.isfinite(out.loss) and out.metrics["overflow"] == 0


def test_gppo_and_gr_opd_options(impl, device):
    """GPPO's delta pair is the lower side of one region and the upper side of another;
    GR-OPD's eps pair is PPO's clip-higher; [B, 1] advantages are [B] ones."""
    case = make_case(5)
    dev = device if impl is rlfuse else "cpu"
    c = {k: v.to(dev) for k, v in case.items()}
    old = torch.where(c["mask"], c["old"], -1.0)
    lo_a, _ = impl.gppo_bounds(old, geometry="kl", topology="binary", delta=0.05)
    _, hi_b = impl.gppo_bounds(old, geometry="kl", topology="binary", delta=0.3)
    lo, hi = impl.gppo_bounds(old, geometry="kl", topology="binary", delta=(0.05, 0.3))
    assert torch.equal(lo, lo_a) and torch.equal(hi, hi_b)
    adv = c["adv"]
    gr = impl.gr_opd_loss(c["lp"], c["old"], c["old"] - 0.5, c["mask"], group_size=2,
                         eps=(0.1, 0.3), advantages=adv[:, None]).loss
    ppo = impl.ppo_loss(c["lp"], c["old"], adv, c["mask"], clip=(0.1, 0.3),
                       agg="seq-mean-token-mean").loss
    torch.testing.assert_close(gr, ppo, **TOL["fp64"])
    g1 = impl.gppo_loss(c["lp"], c["old"], adv[:, None], c["mask"]).loss
    g2 = impl.gppo_loss(c["lp"], c["old"], adv, c["mask"]).loss
    assert torch.equal(g1, g2)


BAD = [
    (dict(clip=0.0), ValueError, r"clip: expected a clip range in \(0, 1\]"),
    (dict(clip=(0.2, 0.0)), ValueError, r"clip\[1\]: expected a clip range finite and > 0"),
    (dict(clip=(1.5, 0.2)), ValueError, r"clip\[0\]: expected a clip range in \(0, 1\]"),
    (dict(clip=(0.1, 0.2, 0.3)), ValueError, "clip: expected a number or a"),
    (dict(clip="0.2"), TypeError, "clip: expected a number"),
    (dict(dual_clip=1.0), ValueError, "dual_clip: expected None or a finite value > 1"),
    (dict(dual_clip=float("inf")), ValueError, "dual_clip"),
    (dict(ratio_level="group"), ValueError, "ratio_level.*'token', 'sequence'"),
    (dict(weights="negative"), ValueError, "weights: expected values >= 0"),
    (dict(weights="nan"), ValueError, "weights: expected finite values"),
    (dict(weights="shape"), ValueError, "weights: expected shape"),
    (dict(loss_scale=float("nan")), ValueError, "loss_scale"),
    (dict(agg="sum"), ValueError, "agg"),
]


@pytest.mark.parametrize("kw, error, match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input(kw, error, match, impl, device):
    case = make_case(6)
    dev = device if impl is rlfuse else "cpu"
    c = {k: v.to(dev) for k, v in case.items()}
    w = {"negative": -c["weights"], "nan": c["weights"] * float("nan"),
         "shape": c["weights"][:, :-1]}
    kw = {k: w[v] if k == "weights" else v for k, v in kw.items()}
    with pytest.raises(error, match=match):
        impl.ppo_loss(c["lp"], c["old"], c["adv"], c["mask"], **kw)


def test_modules(device):
    case = make_case(7, device)
    x = case["lp"].clone().requires_grad_(True)
    a = rlfuse.PPOLoss(clip=(0.2, 0.28), dual_clip=3.0)(x, case["old"], case["adv"], case["mask"])
    b = rlfuse.ppo_loss(x, case["old"], case["adv"], case["mask"], clip=(0.2, 0.28),
                        dual_clip=3.0)
    assert torch.equal(a.loss, b.loss)
    g = rlfuse.GPPOLoss(delta=(0.02, 0.05), dual_clip=2.0)(x, case["old"], case["adv"],
                                                           case["mask"])
    assert torch.isfinite(g.loss)


def test_every_option_combination_runs(device):
    """The cross product of the options in the fused single pass (fp32 logits): finite, equal
    to the reference to fp32 rounding."""
    case = make_case(8)
    for clip, dual, level, weighted in itertools.product((0.2, (0.1, 0.3)), (None, 2.0),
                                                         ("token", "sequence"), (False, True)):
        kw = dict(clip=clip, dual_clip=dual, ratio_level=level)
        if weighted:
            kw["weights"] = case["weights"]
        fused = run(rlfuse, case, "logits", torch.float32, device, **kw)
        ref = run(reference, case, "logits", torch.float32, "cpu", **kw)
        torch.testing.assert_close(fused[0], ref[0], **TOL["fp32_chain"])
        torch.testing.assert_close(fused[2], ref[2], **TOL["fp32_matmul"])
