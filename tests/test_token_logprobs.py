"""Fused per-token log-probs and entropy vs the reference vs float64."""
import subprocess
import sys

import pytest
import torch

import rlfuse
from rlfuse import reference
from rlfuse._dispatch import use_kernels

from conftest import TOL, assert_three_way

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def make_inputs(B, T, V, dtype, device, *, scale=3.0, masked_share=0.3, seed=0, pad_time=1):
    """Logits as the ``[:, :-1]`` view of a ``[B, T + pad_time, V]`` buffer (non-contiguous, as a
    trainer slices them), targets, and a mask with garbage targets at masked positions."""
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(B, T + pad_time, V, generator=gen, dtype=torch.float64) * scale).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) >= masked_share
    garbage = torch.tensor([-100, V, V + 12345, -1])
    targets[~mask] = garbage[torch.randint(0, 4, (int((~mask).sum()),), generator=gen)]
    return base.to(device), targets.to(device), mask.to(device)


def run(fn, base, targets, mask, *, pad_time=1, temperature=1.0, entropy=False, seed=1, **kw):
    """Values and gradient w.r.t. the logits buffer under random upstream gradients."""
    leaf = base.detach().clone().requires_grad_(True)
    logits = leaf[:, : leaf.shape[1] - pad_time]
    out = fn(logits, targets, temperature=temperature, return_entropy=entropy, mask=mask, **kw)
    outs = out if entropy else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)).sum()
               for o in outs)
    loss.backward()
    return [o.detach() for o in outs], leaf.grad


def check_against_float64(base, targets, mask, *, entropy, temperature=1.0, pad_time=1):
    fused, d_fused = run(rlfuse.token_logprobs, base, targets, mask, entropy=entropy,
                         temperature=temperature, pad_time=pad_time)
    ref, d_ref = run(reference.token_logprobs, base, targets, mask, entropy=entropy,
                     temperature=temperature, pad_time=pad_time)
    ref64, d_ref64 = run(reference.token_logprobs, base.double(), targets, mask, entropy=entropy,
                         temperature=temperature, pad_time=pad_time)
    acc = torch.float64 if base.dtype == torch.float64 else torch.float32
    for name, f, r, r64 in zip(["logp", "entropy"], fused, ref, ref64):
        assert f.dtype == acc
        assert_three_way(f, r, r64, name)
    assert d_fused.dtype == base.dtype
    assert_three_way(d_fused, d_ref, d_ref64, "dlogits")
    return fused, d_fused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [37, 4099])  # below one block; a block plus a ragged tail
@pytest.mark.parametrize("entropy", [False, True])
def test_matches_float64(dtype, V, entropy, device):
    base, targets, mask = make_inputs(3, 7, V, dtype, device)
    temperature = 0.5 if dtype == torch.float64 else 0.7  # see conftest.fp32_exact
    check_against_float64(base, targets, mask, entropy=entropy, temperature=temperature)


@pytest.mark.parametrize("V", [129920, 128256, 151936])  # verl's breaking size; Llama 3; Qwen 2
def test_real_vocab_sizes(V, device):
    base, targets, mask = make_inputs(1, 3, V, torch.bfloat16, device, masked_share=0.0)
    check_against_float64(base, targets, mask, entropy=True)


def test_fp32_relative_error_1e6(device):
    """The headline promise: fp32 log-probs and gradients within ~1e-6 relative of float64."""
    base, targets, mask = make_inputs(4, 8, 1000, torch.float32, device)
    (lp,), d = run(rlfuse.token_logprobs, base, targets, mask)
    (lp64,), d64 = run(reference.token_logprobs, base.double(), targets, mask)
    assert ((lp.double() - lp64).abs() / lp64.abs().clamp_min(1.0)).max() < 1e-6
    assert (d.double() - d64).abs().max() / d64.abs().max() < 1e-6


def test_no_mask_and_flat_rows(device):
    """[N, V] input without a mask: every target is read."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(11, 300, generator=gen).to(device)
    targets = torch.randint(0, 300, (11,), generator=gen).to(device)
    (lp, ent), _ = run(rlfuse.token_logprobs, logits, targets, None, entropy=True, pad_time=0)
    (lp64, ent64), _ = run(reference.token_logprobs, logits.double(), targets, None,
                           entropy=True, pad_time=0)
    assert lp.shape == (11,)
    torch.testing.assert_close(lp.double(), lp64, **TOL["fp32_logprob"])
    torch.testing.assert_close(ent.double(), ent64, **TOL["fp32_logprob"])


def test_masked_positions(device):
    """Masked positions: log-prob 0, entropy 0, zero gradient, whatever their targets."""
    base, targets, mask = make_inputs(3, 9, 50, torch.float32, device, masked_share=0.5)
    (lp, ent), d = run(rlfuse.token_logprobs, base, targets, mask, entropy=True)
    assert (~mask).any() and mask.any()
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    assert (d[:, :-1][~mask] == 0).all()
    assert (d[:, -1] == 0).all()  # the column outside the view gets no gradient
    assert (d[:, :-1][mask] != 0).any()


def test_transposed_and_strided_views(device):
    """Batch stride smaller than time stride, and strided targets: no copy needed, same result."""
    gen = torch.Generator().manual_seed(4)
    storage = torch.randn(6, 4, 2, 129, generator=gen).to(device)  # [T, B, 2, V]
    logits = storage[:, :, 1].transpose(0, 1)                      # [B, T, V] view
    targets_buf = torch.randint(0, 129, (6, 4, 3), generator=gen).to(device)
    targets = targets_buf[:, :, 2].t()                              # [B, T] view
    mask = torch.rand(4, 6, generator=gen).to(device) > 0.2
    lp, ent = rlfuse.token_logprobs(logits, targets, mask=mask, return_entropy=True)
    lp64, ent64 = reference.token_logprobs(logits.double().contiguous(), targets.contiguous(),
                                           mask=mask, return_entropy=True)
    torch.testing.assert_close(lp.double(), lp64, **TOL["fp32_logprob"])
    torch.testing.assert_close(ent.double(), ent64, **TOL["fp32_logprob"])


def test_extreme_logits_and_shift_invariance(device):
    """Logits of +-1e4 stay finite; adding a constant to a row changes nothing."""
    gen = torch.Generator().manual_seed(5)
    V = 1000
    # multiples of 1/256, so that adding 512 is exact in fp32 and the shift test sees only the
    # kernel's arithmetic
    logits = (torch.randn(2, 5, V, generator=gen, dtype=torch.float64) * 256).round() / 256
    logits[0, :, ::7] = 1.0e4
    logits[1, :, ::5] = -1.0e4
    targets = torch.randint(0, V, (2, 5), generator=gen)
    targets[0, 0] = 7  # a target at a +1e4 logit
    targets[1, 0] = 5  # a target at a -1e4 logit
    mask = torch.ones(2, 5, dtype=torch.bool)
    base = torch.cat([logits, logits[:, :1]], 1).float().to(device)
    fused, d = check_against_float64(base, targets.to(device), mask.to(device), entropy=True)
    shifted, d_shifted = run(rlfuse.token_logprobs, base + 512.0, targets.to(device),
                             mask.to(device), entropy=True)
    # The shift is exact in the inputs, but lse itself grows by 512 and is rounded to fp32: each
    # row may differ by a few ulp of its largest |logit| + 512.
    row_tol = 2 * torch.finfo(torch.float32).eps * (512 + base[:, :-1].abs().amax(-1))
    for a, b in zip(fused + [d[:, :-1]], shifted + [d_shifted[:, :-1]]):
        diff = (a.double() - b.double()).abs()
        assert (diff.reshape(*row_tol.shape, -1) <= row_tol[..., None]).all()


def test_inplace_backward_matches(device):
    base, targets, mask = make_inputs(2, 6, 300, torch.bfloat16, device)
    _, d_out = run(rlfuse.token_logprobs, base, targets, mask, entropy=True)
    leaf = base.detach().clone().requires_grad_(True)
    buffer = leaf.detach().clone()  # the logits a model would produce, written over by backward
    logits = buffer[:, :-1]
    lp, ent = rlfuse.token_logprobs(logits.requires_grad_(True), targets, mask=mask,
                                    return_entropy=True, inplace_backward=True)
    gen = torch.Generator().manual_seed(1)
    g1 = torch.randn(lp.shape, generator=gen, dtype=torch.float64).to(lp)
    g2 = torch.randn(ent.shape, generator=gen, dtype=torch.float64).to(ent)
    (dlogits,) = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), logits)
    assert dlogits.data_ptr() == logits.data_ptr()  # written into the logits' own buffer
    torch.testing.assert_close(dlogits, d_out[:, :-1], **TOL["exact"])


def test_backward_of_a_plain_sum(device):
    """lp.sum().backward() hands the backward an expanded (stride 0) upstream gradient."""
    base, targets, mask = make_inputs(2, 4, 30, torch.float32, device)
    grads = []
    for fn in (rlfuse.token_logprobs, reference.token_logprobs):
        logits = base[:, :-1].clone().requires_grad_(True)
        fn(logits, targets, mask=mask).sum().backward()
        grads.append(logits.grad)
    torch.testing.assert_close(grads[0], grads[1], **TOL["fp32"])


def test_gradient_of_entropy_alone(device):
    base, targets, mask = make_inputs(2, 4, 64, torch.float64, device)
    logits = base[:, :-1].detach().clone().requires_grad_(True)
    _, ent = rlfuse.token_logprobs(logits, targets, mask=mask, return_entropy=True)
    (g,) = torch.autograd.grad(ent.sum(), logits)
    logits64 = logits.detach().clone().requires_grad_(True)
    _, ent64 = reference.token_logprobs(logits64, targets, mask=mask, return_entropy=True)
    (g64,) = torch.autograd.grad(ent64.sum(), logits64)
    torch.testing.assert_close(g, g64, **TOL["fp64_chain"])


def test_gradcheck_float64(device):
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(0, 9, (2, 3), generator=gen).to(device)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=device)

    def f(x):
        lp, ent = rlfuse.token_logprobs(x, targets, mask=mask, temperature=1.3,
                                        return_entropy=True)
        return lp, ent

    # fast mode (a random projection of the Jacobian: two evaluations, not one per element)
    assert torch.autograd.gradcheck(f, (logits.requires_grad_(True),), fast_mode=True)


def test_empty_batch(device):
    logits = torch.randn(0, 5, 33, device=device, requires_grad=True)
    targets = torch.zeros(0, 5, dtype=torch.long, device=device)
    lp = rlfuse.token_logprobs(logits, targets)
    assert lp.shape == (0, 5)
    lp.sum().backward()
    assert logits.grad.shape == logits.shape


@pytest.mark.parametrize("bad, match, exc", [
    (dict(logits=torch.randn(5)), "logits", ValueError),                         # rank 1
    (dict(logits=torch.randn(1, 2, 3, 5)), "logits", ValueError),                # rank 4
    (dict(logits=torch.randint(0, 3, (2, 3, 5))), "logits", TypeError),          # integer logits
    (dict(targets=torch.zeros(2, 3)), "targets", TypeError),                     # float targets
    (dict(targets=torch.zeros(2, 4, dtype=torch.long)), "targets", ValueError),  # wrong shape
    (dict(targets=torch.full((2, 3), 5)), "targets", ValueError),                # id == V
    (dict(targets=torch.full((2, 3), -1)), "targets", ValueError),               # negative id
    (dict(temperature=0.0), "temperature", ValueError),
    (dict(temperature=-1.0), "temperature", ValueError),
    (dict(temperature=float("nan")), "temperature", ValueError),
    (dict(temperature=float("inf")), "temperature", ValueError),
    (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask", ValueError),
    (dict(mask=torch.full((2, 3), 0.5)), "mask", ValueError),
])
@pytest.mark.parametrize("fn", [rlfuse.token_logprobs, reference.token_logprobs])
def test_bad_input(fn, bad, match, exc):
    args = dict(logits=torch.randn(2, 3, 5), targets=torch.zeros(2, 3, dtype=torch.long),
                temperature=1.0, mask=None)
    args.update(bad)
    with pytest.raises(exc, match=match):
        fn(args.pop("logits"), args.pop("targets"), **args)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("fn", [rlfuse.token_logprobs, reference.token_logprobs])
def test_numeric_mask(fn, validate, device):
    """A 0/1 mask of an integer or float dtype acts as its bool (SPEC 2: bool or 0/1)."""
    base, targets, mask = make_inputs(2, 5, 40, torch.float32, device)
    want = fn(base[:, :-1], targets, mask=mask, return_entropy=True)
    for dtype in (torch.int64, torch.float32):
        got = fn(base[:, :-1], targets, mask=mask.to(dtype), return_entropy=True,
                 validate=validate)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL["exact"])


def test_out_of_range_target_allowed_when_masked(device):
    logits = torch.randn(2, 3, 5, device=device)
    targets = torch.tensor([[0, 9, 1], [-3, 2, 4]], device=device)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool, device=device)
    lp = rlfuse.token_logprobs(logits, targets, mask=mask)
    assert torch.isfinite(lp).all() and (lp[~mask] == 0).all()


@pytest.mark.parametrize("fn", [rlfuse.token_logprobs, reference.token_logprobs])
def test_without_validation_out_of_range_target_is_nan(fn, device):
    """validate=False skips the host sync; a bad unmasked target gives NaN, not a wild read."""
    logits = torch.randn(2, 3, 5, device=device)
    targets = torch.tensor([[0, 5, 1], [-3, 2, 4]], device=device)
    lp = fn(logits, targets, validate=False)
    bad = torch.tensor([[False, True, False], [True, False, False]], device=device)
    assert lp[bad].isnan().all() and torch.isfinite(lp[~bad]).all()


def test_dispatch_without_interpreter_uses_reference():
    """On the CPU without TRITON_INTERPRET, calls fall back to the reference."""
    code = ("import torch, rlfuse; from rlfuse._dispatch import use_kernels; "
            "print(use_kernels(torch.device('cpu')))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
    assert use_kernels(torch.device("cpu")) == (not torch.cuda.is_available()
                                                 or rlfuse.kernels.lib.utils.INTERPRET)


@pytest.mark.gpu
def test_gpu_real_size_int64_offsets():
    """N * V beyond 2**31 elements and more than 65535 rows: int64 offsets, 1-D grid."""
    B, T, V = 2, 8200, 151936  # 2.49e9 elements, 16400 rows
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(B, T + 1, V, device="cuda", dtype=torch.bfloat16, generator=gen)[:, :-1]
    targets = torch.randint(0, V, (B, T), device="cuda", generator=gen)
    lp = rlfuse.token_logprobs(logits, targets)
    rows = [0, T - 1]  # the last rows lie past 2**31 elements
    for b in range(B):
        for t in rows:
            ref = torch.log_softmax(logits[b, t].double(), -1)[targets[b, t]]
            assert abs(lp[b, t].item() - ref.item()) < 1e-4


@pytest.mark.gpu
def test_gpu_many_rows():
    N, V = 70000, 256  # more rows than a grid dimension of 65535
    logits = torch.randn(N, V, device="cuda", requires_grad=True)
    targets = torch.randint(0, V, (N,), device="cuda")
    lp = rlfuse.token_logprobs(logits, targets)
    torch.testing.assert_close(lp, torch.log_softmax(logits.float(), -1).gather(
        -1, targets[:, None])[:, 0], **TOL["fp32_gpu"])
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("seed", range(20))
def test_random_shapes_match_float64(seed, device):
    """Any small shape, vocabulary (V = 1 included) and temperature, drawn from the seed: fp32
    within the three-way rule of float64, values and gradients."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (int(torch.randint(1, n + 1, (), generator=gen)) for n in (3, 4))
    V = 1 if seed == 0 else int(torch.randint(1, 301, (), generator=gen))
    temperature = 0.25 + 3.75 * float(torch.rand((), generator=gen))
    masked_share = 0.9 * float(torch.rand((), generator=gen))
    base, targets, mask = make_inputs(B, T, V, torch.float32, device, masked_share=masked_share,
                                      seed=seed)
    check_against_float64(base, targets, mask, entropy=True, temperature=temperature)


@pytest.mark.gpu
def test_gpu_speed_smoke():
    """Fused forward + backward beats the eager reference on a real shape."""
    import triton.testing

    N, V = 4096, 128256
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, V, (N,), device="cuda")

    def step(fn):
        return lambda: fn(logits, targets).sum().backward()

    fused = triton.testing.do_bench(step(rlfuse.token_logprobs))
    eager = triton.testing.do_bench(step(reference.token_logprobs))
    assert fused < eager, (fused, eager)
