"""LinearHead, what is particular to it, for every loss and policy_logprobs (each op's own file
holds its parity against float64 from a LinearHead): a frozen weight and no bias, a row without
actor tokens, gathering the actor rows, tied embeddings, bad heads, the chunk budget, and what
it allocates (no ``[N, V]`` tensor)."""
import pytest
import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

import rlfuse
from rlfuse import reference

from conftest import TOL
from test_policy_forms import Allocations

B, S, H, V, M = 4, 8, 8, 37, 2
OFFSET, T = 2, 5


def make_case(seed, device, *, empty_row=False):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    if empty_row:
        mask[1] = False
    case = dict(hidden=torch.randn(B, S, H, generator=gen, dtype=torch.float64),
                weight=torch.randn(V, H, generator=gen, dtype=torch.float64) * 0.7,
                bias=torch.randn(V, generator=gen, dtype=torch.float64) * 0.2,
                targets=torch.randint(0, V, (B, T), generator=gen), mask=mask,
                old=-torch.rand(B, T, generator=gen, dtype=torch.float64) * 4,
                adv=torch.randn(B, generator=gen, dtype=torch.float64),
                rewards=(torch.rand(B, generator=gen) > 0.5).double())
    case["ref"] = case["old"] - 0.2
    case["teacher"] = case["old"] - 0.5
    return {k: v.to(device) for k, v in case.items()}


LOSSES = {
    "ggpo": lambda lib, pol, c, **kw: lib.ggpo_loss(pol, c["ref"], c["rewards"], c["mask"],
                                                     group_size=M, beta=0.5, **kw).loss,
    "gppo": lambda lib, pol, c, **kw: lib.gppo_loss(pol, c["old"], c["adv"], c["mask"],
                                                     geometry="chi2", topology="binary",
                                                     **kw).loss,
    "gr_opd": lambda lib, pol, c, **kw: lib.gr_opd_loss(pol, c["old"], c["teacher"], c["mask"],
                                                         group_size=M, **kw).loss,
    "policy_logprobs": lambda lib, pol, c, **kw: (
        lambda lp, ent: (lp * c["mask"]).sum() + 0.5 * ent.sum())(
            *lib.policy_logprobs(pol, return_entropy=True, **kw)),
}


def run(lib, name, case, dtype, device, *, chunk=3, bias=True, frozen=False, **kw):
    """(scalar, gradients of hidden, weight, bias) of one call; the policy's tensors in
    ``dtype``, the other inputs in the compute dtype."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    c = {k: v.to(acc) if v.is_floating_point() else v for k, v in case.items()}
    hidden = case["hidden"].to(dtype).clone().requires_grad_(True)
    weight = case["weight"].to(dtype).clone().requires_grad_(not frozen)
    b = case["bias"].to(dtype).clone().requires_grad_(True) if bias else None
    policy = rlfuse.LinearHead(hidden, weight, case["targets"], b, 0.8, offset=OFFSET,
                               chunk_tokens=chunk)
    out = LOSSES[name](lib, policy, c, **kw)
    leaves = [t for t in (hidden, weight, b) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, leaves)
    return [out.detach().cpu()] + [g.cpu() for g in grads]


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_float64_exact_without_bias_and_with_a_frozen_weight(name, device):
    """fp64: equal to the reference to rounding; without a bias; a frozen weight gets no
    gradient and costs no dweight accumulator."""
    case = make_case(2, device)
    for kw in (dict(bias=False), dict(frozen=True)):
        fused = run(rlfuse, name, case, torch.float64, device, **kw)
        ref = run(reference, name, case, torch.float64, "cpu", **kw)
        assert len(fused) == len(ref) == 3
        for f, r in zip(fused, ref):
            torch.testing.assert_close(f, r, **TOL["fp64_head"])


@pytest.mark.parametrize("name", ["gppo", "policy_logprobs"])
def test_a_row_without_actor_tokens(name, device):
    case = make_case(7, device, empty_row=True)
    fused = run(rlfuse, name, case, torch.float64, device)
    ref = run(reference, name, case, torch.float64, "cpu")
    for f, r in zip(fused, ref):
        torch.testing.assert_close(f, r, **TOL["fp64_head"])
    if name == "gppo":   # the empty row's hidden states get no gradient
        assert (fused[1][1] == 0).all()


@pytest.mark.parametrize("name", ["ggpo", "gppo", "gr_opd"])
def test_gathering_actor_rows_changes_nothing(name, device):
    """validate=True multiplies the actor rows only (the mask read on the host), validate=False
    every row of the window (no host read): the same results."""
    case = make_case(3, device)
    with_gather = run(rlfuse, name, case, torch.float32, device, validate=True)
    without = run(rlfuse, name, case, torch.float32, device, validate=False)
    for a, b in zip(with_gather, without):
        torch.testing.assert_close(a, b, **TOL["fp32"])


def test_tied_embeddings(device):
    """The head's weight is the embedding's: its gradient adds both uses."""
    case = make_case(4, device)
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(4)).to(device)
    grads = []
    for lib, dev in ((rlfuse, device), (reference, "cpu")):
        emb = case["weight"].to(dev).clone().requires_grad_(True)
        hidden = torch.tanh(emb[ids.to(dev)] + case["hidden"].to(dev))
        c = {k: v.to(dev) for k, v in case.items()}
        loss = LOSSES["gppo"](lib, rlfuse.LinearHead(hidden, emb, c["targets"], offset=OFFSET,
                                                     chunk_tokens=4), c)
        grads.append(torch.autograd.grad(loss, emb)[0].cpu())
    torch.testing.assert_close(grads[0], grads[1], **TOL["fp64_head"])


def test_bad_heads(impl, device):
    case = make_case(5, device)
    h, w, y, b = case["hidden"], case["weight"], case["targets"], case["bias"]
    bad = [
        (dict(hidden=h.float()), TypeError, "policy.weight: expected the hidden states' dtype"),
        (dict(weight=w[:, :-1]), ValueError, "policy.weight: expected shape"),
        (dict(bias=b[:-1]), ValueError, "policy.bias: expected shape"),
        (dict(bias=b.float()), TypeError, "policy.bias"),
        (dict(chunk_tokens=0), ValueError, "policy.chunk_tokens"),
        (dict(offset=S - T + 1), ValueError, "policy.offset"),
        (dict(hidden=h[0]), ValueError, "policy.hidden: expected shape"),
        (dict(targets=y[:2]), ValueError, "policy.targets"),
    ]
    for change, error, match in bad:
        fields = dict(hidden=h, weight=w, targets=y, bias=b, offset=OFFSET)
        fields.update(change)
        with pytest.raises(error, match=match):
            LOSSES["gppo"](impl, rlfuse.LinearHead(**fields), case)
    with pytest.raises(ValueError, match="return_entropy"):
        impl.policy_logprobs(case["old"], return_entropy=True)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_no_logits_sized_allocation(name, device):
    """Forward and backward allocate nothing of N x V elements (N = B T tokens): the logits
    exist one chunk at a time, and the fp32 dweight is [V, H] with H < N."""
    case = make_case(6, device)
    c = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
    hidden = c["hidden"].clone().requires_grad_(True)
    weight = c["weight"].clone().requires_grad_(True)
    bias = c["bias"].clone().requires_grad_(True)
    with Allocations() as allocs:
        policy = rlfuse.LinearHead(hidden, weight, c["targets"], bias, offset=OFFSET,
                                   chunk_tokens=6)
        LOSSES[name](rlfuse, policy, c).backward()
    assert allocs.outputs, "the recording saw nothing"
    biggest = max(n for _, n, _ in allocs.outputs)
    assert biggest < B * T * V, [(op, n) for op, n, _ in allocs.outputs if n >= B * T * V]
    assert biggest >= 6 * V            # one chunk of logits is there
    with Allocations() as allocs:      # the negative control: the reference materialises
        LOSSES[name](reference, rlfuse.LinearHead(hidden, weight, c["targets"], bias,
                                                  offset=OFFSET), c).backward()
    assert max(n for _, n, _ in allocs.outputs) >= B * S * V


class Ops(TorchDispatchMode):
    """Every op run while the mode is on, rlfuse's ops and the ops inside them: (name, whether
    it adds at indices, its new tensors' shapes, the single pass op's outputs), a new tensor
    being one whose storage is none of its arguments'. Nothing else is kept: a tensor held
    here would be copied by autograd rather than passed on."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        opdef = _maybe_get_opdef(func) if func.namespace == "rlfuse" else None
        if opdef is not None:     # its implementation with the mode on (as tools.traffic)
            with self:
                out = opdef._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        # an atomic add on a GPU: the sums' bits depend on the order the threads arrive in
        adds = (any(op in name for op in ("index_add", "scatter_add", "scatter_reduce")) or
                ("index_put" in name and bool(args[3] if len(args) > 3
                                              else kwargs.get("accumulate", False))))
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                  if isinstance(a, torch.Tensor)}
        outs = out if isinstance(out, (tuple, list)) else (out,)
        new = [tuple(t.shape) for t in outs if func.namespace != "rlfuse"     # seen inside
               and isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        self.ran.append((name, adds, new, outs if "linear_surrogate" in name else None))
        return out

    def adding_at_indices(self):
        return [name for name, adds, _, _ in self.ran if adds]


@pytest.mark.parametrize("name", ["gppo", "policy_logprobs"])
def test_one_weight_sized_gradient_and_no_atomic_add(name, device):
    """A bf16 head under an upstream gradient of 0.75, forward and backward: two [V, H]
    buffers, the fp32 accumulator and the returned gradient (no cast held from the forward, no
    chunk's product, no scaled copy: the single pass's backward scales and casts the
    accumulator in one pass), and no op that adds at indices."""
    case = make_case(8, device)
    c = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
    hidden = case["hidden"].to(torch.bfloat16).requires_grad_(True)
    weight = case["weight"].to(torch.bfloat16).requires_grad_(True)
    with Ops() as ops:
        policy = rlfuse.LinearHead(hidden, weight, c["targets"], offset=OFFSET, chunk_tokens=3)
        (LOSSES[name](rlfuse, policy, c) * 0.75).backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16
    weight_sized = [op for op, _, shapes, _ in ops.ran for shape in shapes if shape == (V, H)]
    assert len(weight_sized) == 2, weight_sized
    assert not ops.adding_at_indices(), ops.adding_at_indices()


def test_the_upstream_gradient_scales_the_accumulation_rounded_once(device):
    """A bf16 head's weight and bias gradients under an upstream gradient c = 0.3 are c times
    the single pass's fp32 accumulations, rounded to bf16 once."""
    case = make_case(9, device)
    c = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
    hidden, weight, bias = (case[k].to(torch.bfloat16).requires_grad_(True)
                            for k in ("hidden", "weight", "bias"))
    with Ops() as ops:
        policy = rlfuse.LinearHead(hidden, weight, c["targets"], bias, offset=OFFSET,
                                   chunk_tokens=3)
        (LOSSES["gppo"](rlfuse, policy, c) * 0.3).backward()
    (outputs,) = [out for name, _, _, out in ops.ran if "linear_surrogate" in name]
    dweight, dbias = outputs[3:]
    assert dweight.dtype == dbias.dtype == torch.float32
    scale = torch.tensor(0.3, dtype=torch.float32, device=dweight.device)
    assert torch.equal(weight.grad, (dweight * scale).to(torch.bfloat16))
    assert torch.equal(bias.grad, (dbias * scale).to(torch.bfloat16))


def test_default_chunk_from_the_head(monkeypatch):
    """About tokens H / V tokens a chunk, in multiples of 64 (at least 64, at most H tokens and
    1 GiB of logits): a chunk's logits about the size of the hidden states, never larger than
    the weight; RLFUSE_CHUNK_BYTES sets a budget; chunk_tokens wins."""
    from rlfuse.fused_losses.head.linear_head import chunk_tokens_for

    monkeypatch.delenv("RLFUSE_CHUNK_BYTES", raising=False)
    bf16 = lambda V, H: torch.empty(V, H, dtype=torch.bfloat16, device="meta")  # noqa: E731
    assert chunk_tokens_for(bf16(32768, 512), None, 2048) == 64          # 32: the fewest
    assert chunk_tokens_for(bf16(151936, 4096), None, 16384) == 448     # 441.7, rounded up
    assert chunk_tokens_for(bf16(32768, 512), None, 10 ** 6) == 512      # no more than H
    assert chunk_tokens_for(bf16(32768, 8), None, 10 ** 6) == 64
    assert chunk_tokens_for(bf16(151936, 8192), None, 10 ** 7) == (1 << 30) // (151936 * 2)
    assert chunk_tokens_for(bf16(151936, 4096), 100, 16384) == 100
    monkeypatch.setenv("RLFUSE_CHUNK_BYTES", str(151936 * 4 * 10))
    assert chunk_tokens_for(torch.empty(151936, 8, device="meta"), None, 16384) == 10
    monkeypatch.setenv("RLFUSE_CHUNK_BYTES", "1")
    assert chunk_tokens_for(torch.empty(151936, 8, device="meta"), None, 16384) == 1