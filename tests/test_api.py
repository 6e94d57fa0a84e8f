"""The public API's shape: every fused function and its reference twin, and the fallback."""
import ast
import inspect
from pathlib import Path

import pytest
import torch

import rlfuse
from rlfuse._dispatch import falls_back_to

PUBLIC_FUNCTIONS = sorted(name for name in rlfuse.__all__
                          if inspect.isfunction(getattr(rlfuse, name)) and name != "use_kernels")


def test_every_public_function_has_a_reference_twin():
    assert set(PUBLIC_FUNCTIONS) == {"ggpo_loss", "global_counts", "gppo_bounds", "gppo_loss",
                                     "gr_opd_advantages", "gr_opd_loss", "group_advantages",
                                     "packed_index", "policy_logprobs", "ppo_loss",
                                     "token_logprobs"}
    for name in PUBLIC_FUNCTIONS:
        assert name in rlfuse.reference.__all__, name


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_signature_and_docstring_equal_the_reference(name):
    fused, ref = getattr(rlfuse, name), getattr(rlfuse.reference, name)
    assert inspect.signature(fused) == inspect.signature(ref)
    assert fused.__doc__ == ref.__doc__ and len(ref.__doc__) > 200
    if fused is not ref:  # group_advantages is one plain-torch implementation for both
        assert fused.reference is ref


def test_a_signature_that_drifts_fails_at_import():
    def twin(policy, *, beta=1.0):
        """doc"""

    with pytest.raises(TypeError, match="signature"):
        @falls_back_to(twin)
        def drifted(policy, *, beta=2.0):
            pass


def test_the_fallback_forwards_the_call_unchanged(monkeypatch):
    """Off the kernel devices the public function is its reference twin, whatever the argument
    form (positional, keyword, bad input)."""
    calls = []

    def twin(policy, old, *, delta=0.1):
        """doc"""
        calls.append((policy, old, delta))
        return "reference"

    @falls_back_to(twin)
    def fused(policy, old, *, delta=0.1):
        return "kernels"

    monkeypatch.setattr(rlfuse._dispatch, "INTERPRET", False)
    x = torch.zeros(2, 3)
    assert fused(x, 1, delta=0.5) == "reference" and calls[-1] == (x, 1, 0.5)
    assert fused(policy=x, old=2) == "reference" and calls[-1] == (x, 2, 0.1)
    assert fused([1, 2], 3) == "reference"               # bad input: the reference's checks
    monkeypatch.setattr(rlfuse._dispatch, "INTERPRET", True)
    assert fused(x, 1) == "kernels"
    assert fused(rlfuse.Logits(torch.zeros(1, 2, 3), torch.zeros(1, 2)), 1) == "kernels"
    assert fused("not a tensor", 1) == "reference"


def _imports(package: str):
    """(module file, imported module) of every relative or rlfuse import in ``rlfuse/package``."""
    root = Path(rlfuse.__file__).parent / package
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                yield path.name, "." * node.level + (node.module or ""), node
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield path.name, alias.name, node


def test_the_layers():
    """``_contract`` is below both paths: the reference imports neither kernels nor fused code;
    the fused functions import the reference only as the twins they fall back to."""
    for name, module, _ in _imports("reference"):
        assert not module.startswith(("..kernels", "..fused_losses", "triton")), (name, module)
    for name, module, node in _imports("fused_losses"):
        if module.startswith("..reference") or (module == ".." and any(
                a.name == "reference" for a in node.names)):
            assert module == ".." and [a.name for a in node.names] == ["reference"], (name, module)
    for name, module, _ in _imports("kernels"):
        assert not module.startswith(("..reference", "..fused_losses")), (name, module)
