"""The numerics of the row helpers beyond the parity tests: the base-2 exponentials as a GPU
computes them (MUFU.EX2 flushes results below 2^-126 to zero; the interpreter does not), the
statistics the forward saves, rows of one logit, and the target's block written apart from the
loop (the target in the first, a middle, the last full or the partial block)."""
import numpy as np
import pytest
import torch

import rlfuse
from rlfuse import reference
from rlfuse.kernels import logprobs
from rlfuse.kernels.single_pass import single_pass_config

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="emulates the GPU's exp2 in the Triton interpreter")

TINY = 2.0 ** -126      # the smallest normal fp32; MUFU.EX2 returns 0 below it


class _GpuExp2:
    """Switch of the ``gpu_exp2`` fixture, and the count of results it flushed."""

    def __init__(self):
        self.on, self.flushed = True, 0


@pytest.fixture
def gpu_exp2(monkeypatch):
    """``tl.math.exp2`` as MUFU.EX2 computes it in fp32 while ``.on``: results below 2^-126
    are 0."""
    from triton.runtime import interpreter

    state = _GpuExp2()
    plain = interpreter.InterpreterBuilder.create_exp2

    def exp2(self, arg):
        out = plain(self, arg)
        if state.on and out.data.dtype == np.float32:
            small = out.data < TINY
            state.flushed += int(np.count_nonzero(small & (out.data > 0)))
            out = interpreter.TensorHandle(np.where(small, np.float32(0), out.data), out.dtype)
        return out

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp2", exp2)
    return state


def _logprobs_and_grads(x, targets, temperature, seed=1):
    leaf = x.detach().clone().requires_grad_(True)
    lp, ent = rlfuse.token_logprobs(leaf, targets, temperature=temperature, return_entropy=True)
    gen = torch.Generator().manual_seed(seed)
    g, h = torch.randn(lp.shape, generator=gen), torch.randn(ent.shape, generator=gen)
    ((lp * g).sum() + (ent * h).sum()).backward()
    bound = TINY * (1 + g.abs().max() + h.abs().max() * (1 + ent.abs().max() + 149)) / temperature
    return lp.detach(), ent.detach(), leaf.grad, bound.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exp2_flush_changes_no_tested_value(dtype, gpu_exp2):
    """Logits spread over hundreds of nats, so that many probabilities (and rescales of a
    line's sum) fall below 2^-126: with the GPU's exp2 the log-probs and the entropy are the
    same bits, the gradient moves by less than 2^-126 (|a| + 149 |b|) (row_write_dlogits) —
    below any tolerance, and every value stays finite."""
    gen = torch.Generator().manual_seed(0)
    V, temperature = 3000, 0.7
    x = (torch.randn(2, 3, V, generator=gen) * 60).to(dtype)
    x[0, 0, ::3] = -1e4                            # far below the row max: exactly flushed
    x[1, 2, 5] = 300.0                             # one dominant logit: the others underflow
    targets = torch.randint(0, V, (2, 3), generator=gen)
    targets[0, 1] = int(x[0, 1].float().argmin())  # a target whose probability underflows
    gpu_exp2.on = False
    exact = _logprobs_and_grads(x, targets, temperature)
    gpu_exp2.on = True
    flushed = _logprobs_and_grads(x, targets, temperature)
    assert gpu_exp2.flushed > 0                   # the case does flush values
    assert torch.equal(exact[0], flushed[0]) and torch.equal(exact[1], flushed[1])
    assert torch.isfinite(flushed[2]).all()
    diff = (exact[2].double() - flushed[2].double()).abs().max().item()
    assert diff <= exact[3]


def test_exp2_flush_in_the_single_pass(gpu_exp2):
    """The single pass (GPPO from logits) under the GPU's exp2 against float64, as its parity
    tests hold it: loss and gradient within the three-way rule."""
    from conftest import assert_three_way

    gen = torch.Generator().manual_seed(3)
    B, T, V = 2, 3, 700
    x = torch.randn(B, T, V, generator=gen) * 50
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -torch.rand(B, T, generator=gen) * 3
    adv = torch.tensor([1.0, -1.0])
    outs = []
    for impl, data in ((rlfuse, x), (reference, x), (reference, x.double())):
        leaf = data.clone().requires_grad_(True)
        out = impl.gppo_loss(rlfuse.Logits(leaf, targets, 0.9), old.to(data.dtype),
                             adv.to(data.dtype), mask)
        out.loss.backward()
        outs.append((out.loss.detach(), leaf.grad))
    assert gpu_exp2.flushed > 0
    for k, name in enumerate(("loss", "dlogits")):
        assert_three_way(outs[0][k], outs[1][k], outs[2][k], name)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_row_of_one_logit_is_exact(dtype, temperature):
    """p = 1: the log-prob, the entropy and the gradient are exactly 0 at any temperature (m's
    rounding is carried into log s, and subtracted again from the exact x / tau)."""
    x = (torch.randn(3, 4, 1, generator=torch.Generator().manual_seed(2)) * 7).to(dtype)
    targets = torch.zeros(3, 4, dtype=torch.long)
    leaf = x.clone().requires_grad_(True)
    lp, ent = rlfuse.token_logprobs(leaf, targets, temperature=temperature, return_entropy=True)
    (lp.sum() * 3 + ent.sum()).backward()
    assert (lp == 0).all() and (ent == 0).all() and (leaf.grad == 0).all()
    out = rlfuse.gppo_loss(rlfuse.Logits(x.clone(), targets, temperature),
                           torch.zeros(3, 4, dtype=lp.dtype), torch.ones(3, dtype=lp.dtype),
                           torch.ones(3, 4, dtype=torch.bool))
    assert out.metrics["ratio_mean"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_saved_statistics_are_natural(dtype):
    """The forward saves (max z, log sum e^(z - max z)) of z = x / tau in natural units, what
    the vocabulary-parallel combination reads: m is the rounded max of z and m + log s its
    logsumexp; a row of -inf (a padded shard) saves -inf, -inf."""
    gen = torch.Generator().manual_seed(4)
    V, temperature = 5000, 0.5    # 1 / tau exact in fp32, as a GPU passes it (conftest)
    x = (torch.randn(2, 3, V, generator=gen, dtype=torch.float64) * 4).to(dtype)
    x[1, 1] = float("-inf")
    targets = torch.randint(0, V, (2, 3), generator=gen)
    _, stats, _ = logprobs.token_logprobs_fwd(x, targets, None, temperature, False)
    z = x.double() / temperature
    z_max = z.amax(-1).reshape(-1)
    lse = torch.logsumexp(z, -1).reshape(-1)
    acc = stats.dtype
    finite = torch.isfinite(z_max)
    assert torch.equal(stats[finite, 0], (x.to(acc) / temperature).amax(-1).reshape(-1)[finite])
    rtol = 1e-14 if dtype == torch.float64 else 2e-7
    total = stats[:, 0].double() + stats[:, 1].double()
    assert torch.allclose(total[finite], lse[finite], rtol=rtol, atol=rtol)
    assert (stats[~finite] == float("-inf")).all()


def _target_cases(V, block):
    """Target columns that land in each kind of block: first and last column of the first, a
    middle and the last full block, the partial block, and outside the row (validation off)."""
    n_full = V // block
    cols = [0, block - 1, block, (n_full // 2) * block + 7, n_full * block - 1, V - 1]
    return sorted({c for c in cols if 0 <= c < V})


@pytest.mark.parametrize("V", [4096 * 3, 4096 * 3 + 50])   # fp32 blocks of 4096: no tail / tail
def test_target_in_every_kind_of_block(V):
    """dlogits against float64 with the target in the first, a middle, the last full block and
    the partial one (the loop skips the target's block: it is written apart)."""
    from conftest import assert_three_way

    cols = _target_cases(V, 4096)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, len(cols), V, generator=gen) * 3
    targets = torch.tensor([cols])
    outs = []
    for impl, data in ((rlfuse, x), (reference, x), (reference, x.double())):
        leaf = data.clone().requires_grad_(True)
        lp, ent = impl.token_logprobs(leaf, targets, temperature=0.8, return_entropy=True)
        (lp.sum() - 0.5 * ent.sum()).backward()
        outs.append(leaf.grad)
    assert_three_way(outs[0], outs[1], outs[2], "dlogits")


@pytest.mark.parametrize("order", ["backward", "forward"])
@pytest.mark.parametrize("V", [64, 100])           # blocks of 16: no tail / a tail of 4
def test_single_pass_target_in_every_kind_of_block(order, V):
    """The single pass in both block orders, the target in each kind of block: loss and
    dlogits of the whole output equal float64's (the kernels compute in fp64 here)."""
    cols = _target_cases(V, 16)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, len(cols), V, generator=gen, dtype=torch.float64) * 2
    targets = torch.tensor([cols])
    mask = torch.ones(1, len(cols), dtype=torch.bool)
    old = torch.full((1, len(cols)), -4.0, dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    outs = []
    for impl in (rlfuse, reference):
        leaf = x.clone().requires_grad_(True)
        with single_pass_config(f"block_v=16,order={order}"):
            out = impl.ppo_loss(rlfuse.Logits(leaf, targets, 0.5), old, adv, mask)
            outs.append((out.loss.detach(),) + torch.autograd.grad(out.loss, leaf))
    for (name, a), b in zip((("loss", outs[0][0]), ("dlogits", outs[0][1])), outs[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
