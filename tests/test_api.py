"""The public API and the package's shape: every public function and its reference twin (one
signature, one docstring that documents every argument), the dispatch and its fallback, every
launch under its tensors' device, and the
layout of ``rlfuse/`` (layers, no import cycle, no module above 500 lines, a reference that
speaks only of math)."""
import ast
import contextlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import rlfuse
from rlfuse._dispatch import Dispatch, use_kernels
from rlfuse.fused_losses import _op

PACKAGE = Path(rlfuse.__file__).parent
ROOT = PACKAGE.parent
PUBLIC_FUNCTIONS = sorted(name for name in rlfuse.__all__
                          if inspect.isfunction(getattr(rlfuse, name)) and name != "use_kernels")
LOSSES = ("ggpo_loss", "gppo_loss", "gr_opd_loss", "ppo_loss")


def test_every_public_function_has_a_reference_twin():
    assert set(PUBLIC_FUNCTIONS) == {"distill_loss", "ggpo_loss", "global_counts",
                                     "gppo_bounds", "gppo_loss",
                                     "gr_opd_advantages", "gr_opd_loss", "group_advantages",
                                     "head_logits", "kl_penalty", "packed_index",
                                     "policy_logprobs",
                                     "policy_loss", "ppo_loss", "token_divergence",
                                     "token_logprobs"}
    for name in PUBLIC_FUNCTIONS:
        fused, ref = getattr(rlfuse, name), getattr(rlfuse.reference, name)
        assert inspect.signature(fused) == inspect.signature(ref), name
        assert getattr(fused, "reference", ref) is ref, name


def _arguments_section(doc: str) -> dict:
    """{argument name: its text} of a docstring's ``Args:`` section (``a:`` or ``a, b, c:``
    entries, continued on deeper-indented lines)."""
    entries, current = {}, None
    for line in doc.split("Args:", 1)[1].splitlines()[1:]:
        if line.strip() and not line.startswith(" " * 8):
            break
        m = re.match(r"^ {8}([a-z_][a-z_0-9, ]*):(.*)", line)
        if m:
            current = [m.group(2)]
            for name in m.group(1).split(","):
                entries[name.strip()] = current
        elif current is not None:
            current.append(line.strip())
    return {name: " ".join(text) for name, text in entries.items()}


@pytest.mark.parametrize("name", PUBLIC_FUNCTIONS)
def test_the_docstring_documents_every_argument(name):
    """Each public function's docstring (written once, on its definition in ``rlfuse.api``)
    names every argument of its signature in its ``Args:`` section, and no argument it does
    not take: the docs cannot drift from the code."""
    fn = getattr(rlfuse, name)
    assert fn.__doc__ and "Args:" in fn.__doc__, name
    assert set(_arguments_section(fn.__doc__)) == set(inspect.signature(fn).parameters), name


@pytest.mark.parametrize("name", LOSSES)
def test_every_loss_documents_every_policy_form(name):
    text = _arguments_section(getattr(rlfuse, name).__doc__)["policy"]
    for form in ("[B, T]", "rlfuse.Logits", "rlfuse.LinearHead"):
        assert form in text, (name, form)


@pytest.mark.parametrize("name", [n for n in PUBLIC_FUNCTIONS if hasattr(rlfuse.api, n)])
def test_one_definition_behind_both_implementations(name):
    """``rlfuse.<name>`` and ``rlfuse.reference.<name>`` are one definition of ``rlfuse.api``
    bound to two implementations: one signature, one docstring."""
    fused, twin = getattr(rlfuse, name), getattr(rlfuse.reference, name)
    definition = getattr(rlfuse.api, name)
    assert inspect.signature(fused) == inspect.signature(twin)
    assert fused.__doc__ == twin.__doc__ == definition.__doc__
    if name != "group_advantages":   # no implementation: the same function in both
        assert fused.__code__ is twin.__code__ is definition.__code__


def test_the_dispatch_picks_the_reference_off_the_kernels_devices(monkeypatch):
    """The kernels run where ``use_kernels`` says, the reference for everything else (another
    device, an argument that is no tensor or policy: the reference's checks name it)."""
    dispatch = Dispatch(fused="kernels", reference="reference")

    def picked(x):
        with dispatch.on(x) as (run, _):
            return run

    monkeypatch.setattr(rlfuse._dispatch, "INTERPRET", False)
    x = torch.zeros(2, 3)
    assert picked(x) == "reference" and picked([1, 2]) == "reference"
    monkeypatch.setattr(rlfuse._dispatch, "INTERPRET", True)
    assert picked(x) == "kernels"
    assert picked(rlfuse.Logits(torch.zeros(1, 2, 3), torch.zeros(1, 2))) == "kernels"
    assert picked("not a tensor") == "reference"
    with Dispatch(None, "reference").on(x) as (run, _):   # without Triton
        assert run == "reference"


def test_use_kernels_takes_a_device_or_its_name():
    for device in ("cpu", torch.device("cpu"), "meta"):
        assert use_kernels(device) == use_kernels(torch.device(device))
    assert use_kernels("cuda") and use_kernels("cuda:1")     # CUDA runs the kernels
    assert not use_kernels("meta")
    with pytest.raises(RuntimeError):
        use_kernels("not a device")


def _without_the_interpreter(*args: str) -> str:
    """What ``python *args`` prints in a process without TRITON_INTERPRET."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          check=True).stdout


def test_without_the_interpreter_the_cpu_runs_the_reference():
    """On the CPU without TRITON_INTERPRET, calls fall back to the reference, the same results,
    silently (``-W error``: no warning): the CPU's documented path."""
    code = ("import torch, rlfuse; print(rlfuse.use_kernels('cpu')); "
            "x = torch.randn(2, 3, 5); y = torch.randint(0, 5, (2, 3)); "
            "print(torch.equal(rlfuse.token_logprobs(x, y), "
            "rlfuse.reference.token_logprobs(x, y)))")
    assert _without_the_interpreter("-W", "error", "-c", code).split() == ["False", "True"]


def test_the_interpreter_asked_for_too_late_warns_once():
    """``TRITON_INTERPRET=1`` set after ``import rlfuse`` cannot run the kernels: the
    reference runs (the same results) and says so once, not at every call."""
    code = ("import os, warnings, torch, rlfuse; os.environ['TRITON_INTERPRET'] = '1'; "
            "x = torch.randn(2, 3, 5); y = torch.randint(0, 5, (2, 3))\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    same = [torch.equal(rlfuse.token_logprobs(x, y), "
            "rlfuse.reference.token_logprobs(x, y)) for _ in range(2)]\n"
            "print(all(same), len(caught)); print(caught[0].message)")
    same, told, message = _without_the_interpreter("-c", code).strip().split(maxsplit=2)
    assert (same, told) == ("True", "1")
    assert "reference, not its fused kernels: TRITON_INTERPRET=1 was set after rlfuse was " \
           "imported" in message


def test_fallback_reasons(monkeypatch):
    """Where the kernels were expected (tensors on an accelerator) but cannot run, the fallback
    has a reason; where they run, or on the CPU without the interpreter, none."""
    from rlfuse import _dispatch

    assert _dispatch.fallback_reason(torch.device("cuda")) is None
    assert _dispatch.fallback_reason(torch.device("cpu")) is None      # interpreted here
    assert "tensors on mps" in _dispatch.fallback_reason(torch.device("mps"))
    monkeypatch.setattr(_dispatch, "HAVE_TRITON", False)
    assert "triton is not importable" in _dispatch.fallback_reason(torch.device("cuda"))
    monkeypatch.setattr(_dispatch, "HAVE_TRITON", True)
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "set after rlfuse was imported" in _dispatch.fallback_reason(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _dispatch.fallback_reason(torch.device("cpu")) is None


def test_without_triton_the_reference_runs_every_call():
    """A platform without Triton imports rlfuse and runs the reference (one guarded import)."""
    code = ("import sys; sys.modules['triton'] = None; import rlfuse, torch; "
            "assert not rlfuse.use_kernels('cuda'); "
            "assert rlfuse._dispatch.FUSED is None; "
            "x = -torch.rand(2, 3, requires_grad=True); "
            "out = rlfuse.gppo_loss(x, x.detach(), torch.ones(2), torch.ones(2, 3, dtype=bool)); "
            "out.loss.backward(); print(rlfuse.GPPOLoss()(x, x.detach(), torch.ones(2), "
            "torch.ones(2, 3, dtype=bool)).loss.item() == out.loss.item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_every_launch_runs_under_its_tensors_device(monkeypatch, device):
    """Triton launches on the current device: every op's implementation makes its tensors'
    device current first. Checked with a fake device context that records the device entered
    and a launcher that records the device current at each launch."""
    current = []
    launches = []

    @contextlib.contextmanager
    def fake_guard(dev):
        current.append(dev)
        try:
            yield
        finally:
            current.pop()

    def recording(run):
        def launch(self, *args, **kwargs):
            dev = next(a.device for a in args if isinstance(a, torch.Tensor))
            launches.append((self.__name__, current[-1] if current else None, dev))
            return run(self, *args, **kwargs)
        return launch

    if device.type == "cuda":
        pytest.skip("the interpreter's launcher is what is recorded")
    monkeypatch.setattr(_op, "device_guard", fake_guard)
    monkeypatch.setattr(InterpretedFunction, "run", recording(InterpretedFunction.run))

    gen = torch.Generator().manual_seed(3)
    B, T, V = 4, 3, 9
    logits = torch.randn(B, T, V, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    old = -torch.rand(B, T, generator=gen)
    adv = torch.randn(B, generator=gen)
    lp = old.clone().requires_grad_(True)
    for policy in (lp, rlfuse.Logits(logits, targets)):
        rlfuse.ggpo_loss(policy, old, adv, mask, group_size=2, beta=0.5).loss.backward()
        rlfuse.gppo_loss(policy, old, adv, mask).loss.backward()
        rlfuse.gr_opd_loss(policy, old, old - 0.5, mask, group_size=2).loss.backward()
    rlfuse.token_logprobs(logits, targets, return_entropy=True)[1].sum().backward()
    rlfuse.gppo_bounds(old, geometry="kl", topology="binary", delta=0.1)
    rlfuse.gr_opd_advantages(old, old - 0.5, mask, group_size=2)
    kernels = {name for name, _, _ in launches}
    assert len(kernels) >= 10, kernels
    for name, guard, dev in launches:
        assert guard == dev, (name, guard, dev)


# --------------------------------------------------------------------------------------------
# The package's shape
# --------------------------------------------------------------------------------------------

def _modules():
    """{module name: path} of every module of ``rlfuse``."""
    return {"rlfuse." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).replace(
        ".__init__", ""): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, node, level_module: str) -> list:
    """The rlfuse modules an import statement of ``module`` (a package when it is one) imports:
    ``from . import x`` of a submodule ``x`` counts as importing it."""
    modules = _modules()
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("rlfuse")]
    base = level_module.split(".")
    if node.level:
        base = base[:len(base) - node.level + (1 if module in _packages() else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("rlfuse"):
        return []
    found = [target]
    for alias in node.names:
        if f"{target}.{alias.name}" in modules:
            found.append(f"{target}.{alias.name}")
    return found


def _packages():
    return {name for name, path in _modules().items() if path.name == "__init__.py"}


def import_graph():
    """{module: modules it imports at its top level or in functions}, including each parent
    package (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``) but the module's own
    (which are being imported already when it runs)."""
    graph = {}
    for name, path in _modules().items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _resolve(name, node, name):
                    parts = target.split(".")
                    edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        graph[name] = {e for e in edges if e in _modules() and e not in own}   # own packages:
    return graph                                                              # already running


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_layers():
    """The checks, names and shared math sit below both paths; the reference imports neither
    kernels nor fused code, and the fused path imports the reference only as the twins it
    falls back to (and the docstrings they carry); the kernels import neither."""
    graph = import_graph()
    for module, imports in graph.items():
        if module.startswith("rlfuse.reference"):
            assert not {i for i in imports if i.startswith(
                ("rlfuse.kernels", "rlfuse.fused_losses", "rlfuse.integrations",
                 "rlfuse._dispatch"))}, module
        if module.startswith("rlfuse.kernels"):
            assert all(i.startswith(("rlfuse.kernels", "rlfuse._names", "rlfuse._types"))
                       for i in imports), (module, imports)
        if module.startswith(("rlfuse.checks.values", "rlfuse._names", "rlfuse._types")):
            assert not imports - {"rlfuse._names", "rlfuse._types", "rlfuse.checks",
                                  "rlfuse.checks.values"}, module
        if module.startswith(("rlfuse.checks", "rlfuse.shared", "rlfuse.scaleout")):
            assert not {i for i in imports if i.startswith(
                ("rlfuse.kernels", "rlfuse.fused_losses", "rlfuse.reference"))}, module


def room(module: str) -> str:
    """The folder (``rlfuse.<package>``) or top-level module a module belongs to."""
    return ".".join(module.split(".")[:2])


def test_no_cycle_between_packages():
    """Folded into their folders (``rlfuse.kernels``, ``rlfuse.scaleout``, ...) and top-level
    modules, the imports form no cycle: every folder stands above or below every other."""
    rooms = {}
    for module, imports in import_graph().items():
        rooms.setdefault(room(module), set()).update(
            room(i) for i in imports if room(i) != room(module) and i != "rlfuse")
    reach = {r: set(edges) for r, edges in rooms.items()}
    changed = True
    while changed:
        changed = False
        for r in reach:
            more = set().union(*(reach.get(n, set()) for n in reach[r])) - reach[r]
            if more:
                reach[r] |= more
                changed = True
    assert not [r for r in reach if r in reach[r]], {r: sorted(rooms[r]) for r in reach
                                                    if r in reach[r]}


def test_no_module_above_450_lines():
    for name, path in _modules().items():
        assert len(path.read_text().splitlines()) <= 450, name


def test_no_folder_above_12_modules():
    """Folders by kind (``kernels/lib``, ``rows``, ``tokens``, ``tiles``; ``fused_losses/logits``,
    ``head``; ``integrations/trl``, ``verl``): each a room a reader takes in at once."""
    folders = {}
    for path in PACKAGE.rglob("*.py"):
        folders.setdefault(path.parent, []).append(path.name)
    crowded = {str(f.relative_to(PACKAGE)): len(names) for f, names in folders.items()
               if len(names) > 12}
    assert not crowded, crowded
    assert len(folders) >= 12       # the walk found the folders


def test_the_tools_import_no_cycle():
    """``tools/``: the modules they take from each other (at the top or in a function) form no
    cycle (``compile_only`` under ``gpu_compile`` and ``sass``)."""
    tools = {p.stem: p for p in (ROOT / "tools").glob("*.py") if p.stem != "__init__"}
    graph = {name: set() for name in tools}
    for name, path in tools.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "tools":
                graph[name] |= {a.name for a in node.names if a.name in tools}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tools."):
                graph[name].add(node.module.split(".")[1])
    reach = {n: set(e) for n, e in graph.items()}
    for _ in tools:
        for n in reach:
            reach[n] |= set().union(*(reach[m] for m in reach[n]))
    assert not [n for n in reach if n in reach[n]], graph


def test_tests_and_bench_import_by_package():
    """Nothing under ``tests/``, ``bench/`` or ``tools/`` edits ``sys.path`` or loads a module
    from a file path: a process started from a test gets the repository root on ``PYTHONPATH``."""
    for folder in ("tests", "bench", "tools"):
        for path in sorted((ROOT / folder).glob("*.py")):
            text = path.read_text()
            for word in ("sys.path", "spec_from_file_location", "SourceFileLoader"):
                assert word not in text or path.name == "test_api.py", (str(path), word)


def test_the_reference_holds_only_math():
    """``reference/`` never mentions kernels, Triton or the fused path."""
    for path in sorted((PACKAGE / "reference").glob("*.py")):
        text = path.read_text().lower()
        for word in ("kernel", "triton", "fused"):
            assert word not in text, (path.name, word)


def test_one_switch_for_a_missing_triton():
    """Only the kernels import Triton, every module imports the kernels at its top (no import
    inside a function guards a missing Triton), and one module decides whether the fused
    modules are imported at all (``rlfuse._dispatch``)."""
    modules = _modules()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            if any(t.split(".")[0] == "triton" for t in targets):
                assert name.startswith("rlfuse.kernels"), name
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, ast.ImportFrom):
                        assert "kernels" not in (node.module or ""), (name, function.name)
    importers = {name for name, imports in import_graph().items()
                 if any(i.startswith("rlfuse.fused_losses") for i in imports)
                 and not name.startswith("rlfuse.fused_losses")}
    assert importers == {"rlfuse._dispatch"}


def test_the_package_metadata():
    """One version, written in ``rlfuse/_version.py`` (``setup.py`` reads it there); the
    license ``setup.py`` declares in ``LICENSE``; a changelog; ``py.typed`` shipped; numpy a
    dependency (Triton's interpreter runs on it); the Python torch >= 2.10 supports."""
    setup = (ROOT / "setup.py").read_text()
    written = [p for p in PACKAGE.rglob("*.py") if '__version__ = "' in p.read_text()]
    assert written == [PACKAGE / "_version.py"]
    assert '"rlfuse" / "_version.py"' in setup and "version=VERSION" in setup
    assert f"\n## {rlfuse.__version__}\n" in (ROOT / "CHANGELOG.md").read_text()
    assert 'license="Apache-2.0"' in setup
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert (PACKAGE / "py.typed").is_file() and '"rlfuse": ["py.typed"]' in setup
    assert '"numpy"' in setup.split("install_requires=")[1].split("]")[0]
    assert 'python_requires=">=3.10"' in setup


def test_loss_modules_hold_their_hyper_parameters(device):
    """``PolicyLoss`` and ``DistillLoss`` are their functions with the module's
    hyper-parameters, which are attributes: set between calls, they take effect, and the
    module's repr shows them."""
    from rlfuse.divergences import JSD

    g = torch.Generator().manual_seed(3)
    B, T, V = 4, 5, 37
    logits = torch.randn(B, T, V, generator=g).to(device).requires_grad_()
    teacher = torch.randn(B, T, V, generator=g).to(device)
    targets = torch.randint(0, V, (B, T), generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) < 0.8).to(device)
    old = -torch.rand(B, T, generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    policy = rlfuse.Logits(logits, targets)
    module = rlfuse.PolicyLoss("cispo", agg="token-mean")
    assert torch.equal(module(policy, old, adv, mask).loss,
                       rlfuse.policy_loss(policy, old, adv, mask, "cispo", agg="token-mean").loss)
    module.objective = "clip"
    assert torch.equal(module(policy, old, adv, mask).loss,
                       rlfuse.policy_loss(policy, old, adv, mask, "clip", agg="token-mean").loss)
    assert "objective='clip'" in repr(module) and "agg='token-mean'" in repr(module)
    models = (policy, rlfuse.Logits(teacher, targets))
    distill = rlfuse.DistillLoss(JSD(0.5))
    assert torch.equal(distill(*models, mask).loss,
                       rlfuse.distill_loss(*models, mask, JSD(0.5)).loss)
    distill.divergence, distill.agg = JSD(0.9), "token-sum"
    assert torch.equal(distill(*models, mask).loss,
                       rlfuse.distill_loss(*models, mask, JSD(0.9), agg="token-sum").loss)
