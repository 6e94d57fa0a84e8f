"""The numerics beyond the parity tests: the base-2 exponentials as a GPU computes them (MUFU.EX2
flushes results below 2^-126 to zero; the interpreter does not; ``tl.exp`` is ``ex2.approx`` of
a rounded product, so GGPO's group softmax and GR-OPD's discounts use ``exp_accurate``), the
statistics the forward saves, rows of one logit, the target's block written apart from the loop;
extreme values (logits of +-1e38, a trust-region bound beyond fp32), mixed dtypes (GR-OPD in the
widest), Python floats passed to a kernel as a GPU passes them (fp32) against the fp64 scalars
of the regions, and groups of 256 and 1024 rows."""
import struct

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import rlfuse
from rlfuse import reference
from rlfuse.kernels.rows import logprobs
from rlfuse.kernels.lib import utils as kernel_utils
from rlfuse.kernels.lib.head_functions import HeadParams
from rlfuse.kernels.lib.utils import exp_accurate
from rlfuse.kernels.rows.single_pass import single_pass_config

from conftest import TOL, assert_three_way
from loss_harness import check_against_shifted_oracle, run_loss

LIBS = [rlfuse, reference]
# The GPU's exp2 is emulated in the Triton interpreter, which a CUDA run does not use.
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
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


@INTERPRETER_ONLY
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


@INTERPRETER_ONLY
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


@INTERPRETER_ONLY
@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_exp2_in_distillation(gpu_exp2, divergence):
    """Distillation's kernels (each divergence's exponentials one exp2) under the GPU's exp2
    (results below 2^-126 flushed) against float64 as their parity tests hold them: loss,
    entropy and the student's gradient within the three-way rule."""
    from rlfuse.divergences import JSD, ForwardKL, ReverseKL

    div = {"forward_kl": ForwardKL(), "reverse_kl": ReverseKL(), "jsd": JSD(0.3)}[divergence]
    gen = torch.Generator().manual_seed(4)
    B, T, V = 2, 3, 700
    student, teacher = (torch.randn(B, T, V, generator=gen) * 30 for _ in "st")
    mask = torch.ones(B, T, dtype=torch.bool)
    positions = torch.zeros(B, T, dtype=torch.long)
    outs = []
    for impl, dtype in ((rlfuse, torch.float32), (reference, torch.float32),
                        (reference, torch.float64)):
        leaf = student.to(dtype).clone().requires_grad_(True)
        out = impl.distill_loss(rlfuse.Logits(leaf, positions, 0.9),
                                rlfuse.Logits(teacher.to(dtype), positions, 1.2), mask, div)
        out.loss.backward()
        outs.append((out.loss.detach(), out.metrics["entropy"], leaf.grad))
    assert gpu_exp2.flushed > 0
    for k, name in enumerate(("loss", "entropy", "dlogits")):
        assert_three_way(outs[0][k], outs[1][k], outs[2][k], name)


@INTERPRETER_ONLY
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


@INTERPRETER_ONLY
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_saved_statistics(dtype):
    """The forward saves (m, log s): m the row's max logit before the temperature, log s =
    log sum e^((x - m) / tau), what the backward and the vocabulary-parallel combination read:
    m / tau + log s is the row's logsumexp; a row of -inf (a padded shard) saves -inf, -inf."""
    gen = torch.Generator().manual_seed(4)
    V, temperature = 5000, 0.5    # 1 / tau exact in fp32, as a GPU passes it (conftest)
    x = (torch.randn(2, 3, V, generator=gen, dtype=torch.float64) * 4).to(dtype)
    x[1, 1] = float("-inf")
    targets = torch.randint(0, V, (2, 3), generator=gen)
    _, stats, _ = logprobs.token_logprobs_fwd(x, targets, None, HeadParams(temperature), False)
    z = x.double() / temperature
    z_max = z.amax(-1).reshape(-1)
    lse = torch.logsumexp(z, -1).reshape(-1)
    acc = stats.dtype
    finite = torch.isfinite(z_max)
    assert torch.equal(stats[finite, 0], x.to(acc).amax(-1).reshape(-1)[finite])
    rtol = 1e-14 if dtype == torch.float64 else 2e-7
    total = stats[:, 0].double() / temperature + stats[:, 1].double()
    assert torch.allclose(total[finite], lse[finite], rtol=rtol, atol=rtol)
    assert (stats[~finite] == float("-inf")).all()


def _target_cases(V, block):
    """Target columns that land in each kind of block: first and last column of the first, a
    middle and the last full block, the partial block, and outside the row (validation off)."""
    n_full = V // block
    cols = [0, block - 1, block, (n_full // 2) * block + 7, n_full * block - 1, V - 1]
    return sorted({c for c in cols if 0 <= c < V})


@INTERPRETER_ONLY
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


@INTERPRETER_ONLY
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
        torch.testing.assert_close(a, b, **TOL["fp64"], msg=name)


@pytest.mark.parametrize("form", ["logprobs", "logits"])
def test_a_bound_beyond_the_dtype_is_not_a_silent_inf(form, device):
    """two_sided_log / atomic at delta/mu = 100: the fp64 bound e^100 is inf in fp32. The branch
    is decided against the bound in the compute dtype (inf: never clipped), so the unclipped
    r A = e^129 overflows and is refused, as the reference does; with validate=False the
    overflow metric says so."""
    B, T, V = 1, 2, 8
    mask = torch.tensor([[True, False]], device=device)
    old = torch.tensor([[-130.0, 0.0]], device=device)
    adv = torch.ones(B, device=device)
    if form == "logits":
        logits = torch.zeros(B, T, V, device=device)
        logits[0, 0, 3] = 5.0
        policy = rlfuse.Logits(logits.requires_grad_(), torch.full((B, T), 3, device=device))
        lp = torch.log_softmax(logits.detach()[0, 0], -1)[3]
    else:
        policy = torch.tensor([[-1.0, 0.0]], device=device, requires_grad=True)
        lp = -1.0
    assert float(lp) - (-130.0) > 100
    kw = dict(geometry="two_sided_log", topology="atomic", delta=1e-4)
    for lib in LIBS:
        with pytest.raises(ValueError, match="overflow"):
            lib.gppo_loss(policy, old, adv, mask, **kw)
        out = lib.gppo_loss(policy, old, adv, mask, validate=False, **kw)
        assert out.metrics["overflow"].item() == 1.0, lib.__name__


@pytest.mark.parametrize("dtype, row", [
    (torch.float32, [1e38, 0.0, 1.0]),            # (m - m') s overflowed from a finite start
    (torch.float32, [-3.2e38, -3.3e38, -3.25e38]),  # every logit below the old stand-in
    (torch.bfloat16, [-3.2e38, -3.3e38, -3.0e38]),
    (torch.float64, [-1e300, -2e300, -1.5e300]),
    (torch.float64, [1e300, -1e300, 0.0]),
    (torch.float32, [float("-inf"), 0.0, float("-inf")]),
])
def test_extreme_logits(dtype, row, device):
    logits = torch.tensor([row], dtype=torch.float64).to(dtype)
    for target in range(3):
        y = torch.tensor([target])
        got = rlfuse.token_logprobs(logits.to(device), y.to(device), return_entropy=True)
        want = reference.token_logprobs(logits.double(), y, return_entropy=True)
        for g, w, name in zip(got, want, ("logp", "entropy")):
            g = g.cpu().double()
            assert torch.equal(torch.isfinite(g), torch.isfinite(w)), (name, g, w)
            assert torch.equal(g.isnan(), w.isnan()), (name, g, w)
            torch.testing.assert_close(g, w, **TOL["fp32_logprob"], equal_nan=True, msg=name)


@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_large_logits_at_any_temperature(dtype, temperature, device):
    """Logits up to the dtype's largest, at temperatures whose reciprocal is not a power of
    two: log-probs, entropies and the logits' gradient against the fp64 oracle of the shifted
    row, in rows with one huge logit, a huge negative one, a huge common offset with an
    ordinary spread, and huge logits far apart (the statistics keep the row's max before the
    temperature and every difference is taken before it is scaled)."""
    gen = torch.Generator().manual_seed(11)
    B, T, V = 4, 3, 37
    for big in (1e4, 1e12, 1e30, torch.finfo(dtype).max):
        x = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
        x[0, 0, 0], x[0, 1, 1] = big, -big
        x[1] += big / 2
        x[2] = big * (1 - 0.25 * torch.rand(T, V, generator=gen, dtype=torch.float64))
        x[3] = -big * torch.rand(T, V, generator=gen, dtype=torch.float64)
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
        targets = torch.randint(0, V, (B, T), generator=gen)
        targets[0, :2] = torch.tensor([0, 1])
        weights = torch.randn(2, B, T, generator=gen, dtype=torch.float64)
        check_against_shifted_oracle(x, targets, temperature, weights, device,
                                     f"{dtype} tau {temperature} logits {big:.3g}")


@pytest.mark.parametrize("temperature", [0.7, 3.0])
def test_single_pass_from_large_logits(temperature, device):
    """The single pass (PPO from Logits) with logits of 1e30 and the temperature at which a
    product x / tau would carry the rounding of a huge number: a finite loss and gradient, equal
    to the reference's on the shifted rows in fp64."""
    gen = torch.Generator().manual_seed(12)
    B, T, V = 3, 4, 29
    x = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    x[0, 0, 0], x[1] = 1e30, x[1] + 1e30
    x = x.float()
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, 0] = 0
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    leaf = x.to(device).requires_grad_()
    out = rlfuse.ppo_loss(rlfuse.Logits(leaf, targets.to(device), temperature=temperature),
                          old.float().to(device), adv.float().to(device), mask.to(device))
    grad, = torch.autograd.grad(out.loss, leaf)
    shifted = (x.double() - x.double().amax(-1, keepdim=True)).requires_grad_()
    want = reference.ppo_loss(reference.Logits(shifted, targets, temperature=temperature),
                              old, adv, mask)
    want_grad, = torch.autograd.grad(want.loss, shifted)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(out.loss.cpu().double(), want.loss, **TOL["fp32_chain"])
    torch.testing.assert_close(grad.cpu().double(), want_grad, rtol=1e-6,
                               atol=4e-7 * max(1.0, want_grad.abs().max().item()))


@triton.jit
def _exp_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n)
    tl.store(y_ptr + cols, exp_accurate(x), mask=cols < n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_accurate(dtype, device):
    """The per-token exponential of the surrogate and KL kernels: within 4 units of rounding
    of e^x over the whole fp32 range of x (the reduction to 2^(r log2 e), |r log2 e| <= 1/2, is
    exact; the interpreter's exp2 is numpy's, a GPU's ex2.approx adds its own 2 ulp, pinned by
    tests/test_gpu.py), inf above it, 0 below, NaN kept."""
    x = torch.cat([torch.linspace(-103.9, 88.7, 20001, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, 1e-30, 89.0, 100.0, -104.0, -1e4,
                                 float("inf"), float("-inf"), float("nan")],
                                dtype=torch.float64)]).to(dtype)
    y = torch.empty_like(x)
    xd, yd = x.to(device), y.to(device)
    _exp_kernel[(triton.cdiv(x.numel(), 1024),)](xd, yd, x.numel(), BLOCK=1024)
    got, want = yd.cpu().double(), torch.exp(x.double())
    rounded = want.to(dtype).double()                       # inf past the dtype's largest
    normal = torch.isfinite(rounded) & (want > torch.finfo(dtype).tiny)
    rel = ((got - want).abs() / want)[normal]
    assert rel.max().item() <= 4 * torch.finfo(dtype).eps, rel.max().item()
    assert torch.equal(torch.isinf(got), torch.isinf(rounded))
    tiny = ~normal & (want < 1)                             # below the normal range: 0 or tiny
    assert (got[tiny] <= 2 * torch.finfo(dtype).tiny).all()
    assert torch.isnan(got[-1]) and got[-2] == 0 and got[-3] == float("inf")


def test_bf16_outputs_round_to_nearest_even(device):
    """A kernel's fp32 -> bf16 cast rounds to nearest, ties to even, as a GPU's does (the
    interpreter is made to, conftest): exact halves both ways, values just off a half, the
    largest finite values, subnormals, infinities and NaN, against torch's own conversion."""
    from rlfuse.kernels.rows.scale_rows import scale_cast

    one = 1.0 + 2.0 ** -8                                    # halfway between two bf16
    x = torch.tensor([one, 1.0 + 3 * 2.0 ** -8, -one, one + 2.0 ** -20, one - 2.0 ** -20,
                      3.3895e38, -3.3895e38, 1e-39, -2.5e-40, 0.0, -0.0, float("inf"),
                      float("-inf"), float("nan")])
    x = torch.cat([x, torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100])
    got = scale_cast(x.to(device), torch.tensor(1.0, device=device), torch.bfloat16).cpu()
    want = x.to(torch.bfloat16)
    same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
    assert same.all(), (x[~same], got[~same], want[~same])


@pytest.fixture
def gpu_exp(monkeypatch):
    """``tl.exp`` of fp32 as a GPU lowers it, ``ex2.approx`` of the fp32 product ``x log2(e)``:
    the rounding of that product puts a relative error up to ~|x| 2^-24 into e^x (the
    interpreter's ``np.exp`` has none) while ``.on``. ``exp_accurate`` calls ``tl.math.exp2``
    and is not touched. On a GPU: nothing to emulate."""
    from triton.runtime import interpreter

    state = _GpuExp2()
    if torch.cuda.is_available():
        return state
    plain = interpreter.InterpreterBuilder.create_exp

    def exp(self, arg):
        if not state.on or arg.data.dtype != np.float32:
            return plain(self, arg)
        scaled = (arg.data * np.float32(1.4426950408889634)).astype(np.float32)
        return interpreter.TensorHandle(np.exp2(scaled).astype(np.float32), arg.dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_exp", exp)
    return state


@triton.jit
def _group_softmax_kernel(r_ptr, q_ptr, m, beta, BLOCK: tl.constexpr):
    from rlfuse.kernels.tokens.ggpo import _centred_lme   # noqa: F401  (resolved by the JIT)
    rows = tl.arange(0, BLOCK)
    valid = rows < m
    r = tl.load(r_ptr + rows, mask=valid, other=0.0)
    _, q = _centred_lme(r, tl.zeros_like(r), valid, m.to(tl.float32), beta)
    tl.store(q_ptr + rows, q, mask=valid)


def test_ggpo_group_softmax_with_the_gpus_exp(gpu_exp, device):
    """GGPO's group softmax ``q`` at rewards spread over 90 / beta nats: every entry within 8
    units of fp32 rounding of float64's (``tl.exp`` would be ~80 units off at the far end)."""
    r = torch.linspace(0.0, 90.0, 16, dtype=torch.float32)
    q = torch.empty_like(r, device=device)
    _group_softmax_kernel[(1,)](r.to(device), q, 16, 1.0, BLOCK=16)
    q = q.cpu()
    z = r.double() - r.double().mean()
    want = torch.softmax(z, 0)
    rel = ((q.double() - want).abs() / want).max().item()
    assert rel <= 8 * torch.finfo(torch.float32).eps, rel


@triton.jit
def _discount_kernel(k_ptr, w_ptr, n, log_gamma, BLOCK: tl.constexpr):
    from rlfuse.kernels.tokens.gr_opd import discount   # noqa: F401  (resolved by the JIT)
    cols = tl.arange(0, BLOCK)
    k = tl.load(k_ptr + cols, mask=cols < n, other=1)
    tl.store(w_ptr + cols, discount(k, log_gamma, tl.float32), mask=cols < n)


def test_gr_opd_discounts_with_the_gpus_exp(gpu_exp, device):
    """GR-OPD's discounts ``gamma^(k-1)`` of 2,800 actor tokens (down to e^-85, fp32's normal
    range) under the GPU's ``tl.exp``: within 8 units of fp32 rounding of float64's, given the
    fp32 product ``(k - 1) log gamma`` (``tl.exp`` would be up to ~85 units off)."""
    k = torch.arange(1, 2801, dtype=torch.int32)
    w = torch.empty(2800, dtype=torch.float32, device=device)
    log_gamma = float(torch.tensor(0.97).log().float())
    _discount_kernel[(1,)](k.to(device), w, 2800, log_gamma, BLOCK=4096)
    w = w.cpu()
    exponent = ((k - 1).float() * torch.tensor(log_gamma, dtype=torch.float32)).double()
    want = exponent.exp()
    rel = ((w.double() - want).abs() / want).max().item()
    assert rel <= 8 * torch.finfo(torch.float32).eps, rel

def test_gr_opd_advantages_in_the_widest_dtype(device):
    """An fp64 policy with fp32 old / teacher log-probs: the advantages (a cancellation when the
    group's scores are close) are computed in fp64, in both paths."""
    gen = torch.Generator().manual_seed(2)
    B, T = 4, 7
    old = (-torch.rand(B, T, generator=gen) * 3).float()
    teacher = (old + 1e-3 * torch.randn(B, T, generator=gen)).clamp_max(0)   # A cancels
    mask = torch.ones(B, T, dtype=torch.bool)
    lp = (old.double() + 0.01).requires_grad_(True)
    exact = reference.gr_opd_advantages(old.double(), teacher.double(), mask, group_size=2)
    for lib, dev in ((rlfuse, device), (reference, "cpu")):
        out = lib.gr_opd_loss(lp.detach().to(dev).requires_grad_(), old.to(dev),
                              teacher.to(dev), mask.to(dev), group_size=2)
        assert out.loss.dtype == torch.float64
        torch.testing.assert_close(out.metrics["adv_mean"].cpu(), exact.mean(), **TOL["fp64_sum"])
        adv = lib.gr_opd_advantages(old.to(dev), teacher.double().to(dev), mask.to(dev),
                                    group_size=2)
        assert adv.dtype == torch.float64
        torch.testing.assert_close(adv.cpu(), exact, **TOL["fp64_sum"])


def _fp32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


@pytest.fixture
def floats_as_on_a_gpu(monkeypatch, device):
    """The interpreter passes Python floats on as fp64; a GPU launch rounds them to fp32. This
    fixture makes the interpreter do what the GPU does."""
    if device.type == "cuda":
        return
    run = InterpretedFunction.run

    def as_on_a_gpu(a):   # a float argument, in a tuple argument too
        if type(a) is float:
            return _fp32(a)
        return tuple(as_on_a_gpu(x) for x in a) if type(a) is tuple else a

    def launch(self, *args, **kwargs):
        return run(self, *[as_on_a_gpu(a) for a in args], **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", launch)


@pytest.mark.parametrize("geometry, topology", [("chi2", "atomic"), ("kl", "binary"),
                                                ("hellinger", "binary"), ("tv", "mc")])
def test_bounds_take_delta_in_fp64_on_a_gpu(geometry, topology, floats_as_on_a_gpu, device,
                                            monkeypatch):
    """delta = 0.1 is not an fp32 number: the kernels take it as an fp64 pair (hi + lo), so the
    fp64 bounds match the fp64 reference to its own accuracy. The negative control passes delta
    as one float, rounded to fp32 on the way: the bounds are then off by ~1e-8."""
    old = torch.linspace(-12, -1e-3, 50, dtype=torch.float64)
    want = reference.gppo_bounds(old, geometry=geometry, topology=topology, delta=0.1)
    got = rlfuse.gppo_bounds(old.to(device), geometry=geometry, topology=topology, delta=0.1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, **TOL["fp64"])
    if device.type == "cuda":
        return
    monkeypatch.setattr(kernel_utils, "fp64_parts", lambda x: (x, 0.0))
    got = rlfuse.gppo_bounds(old, geometry=geometry, topology=topology, delta=0.1)
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) > 1e-10


def test_fp64_loss_with_gpu_float_passing(floats_as_on_a_gpu, device):
    """GR-OPD's clip range eps = 0.2 reaches the region as an fp64 pair: the fp64 loss matches
    the fp64 reference exactly, with ratios at 1 + eps where fp32(0.2) would move the branch."""
    gen = torch.Generator().manual_seed(4)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2
    teacher = old - torch.rand(B, T, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    lp = old + torch.log1p(torch.tensor(0.2, dtype=torch.float64)) * (torch.rand(B, T) > 0.5)
    buffer = torch.cat([lp, lp[:, :1]], 1)
    args = (old, teacher, mask)
    fused = run_loss(rlfuse.gr_opd_loss, buffer, dtype=torch.float64, device=device, args=args,
                     group_size=2, gamma=1.0, lam=0.5)
    ref = run_loss(reference.gr_opd_loss, buffer, dtype=torch.float64, args=args, group_size=2,
                   gamma=1.0, lam=0.5)
    torch.testing.assert_close(fused[0].cpu(), ref[0], **TOL["fp64_pairs"])
    torch.testing.assert_close(fused[2].cpu(), ref[2], **TOL["fp64_pairs"])


@pytest.mark.parametrize("objective", [
    lambda O: O.Clip(clip=0.2, dual_clip=3.1),            # p0: the dual clip
    lambda O: O.SAPOTRL(tau_pos=1.05, tau_neg=0.9),       # p0, p1: the temperatures
    lambda O: O.DPPOTV(clip=0.15, truncation=3.3),        # p0..p2: the move, the truncation
    lambda O: O.DRO(dro_beta=0.1),                        # p0: beta
])
def test_objective_parameters_in_fp64_on_a_gpu(objective, floats_as_on_a_gpu, device):
    """An objective's parameters that fp32 does not represent reach the kernels as fp64 pairs:
    the fp64 loss and gradient match the fp64 reference to a few ulp, with Python floats
    passed as a GPU passes them."""
    from rlfuse import objectives

    gen = torch.Generator().manual_seed(6)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 0.1
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 1.5
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    buffer = torch.cat([lp, lp[:, :1]], 1)
    args = (old, adv, mask, objective(objectives))
    fused = run_loss(rlfuse.policy_loss, buffer, dtype=torch.float64, device=device, args=args)
    ref = run_loss(reference.policy_loss, buffer, dtype=torch.float64, args=args)
    torch.testing.assert_close(fused[0].cpu(), ref[0], **TOL["fp64_pairs"])
    torch.testing.assert_close(fused[2].cpu(), ref[2], **TOL["fp64_pairs"])


@pytest.mark.parametrize("loss", ["ggpo", "ggpo_clip", "gr_opd"])
def test_group_scalars_in_fp64_on_a_gpu(loss, floats_as_on_a_gpu, device):
    """GGPO's beta and clip radius, GR-OPD's gamma, lam, clips and std_eps, none of them an
    fp32 value, reach the group kernels as fp64 pairs: fp64 losses and gradients equal the
    reference's to a few ulp with Python floats passed as a GPU passes them."""
    gen = torch.Generator().manual_seed(8)
    B, T = 4, 5
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 2 - 0.1
    lp = old + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    mask = torch.ones(B, T, dtype=torch.bool)
    buffer = torch.cat([lp, lp[:, :1]], 1)
    if loss == "gr_opd":
        args, kw = (old, old - torch.rand(B, T, generator=gen, dtype=torch.float64), mask), \
            dict(group_size=2, gamma=0.97, lam=0.3, feedback_clip=0.7, adv_clip=1.3, std_eps=0.1)
    else:
        args = (old, torch.rand(B, generator=gen, dtype=torch.float64), mask)
        kw = dict(group_size=2, beta=0.3, clip_radius=0.1 if loss == "ggpo_clip" else None)
    name = "gr_opd_loss" if loss == "gr_opd" else "ggpo_loss"
    fused = run_loss(getattr(rlfuse, name), buffer, dtype=torch.float64, device=device,
                     args=args, **kw)
    ref = run_loss(getattr(reference, name), buffer, dtype=torch.float64, args=args, **kw)
    torch.testing.assert_close(fused[0].cpu(), ref[0], **TOL["fp64_pairs"])
    torch.testing.assert_close(fused[2].cpu(), ref[2], **TOL["fp64_pairs"])


def test_head_scalars_in_fp64_on_a_gpu(floats_as_on_a_gpu, device, monkeypatch):
    """1 / temperature, a softcap and a logit scale that fp32 does not represent reach the row
    kernels as fp64 pairs: fp64 log-probs and gradients of logits and of a capped head match
    the fp64 reference to its own accuracy. The negative control passes each as one float,
    rounded to fp32 on the way."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 17, generator=gen, dtype=torch.float64) * 6
    targets = torch.randint(0, 17, (2, 3), generator=gen)
    weight = torch.randn(17, 17, generator=gen, dtype=torch.float64)

    def calls(lib):
        logits = x.clone().to(device).requires_grad_(True)
        head = lib.LinearHead(logits, weight.to(device), targets.to(device), temperature=0.7,
                              logit_scale=0.3, softcap=2.5)
        lp = lib.token_logprobs(logits, targets.to(device), temperature=0.7)
        (grad,) = torch.autograd.grad(lp.sum() + lib.policy_logprobs(head).sum(), logits)
        return lp.detach().cpu(), lib.policy_logprobs(head).detach().cpu(), grad.cpu()

    want = calls(reference)
    for got, ref in zip(calls(rlfuse), want):
        torch.testing.assert_close(got, ref, **TOL["fp64_head"])
    if device.type == "cuda":
        return
    monkeypatch.setattr(kernel_utils, "fp64_parts", lambda v: (v, 0.0))
    assert max((g - w).abs().max().item() for g, w in zip(calls(rlfuse), want)) > 1e-10


@pytest.mark.parametrize("group_size", [256, 1024])
def test_large_groups(group_size, device):
    """Groups of 256 and 1024 rows (the group kernels hold a whole group; their tile shrinks in
    time as the group grows): GGPO and GR-OPD advantages against float64."""
    gen = torch.Generator().manual_seed(group_size)
    B, T = group_size, 5
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    teacher = old - torch.rand(B, T, generator=gen, dtype=torch.float64)
    rewards = torch.rand(B, generator=gen, dtype=torch.float64)
    lp = torch.cat([old + 0.1, old[:, :1]], 1)
    for clip in (None, 0.05):
        fused = run_loss(rlfuse.ggpo_loss, lp, dtype=torch.float32, device=device,
                         args=(old.float(), rewards.float(), mask), group_size=group_size,
                         beta=0.5, clip_radius=clip)
        ref = run_loss(reference.ggpo_loss, lp, dtype=torch.float32,
                       args=(old.float(), rewards.float(), mask), group_size=group_size,
                       beta=0.5, clip_radius=clip)
        ref64 = run_loss(reference.ggpo_loss, lp, dtype=torch.float64,
                         args=(old, rewards, mask), group_size=group_size, beta=0.5,
                         clip_radius=clip)
        assert_three_way(fused[0].cpu(), ref[0], ref64[0], "loss")
        assert_three_way(fused[2].cpu(), ref[2], ref64[2], "gradient")
    adv = rlfuse.gr_opd_advantages(old.float().to(device), teacher.float().to(device),
                                   mask.to(device), group_size=group_size)
    assert_three_way(adv.cpu(), reference.gr_opd_advantages(old.float(), teacher.float(), mask,
                                                            group_size=group_size),
                     reference.gr_opd_advantages(old, teacher, mask, group_size=group_size),
                     "advantages")
