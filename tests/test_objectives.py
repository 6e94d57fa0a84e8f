"""The registries of objectives, divergences and KL estimators are the one list: every record of
``rlfuse.objectives`` names a per-token function both implementations define (or a batch
function), every record of ``rlfuse.divergences`` a per-position function both define, every
such function serves a record, every KL estimator has its math in both implementations, and
the tables that test or document them cover the registry (a record or estimator missing from
one fails here); no kernel takes more than 30 parameters."""
import ast
import dataclasses
import inspect
from pathlib import Path

import pytest

import rlfuse
from rlfuse import divergences as D
from rlfuse import objectives as O
from rlfuse._names import KL_ESTIMATORS
from rlfuse.kernels.lib import divergence_functions as kernel_divergences
from rlfuse.kernels.tokens import kl as kernel_kl
from rlfuse.kernels.lib import token_functions as kernel_functions
from rlfuse.reference import divergence_functions as reference_divergences
from rlfuse.reference import kl as reference_kl
from rlfuse.reference import token_functions as reference_functions

import test_distill
import test_fuzz
import test_policy_loss

ROOT = Path(__file__).resolve().parent.parent
RECORDS = sorted(O.OBJECTIVES.values(), key=lambda cls: cls.name)


@pytest.mark.parametrize("record", RECORDS, ids=lambda cls: cls.name)
def test_a_record_is_its_whole_objective(record):
    """A record's example is checked when built, its name keys the registry, and what it says
    of itself holds together: a token-local objective's function exists in the kernels and the
    reference (each registered where it is defined), its surrogate names that function; a
    batch-level one has its [B, T] function."""
    example = record.example()
    assert O.OBJECTIVES[record.name] is record and O.as_objective(example) is example
    assert dataclasses.is_dataclass(example)
    if example.ratio == "batch":
        assert callable(example.batch) and example.weight_ratio in ("token", "sequence")
        return
    surrogate = example.surrogate()
    assert surrogate.function == example.token
    assert kernel_functions.token_function(example.token) is \
        kernel_functions.TOKEN_FUNCTIONS[example.token]
    assert reference_functions.token_function(example.token).__name__ == example.token
    assert len(example.flags) <= 3          # the kernels' columns flag0..flag2
    assert example.ratio in ("token", "sequence", "sequence_straight")


def test_every_per_token_function_serves_a_record():
    tokens = {cls.token for cls in RECORDS if cls.token is not None}
    assert set(kernel_functions.TOKEN_FUNCTIONS) == set(reference_functions.TOKEN_FUNCTIONS) \
        == tokens


def test_an_unknown_function_or_estimator_raises_in_both_implementations():
    for lookup in (kernel_functions.token_function, reference_functions.token_function):
        with pytest.raises(ValueError, match="no per-token function 'tanh_clip'"):
            lookup("tanh_clip")
    with pytest.raises(ValueError, match="estimator: expected one of"):
        reference_kl.kl_estimate(None, None, "k4")


def test_every_estimator_has_its_math_in_both_implementations():
    """The kernels' codes are positions in ``_names.KL_ESTIMATORS`` (a code without a branch
    fails to compile: ``kernels.tokens.kl.kl_term``'s static assert), the reference's functions are
    keyed by the same names."""
    assert set(reference_kl.ESTIMATORS) == set(KL_ESTIMATORS)
    assert [int(c) for c in (kernel_kl.K1, kernel_kl.ABS, kernel_kl.K2, kernel_kl.K3)] == \
        [KL_ESTIMATORS.index(n) for n in ("k1", "abs", "k2", "k3")]


def test_the_tables_cover_every_record():
    """The tests' tables of objectives (float64 and three-way parity of every policy form,
    the fuzz) and the docs' tables hold an instance or a row of every record."""
    registry = set(O.OBJECTIVES.values())
    assert {type(o) for o in test_policy_loss.OBJECTIVES.values()} == registry
    assert {type(make()) for make in test_fuzz.FUZZ_OBJECTIVES} == registry
    for page in ("docs/objectives.md", "README.md"):
        text = (ROOT / page).read_text()
        missing = [cls.__name__ for cls in registry if f"`{cls.__name__}(" not in text]
        assert not missing, (page, missing)


@pytest.mark.parametrize("record", D.DIVERGENCES, ids=lambda cls: cls.__name__)
def test_a_divergence_record_is_its_whole_divergence(record):
    """A divergence's example is checked when built and computed by a per-position function
    both implementations define (each registered where it is defined)."""
    example = record.example()
    assert dataclasses.is_dataclass(example) and D.check_divergence(example, False) is example
    function, params = example.terms()
    assert all(isinstance(p, float) for p in params)
    assert kernel_divergences.divergence_function(function) is \
        kernel_divergences.DIVERGENCE_FUNCTIONS[function]
    assert reference_divergences.divergence_function(function).__name__ == function


def test_every_per_position_function_serves_a_divergence():
    functions = {cls.function for cls in D.DIVERGENCES}
    assert set(kernel_divergences.DIVERGENCE_FUNCTIONS) == \
        set(reference_divergences.DIVERGENCE_FUNCTIONS) == functions
    for lookup in (kernel_divergences.divergence_function,
                   reference_divergences.divergence_function):
        with pytest.raises(ValueError, match="no per-position function 'hellinger'"):
            lookup("hellinger")


def test_the_tables_cover_every_divergence():
    """The float64 parity table of distillation holds an instance of every record, the docs'
    table a row."""
    assert {type(d) for d in test_distill.DIVERGENCES} == set(D.DIVERGENCES)
    text = (ROOT / "docs/distillation.md").read_text()
    missing = [cls.__name__ for cls in D.DIVERGENCES if f"| `{cls.__name__}(" not in text]
    assert not missing, missing


def test_every_estimator_is_tested_and_documented():
    text = (ROOT / "docs/objectives.md").read_text()
    for name in KL_ESTIMATORS:
        assert f"`{name}`" in text, name
    source = (ROOT / "tests/test_verl.py").read_text()
    assert all(f'"{name}"' in source for name in KL_ESTIMATORS)


def _jit_functions():
    for path in sorted((ROOT / "rlfuse" / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield f"{path.name}:{node.name}", len(node.args.args)


def test_no_kernel_takes_more_than_30_parameters():
    """A kernel's boolean options in one ``FLAGS`` word (``kernels.lib.utils.Flags``), its strides
    in tuples: every ``@triton.jit`` function stays readable at a glance."""
    wide = {name: n for name, n in _jit_functions() if n > 30}
    assert not wide, wide
    assert len(dict(_jit_functions())) > 40      # the scan found the kernels


def test_the_policy_loss_objective_takes_a_name_or_a_record():
    assert inspect.signature(rlfuse.policy_loss).parameters["objective"].default == "clip"
    with pytest.raises(TypeError, match="objective: expected a name or an instance"):
        O.as_objective(object())
    with pytest.raises(ValueError, match="objective: expected one of"):
        O.as_objective("tanh_clip")


def test_each_flag_reads_its_own_bit():
    """A kernel module's bits are unpacked by position beside its ``Flags``: each ``_NAME``
    constexpr is the bit the launcher packs for ``NAME``, and a launcher names every flag."""
    import importlib
    import pkgutil

    import rlfuse.kernels
    from rlfuse.kernels.lib.utils import Flags

    found = 0
    for info in pkgutil.walk_packages(rlfuse.kernels.__path__, "rlfuse.kernels."):
        module = importlib.import_module(info.name)
        for flags in (v for v in vars(module).values() if isinstance(v, Flags)):
            found += 1
            for i, name in enumerate(flags.names):
                assert getattr(module, f"_{name}").value == 1 << i, (info.name, name)
                assert flags.word(**{n: n == name for n in flags.names}) == 1 << i
            with pytest.raises(TypeError, match="flags"):
                flags.word(**{n: True for n in flags.names[1:]})
    assert found >= 3
