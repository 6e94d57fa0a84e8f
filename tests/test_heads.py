"""What models put after the output projection (SPEC 8.2): a ``LinearHead``'s ``logit_scale``
and ``softcap`` against float64 (three-way) for the log-prob ladder (``policy_logprobs`` with
entropy and every gradient, packed rows too) and the single pass (``policy_loss`` with its KL
and entropy terms), extreme and -inf logits through the softcap, ``head_dtype`` (an fp32 matmul
over bf16 hidden states, also under autocast), and bad heads. The heads of real models (Gemma,
Cohere, Granite) against their own logits: ``test_trl.py``."""
import pytest
import torch

import rlfuse
from rlfuse import objectives, reference, terms

from conftest import TOL, assert_three_way

B, S, H, V = 3, 7, 8, 37
OFFSET, T = 2, 4
# (logit_scale, softcap): each alone and both, the softcap small enough to bend every logit
HEADS = [(0.625, None), (1.0, 2.5), (1.75, 4.0)]


def make_case(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    case = dict(hidden=torch.randn(B, S, H, generator=gen, dtype=torch.float64) * 1.5,
                weight=torch.randn(V, H, generator=gen, dtype=torch.float64),
                bias=torch.randn(V, generator=gen, dtype=torch.float64) * 0.5,
                targets=torch.randint(0, V, (B, T), generator=gen), mask=mask,
                old=-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3,
                adv=torch.randn(B, T, generator=gen, dtype=torch.float64),
                upstream=torch.randn(2, B, T, generator=gen, dtype=torch.float64))
    case["ref"] = case["old"] - 0.25 * torch.rand(B, T, generator=gen, dtype=torch.float64)
    return case


def head(lib, leaves, case, scale, cap, *, packed=False, **kw):
    hidden, weight, bias = leaves
    if packed:   # every row of the window, back to back, and one row no loss position uses
        rows = torch.cat([(torch.arange(B * T) // T) * S + OFFSET + torch.arange(B * T) % T,
                          torch.tensor([0])])
        index = torch.cat([torch.arange(B * T), torch.tensor([-1])])
        targets = torch.cat([case["targets"].reshape(-1), torch.tensor([0])])
        return lib.LinearHead(hidden.reshape(B * S, H)[rows], weight, targets, bias, 0.75,
                              index=index, chunk_tokens=5, logit_scale=scale, softcap=cap, **kw)
    return lib.LinearHead(hidden, weight, case["targets"], bias, 0.75, offset=OFFSET,
                          chunk_tokens=5, logit_scale=scale, softcap=cap, **kw)


def leaves_of(case, dtype):
    return [case[k].to(dtype).clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]


def logprobs_run(lib, case, dtype, scale, cap, packed=False):
    leaves = leaves_of(case, dtype)
    lp, ent = lib.policy_logprobs(head(lib, leaves, case, scale, cap, packed=packed),
                                  return_entropy=True)
    if packed:
        lp, ent = lp[:B * T].view(B, T), ent[:B * T].view(B, T)
    up = case["upstream"].to(lp.dtype)
    grads = torch.autograd.grad((lp * up[0]).sum() + (ent * up[1]).sum(), leaves)
    return [lp.detach(), ent.detach(), *grads]


def loss_run(lib, case, dtype, scale, cap):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    c = {k: v.to(acc) if v.is_floating_point() else v for k, v in case.items()}
    leaves = leaves_of(case, dtype)
    out = lib.policy_loss(head(lib, leaves, case, scale, cap), c["old"], c["adv"], c["mask"],
                          objectives.Clip(0.2), ref_logprobs=c["ref"],
                          kl=terms.KLPenalty(0.25), entropy=terms.EntropyBonus(0.125))
    return [out.loss.detach(), *torch.autograd.grad(out.loss, leaves)]


LABELS = {"logprobs": ("logp", "entropy", "dhidden", "dweight", "dbias"),
          "loss": ("loss", "dhidden", "dweight", "dbias")}
RUNS = {"logprobs": logprobs_run, "loss": loss_run}


@pytest.mark.parametrize("scale,cap", HEADS)
@pytest.mark.parametrize("what", ["logprobs", "loss"])
def test_float64_equals_the_reference(what, scale, cap, device):
    case = make_case(1)
    fused = RUNS[what](rlfuse, case, torch.float64, scale, cap)
    ref = RUNS[what](reference, case, torch.float64, scale, cap)
    for label, f, r in zip(LABELS[what], fused, ref):
        torch.testing.assert_close(f.cpu(), r, **TOL["fp64_head"], msg=label)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("what", ["logprobs", "loss"])
def test_three_way_against_float64(what, dtype, device):
    case = make_case(2)
    scale, cap = HEADS[2]
    fused = RUNS[what](rlfuse, case, dtype, scale, cap)
    ref = RUNS[what](reference, case, dtype, scale, cap)
    ref64 = RUNS[what](reference, case, torch.float64, scale, cap)
    for label, f, r, r64 in zip(LABELS[what], fused, ref, ref64):
        assert f.dtype == r.dtype, label
        assert_three_way(f.cpu(), r, r64, label)


def test_packed_rows_equal_the_padded_layout(device):
    case = make_case(3)
    padded = logprobs_run(rlfuse, case, torch.float64, *HEADS[2])
    packed = logprobs_run(rlfuse, case, torch.float64, *HEADS[2], packed=True)
    for label, a, b in zip(LABELS["logprobs"], padded, packed):
        torch.testing.assert_close(b, a, **TOL["fp64_head"], msg=label)


def test_the_softcap_bends_the_logits(device):
    """The softcap changes the log-probs (the tests above would pass without it only if it
    did nothing) and equals the definition written out: cap tanh(s x / cap) / temperature."""
    case = make_case(4)
    capped = logprobs_run(rlfuse, case, torch.float64, 1.75, 2.5)[0]
    plain = logprobs_run(rlfuse, case, torch.float64, 1.75, None)[0]
    assert (capped - plain).abs().max() > 0.1
    logits = torch.nn.functional.linear(case["hidden"], case["weight"], case["bias"])
    z = 2.5 * torch.tanh(1.75 * logits / 2.5) / 0.75
    expected = torch.log_softmax(z[:, OFFSET:OFFSET + T], -1).gather(
        -1, case["targets"][..., None])[..., 0]
    torch.testing.assert_close(capped, expected, **TOL["fp64_head"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_and_infinite_logits_through_the_softcap(dtype, device):
    """Logits of +-1e30 and -inf (a vocabulary entry masked by the bias) come out at +-cap:
    finite log-probs, and the gradient of a saturated logit is 0 (1 - tanh^2 = 0), not NaN."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 3, V, generator=gen, dtype=torch.float64) * 4
    x[0, 0, :2] = torch.tensor([1e30, -1e30])
    bias = torch.zeros(V, dtype=torch.float64)
    bias[5] = float("-inf")
    hidden = x.to(dtype).requires_grad_(True)
    targets = torch.tensor([[0, 5, 7]])
    # the identity head: the logits are the hidden states plus the bias
    policy = rlfuse.LinearHead(hidden, torch.eye(V, dtype=dtype), targets, bias.to(dtype),
                               softcap=3.0)
    lp, ent = rlfuse.policy_logprobs(policy, return_entropy=True)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), hidden)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all() and torch.isfinite(grad).all()
    assert (grad[0, 0, :2] == 0).all() and (grad[0, :, 5] == 0).all()
    z = 3.0 * torch.tanh((x + bias) / 3.0)
    expected = torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(lp.double(), expected, **TOL["fp32" if dtype == torch.float32
                                                            else "fp64_head"])


def test_head_dtype_runs_the_matmuls_in_fp32(device):
    """bf16 hidden states and an fp32 head (TRL's cast_lm_head_to_fp32): with head_dtype the
    call equals casting the hidden states by hand, under bf16 autocast too, and each gradient
    comes back in its tensor's dtype."""
    case = make_case(6)
    hidden = case["hidden"].to(torch.bfloat16)
    weight = case["weight"].float()
    results = []
    for by_hand, autocast in ((True, False), (False, False), (False, True)):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        policy = rlfuse.LinearHead(h.float() if by_hand else h, w, case["targets"],
                                   offset=OFFSET, head_dtype=None if by_hand else torch.float32)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            lp = rlfuse.policy_logprobs(policy)
        dh, dw = torch.autograd.grad((lp * case["upstream"][0].float()).sum(), (h, w))
        assert (dh.dtype, dw.dtype) == (torch.bfloat16, torch.float32)
        results.append((lp.detach(), dh, dw))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    ref = reference.policy_logprobs(rlfuse.LinearHead(hidden, weight, case["targets"],
                                                      offset=OFFSET, head_dtype=torch.float32))
    torch.testing.assert_close(results[0][0].cpu(), ref, **TOL["fp32"])


def test_bad_heads(impl, device):
    case = make_case(7)
    fields = dict(hidden=case["hidden"], weight=case["weight"], targets=case["targets"],
                  offset=OFFSET)
    bad = [(dict(logit_scale=0.0), ValueError, "policy.logit_scale"),
           (dict(logit_scale=-1.0), ValueError, "policy.logit_scale"),
           (dict(logit_scale=float("inf")), ValueError, "policy.logit_scale"),
           (dict(softcap=0.0), ValueError, "policy.softcap"),
           (dict(softcap=float("nan")), ValueError, "policy.softcap"),
           (dict(softcap="30"), TypeError, "policy.softcap"),
           (dict(head_dtype=torch.int32), TypeError, "policy.head_dtype"),
           (dict(weight=case["weight"].float()), TypeError, "or a head_dtype")]
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            impl.policy_logprobs(impl.LinearHead(**dict(fields, **change)))
