"""Every op and policy form under ``torch.autocast`` (bf16 and fp16, the mixed precision of TRL
and accelerate): fp32 leaves get fp32 gradients, and the results keep the three-way rule
against float64 with the same-precision reference under the same autocast as the yardstick (a
head's matmul in the autocast dtype, as autocast runs a linear layer; the rest in fp32)."""
import pytest
import torch

import rlfuse
from rlfuse import objectives, reference, terms

from conftest import assert_three_way

B, T, H, V = 4, 5, 16, 37


def make_case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.25
    mask[:, 0] = True
    return dict(hidden=torch.randn(B, T, H, generator=gen, dtype=torch.float64),
                weight=torch.randn(V, H, generator=gen, dtype=torch.float64) / 2,
                bias=torch.randn(V, generator=gen, dtype=torch.float64) / 4,
                ids=torch.randint(0, V, (B, T), generator=gen), mask=mask,
                old=-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3,
                teacher=-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3,
                adv=torch.randn(B, generator=gen, dtype=torch.float64),
                rewards=torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64))


def _loss(out):
    if isinstance(out, rlfuse.LossOutput):
        return out.loss
    if isinstance(out, tuple):       # (log-probs, entropy)
        return sum((x * (i + 1)).sum() for i, x in enumerate(out))
    return (out * torch.linspace(0.5, 1.5, out.shape[-1], dtype=out.dtype)).sum()


CALLS = {
    "token_logprobs": lambda lib, p, c: lib.token_logprobs(p.logits, p.targets, mask=c["mask"],
                                                         return_entropy=True),
    "policy_logprobs": lambda lib, p, c: lib.policy_logprobs(p, return_entropy=True),
    "ppo": lambda lib, p, c: lib.ppo_loss(p, c["old"], c["adv"], c["mask"], clip=(0.2, 0.28)),
    "gppo": lambda lib, p, c: lib.gppo_loss(p, c["old"], c["adv"], c["mask"]),
    "ggpo": lambda lib, p, c: lib.ggpo_loss(p, c["old"], c["rewards"], c["mask"], group_size=2,
                                            beta=0.5),
    "gr_opd": lambda lib, p, c: lib.gr_opd_loss(p, c["old"], c["teacher"], c["mask"],
                                                group_size=2),
    "policy_terms": lambda lib, p, c: lib.policy_loss(
        p, c["old"], c["adv"], c["mask"], objectives.CISPO(), ref_logprobs=c["teacher"],
        kl=terms.KLPenalty(0.1), entropy=terms.EntropyBonus(0.05)),
    "policy_vespo": lambda lib, p, c: lib.policy_loss(
        p, c["old"], c["adv"], c["mask"], objectives.VESPO(),
        entropy_mask=terms.TopEntropyMask(0.5)),
}


def run(lib, case, form, call, device, autocast):
    """(loss, metrics, gradients of the leaves) of ``call`` on fp32 leaves (float64 ones when
    ``autocast`` is None, the yardstick), the policy built and the call made under autocast."""
    dtype = torch.float64 if autocast is None else torch.float32
    hidden, weight, bias = (case[k].to(device, dtype).requires_grad_(True)
                            for k in ("hidden", "weight", "bias"))
    data = {k: v.to(device) if k in ("mask", "ids") else v.to(device, dtype)
            for k, v in case.items() if k not in ("hidden", "weight", "bias")}
    context = torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast
                             is not None)
    with context:
        if form == "head":
            policy = lib.LinearHead(hidden, weight, data["ids"], bias, chunk_tokens=7)
        else:   # the logits of a linear layer, as a model makes them under autocast
            policy = lib.Logits(torch.nn.functional.linear(hidden, weight, bias), data["ids"])
        out = CALLS[call](lib, policy, data)
    loss = _loss(out)
    grads = torch.autograd.grad(loss, (hidden, weight, bias))
    metrics = out.metrics if isinstance(out, rlfuse.LossOutput) else {}
    return loss.detach().cpu(), {k: v.cpu() for k, v in metrics.items()}, \
        [g.cpu() for g in grads]


CASES = [(call, form) for call in sorted(CALLS) for form in ("logits", "head")
         if not (call == "token_logprobs" and form == "head")]   # token_logprobs takes logits


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16],
                         ids=["bf16", "fp16"])
@pytest.mark.parametrize("call, form", CASES)
def test_under_autocast(call, form, autocast, device):
    case = make_case()
    fused = run(rlfuse, case, form, call, device, autocast)
    ref = run(reference, case, form, call, "cpu", autocast)
    ref64 = run(reference, case, form, call, "cpu", None)
    assert fused[0].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in fused[2])     # the leaves' own dtype
    assert_three_way(fused[0], ref[0], ref64[0], "loss", atol_dtype=autocast)
    for name, g, r, r64 in zip(("dhidden", "dweight", "dbias"), fused[2], ref[2], ref64[2]):
        assert_three_way(g, r, r64, name, atol_dtype=autocast)
    assert fused[1].keys() == ref64[1].keys()
    for name in fused[1]:
        assert_three_way(fused[1][name], ref[1][name], ref64[1][name], name,
                         atol_dtype=autocast, scale=3.0 if name == "approx_kl" else None)


def test_autocast_leaves_the_head_in_its_dtype(device):
    """The cast happens inside the call: the caller's LinearHead keeps its fp32 tensors, and a
    float64 head is not cast (autocast does not cast float64)."""
    case = make_case()
    hidden = case["hidden"].to(device).requires_grad_(True)
    weight = case["weight"].to(device)
    head = rlfuse.LinearHead(hidden, weight, case["ids"].to(device))
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out = rlfuse.gppo_loss(head, case["old"].to(device), case["adv"].to(device),
                               case["mask"].to(device))
    assert head.hidden.dtype == torch.float64 and out.loss.dtype == torch.float64
    (g,) = torch.autograd.grad(out.loss, hidden)
    plain = rlfuse.gppo_loss(rlfuse.LinearHead(hidden, weight, case["ids"].to(device)),
                             case["old"].to(device), case["adv"].to(device),
                             case["mask"].to(device))
    (g_plain,) = torch.autograd.grad(plain.loss, hidden)
    torch.testing.assert_close(g, g_plain, rtol=0, atol=0)


def test_compiled_under_autocast(device):
    """``torch.compile(fullgraph=True)`` of a step under autocast: the same loss and gradients
    as eager (the cast and the autocast switch are traced, not a graph break)."""
    case = make_case(1)
    kind = torch.device(device).type

    def step(hidden, weight):
        with torch.autocast(kind, dtype=torch.bfloat16):
            head = rlfuse.LinearHead(hidden, weight, case["ids"].to(device), chunk_tokens=7)
            out = rlfuse.ppo_loss(head, case["old"].float().to(device),
                                  case["adv"].float().to(device), case["mask"].to(device),
                                  validate=False)
        return out.loss

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        hidden = case["hidden"].float().to(device).requires_grad_(True)
        weight = case["weight"].float().to(device).requires_grad_(True)
        loss = fn(hidden, weight)
        results.append((loss.detach(), *torch.autograd.grad(loss, (hidden, weight))))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
