"""rlfuse against an independent implementation: Liger-Kernel (the benchmarks' peer).

GR-OPD with given advantages IS GRPO with the PPO clip, beta = 0 and the per-response token mean,
which Liger's ``GrpoLossFunction`` implements in its own Triton kernels; per-token log-probs are
Liger's selective log-softmax. Both are called through the benchmark's adapters
(``bench.cases``), so this also checks that the peer rows of the benchmark do rlfuse's work.
"""
from types import SimpleNamespace

import pytest
import torch

import rlfuse
from bench import cases

from conftest import PEER_GRAD_RTOL, TOL

liger = pytest.importorskip(cases.LIGER_MODULE)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GRAD_RTOL = PEER_GRAD_RTOL


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Liger's fused-linear loss torch.compiles its chunk loss, with the epsilons bound as
    constants, on every call. After a compile with other epsilons and dtype (the PPO row's
    clip-higher in bf16) torch 2.13 reuses a stale backward: the fp32 GR-OPD loss stays exact
    but Liger's dhidden moves by 5e-4 of its scale, against the float64 reference as against
    rlfuse. Each test starts from an empty compile cache, so the peer is the peer."""
    torch._dynamo.reset()
    yield


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def inputs(request):
    shape = next(s for s in cases.make_shapes(quick=True)
                 if s.V is not None and s.dtype == request.param)
    return cases.make_inputs(shape, DEVICE, seed=3)


def test_token_logprobs_match_liger(inputs):
    x = inputs
    ours = rlfuse.token_logprobs(x.logits, x.targets, mask=x.mask)
    theirs = cases.OPS["token_logprobs"].liger(liger, x)
    assert theirs.shape == ours.shape
    torch.testing.assert_close(ours.detach()[x.mask], theirs[x.mask], **TOL["fp32_logprob_abs"])


def test_gr_opd_with_advantages_is_liger_grpo(inputs):
    # An old policy further off than the benchmark's, so that the clip is active on both sides.
    x = SimpleNamespace(**vars(inputs))
    g = torch.Generator(device=DEVICE).manual_seed(4)
    x.old_lp = (x.old_lp + 0.3 * torch.randn(x.old_lp.shape, generator=g, device=DEVICE)
                ).clamp_max(0.0)
    out = rlfuse.gr_opd_loss(rlfuse.Logits(x.logits, x.targets), x.old_lp, x.teacher_lp, x.mask,
                             group_size=x.group_size, eps=0.2, advantages=x.opd_advantages)
    assert 0.1 < out.metrics["clip_frac"].item() < 0.9
    ours = out.loss
    theirs = cases.OPS["gr_opd_logits"].liger(liger, x)
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item()))
    (g_ours,) = torch.autograd.grad(ours, x.logits)
    (g_theirs,) = torch.autograd.grad(theirs, x.logits_full)
    assert g_theirs[:, -1].abs().max() == 0       # the last position predicts nothing
    g_theirs = g_theirs[:, :-1]
    scale = g_theirs.abs().max().item()
    assert scale > 0
    err = (g_ours.float() - g_theirs.float()).abs().max().item()
    assert err <= GRAD_RTOL[x.logits.dtype] * scale, (err, scale)


def test_linear_head_gr_opd_is_liger_fused_linear_grpo(inputs):
    """The LinearHead peer: Liger's chunked fused-linear GRPO loss (through the benchmark's
    adapter) against rlfuse's GR-OPD from a LinearHead with the same advantages — loss and the
    gradients of the hidden states and the head's weight, which are matmuls of the rounded
    dlogits on both sides: up to 4 of the dlogits' rounding steps of their scale."""
    x = SimpleNamespace(**vars(inputs))
    g = torch.Generator(device=DEVICE).manual_seed(5)
    x.old_lp = (x.old_lp + 0.3 * torch.randn(x.old_lp.shape, generator=g, device=DEVICE)
                ).clamp_max(0.0)
    head = rlfuse.LinearHead(x.hidden, x.weight, x.targets, chunk_tokens=5)
    out = rlfuse.gr_opd_loss(head, x.old_lp, x.teacher_lp, x.mask, group_size=x.group_size,
                             eps=0.2, advantages=x.opd_advantages)
    assert 0.05 < out.metrics["clip_frac"].item() < 0.95
    theirs = cases.OPS["gr_opd_head"].liger(liger, x)
    assert abs(out.loss.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item()))
    ours_grads = torch.autograd.grad(out.loss, (x.hidden, x.weight))
    their_grads = torch.autograd.grad(theirs, (x.hidden, x.weight))
    for name, a, b in zip(("dhidden", "dweight"), ours_grads, their_grads):
        scale = b.abs().max().item()
        assert scale > 0, name
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 4 * GRAD_RTOL[x.hidden.dtype] * scale, (name, err, scale)


@pytest.mark.parametrize("form", ["logits", "head"])
def test_ppo_clip_higher_is_liger_grpo(inputs, form):
    """ppo_loss with DAPO's clip-higher and TRL's grpo aggregation against Liger's GRPO loss
    with the same epsilons (its triton loss over the logits, its fused-linear loss over the
    head), through the benchmark's adapters of the ppo rows."""
    x = SimpleNamespace(**vars(inputs))
    g = torch.Generator(device=DEVICE).manual_seed(6)
    x.old_lp = (x.old_lp + 0.3 * torch.randn(x.old_lp.shape, generator=g, device=DEVICE)
                ).clamp_max(0.0)
    if form == "logits":
        policy, leaves, theirs_leaves = rlfuse.Logits(x.logits, x.targets), (x.logits,), \
            (x.logits_full,)
    else:
        policy = rlfuse.LinearHead(x.hidden, x.weight, x.targets, chunk_tokens=5)
        leaves = theirs_leaves = (x.hidden, x.weight)
    out = rlfuse.ppo_loss(policy, x.old_lp, x.advantages, x.mask, clip=cases.PPO_CLIP,
                          agg=cases.PPO_AGG)
    assert 0.05 < (out.metrics["clip_frac_low"] + out.metrics["clip_frac_high"]).item() < 0.95
    theirs = cases.OPS[f"ppo_{form}"].liger(liger, x)
    assert abs(out.loss.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item()))
    ours_grads = torch.autograd.grad(out.loss, leaves)
    their_grads = torch.autograd.grad(theirs, theirs_leaves)
    if form == "logits":
        assert their_grads[0][:, -1].abs().max() == 0   # the last position predicts nothing
        their_grads = (their_grads[0][:, :-1],)
    # logits: one rounding of dlogits per side; head: matmuls of the rounded dlogits (up to 4)
    rounding = (1 if form == "logits" else 4) * GRAD_RTOL[leaves[0].dtype]
    for a, b in zip(ours_grads, their_grads):
        scale = b.abs().max().item()
        assert scale > 0
        err = (a.float() - b.float()).abs().max().item()
        assert err <= rounding * scale, (err, scale)
