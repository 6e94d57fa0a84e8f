"""Shared test configuration: the tolerance table, the three-way check, output poisoning.

The suite runs the real Triton kernels on the CPU through the interpreter (``TRITON_INTERPRET=1``
must be set before triton is imported; ``make test`` does). Tests marked ``gpu`` need CUDA.
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import rlfuse.kernels.utils as kernel_utils  # noqa: E402

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


# On a GPU, Triton passes Python floats to kernels as fp32 scalars, so a float64 kernel run sees
# its hyper-parameters rounded to fp32 while the float64 reference does not. Tests that hold a
# float64 kernel run to float64 accuracy therefore use hyper-parameters that fp32 represents
# exactly (powers of two for a temperature, whose inverse is what the kernels receive).
def fp32_exact(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def max_err(x: torch.Tensor, ref64: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - ref64.double()).abs().max().item()


def assert_three_way(fused: torch.Tensor, ref: torch.Tensor, ref64: torch.Tensor, name: str = "",
                     atol_dtype: torch.dtype = None, scale: float = None):
    """The three-way rule above; ``atol_dtype`` defaults to the dtype of ``fused``. ``scale``
    replaces ``max(1, max|ref64|)`` for a result made of larger terms that cancel (a mean of
    differences of log-probs is rounded at the log-probs' magnitude, not at its own)."""
    assert fused.shape == ref64.shape, f"{name}: shape {tuple(fused.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(fused).all(), f"{name}: non-finite values"
    if scale is None:
        scale = max(1.0, ref64.abs().max().item()) if ref64.numel() else 1.0
    bound = THREE_WAY_FACTOR * max_err(ref, ref64) + ATOL[atol_dtype or fused.dtype] * scale
    err = max_err(fused, ref64)
    assert err <= bound, f"{name}: max error {err:.3e} vs float64 exceeds {bound:.3e}"


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every kernel output starts as NaN, so an element a kernel does not write fails."""
    kernel_utils.POISON_OUTPUTS = True
    yield
    kernel_utils.POISON_OUTPUTS = False


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (real sizes, speed smoke)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def integration(module: str):
    """Imports a trainer package the integration tests run against: skipped where it is not
    installed, an error under ``make test`` (``RLFUSE_REQUIRE_INTEGRATIONS=1``), which installs
    it — so CI never skips them."""
    if os.environ.get("RLFUSE_REQUIRE_INTEGRATIONS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture
def device():
    """Where the kernel tests run: CUDA when there is one, else the CPU through the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
