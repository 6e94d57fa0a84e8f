"""policy_loss: every objective and term against float64 in every policy form, the fused kernels
against the reference, TRL's formulas (its own functions where it has them), bad input."""
import math
from types import SimpleNamespace

import pytest
import torch

import rlfuse
from rlfuse import objectives as O
from rlfuse import reference
from rlfuse import terms as K

from conftest import (TOL, as_logprobs, assert_three_way, fp32_exact, integration,
                      matmul_rounding)

B, T, V, H = 4, 6, 37, 8


def make_case(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.25
    mask[:, 0] = True
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    noise = lambda s: s * torch.randn(B, T, generator=gen, dtype=torch.float64)   # noqa: E731
    nan = torch.full((B, T), float("nan"), dtype=torch.float64)
    garbage = lambda x: torch.where(mask, x, nan)   # noqa: E731  (never to be read)
    return dict(logits=logits, targets=targets, mask=mask, lp=lp,
                old=garbage(as_logprobs(lp + noise(0.4))), ref=garbage(as_logprobs(lp + noise(0.5))),
                sampling=garbage(as_logprobs(lp + noise(0.6))),
                adv=torch.randn(B, generator=gen, dtype=torch.float64),
                adv_tok=torch.randn(B, T, generator=gen, dtype=torch.float64),
                weights=torch.rand(B, T, generator=gen, dtype=torch.float64) * 2,
                hidden=torch.randn(B, T, H, generator=gen, dtype=torch.float64),
                weight=torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.7)


def policy_of(case, form, dtype, device):
    leaf = {"logprobs": case["lp"], "logits": case["logits"], "head": case["hidden"]}[form]
    leaf = leaf.to(device=device, dtype=dtype).clone().requires_grad_(True)
    targets = case["targets"].to(device)
    if form == "logits":
        return leaf, rlfuse.Logits(leaf, targets)
    if form == "head":
        return leaf, rlfuse.LinearHead(leaf, case["weight"].to(device, dtype), targets,
                                       chunk_tokens=5)
    return leaf, leaf


def run(lib, case, form, dtype, device, objective, **kw):
    """(loss, metrics, gradient w.r.t. the policy's leaf) of policy_loss; the [B, T] inputs in
    the compute dtype."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    leaf, policy = policy_of(case, form, dtype, device)
    kw = {k: v.to(device=device, dtype=acc) if isinstance(v, torch.Tensor) else v
          for k, v in kw.items()}
    old = kw.pop("old", case["old"].to(device=device, dtype=acc))
    adv = kw.pop("adv", case["adv"].to(device=device, dtype=acc))
    out = lib.policy_loss(policy, old, adv, case["mask"].to(device), objective, **kw)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out.loss.detach().cpu(), {k: v.cpu() for k, v in out.metrics.items()}, grad.cpu()


X = fp32_exact   # hyper-parameters a float64 kernel run sees exactly (Triton passes fp32)
OBJECTIVES = {
    "clip": O.Clip(clip=(X(0.2), X(0.28))),
    # the dual clip binds before the cap (both bound r for A < 0; TRL's cap: "bnpo_delta")
    "clip_dual_cap": O.Clip(clip=(X(0.2), X(0.28)), dual_clip=X(1.5), ratio_cap=X(1.75)),
    "gppo": O.GPPO(geometry="chi2", topology="binary", delta=(0.05, 0.3)),
    "cispo": O.CISPO(clip=(X(0.2), X(0.28))),
    "cispo_trl": O.CISPOTRL(epsilon_high=X(1.25)),
    "cispo_trl_sequence": O.CISPOTRL(epsilon_high=X(1.25), ratio_level="sequence"),
    "sapo": O.SAPO(tau_pos=1.0, tau_neg=X(1.0625)),
    "sapo_trl": O.SAPOTRL(tau_pos=X(0.75), tau_neg=X(1.0625)),
    "sapo_trl_sequence": O.SAPOTRL(tau_pos=X(0.75), tau_neg=X(1.0625), ratio_level="sequence"),
    "gpg": O.GPG(),
    "dro": O.DRO(dro_beta=X(0.375)),
    "dppo_tv": O.DPPOTV(clip=(X(0.05), X(0.08)), truncation=X(1.5)),
    "dppo_kl": O.DPPOKL(clip=(X(0.02), X(0.04)), truncation=X(1.5)),
    "gspo": O.GSPO(clip=(X(0.02), X(0.003))),
    "gspo_trl": O.GSPOTRL(clip=(X(0.02), X(0.003)), ratio_cap=X(1.125)),
    "luspo": O.LUSPO(clip=(X(0.02), X(0.03))),
    "geo_mean": O.GeoMean(clip=(X(0.2), X(0.3))),
    "vespo": O.VESPO(),
    "clip_cov": O.ClipCov(clip=(X(0.2), X(0.28)), clip_cov_ratio=0.2, clip_cov_lb=-1.0,
                          clip_cov_ub=1.0),
    "kl_cov": O.KLCov(kl_cov_ratio=0.25, ppo_kl_coef=X(0.5)),
}


def terms(name, case):
    """The terms of a case by name (``logits``-only ones need Logits / LinearHead)."""
    return {
        "none": {},
        "kl_k3": dict(ref_logprobs=case["ref"], kl=K.KLPenalty(X(0.25))),
        "kl_trl": dict(ref_logprobs=case["ref"], kl=K.KLPenalty(X(0.25), clamp=False,
                                                               importance_weighted=True)),
        "kl_abs_st": dict(ref_logprobs=case["ref"], kl=K.KLPenalty(X(0.25), "abs+")),
        "weights": dict(weights=case["weights"], agg="seq-mean-token-sum"),
        "entropy": dict(entropy=K.EntropyBonus(X(0.125))),
        # the single pass's KL and entropy together (as TRL runs them), with weights
        "kl_entropy": dict(ref_logprobs=case["ref"], kl=K.KLPenalty(X(0.25), clamp=False,
                                                                   importance_weighted=True),
                           entropy=K.EntropyBonus(X(0.125))),
        "kl_abs_st_weights": dict(ref_logprobs=case["ref"], kl=K.KLPenalty(X(0.25), "abs+"),
                                  weights=case["weights"], agg="seq-mean-token-sum"),
        "entropy_mask": dict(entropy=K.EntropyBonus(X(0.125), agg="token-mean"),
                             entropy_mask=K.TopEntropyMask(0.5)),
        "off_policy": dict(off_policy_mask=K.OffPolicyMask(X(0.125), case["sampling"]),
                           ref_logprobs=case["ref"], kl=K.KLPenalty(X(0.25), "low_var_kl")),
    }[name]


LOGPROB_TERMS = ("none", "kl_k3", "kl_trl", "kl_abs_st", "weights", "off_policy")
# from logits: each kind of term once, the single pass's KL and entropy in one call (the plain
# objective and k3 as from log-probs)
LOGITS_TERMS = ("kl_entropy", "kl_abs_st_weights", "off_policy", "entropy_mask")
# a LinearHead's chunks run the logits' row kernels: its single pass with every term, and its
# two passes
HEAD_TERMS = ("kl_entropy", "entropy_mask")
FIXED_AGG = ("sapo", "luspo", "geo_mean")


def objective_kw(objective, kw):
    if objective in FIXED_AGG:
        kw = {k: v for k, v in kw.items() if k != "agg"}
    return kw


def seeded(kw, seed=7):
    return dict(kw, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("form", ["logprobs", "logits", "head"])
def test_fused_is_the_reference_in_float64(objective, form, device):
    """Every objective with every term, from every policy form: the kernels compute the
    reference's math (float64, exact hyper-parameters)."""
    case = make_case(1)
    for name in {"logprobs": LOGPROB_TERMS, "logits": LOGITS_TERMS, "head": HEAD_TERMS}[form]:
        kw = objective_kw(objective, terms(name, case))
        fused = run(rlfuse, case, form, torch.float64, device, OBJECTIVES[objective], **seeded(kw))
        ref = run(reference, case, form, torch.float64, "cpu", OBJECTIVES[objective],
                  **seeded(kw))
        torch.testing.assert_close(fused[0], ref[0], **TOL["fp64_chain"], msg=name)
        torch.testing.assert_close(fused[2], ref[2], **TOL["fp64_chain"], msg=name)
        assert fused[1].keys() == ref[1].keys(), name
        for metric in fused[1]:
            torch.testing.assert_close(fused[1][metric], ref[1][metric], **TOL["fp64_chain"],
                                       msg=f"{name}: {metric}")


def head_floors(case, objective, kw, dtype):
    """The rounding floors of a LinearHead's loss and hidden-state gradient in ``dtype``: each
    logit ``y = h W^T`` rounded by its matmul (H terms) moves the loss by at most ``|dL/dy|``
    times that, and the gradient ``dL/dy W`` is itself a matmul of V terms. ``dL/dy`` is the
    float64 reference's, from the head's exact logits through an identity head."""
    logits = case["hidden"] @ case["weight"].T
    eye = torch.eye(logits.shape[-1], dtype=torch.float64)
    dy = run(reference, dict(case, hidden=logits, weight=eye), "head", torch.float64, "cpu",
             objective, **seeded(kw))[2]
    loss = (dy.abs() * matmul_rounding(case["hidden"], case["weight"].T, dtype)).sum().item()
    return loss, matmul_rounding(dy, case["weight"], dtype).max().item()


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
@pytest.mark.parametrize("form, dtype", [("logprobs", torch.float32), ("logits", torch.bfloat16),
                                         ("logits", torch.float32), ("head", torch.float32)])
def test_matches_float64(objective, form, dtype, device):
    """The three-way rule in the inputs' own dtype, with the KL penalty and (from logits) the
    entropy bonus."""
    case = make_case(2)
    kw = dict(terms("kl_trl", case), **(terms("entropy", case) if form != "logprobs" else {}))
    fused = run(rlfuse, case, form, dtype, device, OBJECTIVES[objective], **seeded(kw))
    ref = run(reference, case, form, dtype, "cpu", OBJECTIVES[objective], **seeded(kw))
    ref64 = run(reference, case, form, torch.float64, "cpu", OBJECTIVES[objective],
                **seeded(kw))
    floors = head_floors(case, OBJECTIVES[objective], kw, dtype) if form == "head" else (0, 0)
    assert_three_way(fused[0], ref[0], ref64[0], "loss", floor=floors[0])
    assert_three_way(fused[2], ref[2], ref64[2], "gradient", floor=floors[1])
    assert fused[1].keys() == ref64[1].keys()
    for name in fused[1]:
        # log-ratios are rounded at the log-probs' magnitude (~8), not at their mean's
        scale = 8.0 if name in ("approx_kl", "kl") else None
        assert_three_way(fused[1][name], ref[1][name], ref64[1][name], name,
                         atol_dtype=torch.float32, scale=scale)


def test_objectives_bind():
    """Each objective's branches act on the test case: its flags count tokens, so the
    comparisons above reach the clipped, capped, dropped and truncated branches."""
    case = make_case(1)
    flags = {"clip": ["clip_frac_low", "clip_frac_high"], "clip_dual_cap": ["dual_clip_frac"],
             "cispo": ["clip_frac"], "cispo_trl": ["clip_frac_high"],
             "dppo_tv": ["dropped_frac", "truncated_frac"],
             "dppo_kl": ["dropped_frac", "truncated_frac"], "gspo": ["clip_frac_low", "clip_frac_high"],
             "gspo_trl": ["clip_frac_low", "clip_frac_high"], "geo_mean": ["clip_frac_high"],
             "clip_cov": ["cut_frac"]}
    for objective, names in flags.items():
        metrics = run(reference, case, "logprobs", torch.float64, "cpu", OBJECTIVES[objective],
                      **seeded({}))[1]
        for name in names:
            assert metrics[name] > 0, (objective, name)


@pytest.mark.parametrize("form", ["logprobs", "logits"])
def test_clip_clamps_the_log_ratio_as_verl(form, impl, device):
    """Clip (no dual clip) at log-ratios past +-20, both signs of A: verl's vanilla formula,
    max(-A r, -A clip(r, lo, hi)) with r = exp(clamp(lp - old, -20, 20)) (the value at the
    clamp, no gradient past it), in float64; GPPO clamps nothing (r A unclamped)."""
    dev = device if impl is rlfuse else "cpu"
    case = make_case(4)
    log_ratio = torch.tensor([30.0, -30.0, 25.0, -25.0, 0.1, -0.1], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, -0.5, 0.5, 1.0, -1.0]], dtype=torch.float64).expand(B, T)
    mask = torch.ones(B, T, dtype=torch.bool, device=dev)
    # a negative log-ratio of 30 needs a log-prob below -30: the target's logit at -50 there
    logits = case["logits"].clone()
    low = (log_ratio < 0).expand(B, T)
    logits[low, case["targets"][low]] = -50.0
    case = dict(case, mask=mask, logits=logits,
                lp=reference.token_logprobs(logits, case["targets"]))
    leaf, policy = policy_of(case, form, torch.float64, dev)
    lp = leaf if form == "logprobs" else reference.token_logprobs(leaf, case["targets"].to(dev))
    old = lp.detach() - log_ratio.to(dev)
    assert old.max() < 0
    adv = adv.to(dev)

    def oracle(clamp):
        r = torch.exp((lp - old).clamp(-clamp, clamp))
        return torch.maximum(-adv * r, -adv * r.clamp(1 - X(0.2), 1 + X(0.28))).mean()

    for objective, clamp in ((O.Clip(clip=(X(0.2), X(0.28))), 20.0),
                             (O.GPPO("chi2", "atomic", delta=X(1e6)), math.inf)):
        out = impl.policy_loss(policy, old, adv, mask, objective)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        if clamp == math.inf:          # GPPO's region: wider than any ratio here, so r A
            expected = (-adv * torch.exp(lp - old)).mean()
        else:
            expected = oracle(clamp)
        (grad_expected,) = torch.autograd.grad(expected, leaf, retain_graph=True)
        torch.testing.assert_close(out.loss, expected, **TOL["fp64"])
        torch.testing.assert_close(grad, grad_expected, **TOL["fp64_grad"])


def test_unscored_sampling_tokens_count_as_zero(impl, device):
    """Tokens vLLM could not score carry NaN sampling log-probs: the off-policy mask takes their
    sampling - lp as 0, as TRL's get_off_policy_mask does, with validate=True too."""
    GRPOTrainer = integration("trl.trainer.grpo_trainer").GRPOTrainer
    dev = device if impl is rlfuse else "cpu"
    case = make_case(5)
    mask = case["mask"]
    lp = torch.where(mask, case["lp"], 0.0).float()
    sampling = torch.where(mask, case["sampling"], 0.0).float()
    sampling[0, 0] = sampling[2, 0] = math.nan       # actor tokens (column 0 always is)
    adv = -case["adv"].abs().float()                 # negative: the mask decides every row
    for threshold in (0.05, 0.5, 5.0):
        keep = GRPOTrainer.get_off_policy_mask(adv[:, None], lp, sampling, mask.float(),
                                               threshold)[:, 0]
        x = lp.to(dev).requires_grad_(True)
        out = impl.policy_loss(x, lp.to(dev), adv.to(dev), mask.to(dev), "clip",
                               off_policy_mask=K.OffPolicyMask(threshold, sampling.to(dev)))
        assert out.metrics["off_policy_mask_frac"].item() == pytest.approx(
            (keep[:, None] * mask).sum().item() / mask.sum().item()), threshold
        assert torch.isfinite(out.loss)


def test_terms_metrics(device):
    case = make_case(3)
    out = run(rlfuse, case, "logits", torch.float32, device, "clip",
              **terms("entropy_mask", case), **terms("off_policy", case))[1]
    assert {"kl", "entropy", "entropy_mask_frac", "off_policy_mask_frac"} <= set(out)
    assert 0 < out["entropy_mask_frac"] < 1 and 0 < out["off_policy_mask_frac"] <= 1
    mask = case["mask"]
    lp, h = reference.token_logprobs(case["logits"], case["targets"], return_entropy=True)
    torch.testing.assert_close(out["entropy"], h[mask].mean().float(), **TOL["fp32_sum"])


def test_sequence_shares_of_the_clip(impl, device):
    """clip_frac_low_seq_min / clip_frac_high_seq_max: the least share of tokens clipped from
    below and the greatest from above over the sequences with tokens (a row without any is
    left out); clip_frac_*_seq_mean: the mean share over every sequence (one without tokens
    counts 0, as TRL's sequence-level mean); against a loop over the sequences, with the
    advantages and their negation."""
    case = make_case(4)
    mask = case["mask"].clone()
    mask[2] = False
    old = torch.where(mask, case["old"], 0.0)
    r = torch.exp(case["lp"] - old)
    seen = []
    for adv in (case["adv_tok"], -case["adv_tok"]):
        out = impl.policy_loss(case["lp"].to(device), old.to(device), adv.to(device),
                               mask.to(device), O.Clip(0.0625))
        low, high = (adv < 0) & (r < 0.9375), (adv > 0) & (r > 1.0625)
        shares = [((low[b] & mask[b]).sum() / mask[b].sum(), (high[b] & mask[b]).sum() /
                   mask[b].sum()) for b in range(B) if mask[b].any()]
        want_low, want_high = min(x[0] for x in shares), max(x[1] for x in shares)
        assert out.metrics["clip_frac_low_seq_min"].item() == pytest.approx(want_low.item())
        assert out.metrics["clip_frac_high_seq_max"].item() == pytest.approx(want_high.item())
        for side, i in (("low", 0), ("high", 1)):
            assert out.metrics[f"clip_frac_{side}_seq_mean"].item() == pytest.approx(
                sum(x[i].item() for x in shares) / B)
        seen += [want_low.item(), want_high.item()]
    assert min(seen) >= 0 and sorted(seen)[-2] > 0    # some extremes are not 0
    empty = impl.policy_loss(case["lp"][:, :0].to(device), old[:, :0].to(device),
                             case["adv_tok"][:, :0].to(device), mask[:, :0].to(device),
                             O.Clip(0.0625))
    assert empty.metrics["clip_frac_low_seq_min"] == 0 == empty.metrics["clip_frac_high_seq_max"]
    assert empty.metrics["clip_frac_low_seq_mean"] == 0


def test_cispo_trl_sequence_clip_share(impl, device):
    """TRL's CISPO at the sequence level: clip_frac_high is the share of the tokens whose
    sequence ratio exceeds the cap (A > 0), clip_frac_high_seq_mean the share of the sequences
    (TRL's cispo_clip_ratio there), against a loop over rows of different lengths."""
    case = make_case(5)
    mask = case["mask"]
    old = torch.where(mask, case["old"], 0.0)
    out = impl.policy_loss(case["lp"].to(device), old.to(device), case["adv"].to(device),
                           mask.to(device), O.CISPOTRL(epsilon_high=1.05, ratio_level="sequence"))
    seq = [(case["lp"][b] - old[b])[mask[b]].mean() for b in range(B)]
    flags = [bool(seq[b] > math.log(1.05) and case["adv"][b] > 0) for b in range(B)]
    n = mask.sum(-1)
    assert 0 < sum(flags) < B and len(set(n.tolist())) > 1
    assert out.metrics["clip_frac_high_seq_mean"].item() == pytest.approx(sum(flags) / B)
    assert out.metrics["clip_frac_high"].item() == pytest.approx(
        sum(int(n[b]) for b in range(B) if flags[b]) / int(n.sum()))


def test_clip_cov_replays_its_draw(impl, device):
    """The random choice of Clip-Cov comes from ``generator``: the same seed, the same tokens
    (the same loss); another seed, another choice."""
    case = make_case(4)
    dev = device if impl is rlfuse else "cpu"
    objective = OBJECTIVES["clip_cov"]
    a = run(impl, case, "logprobs", torch.float64, dev, objective, **seeded({}, 1))
    b = run(impl, case, "logprobs", torch.float64, dev, objective, **seeded({}, 1))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    others = {run(impl, case, "logprobs", torch.float64, dev, objective, **seeded({}, s))[0].item()
              for s in range(2, 8)}
    assert len(others | {a[0].item()}) > 1


def test_gr_opd_is_the_clip_over_its_advantages(impl, device):
    """GR-OPD with terms is policy_loss with gr_opd_advantages (docs/objectives.md): without
    terms, equal to gr_opd_loss in loss and gradient."""
    case = make_case(5)
    dev = device if impl is rlfuse else "cpu"
    old, mask = case["old"].to(dev), case["mask"].to(dev)
    teacher = case["ref"].to(dev)
    adv = impl.gr_opd_advantages(old, teacher, mask, group_size=2)
    outs = []
    for call in (lambda p: impl.gr_opd_loss(p, old, teacher, mask, group_size=2, eps=0.25),
                 lambda p: impl.policy_loss(p, old, adv, mask, O.Clip(clip=0.25),
                                            agg="seq-mean-token-mean")):
        leaf, policy = policy_of(case, "logits", torch.float64, dev)
        out = call(policy)
        outs.append((out.loss.detach(), torch.autograd.grad(out.loss, leaf)[0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], **TOL["fp64_chain"])
    torch.testing.assert_close(outs[1][1], outs[0][1], **TOL["fp64_chain"])


# --------------------------------------------------------------------------------------------
# TRL's formulas
# --------------------------------------------------------------------------------------------

def trl_loss(lp, old, adv, mask, h, *, loss_type, eps_low, eps_high, level="token", delta=None,
             beta=0.0, ref=None, bias_correction=True, tau=(1.0, 1.0625), vespo=(2.0, 3.0, 3.0, 2.0),
             is_ratio=None, top_q=1.0, entropy_coef=0.0, opsm=None, sampling=None, max_len=None,
             num_items=None):
    """GRPOTrainer._compute_loss on one process without gradient accumulation, in plain torch;
    its masks and VESPO's weights by TRL's own functions."""
    from trl import GRPOTrainer

    mask = mask.to(lp.dtype)
    adv = adv.unsqueeze(1)
    one_process = SimpleNamespace(accelerator=SimpleNamespace(
        pad_across_processes=lambda x, dim, pad_index: x, gather=lambda x: x))
    entropy_mask = GRPOTrainer.get_high_entropy_mask(one_process, h, mask, 1 - top_q) \
        if top_q < 1 else None
    if opsm is not None:
        off_policy = GRPOTrainer.get_off_policy_mask(adv, lp, sampling, mask, opsm)
    log_ratio = lp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta:
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        if bias_correction:
            kl = kl * coef_1
    if loss_type == "cispo":
        loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * lp
    elif loss_type == "sapo":
        taus = torch.where(adv > 0, tau[0], tau[1])
        loss = -torch.sigmoid(taus * (coef_1 - 1)) * 4 / taus * adv
    elif loss_type == "vespo":
        phi = GRPOTrainer.get_gamma_weights(adv, log_ratio, mask, is_ratio, *vespo)
        loss = -phi * adv * lp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if opsm is not None:
        loss = loss * off_policy
    if entropy_mask is not None:
        loss = loss * entropy_mask
    if is_ratio is not None and loss_type != "vespo":
        loss = loss * is_ratio
    if beta:
        loss = loss + beta * kl
    if loss_type in ("grpo", "sapo"):
        out = ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        out = (loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        out = (loss * mask).sum() / (loss.size(0) * max_len)
    elif loss_type in ("cispo", "dapo", "vespo"):
        out = (loss * mask).sum() / num_items
    else:   # luspo
        out = (loss * mask).sum(-1).mean()
    if entropy_coef:
        eff = mask if entropy_mask is None else mask * entropy_mask
        out = out - entropy_coef * (h * eff).sum() / eff.sum().clamp(min=1.0)
    return out


def rlfuse_for_trl(policy, old, adv, mask, *, loss_type, eps_low, eps_high, level="token",
                   delta=None, beta=0.0, ref=None, bias_correction=True, tau=(1.0, 1.0625),
                   vespo=(2.0, 3.0, 3.0, 2.0), is_ratio=None, top_q=1.0, entropy_coef=0.0,
                   opsm=None, sampling=None, max_len=None, num_items=None):
    """The rlfuse call of each TRL loss_type and option (docs/trl.md's table)."""
    clip = (eps_low, eps_high)
    if loss_type == "cispo":
        objective = O.CISPOTRL(epsilon_high=eps_high, ratio_level=level)
    elif loss_type == "sapo":
        objective = O.SAPOTRL(tau_pos=tau[0], tau_neg=tau[1], ratio_level=level)
    elif loss_type == "vespo":
        objective = O.VESPO(*vespo)
    elif loss_type == "luspo":
        objective = O.LUSPO(clip=clip, ratio_cap=delta, ratio_level=level)
    elif level == "sequence":
        objective = O.GSPOTRL(clip=clip, ratio_cap=delta)
    else:
        objective = O.Clip(clip=clip, ratio_cap=delta)
    if loss_type in ("grpo", "sapo"):
        agg = dict(agg="seq-mean-token-mean")
    elif loss_type == "bnpo":
        agg = dict(agg="token-mean")
    elif loss_type == "dr_grpo":
        agg = dict(agg="token-mean", num_tokens=mask.shape[0] * max_len)
    elif loss_type == "luspo":
        agg = {}
    else:
        agg = dict(agg="token-mean", num_tokens=num_items)
    kw = dict(agg, weights=is_ratio)
    if beta:
        kw.update(ref_logprobs=ref, kl=K.KLPenalty(beta, "k3", clamp=False,
                                                   importance_weighted=bias_correction))
    if entropy_coef:
        kw["entropy"] = K.EntropyBonus(entropy_coef, agg="token-mean")
    if top_q < 1:
        kw["entropy_mask"] = K.TopEntropyMask(top_q)
    if opsm is not None:
        kw["off_policy_mask"] = K.OffPolicyMask(opsm, sampling)
    return rlfuse.policy_loss(policy, old, adv, mask, objective, **kw).loss


TRL_CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo_delta": dict(loss_type="bnpo", delta=X(1.25)),
    "dr_grpo": dict(loss_type="dr_grpo", max_len=T + 2),
    "dapo_is_ratio": dict(loss_type="dapo", num_items=17.0, is_ratio="weights"),
    "cispo": dict(loss_type="cispo", eps_high=X(1.25), num_items=17.0),
    "cispo_sequence": dict(loss_type="cispo", eps_high=X(1.25), num_items=17.0,
                           level="sequence"),
    "sapo": dict(loss_type="sapo"),
    "sapo_sequence": dict(loss_type="sapo", level="sequence"),
    "luspo": dict(loss_type="luspo", level="sequence"),
    "gspo": dict(loss_type="grpo", level="sequence", delta=X(1.125)),
    "vespo": dict(loss_type="vespo", num_items=17.0, is_ratio="weights"),
    "beta": dict(loss_type="grpo", beta=X(0.125), ref="ref"),
    "beta_no_correction": dict(loss_type="dapo", num_items=17.0, beta=X(0.125), ref="ref",
                               bias_correction=False),
    "beta_sequence": dict(loss_type="grpo", level="sequence", beta=X(0.125), ref="ref"),
    "entropy": dict(loss_type="bnpo", entropy_coef=X(0.0625)),
    "top_entropy": dict(loss_type="grpo", top_q=0.5, entropy_coef=X(0.0625)),
    "opsm": dict(loss_type="dapo", num_items=17.0, opsm=X(0.125), sampling="sampling"),
    "everything": dict(loss_type="grpo", delta=X(1.5), beta=X(0.125), ref="ref", top_q=0.75,
                       entropy_coef=X(0.0625), opsm=X(0.25), sampling="sampling",
                       is_ratio="weights"),
}


@pytest.mark.parametrize("name", sorted(TRL_CASES))
def test_trl_formulas(name, device):
    """Every TRL 1.16 loss_type and loss option: rlfuse's loss and gradient (from logits, fused)
    equal TRL's formula on the same tokens (float64)."""
    integration("trl")
    case = make_case(5)
    kw = dict(dict(eps_low=X(0.2), eps_high=X(0.28)), **TRL_CASES[name])
    for key in ("is_ratio", "ref", "sampling"):
        if isinstance(kw.get(key), str):
            # TRL's importance ratios are 1 at padded positions (a log-ratio of 0 there)
            kw[key] = torch.where(case["mask"], case[kw[key]], 0.0 if key != "is_ratio" else 1.0)
    mask = case["mask"]
    old = torch.where(mask, case["old"], 0.0)
    x = case["logits"].clone().requires_grad_(True)
    lp, h = reference.token_logprobs(x, case["targets"], return_entropy=True)
    want = trl_loss(lp, old, case["adv"], mask, h, **kw)
    (want_grad,) = torch.autograd.grad(want, x)
    y = case["logits"].to(device).clone().requires_grad_(True)
    dev_kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    got = rlfuse_for_trl(rlfuse.Logits(y, case["targets"].to(device)), old.to(device),
                         case["adv"].to(device), mask.to(device), **dev_kw)
    (grad,) = torch.autograd.grad(got, y)
    torch.testing.assert_close(got.cpu(), want.detach(), **TOL["fp64_chain"])
    torch.testing.assert_close(grad.cpu(), want_grad, **TOL["fp64_chain"])


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def bad_calls(case):
    lp = case["lp"].clone().requires_grad_(True)
    logits = rlfuse.Logits(case["logits"].clone().requires_grad_(True), case["targets"])
    old, adv, mask = case["old"], case["adv"], case["mask"]
    ref = case["ref"]
    return [
        (lambda f: f(lp, old, adv, mask, "ppo"), ValueError, "objective: expected one of 'clip'"),
        (lambda f: f(lp, old, adv, mask, 3), TypeError, "objective: expected a name"),
        (lambda f: f(lp, old, adv, mask, "dro"), ValueError, "dro_beta: DRO needs"),
        (lambda f: f(lp, old, adv, mask, O.SAPO(tau_pos=0.0)), ValueError,
         "tau_pos: expected a value finite and > 0"),
        (lambda f: f(lp, old, adv, mask, O.DPPOTV(truncation=-1.0)), ValueError, "truncation"),
        (lambda f: f(lp, old, adv, mask, O.ClipCov(clip_cov_lb=2.0, clip_cov_ub=1.0)), ValueError,
         "clip_cov_ub: expected a value above clip_cov_lb"),
        (lambda f: f(lp, old, adv, mask, O.Clip(ratio_cap=0.0)), ValueError, "ratio_cap"),
        (lambda f: f(lp, old, adv, mask, O.VESPO(k_pos=math.nan)), ValueError,
         "k_pos: expected a number, got nan"),
        (lambda f: f(lp, old.exp(), adv, mask), ValueError,
         r"old_logprobs: expected log-probabilities \(<= 0\)"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref.exp(), kl=K.KLPenalty(0.1)),
         ValueError, "ref_logprobs: expected log-probabilities"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref[:, :2], kl=K.KLPenalty(0.1)),
         ValueError, r"ref_logprobs: expected shape \(4, 6\)"),
        (lambda f: f(lp, old, adv, mask, kl=K.KLPenalty(0.1)), ValueError,
         "ref_logprobs: the KL penalty needs both"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref), ValueError,
         "ref_logprobs: the KL penalty needs both"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref, kl=K.KLPenalty(-0.1)), ValueError,
         "kl.coef: expected a value finite and >= 0"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref, kl=K.KLPenalty(math.nan)),
         ValueError, "kl.coef: expected a number, got nan"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref, kl=K.KLPenalty(0.1, "k4")),
         ValueError, "estimator: expected one of 'k1', 'abs'"),
        (lambda f: f(lp, old, adv, mask, ref_logprobs=ref, kl=0.1), TypeError,
         "kl: expected None or an rlfuse.terms.KLPenalty"),
        (lambda f: f(lp, old, adv, mask, entropy=K.EntropyBonus(0.1)), ValueError,
         "entropy: needs the policy's entropy"),
        (lambda f: f(lp, old, adv, mask, entropy_mask=K.TopEntropyMask(0.2)), ValueError,
         "entropy_mask: needs the policy's entropy"),
        (lambda f: f(logits, old, adv, mask, entropy=K.EntropyBonus(-1.0)), ValueError,
         "entropy.coef: expected a value finite and >= 0"),
        (lambda f: f(logits, old, adv, mask, entropy_mask=K.TopEntropyMask(1.5)), ValueError,
         r"entropy_mask.quantile: expected a value in \[0, 1\]"),
        (lambda f: f(lp, old, adv, mask, off_policy_mask=K.OffPolicyMask(0.0)), ValueError,
         "off_policy_mask.threshold"),
        (lambda f: f(lp, old, adv, mask, off_policy_mask=K.OffPolicyMask(
            0.5, torch.where(mask, -math.inf, 0.0))), ValueError,
         "sampling_logprobs: expected finite values"),
        (lambda f: f(lp, old, adv, mask, off_policy_mask=K.OffPolicyMask(
            0.5, torch.where(mask, 0.5, 0.0))), ValueError,
         r"sampling_logprobs: expected log-probabilities \(<= 0\)"),
        (lambda f: f(lp, old, adv, mask, generator=123), TypeError,
         "generator: expected a torch.Generator or None; got int"),
        (lambda f: f(lp, old, adv, mask, "sapo", agg="token-mean"), ValueError,
         "agg: objective 'sapo' aggregates by 'seq-mean-token-mean'"),
        (lambda f: f(lp, old, adv, mask, agg="mean"), ValueError, "agg: expected one of"),
    ]


@pytest.mark.parametrize("index", range(len(bad_calls(make_case(0)))))
def test_bad_input(index, impl):
    fn, error, match = bad_calls(make_case(0))[index]
    with pytest.raises(error, match=match):
        fn(impl.policy_loss)


def test_kl_penalty_bad_input(impl):
    lp = -torch.rand(2, 3)
    with pytest.raises(ValueError, match="estimator: expected one of"):
        impl.kl_penalty(lp, lp, "full")
    with pytest.raises(ValueError, match=r"ref_logprobs: expected shape \(2, 3\)"):
        impl.kl_penalty(lp, lp[:, :2])
