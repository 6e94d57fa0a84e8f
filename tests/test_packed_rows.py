"""Packed (padding-free) rows: ``rlfuse.packed_index`` from varlen offsets, every loss and
``policy_logprobs`` from packed rows equal to the padded layout (values, metrics, gradients row
for row), both implementations and both policy forms, and their bad input."""
import pytest
import torch

import rlfuse
from rlfuse import objectives, terms

from conftest import TOL


def test_packed_index_from_cu_seqlens():
    # two sequences: 3 prompt + 2 response tokens, 2 prompt + 3 response tokens; T = 3
    cu = torch.tensor([0, 5, 10])
    index = rlfuse.packed_index(cu, torch.tensor([3, 2]), 3)
    # row j predicts token j + 1 of its sequence: response token t = j + 1 - prompt
    assert index.tolist() == [-1, -1, 0, 1, -1,     # rows 2, 3 predict responses 0, 1
                              -1, 3, 4, 5, -1]      # the last row of each predicts nothing
    # a response longer than T is cut at T
    assert rlfuse.packed_index(torch.tensor([0, 6]), torch.tensor([1]), 2).tolist() == \
        [0, 1, -1, -1, -1, -1]


@pytest.mark.parametrize("bad,match", [
    (dict(cu_seqlens=torch.tensor([[0, 2]])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0.0, 2.0])), "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([1, 3])), "starting at 0"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2]), prompt_lengths=torch.tensor([1, 1])),
     "non-decreasing"),
    (dict(prompt_lengths=torch.tensor([1, 1])), "prompt_lengths"),
    (dict(prompt_lengths=torch.tensor([-1])), r"prompt_lengths: expected values in \[0"),
    (dict(prompt_lengths=torch.tensor([5])), r"prompt_lengths: expected values in \[0"),
    (dict(response_length=-1), "response_length"),
])
def test_packed_index_bad_input(bad, match):
    args = dict(cu_seqlens=torch.tensor([0, 4]), prompt_lengths=torch.tensor([1]),
                response_length=3)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        rlfuse.packed_index(**args)


def _padded_and_packed(dtype, seed=0):
    """A padded batch (whole outputs [B, P + T + 1, V] or hidden states, offset P) and the same
    rows packed (prompts, responses of different lengths, then the next sequence)."""
    g = torch.Generator().manual_seed(seed)
    B, T, P, V, H = 4, 5, 2, 37, 8
    lengths = torch.tensor([5, 2, 4, 1])
    mask = torch.arange(T) < lengths[:, None]
    targets = torch.randint(0, V, (B, T), generator=g)
    logits = (3 * torch.randn(B, P + T + 1, V, generator=g, dtype=torch.float64)).to(dtype)
    hidden = torch.randn(B, P + T + 1, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / 3).to(dtype)
    n_rows = P + lengths + 1
    cu = torch.cat([torch.zeros(1, dtype=torch.long), n_rows.cumsum(0)])
    index = rlfuse.packed_index(cu, torch.full((B,), P + 1), T)
    seq = torch.repeat_interleave(torch.arange(B), n_rows)
    pos = torch.cat([torch.arange(int(n)) for n in n_rows])
    used = index >= 0
    packed_targets = torch.where(used, targets[seq, (pos - P).clamp(0, T - 1)], 0)
    own = rlfuse.reference.token_logprobs(logits[:, P:P + T].double(), targets, mask=mask)
    old = torch.where(mask, own + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64),
                      0).clamp_max(0)
    return dict(mask=mask, targets=targets, logits=logits, hidden=hidden, weight=weight,
                index=index, seq=seq, pos=pos, packed_targets=packed_targets, old=old,
                teacher=(own - 0.5).clamp_max(0), rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]),
                adv=torch.randn(B, generator=g, dtype=torch.float64), P=P)


LOSSES = {
    "ggpo": lambda lib, pol, d: lib.ggpo_loss(pol, d["old"], d["rewards"], d["mask"],
                                              group_size=2, beta=0.5),
    "gppo": lambda lib, pol, d: lib.gppo_loss(pol, d["old"], d["adv"], d["mask"],
                                              agg="seq-mean-token-mean"),
    "gr_opd": lambda lib, pol, d: lib.gr_opd_loss(pol, d["old"], d["teacher"], d["mask"],
                                                  group_size=2),
    "ppo": lambda lib, pol, d: lib.ppo_loss(pol, d["old"], d["adv"], d["mask"], clip=(0.2, 0.28)),
    "gspo": lambda lib, pol, d: lib.ppo_loss(pol, d["old"], d["adv"], d["mask"],
                                             ratio_level="sequence"),
    "policy_terms": lambda lib, pol, d: lib.policy_loss(
        pol, d["old"], d["adv"], d["mask"], objectives.CISPO(), ref_logprobs=d["teacher"],
        kl=terms.KLPenalty(0.25), entropy=terms.EntropyBonus(0.125)),
    "policy_vespo": lambda lib, pol, d: lib.policy_loss(
        pol, d["old"], d["adv"], d["mask"], objectives.VESPO(),
        entropy_mask=terms.TopEntropyMask(0.5)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("form", ["logits", "head"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_packed_rows_equal_the_padded_layout(impl, loss, form, dtype):
    """The same loss, metrics and gradients (row for row) from packed rows as from the padded
    batch: the kernels run the same rows either way."""
    d = _padded_and_packed(dtype)
    seq, pos = d["seq"], d["pos"]
    if form == "logits":
        padded_leaf = d["logits"].clone().requires_grad_()
        packed_leaf = d["logits"][seq, pos].clone().requires_grad_()
        padded = impl.Logits(padded_leaf, d["targets"], offset=d["P"])
        packed = impl.Logits(packed_leaf, d["packed_targets"], index=d["index"])
        leaves = ((padded_leaf,), (packed_leaf,))
    else:
        weight_a, weight_b = (d["weight"].clone().requires_grad_() for _ in range(2))
        padded_leaf = d["hidden"].clone().requires_grad_()
        packed_leaf = d["hidden"][seq, pos].clone().requires_grad_()
        padded = impl.LinearHead(padded_leaf, weight_a, d["targets"], offset=d["P"],
                                chunk_tokens=4)
        packed = impl.LinearHead(packed_leaf, weight_b, d["packed_targets"], index=d["index"],
                                chunk_tokens=4)
        leaves = ((padded_leaf, weight_a), (packed_leaf, weight_b))
    a, b = LOSSES[loss](impl, padded, d), LOSSES[loss](impl, packed, d)
    tol = TOL["fp64_sum"] if dtype == torch.float64 else TOL["fp32_sum"]
    torch.testing.assert_close(b.loss, a.loss, **tol)
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        torch.testing.assert_close(b.metrics[k], a.metrics[k], **tol, msg=k)
    ga = torch.autograd.grad(a.loss, leaves[0])
    gb = torch.autograd.grad(b.loss, leaves[1])
    torch.testing.assert_close(gb[0], ga[0][seq, pos], **tol)     # row for row
    if form == "head":
        torch.testing.assert_close(gb[1], ga[1], **tol)            # the head: summed
    prompt_rows = d["index"] < 0
    assert gb[0][prompt_rows].abs().max() == 0


def test_packed_policy_logprobs_are_per_row(impl):
    d = _padded_and_packed(torch.float64)
    seq, pos = d["seq"], d["pos"]
    packed = impl.Logits(d["logits"][seq, pos], d["packed_targets"], index=d["index"])
    lp, ent = impl.policy_logprobs(packed, return_entropy=True)
    whole_lp, whole_ent = impl.policy_logprobs(impl.Logits(d["logits"], d["targets"],
                                                         offset=d["P"]), return_entropy=True)
    used = d["index"] >= 0
    assert lp.shape == ent.shape == d["index"].shape
    t = pos - d["P"]
    torch.testing.assert_close(lp[used], whole_lp[seq[used], t[used]], **TOL["fp64_sum"])
    torch.testing.assert_close(ent[used], whole_ent[seq[used], t[used]], **TOL["fp64_sum"])
    assert lp[~used].abs().max() == 0 and ent[~used].abs().max() == 0


@pytest.mark.parametrize("bad,error,match", [
    (dict(index=lambda i: i.clone().fill_(-2)), ValueError, r"index: expected values in \[-1"),
    (dict(index=lambda i: torch.where(i >= 0, i + 100, i)), ValueError, r"\[-1, 20\)"),
    (dict(index=lambda i: torch.where(i >= 0, 0, i)), ValueError, "appears twice"),
    (dict(index=lambda i: i.int()), TypeError, "int64"),
    (dict(index=lambda i: i[:-1]), ValueError, "policy.index"),
    # an actor position left without a row would count as log-prob 0 (probability 1)
    (dict(index=lambda i: torch.where(i == i.max(), -1, i)), ValueError,
     r"actor position \[3, 0\] \(mask=True\) has no row"),
    (dict(offset=1), ValueError, "take no offset"),
    (dict(targets=lambda y: torch.where(y == y, 99, y)), ValueError, r"\[0, 37\)"),
])
def test_packed_bad_input(impl, bad, error, match):
    d = _padded_and_packed(torch.float64)
    args = dict(logits=d["logits"][d["seq"], d["pos"]], targets=d["packed_targets"],
                index=d["index"], offset=0)
    for k, v in bad.items():
        args[k] = v(args[k]) if callable(v) else v
    with pytest.raises(error, match=match):
        LOSSES["gppo"](impl, impl.Logits(**args), d)


def test_packed_needs_rows_and_a_loss_shape(impl):
    d = _padded_and_packed(torch.float64)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        LOSSES["gppo"](impl, impl.Logits(d["logits"], d["targets"], index=d["index"]), d)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        LOSSES["gppo"](impl, impl.LinearHead(d["hidden"], d["weight"], d["targets"],
                                           index=d["index"]), d)


@pytest.mark.parametrize("form", ["logits", "head"])
def test_an_empty_pack(impl, form):
    """N = 0 packed rows (a micro-batch with no tokens): per-row log-probs of shape [0], and a
    loss of 0 over an all-masked [B, T] whose gradient has the rows' shape."""
    V, H = 7, 4
    targets, index = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    leaf = torch.randn(0, V if form == "logits" else H, requires_grad=True)
    weight = torch.randn(V, H)

    def policy():
        if form == "logits":
            return impl.Logits(leaf, targets, index=index)
        return impl.LinearHead(leaf, weight, targets, index=index)

    assert tuple(impl.policy_logprobs(policy()).shape) == (0,)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    for loss in (impl.gppo_loss, impl.ppo_loss):
        out = loss(policy(), torch.zeros(2, 5), torch.zeros(2), mask)
        (grad,) = torch.autograd.grad(out.loss, leaf)
        assert out.loss.item() == 0 and grad.shape == leaf.shape
