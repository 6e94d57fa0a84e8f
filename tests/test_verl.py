"""rlfuse in verl (the real package): the registered policy losses against verl's own ``vanilla``
loss — every loss_agg_mode, clip-higher, dual clip, rollout_is_weights, global batch info —
loss, gradient and metrics."""
import itertools

import pytest
import torch

from conftest import APPROX, TOL, integration  # noqa: E402

core_algos = integration("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig  # noqa: E402
import rlfuse  # noqa: E402
import rlfuse.integrations.verl  # noqa: E402,F401  (registers the losses)

B, T = 6, 7
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
         "seq-mean-token-sum-norm"]
BATCH_INFO = [{}, {"dp_size": 2, "batch_num_tokens": 61, "global_batch_size": 11,
                   "loss_scale_factor": 9}]


def config(low=0.2, high=0.28, c=3.0, info=None):
    return ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high,
                       clip_ratio_c=c, ppo_micro_batch_size_per_gpu=1, rollout_n=2,
                       ppo_mini_batch_size=2, global_batch_info=info or {})


def batch(seed, device):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) > 0.3).float()
    mask[:, 0] = 1
    mask[3] = 0                                   # a fully masked row
    old = -torch.rand(B, T, generator=gen) * 3
    lp = old + 0.5 * torch.randn(B, T, generator=gen)     # ratios in and out of the clip
    adv = torch.randn(B, 1, generator=gen).expand(B, T) + 0.1 * torch.randn(B, T, generator=gen)
    weights = torch.rand(B, T, generator=gen) * 2
    return [x.to(device) for x in (old, lp, adv, mask, weights)]


def losses(name, old, lp, adv, mask, mode, cfg, weights):
    x = lp.clone().requires_grad_(True)
    fn = core_algos.get_policy_loss_fn(name)
    loss, metrics = fn(old, x, adv, mask, loss_agg_mode=mode, config=cfg,
                       rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("mode, info, weighted", list(itertools.product(
    MODES, range(len(BATCH_INFO)), (False, True))))
def test_rlfuse_ppo_is_verl_vanilla(mode, info, weighted, device):
    old, lp, adv, mask, weights = batch(info * 7 + MODES.index(mode), device)
    cfg = config(info=BATCH_INFO[info])
    w = weights if weighted else None
    ours = losses("rlfuse_ppo", old, lp, adv, mask, mode, cfg, w)
    theirs = losses("vanilla", old, lp, adv, mask, mode, cfg, w)
    # fp32 rounding of the same sums in another order (and verl's 1e-8 in seq-mean-token-mean)
    torch.testing.assert_close(ours[0], theirs[0], **TOL["fp32_sum"])
    torch.testing.assert_close(ours[1], theirs[1], **TOL["fp32_reduce"])
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert ours[2][key] == pytest.approx(theirs[2][key], **APPROX["fp32_metric"]), key
    assert ours[2]["actor/rlfuse_overflow"] == 0.0
    assert ours[2]["actor/rlfuse_fused"] == float(rlfuse.use_kernels(device))   # the kernels ran


@pytest.mark.parametrize("low, high, c", [(0.2, 0.2, 3.0), (0.1, 0.3, 1.5), (0.2, 0.28, 10.0)])
def test_clip_settings(low, high, c, device):
    old, lp, adv, mask, _ = batch(11, device)
    lp = old + 1.5 * (lp - old)           # more clipped and dual-clipped tokens
    cfg = config(low, high, c)
    ours = losses("rlfuse_ppo", old, lp, adv, mask, "token-mean", cfg, None)
    theirs = losses("vanilla", old, lp, adv, mask, "token-mean", cfg, None)
    assert theirs[2]["actor/pg_clipfrac"] > 0
    assert (theirs[2]["actor/pg_clipfrac_lower"] > 0) == (c < 5)   # r > c happens for c <= 3
    torch.testing.assert_close(ours[0], theirs[0], **TOL["fp32_sum"])
    torch.testing.assert_close(ours[1], theirs[1], **TOL["fp32_reduce"])
    for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
        assert ours[2][key] == pytest.approx(theirs[2][key], **APPROX["fp32_share"]), key


def test_rlfuse_gppo_and_register_gppo(device):
    """rlfuse_gppo is gppo_loss with the seed's region under verl's aggregation; other regions
    register under other names."""
    old, lp, adv, mask, _ = batch(12, device)
    cfg = config()
    ours = losses("rlfuse_gppo", old, lp, adv, mask, "seq-mean-token-mean", cfg, None)
    x = lp.clone().requires_grad_(True)
    rows = (mask.sum(-1) > 0).sum().float()
    ref = rlfuse.gppo_loss(x, old, adv, mask.bool(), agg="seq-mean-token-mean",
                           num_sequences=rows).loss
    torch.testing.assert_close(ours[0], ref.detach(), **TOL["fp32"])
    rlfuse.integrations.verl.register_gppo("rlfuse_gppo_kl", geometry="kl", topology="binary",
                                           delta=(0.05, 0.2))
    kl = losses("rlfuse_gppo_kl", old, lp, adv, mask, "token-mean", cfg, None)
    x = lp.clone().requires_grad_(True)
    ref = rlfuse.gppo_loss(x, old, adv, mask.bool(), geometry="kl", topology="binary",
                           delta=(0.05, 0.2)).loss
    torch.testing.assert_close(kl[0], ref.detach(), **TOL["fp32"])


def test_gr_opd_as_advantage_estimator(device):
    """docs/verl.md's recipe: GR-OPD's advantages from the teacher's log-probs, trained by
    rlfuse_ppo with seq-mean-token-mean and a dual clip that never binds, is gr_opd_loss."""
    old, lp, _, mask, _ = batch(14, device)
    mask[3, 0] = 1                                  # GR-OPD needs a token in every response
    teacher = (old + torch.randn(old.shape, generator=torch.Generator().manual_seed(15))
               .to(device)).clamp_max(0)
    adv = rlfuse.gr_opd_advantages(old, teacher, mask.bool(), group_size=2)
    ours = losses("rlfuse_ppo", old, lp, adv[:, None].expand(B, T), mask,
                  "seq-mean-token-mean", config(0.2, 0.2, 1e9), None)
    x = lp.clone().requires_grad_(True)
    ref = rlfuse.gr_opd_loss(x, old, teacher, mask.bool(), group_size=2, eps=0.2,
                             advantages=adv).loss
    (ref_grad,) = torch.autograd.grad(ref, x)
    assert ours[2]["actor/pg_clipfrac"] > 0
    torch.testing.assert_close(ours[0], ref.detach(), **TOL["fp32_reduce"])
    torch.testing.assert_close(ours[1], ref_grad, **TOL["fp32_grad"])


def test_dp_without_global_counts_is_refused(device):
    old, lp, adv, mask, _ = batch(13, device)
    for mode, match in (("token-mean", "batch_num_tokens"), ("seq-mean-token-mean",
                                                              "global_batch_size")):
        with pytest.raises(ValueError, match=match):
            losses("rlfuse_ppo", old, lp, adv, mask, mode, config(info={"dp_size": 2}), None)



# --------------------------------------------------------------------------------------------
# Every verl loss_mode: rlfuse_<mode> against verl's own function
# --------------------------------------------------------------------------------------------

VERL_MODES = ["vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
              "geo_mean", "dro", "cispo", "bypass_mode"]


def mode_config(mode, info=None, loss_type="ppo_clip"):
    """An ActorConfig for ``mode`` whose options all bind on the test batch: DPPO's divergence
    thresholds near the batch's moves, Clip-Cov's covariance window around its values,
    KL-Cov's share of tokens, DRO's penalty, bypass_mode's rollout correction."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig
    from verl.workers.config.actor import PolicyLossConfig

    clip = {"dppo_tv": (0.05, 0.08), "dppo_kl": (0.02, 0.04), "gspo": (3e-3, 4e-3)}.get(
        mode, (0.2, 0.28))
    policy = PolicyLossConfig(
        loss_mode=mode, clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=0.5, kl_cov_ratio=0.2,
        ppo_kl_coef=0.5, dro_beta=0.3,
        rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5,
                                                   loss_type=loss_type))
    return ActorConfig(strategy="fsdp", clip_ratio=0.2, clip_ratio_low=clip[0],
                       clip_ratio_high=clip[1], clip_ratio_c=3.0,
                       ppo_micro_batch_size_per_gpu=1, rollout_n=2, ppo_mini_batch_size=2,
                       tau_pos=1.0, tau_neg=1.05, policy_loss=policy,
                       global_batch_info=info or {})


def both(mode, cfg, agg, weighted, seed, device):
    old, lp, adv, mask, weights = batch(seed, device)
    w = weights if weighted else None
    torch.manual_seed(seed)                  # clip_cov draws from torch's default generator
    ours = losses(f"rlfuse_{mode}", old, lp, adv, mask, agg, cfg, w)
    torch.manual_seed(seed)
    theirs = losses(mode, old, lp, adv, mask, agg, cfg, w)
    return ours, theirs


def assert_same(ours, theirs):
    # fp32 rounding of the same sums in another order (and verl's 1e-8 in seq-mean-token-mean)
    torch.testing.assert_close(ours[0], theirs[0], **TOL["fp32_sum"])
    torch.testing.assert_close(ours[1], theirs[1], **TOL["fp32_reduce"])
    assert set(theirs[2]) <= set(ours[2])
    for key, value in theirs[2].items():
        assert ours[2][key] == pytest.approx(value, **APPROX["fp32_metric"]), key


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("agg", MODES)
def test_every_mode_is_verls(mode, agg, device):
    """Loss, gradient and metrics of rlfuse_<mode> and verl's <mode>: every loss_agg_mode,
    with rollout weights, with and without global batch counts."""
    for info, weighted in ((0, True), (1, False)):
        cfg = mode_config(mode, BATCH_INFO[info])
        assert_same(*both(mode, cfg, agg, weighted, 20 + MODES.index(agg) + 7 * info, device))


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "gspo", "sapo", "clip_cov", "kl_cov",
                                  "geo_mean", "cispo"])
def test_every_mode_binds(mode, device):
    """The options of each mode act on the test batch (a metric of each is not 0), so the
    comparisons above compare the branches, not only the plain ones."""
    _, theirs = both(mode, mode_config(mode), "token-mean", False, 21, device)
    key = {"kl_cov": "actor/ppo_kl", "sapo": "actor/ppo_kl"}.get(mode, "actor/pg_clipfrac")
    assert theirs[2][key] != 0.0, key


def test_bypass_mode_reinforce(device):
    cfg = mode_config("bypass_mode", loss_type="reinforce")
    assert_same(*both("bypass_mode", cfg, "seq-mean-token-sum", False, 31, device))


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+",
                                  "abs+", "k2+", "k3+", "low_var_kl+"])
def test_kl_penalty_is_verls(kind, device):
    """Each of verl's KL types and their straight-through forms: verl's values and gradients.
    k3 is e^u - u - 1 in fp32 on both sides, where one unit of rounding of the exponential
    (2^-23 e^u; two exponentials need not round alike) stands out of the cancellation: each
    value is held to that, relative to max(1, e^u), beside the fp32 tolerance."""
    old, lp, _, _, _ = batch(40, device)
    lp = old + 8 * (lp - old)                       # log-ratios past verl's clamps of k3
    x, y = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ours = rlfuse.integrations.verl.kl_penalty(x, old, kind)
    theirs = core_algos.kl_penalty(y, old, kind)
    grad = torch.randn(ours.shape, generator=torch.Generator().manual_seed(41)).to(device)
    exponential = kind.rstrip("+") in ("k3", "low_var_kl")
    ulp = 2.0 ** -23 * torch.exp((lp - old).double().abs().clamp(max=20.0)).cpu()

    def close(a, b, what):
        if not exponential:
            torch.testing.assert_close(a, b, **TOL["fp32"], msg=what)
            return
        beyond = (a.cpu().double() - b.cpu().double()).abs() - ulp
        assert beyond.max().item() <= TOL["fp32"]["atol"], (what, beyond.max().item())

    close(ours, theirs, "value")
    (gx,) = torch.autograd.grad(ours, x, grad)
    (gy,) = torch.autograd.grad(theirs, y, grad)
    close(gx, gy, "gradient")


def extreme_batch(device, dtype=torch.float32):
    """The test batch with log-ratios of +-28 to +-31 at four actor tokens, advantages of both
    signs there (past verl's clamp of +-20 in its losses and in ``ppo_kl``)."""
    old, lp, adv, mask, weights = (x.to(dtype) for x in batch(50, device))
    adv = adv.clone()
    for (b, t), (o, p), a in (((0, 1), (-31.0, -1.0), -1.0), ((1, 2), (-0.5, -30.5), 1.0),
                              ((2, 0), (-30.25, -0.25), 0.5), ((4, 3), (-0.75, -28.0), -1.5)):
        old[b, t], lp[b, t], mask[b, t], adv[b, t] = o, p, 1.0, a
    return old, lp, adv, mask, weights


@pytest.mark.parametrize("mode", VERL_MODES)
def test_every_mode_at_extreme_log_ratios(mode, device):
    """Log-ratios of +-30: the same loss, gradient and metrics as verl's."""
    old, lp, adv, mask, weights = extreme_batch(device)
    cfg = mode_config(mode)
    for agg in ("token-mean", "seq-mean-token-mean"):
        torch.manual_seed(51)
        ours = losses(f"rlfuse_{mode}", old, lp, adv, mask, agg, cfg, weights)
        torch.manual_seed(51)
        theirs = losses(mode, old, lp, adv, mask, agg, cfg, weights)
        assert_same(ours, theirs)


# sapo and geo_mean divide by a row's tokens + 1e-8 whatever the aggregation (a 1e-9 relative
# difference that fp64 shows; the fp32 test above covers them)
@pytest.mark.parametrize("mode", [m for m in VERL_MODES if m not in ("sapo", "geo_mean")])
def test_every_mode_at_extreme_log_ratios_in_float64(mode, device):
    """In float64, where fp32 rounding hides nothing: verl's clamp of the log-ratio (the value
    at +-20, no gradient past it) exactly where verl clamps, so the loss and every gradient are
    verl's to fp64 rounding (a gradient verl leaves at 0 is 0)."""
    old, lp, adv, mask, weights = extreme_batch(device, torch.float64)
    cfg = mode_config(mode)
    for agg in ("token-mean", "token-sum"):       # (seq-mean-token-mean: verl's + 1e-8)
        torch.manual_seed(51)
        ours = losses(f"rlfuse_{mode}", old, lp, adv, mask, agg, cfg, weights)
        torch.manual_seed(51)
        theirs = losses(mode, old, lp, adv, mask, agg, cfg, weights)
        torch.testing.assert_close(ours[0], theirs[0], **TOL["fp64_sum"])
        torch.testing.assert_close(ours[1], theirs[1], **TOL["fp64_relative"])


def _term_batch(device):
    """fp64 ``(lp, old, ref, adv, mask)`` with tokens in every row (verl's seq-means count the
    non-empty rows, rlfuse's every row)."""
    gen = torch.Generator().manual_seed(11)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.1
    lp = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp_max(0)
    ref = (old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp_max(0)
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    return [x.to(device) for x in (lp, old, ref, adv, mask)]


@pytest.mark.parametrize("name", sorted(rlfuse.objectives.OBJECTIVES))
def test_kl_term_aggregates_as_verls_actor(name, impl, device):
    """With ``KLPenalty(agg=mode)`` the KL term of every objective is verl's actor's KL loss,
    ``agg_loss(kl_penalty(lp, ref), mask, loss_agg_mode)``; without ``agg`` the objective's own
    aggregation (the caller's ``agg`` where the objective has none): value and gradient in
    fp64."""
    lp, old, ref, adv, mask = _term_batch(device)
    objective = rlfuse.objectives.OBJECTIVES[name].example()
    coef = 0.3

    def loss(kl, agg):
        x = lp.clone().requires_grad_(True)
        out = impl.policy_loss(x, old, adv, mask, objective, agg=agg, kl=kl,
                               ref_logprobs=None if kl is None else ref,
                               generator=torch.Generator(device).manual_seed(0))
        return out.loss.detach(), torch.autograd.grad(out.loss, x)[0]

    def verl(mode):
        x = lp.clone().requires_grad_(True)
        kl = core_algos.agg_loss(core_algos.kl_penalty(x, ref, "low_var_kl"), mask.double(),
                                 mode)
        return coef * kl.detach(), coef * torch.autograd.grad(kl, x)[0]

    without = loss(None, None)
    for mode in MODES:
        with_kl = loss(rlfuse.terms.KLPenalty(coef, "low_var_kl", agg=mode), None)
        expected = verl(mode)
        for got, plain, want in zip(with_kl, without, expected):
            # verl's +1e-8 per sequence in seq-mean-token-mean, fp64 sums in another order
            torch.testing.assert_close(got - plain, want, rtol=1e-7, atol=1e-12)
    own = objective.agg or "token-sum"
    caller = None if objective.agg else own
    default = loss(rlfuse.terms.KLPenalty(coef, "low_var_kl"), caller)
    plain = loss(None, caller)
    for got, base, want in zip(default, plain, verl(own)):
        torch.testing.assert_close(got - base, want, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("name", ["geo_mean", "sapo", "clip"])
def test_entropy_term_aggregates_as_verls_actor(name, impl, device):
    """``EntropyBonus(agg=mode)`` from logits is verl's actor's entropy loss,
    ``agg_loss(entropy, mask, loss_agg_mode)``; without ``agg`` the objective's aggregation:
    value and the gradient to the logits in fp64."""
    lp, old, ref, adv, mask = _term_batch(device)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, T, 11, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(0, 11, (B, T), generator=gen).to(device)
    objective = rlfuse.objectives.OBJECTIVES[name].example()
    coef = 0.2

    def loss(entropy):
        x = logits.clone().requires_grad_(True)
        out = impl.policy_loss(rlfuse.Logits(x, targets), old, adv, mask, objective,
                               entropy=entropy)
        return out.loss.detach(), torch.autograd.grad(out.loss, x)[0]

    def verl(mode):
        x = logits.clone().requires_grad_(True)
        h = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
        term = -coef * core_algos.agg_loss(h, mask.double(), mode)
        return term.detach(), torch.autograd.grad(term, x)[0]

    plain = loss(None)
    for mode in MODES + [None]:
        got = loss(rlfuse.terms.EntropyBonus(coef, agg=mode))
        for g, p, want in zip(got, plain, verl(mode or objective.agg or "token-mean")):
            torch.testing.assert_close(g - p, want, rtol=1e-7, atol=1e-12)
