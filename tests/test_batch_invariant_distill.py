"""Distillation from a batch-invariant student head (``kernels.tiles.distill_tiles``), beside a
batch-invariant teacher head or the teacher's logits: each position's
divergence and the student's entropy, and each row's hidden-state gradient, bitwise the same
whatever else is in the call; every gradient the same run to run; exact against float64 by the
three-way rule; no tensor of a row's vocabulary formed. The fused path in the Triton
interpreter."""
import pytest
import torch

import rlfuse
import rlfuse.reference
from conftest import assert_three_way
from rlfuse.divergences import JSD, ForwardKL, ReverseKL
from rlfuse.kernels.tiles.matmul import BLOCK_M

H, H_T, V, T = 24, 16, 300, 5
DIVERGENCES = {"forward_kl": ForwardKL(), "reverse_kl": ReverseKL(), "jsd": JSD(0.3)}
# heads without a bias, and heads with one and a student with a logit scale, softcap and
# temperature
STUDENTS = {"plain": {}, "capped": dict(logit_scale=0.5, softcap=4.0, temperature=0.8)}


def _weights(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H ** 0.5).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    tw = (torch.randn(V, H_T, generator=g, dtype=torch.float64) / H_T ** 0.5).to(dtype)
    tb = torch.randn(V, generator=g, dtype=torch.float64).to(dtype)
    return w, b, tw, tb


def _rows(n, dtype, seed, teacher="head"):
    """``n`` rows of the student's hidden states (a prompt row first), the teacher's hidden
    states or logits (two prompt rows first; its logits a view of a longer sequence's over a
    wider vocabulary: strides of no ``[B, S, V]`` tensor) and a mask."""
    g = torch.Generator().manual_seed(seed)
    hidden = (2 * torch.randn(n, T + 1, H, generator=g, dtype=torch.float64)).to(dtype)
    if teacher == "head":
        t_rows = (2 * torch.randn(n, T + 2, H_T, generator=g, dtype=torch.float64)).to(dtype)
    else:
        t_rows = (2 * torch.randn(n, T + 3, V + 7, generator=g,
                                  dtype=torch.float64)).to(dtype)[:, :T + 2, :V]
    mask = torch.rand(n, T, generator=g) > 0.25
    return hidden, t_rows, mask


def _results(weights, hidden, t_rows, mask, divergence, student, *, lib=rlfuse,
             single=False, chunk_tokens=None):
    """``(value, entropy, dhidden, dweight[, dbias])``: the divergence of each position and
    the student's entropy, and the gradients of ``sum c_t value`` (``c_t`` each position's own
    weight), from ``token_divergence`` (the two passes) or ``distill_loss`` (the single
    pass); ``t_rows``: the teacher head's hidden states or the teacher's logits."""
    w, b, tw, tb = (x.detach().clone().requires_grad_(i < 2) for i, x in enumerate(weights))
    if not STUDENTS[student]:
        b = tb = None
    hidden = hidden.detach().clone().requires_grad_()
    targets = torch.zeros(mask.shape, dtype=torch.long)
    s = lib.LinearHead(hidden, w, targets, bias=b, chunk_tokens=chunk_tokens,
                       batch_invariant=True, **STUDENTS[student])
    if t_rows.shape[-1] == V:
        t = lib.Logits(t_rows, targets, offset=1, temperature=1.2)
    else:
        t = lib.LinearHead(t_rows, tw, targets, bias=tb, offset=1, temperature=1.2,
                           batch_invariant=True)
    c = torch.linspace(0.2, 1.0, T).expand(mask.shape)
    value, metrics = lib.token_divergence(s, t, divergence, mask, return_metrics=True)
    if single:
        loss = lib.distill_loss(s, t, mask, divergence, agg="token-sum", weights=c).loss
    else:
        loss = (value * c.to(value.dtype)).sum()
    loss.backward()
    return (value.detach(), metrics["entropy"], hidden.grad, w.grad) + \
        (() if b is None else (b.grad,))


# each student in each dtype beside a teacher head, through the two passes in one and the single
# pass in the other; each beside the teacher's logits once
CASES = [("plain", torch.float32, False, "head"), ("plain", torch.bfloat16, True, "head"),
         ("capped", torch.float32, True, "head"), ("capped", torch.bfloat16, False, "head"),
         ("plain", torch.float32, True, "logits"), ("capped", torch.bfloat16, False, "logits")]
CASE_IDS = [f"{s}-{str(d)[6:]}-{'single_pass' if one else 'two_passes'}-{t}"
            for s, d, one, t in CASES]


@pytest.mark.parametrize("student, dtype, single, teacher", CASES, ids=CASE_IDS)
def test_a_rows_divergence_is_its_own_whatever_the_batch(student, dtype, single, teacher):
    """One row alone, then among random companions in batches of 2 to 14 rows (70 tokens:
    past one tile of rows), at several positions and chunk sizes: its divergences, entropies
    and hidden-state gradient the same bits."""
    weights = _weights(dtype)
    divergence = DIVERGENCES["jsd"]
    row = _rows(1, dtype, seed=1, teacher=teacher)
    alone = _results(weights, *row, divergence, student, single=single)
    assert 14 * T > BLOCK_M
    for n, position, chunk in ((2, 1, None), (14, 13, 4), (5, 0, 7)):
        hidden, t_rows, mask = _rows(n, dtype, seed=n + position, teacher=teacher)
        hidden[position], t_rows[position], mask[position] = (x[0] for x in row)
        batch = _results(weights, hidden, t_rows, mask, divergence, student, single=single,
                         chunk_tokens=chunk)
        for got, want in zip(batch[:3], alone[:3]):
            assert torch.equal(got[position], want[0]), (n, position, chunk)


def test_every_gradient_is_the_same_run_to_run():
    weights = _weights(torch.bfloat16)
    rows = _rows(14, torch.bfloat16, seed=5)
    first = _results(weights, *rows, DIVERGENCES["reverse_kl"], "capped", chunk_tokens=20)
    again = _results(weights, *rows, DIVERGENCES["reverse_kl"], "capped", chunk_tokens=20)
    for got, want in zip(first, again):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
@pytest.mark.parametrize("student, dtype, single, teacher", CASES, ids=CASE_IDS)
def test_exact_against_float64(student, dtype, single, teacher, name):
    """Against the reference on the same inputs in their dtype and in float64 (three-way
    rule): every divergence's values, the student's entropies and its gradients."""
    weights = _weights(dtype, seed=2)
    rows = _rows(4, dtype, seed=3, teacher=teacher)
    got = _results(weights, *rows, DIVERGENCES[name], student, single=single, chunk_tokens=6)
    ref = _results(weights, *rows, DIVERGENCES[name], student, lib=rlfuse.reference,
                   single=single)
    ref64 = _results([x.double() for x in weights], *(x.double() if x.is_floating_point()
                                                       else x for x in rows),
                     DIVERGENCES[name], student, lib=rlfuse.reference, single=single)
    for what, a, r, r64 in zip(("value", "entropy", "dhidden", "dweight", "dbias"), got, ref,
                               ref64):
        assert_three_way(a.double(), r.double(), r64, what, atol_dtype=a.dtype)
