"""The benchmark cases as pytest-benchmark tests: ``pytest bench/`` (``--benchmark-json`` etc.).

Same op table, input factory and timed steps as ``python -m bench``, at the --quick shapes (the
CPU runs the kernels through the Triton interpreter, so its numbers only show that every case
runs). On a GPU, ``pytest bench/ --benchmark-only`` gives wall-clock timings of each step.
"""
import functools

import pytest
import torch

from bench import cases, measure

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IMPLS = ("fused", "reference")


@functools.lru_cache(maxsize=None)
def _inputs(from_logits: bool):
    """One input set per policy form, shared by every test (the factory of ``python -m bench``)."""
    shapes = cases.make_shapes(quick=True)
    shape = next(s for s in shapes if (s.V is not None) == from_logits)
    return cases.make_inputs(shape, DEVICE)


@pytest.mark.parametrize("mode", cases.MODES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op_name", list(cases.OPS))
def test_bench(benchmark, op_name, impl, mode):
    op = cases.OPS[op_name]
    if mode not in cases.modes_for(op, impl):
        pytest.skip(f"{op_name} has no {mode} row for {impl}")
    x = _inputs(op.from_logits)
    step = measure.make_step(cases.forward_fn(op, impl, cases.load_impl(impl), x), mode)
    benchmark.group = f"{op_name} {mode} {x.shape}"
    benchmark.extra_info.update(impl=impl, N=x.shape.N, V=x.shape.V, bytes=op.bytes(x.shape, mode))
    # The interpreter takes ~0.1 s a call: a few rounds, not pytest-benchmark's calibration.
    benchmark.pedantic(measure.synced(step, DEVICE), rounds=2, warmup_rounds=1, iterations=1)
