"""Every name and file a comment, a docstring or a page of the docs cites exists: a dotted name
in double backticks whose first part is one of the project's modules
(``head_functions.HeadParams``, ``rlfuse.kernels.lib.token_functions.token_function``) resolves
to an attribute (an installed package's name as that package's), a ``rlfuse.*`` name in the docs too, and a cited file of the project
(a ``.py`` file, or a path under one of its folders) is there. A moved or renamed piece of code
leaves no stale pointer behind."""
import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("rlfuse", "tools", "bench", "tests")
                 for p in (ROOT / folder).rglob("*.py"))
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FOLDERS = ("rlfuse", "tools", "bench")


def _modules():
    """{dotted module name: True} of every module of the project."""
    names = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules()
# the last parts by which a citation may name a module (``row_functions``,
# ``kernels.lib.row_functions``)
SUFFIXES = {}
for _name in MODULES:
    _parts = _name.split(".")
    for _i in range(len(_parts)):
        SUFFIXES.setdefault(".".join(_parts[_i:]), set()).add(_name)


def _resolves(citation: str) -> bool:
    """Some module named by a prefix of ``citation`` (an installed package's, or the last parts
    of one of the project's) has the rest as attributes."""
    parts = citation.split(".")
    for k in range(len(parts), 0, -1):
        for module in sorted(SUFFIXES.get(".".join(parts[:k]), ())) + [".".join(parts[:k])]:
            try:
                obj = importlib.import_module(module)
                for attr in parts[k:]:
                    obj = getattr(obj, attr)
            except SystemExit:     # a tool that refuses the interpreter: its top-level names
                if k == len(parts) or (len(parts) - k == 1 and
                                       parts[k] in _top_level_names(module)):
                    return True
                continue
            except (ImportError, AttributeError, ValueError):
                continue
            return True
    return False


def _top_level_names(module: str) -> set:
    tree = ast.parse((ROOT / (module.replace(".", "/") + ".py")).read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


CODE_CITATION = re.compile(r"``([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)``")
PAGE_CITATION = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
FILE_CITATION = re.compile(r"`((?:[\w.-]+/)*[\w.-]+\.(?:py|md|json|sh))`")
# where a cited file of the project may be: its folders, the package's subfolders
FILE_ROOTS = ("rlfuse", "tests", "tools", "bench", "docs", ".ci")


# what a page's name must start with to be a citation of the code: the package, its folders,
# the tools (a module's bare name is too common a word in prose: verl's ``policy_loss.*`` keys)
PAGE_PREFIXES = {"rlfuse", "tools", "bench", "_names", "_types", "_dispatch"} | {
    p.name for p in (ROOT / "rlfuse").iterdir() if p.is_dir() and p.name != "__pycache__"}


def _cited_names(path: Path):
    text = path.read_text()
    code = path.suffix == ".py"
    for name in (CODE_CITATION if code else PAGE_CITATION).findall(text):
        if name.rsplit(".", 1)[1] in ("json", "md", "py", "sh", "txt", "png", "sass"):
            continue                     # a file's name (``traffic.json``), not an attribute
        first = name.split(".")[0]
        if (code and first in SUFFIXES) or first in PAGE_PREFIXES:
            yield name


PACKAGE_FOLDERS = tuple(p.name for p in (ROOT / "rlfuse").iterdir() if p.is_dir())


def _project_file(cited: str) -> bool:
    """A bare ``.py`` name or a path under one of the project's folders (not an output file,
    not another package's path)."""
    first = cited.split("/")[0]
    return ("/" not in cited and cited.endswith(".py")) or first in FILE_ROOTS + PACKAGE_FOLDERS


def _file_exists(cited: str, near: Path) -> bool:
    bases = [ROOT, near.parent] + [ROOT / f for f in FILE_ROOTS]
    bases += [ROOT / "rlfuse" / f for f in PACKAGE_FOLDERS]
    return any((base / cited).exists() for base in bases)


@pytest.mark.parametrize("path", SOURCES + PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_citation_resolves(path):
    stale = sorted({n for n in _cited_names(path) if not _resolves(n)})
    text = path.read_text()
    missing = sorted({f for f in FILE_CITATION.findall(text)
                      if _project_file(f) and not _file_exists(f, path)})
    assert not stale and not missing, (stale, missing)


def test_the_check_catches_a_stale_citation():
    assert _resolves("kernels.lib.head_functions.HeadParams")
    assert _resolves("rlfuse.objectives.Clip")
    assert not _resolves("kernels.lib.row_functions.row_inv_temp")
    assert not _resolves("rlfuse._specs.KLTerm")
    assert _file_exists("kernels/lib/row_functions.py", ROOT / "docs" / "layout.md")
    assert not _file_exists("scaleout/vocab_op.py", ROOT / "docs" / "layout.md")
