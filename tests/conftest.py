"""Shared test configuration: the tolerances, the three-way check, the implementations under test,
output poisoning, the guard that the kernels really run, a per-test time limit and the progress
lines of a long run (``progress.py``).

The suite runs the real Triton kernels on the CPU through the interpreter (``TRITON_INTERPRET=1``
must be set before triton is imported; ``make test`` does, and so does this file when it is
first). Tests marked ``gpu`` need CUDA.
"""
import importlib
import math
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import progress  # noqa: E402
import rlfuse  # noqa: E402
import rlfuse.kernels.lib.utils as kernel_utils  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


ROOT = Path(__file__).resolve().parent.parent


def process_env(*folders: Path, drop: tuple = (), **values: str) -> dict:
    """The environment of a process a test starts: this one's, less ``drop``, with ``values``
    set and ``folders`` (the repository root when none) ahead on ``PYTHONPATH``, so that a test
    file run as a script imports ``tools`` through this file as pytest does."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    path = [str(f) for f in folders or (ROOT,)] + [os.environ.get("PYTHONPATH", "")]
    return dict(env, **values, PYTHONPATH=os.pathsep.join(filter(None, path)))


def nvidia_backend() -> bool:
    """Whether this Triton can compile for NVIDIA GPUs (the compile-only sm_90 tests)."""
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


if os.environ.get("TRITON_INTERPRET") == "1":
    from tools.interpreter import round_bf16_as_a_gpu

    round_bf16_as_a_gpu()

# --------------------------------------------------------------------------------------------
# Tolerances
# --------------------------------------------------------------------------------------------

# Three-way rule (STYLE.md): with ref64 the float64 reference on the same (rounded) inputs and
# ref the reference run on the inputs' own dtype,
#     max|fused - ref64| <= THREE_WAY_FACTOR * max|ref - ref64| + atol * max(1, max|ref64|).
# The fused kernels accumulate in the same precision as the reference (fp32, fp64 for fp64), in
# a different order, so their error may exceed the reference's by a small factor, never by
# orders of magnitude. `atol` is a few units of rounding of the result's dtype: it covers the
# cases where the reference happens to be exact.
THREE_WAY_FACTOR = 2.0
ATOL = {
    torch.float64: 1e-13,
    torch.float32: 4e-7,   # ~3 ulp at 1
    torch.float16: 2e-3,   # ~2 ulp at 1
    torch.bfloat16: 1.6e-2,  # ~2 ulp at 1
}

# Direct comparisons (``torch.testing.assert_close(a, b, **TOL[name])``), each with its reason.
TOL = {
    # the same arithmetic in the same order: launch configurations, layouts, wrappers
    "exact": dict(rtol=0, atol=0),
    # fp64 results of the same math in another order (a few ulp of the terms summed)
    "fp64": dict(rtol=1e-12, atol=1e-14),
    # fp64 gradients with terms of ~1e-3 (a few ulp of them)
    "fp64_grad": dict(rtol=1e-12, atol=1e-15),
    # fp64 through more operations (a loss and its gradient over several kernels, log-space
    # bounds)
    "fp64_chain": dict(rtol=1e-10, atol=1e-12),
    # fp64 sums over a batch whose terms cancel (micro-batches adding up, shifted rewards)
    "fp64_sum": dict(rtol=1e-12, atol=1e-12),
    # fp64 trust-region bounds from the kernels' closed forms and fixed-iteration root finding
    # against the reference's bisection: ratios around 1, relative, absolute where 1 - x cancels
    "bounds_fp64": dict(rtol=1e-9, atol=1e-12),
    # fp32 bounds: fp64 computed, rounded once to fp32 (1 ulp = 6e-8 at 1)
    "bounds_fp32": dict(rtol=1e-6, atol=1e-7),
    # fp32 results against fp64 of one short computation (a log-prob, one loss term), or an fp32
    # loss against the fp32 reference (a few ulp of it)
    "fp32": dict(rtol=1e-6, atol=1e-7),
    # fp32 results of a reduction over a row or a batch (a few ulp of its largest terms)
    "fp32_sum": dict(rtol=2e-6, atol=1e-6),
    # fp32 against fp32 in another order, through a chain (losses from logits, head gradients)
    "fp32_chain": dict(rtol=1e-5, atol=1e-6),
    # fp32 gradients through matmuls in another order (a LinearHead's chunks against one
    # matmul, a model's layers: cuBLAS / MKL blocking differs)
    "fp32_matmul": dict(rtol=1e-4, atol=1e-6),
    # fp64 with hyper-parameters exact in fp64 (the regions' fp32 pairs hi + lo): the same math
    # in another order, to a few ulp
    "fp64_pairs": dict(rtol=1e-13, atol=1e-15),
    # fp64 through a LinearHead's chunked matmuls (the matmuls' own reassociation)
    "fp64_head": dict(rtol=1e-12, atol=1e-13),
    # fp32 log-probs and entropies of rows of logits of size ~10 against fp64 (a few ulp of the
    # row's logsumexp)
    "fp32_logprob": dict(rtol=1e-6, atol=1e-6),
    # fp32 losses of one batch computed two ways (in another order, or with another wrapper's
    # normaliser, e.g. verl's 1e-8 in seq-mean-token-mean)
    "fp32_reduce": dict(rtol=2e-6, atol=1e-7),
    # fp32 gradients of ~1e-3 per token (a few ulp of them)
    "fp32_grad": dict(rtol=2e-6, atol=1e-8),
    # fp32 log-probs of two implementations over rows of V ~ 1000 (Liger's kernel and ours): a
    # few ulp of |log p| <= 16, absolute
    "fp32_logprob_abs": dict(rtol=0, atol=4e-6),
    # fp32 log-softmax on a GPU against torch's on a GPU (approximate math in both)
    "fp32_gpu": dict(rtol=1e-5, atol=1e-5),
    # a bf16 gradient on a GPU against fp64 (one bf16 rounding, 2^-8, of terms up to ~2)
    "bf16_grad": dict(rtol=2e-2, atol=1e-9),
    # fp64 against a Python-float loop of a definition, relative only: each value to a few ulp
    # of itself
    "fp64_relative": dict(rtol=1e-12, atol=0),
    # fp64 gradients against the Python-float loop of GGPO's definition (exp, log, group sums)
    "fp64_definition_grad": dict(rtol=1e-10, atol=1e-14),
    # fp64 sums that are 0 in exact arithmetic (GGPO's coefficients per group): absolute only
    "fp64_zero_sum": dict(rtol=0, atol=1e-12),
    # fp32 gradients of two code paths with the same coefficients (GGPO's direct branch and
    # clip_radius=inf)
    "fp32_branches": dict(rtol=1e-6, atol=1e-9),
    # fp64 gradients w.r.t. logits (through the softmax), fused against the reference
    "fp64_logits_grad": dict(rtol=1e-10, atol=1e-13),
    # fp64: the losses of micro-batches with global counts, summed, against the whole batch's
    "fp64_micro_batches": dict(rtol=1e-13, atol=0.0),
    # trust-region bounds against a bisection of D(r) = delta: rtol 1e-6 the contract of the
    # two root-found cells, atol the cancellation in 1 - x near a zero lower bound
    "bisection": dict(rtol=1e-6, atol=1e-12),
    # finite upper bounds against the bisection: the contract's rtol, relative only
    "bisection_hi": dict(rtol=1e-6, atol=0.0),
    # kl / two_sided_log lower bounds far below 1e-12, against the bisection in log space
    "bisection_log": dict(rtol=0.0, atol=1e-6),
}
# ``pytest.approx`` of Python floats: fp64 against a Python-float loop (a few ulp); fp32 metrics
# of two trainers' code (TRL's, verl's) over the same tokens; the demo's fused and reference
# runs, which sample the same tokens and differ in fp32 rounding only (losses and metrics of a
# few steps, the final reward to its printed precision).
APPROX = {
    "fp64": dict(rel=1e-12),
    "fp64_metric": dict(rel=1e-12, abs=1e-15),
    "fp32_metric": dict(rel=1e-5, abs=1e-6),
    "fp32_share": dict(rel=1e-6),
    "fp32_metric_abs": dict(abs=1e-6),
    "demo_steps": dict(abs=1e-4),
    "demo_forms": dict(abs=1e-5),
    "demo_split": dict(abs=1e-6),
    "demo_reward": dict(abs=1e-6),
}
# A gradient accumulated over two backwards in fp16 against three times one backward: each
# backward's gradient rounded to fp16 (two fp16 subnormal steps absolute)
FP16_ACCUMULATION = dict(rtol=2e-3, atol=1.2e-7)
# Two fp32 implementations of one loss (Liger-Kernel's and ours) differ in summation order only:
# a few fp32 ulps of the gradient's scale; in bf16 each side rounds its fp32 gradient once: one
# bf16 ulp (2^-8 relative; 2^-7 allows either side to sit on a rounding boundary).
PEER_GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}
# A vocabulary split against the whole vocabulary in one process: both compute in the same
# precision and differ in summation order (log S, the entropy's chain rule): a few units of
# rounding of the compute dtype (fp32 for bf16 logits) on values; a bf16 gradient is rounded
# once on each side, so one bf16 unit of its scale.
SPLIT_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}
SPLIT_GRAD_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2.0 ** -7}


# On a GPU, Triton passes Python floats to kernels as fp32 scalars, so a float64 kernel run sees
# its hyper-parameters rounded to fp32 while the float64 reference does not. Tests that hold a
# float64 kernel run to float64 accuracy therefore use hyper-parameters that fp32 represents
# exactly (powers of two for a temperature, whose inverse is what the kernels receive).
def fp32_exact(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def as_logprobs(x: torch.Tensor) -> torch.Tensor:
    """Test data as log-probs: ``-|x|``, <= 0 (the losses refuse a positive log-prob)."""
    return -x.abs()


def max_err(x: torch.Tensor, ref64: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - ref64.double()).abs().max().item()


def assert_three_way(fused: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, name: str = "",
                     atol_dtype: torch.dtype = None, scale: float = None, floor: float = 0.0):
    """The three-way rule above; ``atol_dtype`` defaults to the dtype of ``fused``. ``scale``
    replaces ``max(1, max|ref64|)`` for a result made of larger terms that cancel (a mean of
    differences of log-probs is rounded at the log-probs' magnitude, not at its own).
    ``floor``: the least error the reference's yardstick stands for, bounded from the operation
    itself (``matmul_rounding``): the reference's own error moves with the machine's BLAS and
    vector units, and where it happens to be small it must not make the rule tighter than the
    operation's rounding allows."""
    assert fused.shape == ref64.shape, f"{name}: shape {tuple(fused.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(fused).all(), f"{name}: non-finite values"
    if scale is None:
        scale = max(1.0, ref64.abs().max().item()) if ref64.numel() else 1.0
    yardstick = max(max_err(ref, ref64), floor)
    bound = THREE_WAY_FACTOR * yardstick + ATOL[atol_dtype or fused.dtype] * scale
    err = max_err(fused, ref64)
    assert err <= bound, f"{name}: max error {err:.3e} vs float64 exceeds {bound:.3e}"


def matmul_rounding(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rounding of each entry of ``a @ b`` computed in ``dtype`` (float64 inputs, the exact
    operands), ``sqrt(K) u sum_k |a_ik| |b_kj|`` with K the inner size and u the unit roundoff:
    the error a K-term dot product accumulates, whatever order a BLAS sums it in (the
    error-relative rule of cut-cross-entropy's tests)."""
    u = torch.finfo(dtype).eps / 2
    return math.sqrt(a.shape[-1]) * u * (a.abs() @ b.abs())


# --------------------------------------------------------------------------------------------
# What runs
# --------------------------------------------------------------------------------------------

def kernels_run_on(device: torch.device) -> bool:
    """The fused functions run the kernels on ``device`` (on the CPU: interpreted)."""
    if not rlfuse.use_kernels(device):
        return False
    if device.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(kernel_utils.load_tile, InterpretedFunction)
    return True


@pytest.fixture(autouse=True)
def kernels_must_run(request):
    """Every test fails, rather than compare the reference with itself, where the fused
    functions would fall back to it: on a CPU whose Triton was imported before
    ``TRITON_INTERPRET=1`` was set. (Tests of the reference alone are exempt.)"""
    params = getattr(request.node, "callspec", None)
    if params is not None and params.params.get("impl") == "reference":
        return
    if not kernels_run_on(DEVICE):
        pytest.fail(f"the kernels do not run on {DEVICE}: set TRITON_INTERPRET=1 before Python "
                    f"starts (make test does); the fused functions would silently run the "
                    f"reference", pytrace=False)


@pytest.fixture
def device():
    """Where the kernel tests run: CUDA when there is one, else the CPU through the interpreter."""
    return DEVICE


@pytest.fixture(params=["fused", "reference"])
def impl(request):
    """The implementation under test: ``rlfuse`` (the kernels) or ``rlfuse.reference`` (plain
    torch), the same functions with the same signatures."""
    return rlfuse if request.param == "fused" else rlfuse.reference


@pytest.fixture(autouse=True)
def time_limit():
    """With ``RLFUSE_TEST_TIMEOUT=S`` (the GPU check sets it) a test still running after S
    seconds fails, and the run goes on to the next (a call that never returns to Python is
    left to the caller's own timeout)."""
    seconds = int(os.environ.get("RLFUSE_TEST_TIMEOUT", "0") or 0)
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"the test ran past RLFUSE_TEST_TIMEOUT={seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every kernel output starts as NaN, so an element a kernel does not write fails."""
    kernel_utils.OUTPUT_FILL = float("nan")
    yield
    kernel_utils.OUTPUT_FILL = None


def pytest_addoption(parser):
    progress.addoption(parser)


def pytest_configure(config):
    progress.register(config)
    config.addinivalue_line("markers", "gpu: needs a CUDA device (real sizes, speed smoke)")
    config.addinivalue_line("markers", "slow: minutes on a 2-core CPU; left out of `make test`, "
                                       "run by `make check` (CI)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def integration(module: str):
    """Imports an optional module a test module needs (a trainer the integration tests run
    against, rlfuse's drop-in for it, ``hypothesis``, ``transformers``): the test module is
    skipped where the import fails for any reason — the package missing, or one of its own
    dependencies (TRL installed without ``pandas`` or ``datasets`` imports, and fails at its
    first trainer: a ``RuntimeError``) — so a GPU machine's bare Python collects the rest; an
    error under ``make test`` (``RLFUSE_REQUIRE_INTEGRATIONS=1``), which installs them all —
    so CI never skips them."""
    if os.environ.get("RLFUSE_REQUIRE_INTEGRATIONS") == "1":
        return importlib.import_module(module)
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001  (whatever the import raises)
        reason = " ".join(str(e).split())     # TRL's message spans lines
        pytest.skip(f"needs {module}: {type(e).__name__}: {reason}", allow_module_level=True)
