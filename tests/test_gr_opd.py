"""Fused GR-OPD vs the reference vs float64: advantages, loss, gradients, both forms."""
import math

import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import assert_three_way
from loss_harness import check_three_way, constexpr_params, run_loss, token_inputs, with_garbage

# Hyper-parameters that reach a float64 kernel run unrounded (see conftest.fp32_exact): the
# kernels receive log(gamma), so gamma = exp(an fp32 number).
EXACT = dict(gamma=math.exp(-0.0625), std_eps=2.0 ** -20)


def gr_opd_case(B, T, *, seed, spread=0.3):
    gen, _, mask = token_inputs(B, T, seed=seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 4
    teacher = old + torch.randn(B, T, generator=gen, dtype=torch.float64)
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * spread
    return torch.cat([lp, lp[:, :1]], 1), with_garbage(old, mask), with_garbage(teacher, mask), mask


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
    torch.testing.assert_close(adv.cpu(), ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_discount_spans_time_blocks(dtype, device):
    """T beyond one time block of the group kernel: the actor index k carries across blocks."""
    from rlfuse.kernels.utils import group_tile

    m, T = 16, 300
    assert group_tile(T, m)[1] < T
    check_advantages(m, T, dtype, device, seed=8, **dict(EXACT, group_size=m,
                     gamma=math.exp(-2.0 ** -7), feedback_clip=0.75))


def test_advantages_identical_scores(device):
    """sigma = 0: A = clamp(lam mu / std_eps), finite."""
    _, old, _, mask = gr_opd_case(4, 6, seed=5)
    teacher = old + 0.5
    adv = rlfuse.gr_opd_advantages(old.to(device), teacher.to(device), mask.to(device),
                                   group_size=2, lam=0.25)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv.cpu(), torch.full((4,), 5.0, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_logprobs_matches_float64(dtype, lam, device):
    lp, old, teacher, mask = gr_opd_case(6, 11, seed=7)
    check_three_way(rlfuse.gr_opd_loss, reference.gr_opd_loss, lp, dtype=dtype, device=device,
                    args=(old.to(dtype), teacher.to(dtype), mask),
                    args64=(old, teacher, mask),
                    metric_names=["clip_frac", "adv_mean", "adv_abs_mean", "feedback_mean"],
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
    old = with_garbage(lp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.2, mask)
    teacher = with_garbage(lp + torch.randn(B, T, generator=gen, dtype=torch.float64), mask)
    check_three_way(rlfuse.gr_opd_loss, reference.gr_opd_loss, logits, dtype=dtype,
                    device=device, logits_targets=targets,
                    args=(old.float(), teacher.float(), mask), args64=(old, teacher, mask),
                    group_size=2)


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
    torch.testing.assert_close(parts[0][0] + parts[1][0], full[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([parts[0][2], parts[1][2]]), full[2])


def test_precomputed_advantages_same_loss_and_metrics(device):
    lp, old, teacher, mask = gr_opd_case(6, 7, seed=14)
    adv = rlfuse.gr_opd_advantages(old.to(device), teacher.to(device), mask.to(device),
                                   group_size=3)
    kw = dict(dtype=torch.float64, device=device, args=(old, teacher, mask), group_size=3)
    computed = run_loss(rlfuse.gr_opd_loss, lp, **kw)
    given = run_loss(rlfuse.gr_opd_loss, lp, advantages=adv, **kw)
    torch.testing.assert_close(given[0], computed[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(given[2], computed[2], rtol=1e-12, atol=1e-14)
    for name, value in computed[1].items():
        torch.testing.assert_close(given[1][name], value, rtol=1e-12, atol=1e-14)


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
    torch.testing.assert_close(loss, per_response, rtol=1e-12, atol=1e-14)
    assert abs(loss.item() - token_mean.item()) > 1e-3


def test_overflow_raises(device):
    lp, old, teacher, mask = gr_opd_case(2, 3, seed=11)
    lp = torch.cat([torch.where(mask, old, 0.0) + 100.0, lp[:, -1:]], 1)
    adv = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    for fn in (rlfuse.gr_opd_loss, reference.gr_opd_loss):
        with pytest.raises(ValueError, match="overflow"):
            run_loss(fn, lp, dtype=torch.float32, device=device,
                     args=(old.float(), teacher.float(), mask), group_size=2,
                     advantages=adv.float())


def test_runtime_hyperparameters_are_not_constexpr():
    from rlfuse.kernels import gr_opd

    assert constexpr_params(gr_opd._gr_opd_adv_kernel) <= {"BLOCK_M", "BLOCK_T", "ACC"}


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
@pytest.mark.parametrize("fn", [rlfuse.gr_opd_loss, reference.gr_opd_loss])
def test_bad_input(fn, bad, exc, match):
    a = dict(policy=torch.zeros(4, 5), old=torch.zeros(4, 5) - 1, teacher=torch.zeros(4, 5) - 2,
             mask=torch.ones(4, 5, dtype=torch.bool), group_size=2)
    bad = dict(bad)
    if bad.pop("empty_response", False):
        a["mask"][1] = False
    a.update(bad)
    with pytest.raises(exc, match=match):
        fn(a.pop("policy"), a.pop("old"), a.pop("teacher"), a.pop("mask"), **a)


def test_module_wrapper(device):
    lp, old, teacher, mask = gr_opd_case(4, 5, seed=12)
    module = rlfuse.GROPDLoss(group_size=2, eps=0.3)
    args = (lp[:, :-1].float().to(device), old.float().to(device), teacher.float().to(device),
            mask.to(device))
    assert torch.equal(module(*args).loss, rlfuse.gr_opd_loss(*args, group_size=2, eps=0.3).loss)
