"""``policy_logprobs`` in every policy form: log-probs and entropy with their gradients against
float64 (three-way) from ``Logits`` (a whole output with ``offset``), ``LinearHead`` (in chunks
that do and do not divide the rows) and packed rows of either; log-probs given as a tensor are
returned as they are and carry no entropy."""
import pytest
import torch

import rlfuse
from rlfuse import reference

from conftest import TOL, assert_three_way

B, S, H, V = 4, 8, 8, 37
OFFSET, T = 2, 5          # rows 2..6 of the output predict the 5 targets


def make_case(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    return dict(hidden=torch.randn(B, S, H, generator=gen, dtype=torch.float64),
                weight=torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.7,
                bias=torch.randn(V, generator=gen, dtype=torch.float64) * 0.2,
                logits=torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2,
                targets=torch.randint(0, V, (B, T), generator=gen), mask=mask,
                upstream=torch.randn(2, B, T, generator=gen, dtype=torch.float64))


def packed(case):
    """The window's rows packed back to back (all B T of them, then two rows no loss position
    uses) and their index."""
    index = torch.cat([torch.arange(B * T), torch.full((2,), -1)])
    rows = torch.cat([torch.arange(B * T) // T * S + OFFSET + torch.arange(B * T) % T,
                      torch.tensor([0, S - 1])])
    targets = torch.cat([case["targets"].reshape(-1), torch.zeros(2, dtype=torch.long)])
    return rows, targets, index


def run(lib, form, case, dtype, device, chunk=3):
    """(logp, entropy, gradients of the leaves) for a scalar of random weights on both."""
    leaves = {"logits": ["logits"], "packed_logits": ["logits"],
              "head": ["hidden", "weight", "bias"],
              "packed_head": ["hidden", "weight", "bias"]}[form]
    leaf = {k: case[k].to(dtype).to(device).clone().requires_grad_(True) for k in leaves}
    targets = case["targets"].to(device)
    if form.startswith("packed"):
        rows, packed_targets, index = (x.to(device) for x in packed(case))
        flat = "logits" if form == "packed_logits" else "hidden"
        source = leaf[flat].reshape(B * S, -1)[rows]
        if form == "packed_logits":
            policy = lib.Logits(source, packed_targets, 0.8, index=index)
        else:
            policy = lib.LinearHead(source, leaf["weight"], packed_targets, leaf["bias"], 0.8,
                                    index=index, chunk_tokens=chunk)
    elif form == "logits":
        policy = lib.Logits(leaf["logits"], targets, 0.8, offset=OFFSET)
    else:
        policy = lib.LinearHead(leaf["hidden"], leaf["weight"], targets, leaf["bias"], 0.8,
                                offset=OFFSET, chunk_tokens=chunk)
    lp, ent = lib.policy_logprobs(policy, return_entropy=True)
    if form.startswith("packed"):          # per row: the window's rows first
        lp, ent = lp[:B * T].view(B, T), ent[:B * T].view(B, T)
    acc = lp.dtype
    up = case["upstream"].to(device).to(acc)
    grads = torch.autograd.grad((lp * up[0]).sum() + (ent * up[1]).sum(), list(leaf.values()))
    return [lp.detach().cpu(), ent.detach().cpu()] + [g.cpu() for g in grads]


FORMS = ["logits", "head", "packed_logits", "packed_head"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", FORMS)
def test_matches_float64(form, dtype, device):
    case = make_case(1)
    fused = run(rlfuse, form, case, dtype, device)
    ref = run(reference, form, case, dtype, "cpu")
    ref64 = run(reference, form, case, torch.float64, "cpu")
    labels = ("logp", "entropy") + (("dlogits",) if "logits" in form else
                                   ("dhidden", "dweight", "dbias"))
    for label, f, r, r64 in zip(labels, fused, ref, ref64):
        assert f.dtype == r.dtype, label
        assert_three_way(f, r, r64, label)


@pytest.mark.parametrize("chunk", [3, 20, 64])     # does not divide N = 20; divides; one chunk
def test_head_in_any_chunk_equals_float64(chunk, device):
    case = make_case(2)
    fused = run(rlfuse, "head", case, torch.float64, device, chunk=chunk)
    ref = run(reference, "head", case, torch.float64, "cpu")
    for f, r in zip(fused, ref):
        torch.testing.assert_close(f, r, **TOL["fp64_head"])


def test_logprobs_pass_through(impl):
    lp = -torch.rand(B, T, requires_grad=True)
    assert impl.policy_logprobs(lp) is lp
    with pytest.raises(ValueError, match="return_entropy"):
        impl.policy_logprobs(lp, return_entropy=True)


def test_no_grad_gives_tensors_without_grad(impl, device):
    """What a trainer runs for the old or reference log-probs."""
    case = make_case(3)
    head = impl.LinearHead(case["hidden"].float().to(device), case["weight"].float().to(device),
                           case["targets"].to(device), offset=OFFSET)
    with torch.no_grad():
        lp = impl.policy_logprobs(head)
    assert lp.shape == (B, T) and lp.dtype == torch.float32 and not lp.requires_grad
