"""TRL's Triton kernels (``trl/kernels``: its log-probs and entropy, its chunked head, its
chunked divergence) where TRL itself cannot be imported whole: TRL installed without its
dependencies (``pip install --no-deps`` of a carried wheel, on a GPU machine without internet)
lacks some of ``transformers``, ``accelerate``, ``datasets``, ``pandas``, ..., which
``trl.trainer.utils`` — what the kernels call into — imports. The package is then loaded
kernels only: ``trl`` and ``trl.trainer`` as bare packages over its folders (their
``__init__`` not run), ``trl.trainer.utils`` as what the kernels take from it (a head's ZeRO-3
gather, a null context on one GPU; TRL's chunk size, read from its source) and, without
``transformers``, its ``is_triton_available``. The kernels' own code is TRL's, unchanged.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path

CHUNK_SIZE = "_CHUNKED_LOGPROB_CHUNK_SIZE"


UTILS = "trl.trainer.utils"   # what the kernels import from TRL, at import or at call time


def load(module: str):
    """``module`` (one of ``trl.kernels``'), imported as usual where TRL's trainer utilities
    import, else from the installed package's files kernels only; raises ``ImportError`` where
    TRL is not installed."""
    if _kernels_only_loaded():
        return importlib.import_module(module)
    try:
        importlib.import_module(UTILS)
        return importlib.import_module(module)
    except Exception:  # noqa: BLE001  (ImportError, or TRL's lazy import's RuntimeError)
        pass
    for name in [m for m in sys.modules if m == "trl" or m.startswith("trl.")]:
        del sys.modules[name]                  # a failed import's half-made modules
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("TRL is not installed (pip install --no-deps a trl wheel)")
    root = Path(next(iter(spec.submodule_search_locations)))
    _stub_transformers()
    for name, folder in (("trl", root), ("trl.trainer", root / "trainer")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    utils = types.ModuleType(UTILS)
    utils.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
    size = re.search(rf"^{CHUNK_SIZE} = (\d+)$", (root / "trainer" / "utils.py").read_text(),
                     re.MULTILINE)
    setattr(utils, CHUNK_SIZE, int(size.group(1)))
    utils.KERNELS_ONLY = True
    sys.modules[UTILS] = sys.modules["trl.trainer"].utils = utils
    sys.modules["trl"].trainer = sys.modules["trl.trainer"]
    return importlib.import_module(module)


def _kernels_only_loaded() -> bool:
    return getattr(sys.modules.get(UTILS), "KERNELS_ONLY", False)


def _stub_transformers() -> None:
    """``transformers.utils.is_triton_available`` where ``transformers`` is not importable."""
    try:
        importlib.import_module("transformers.utils")
        return
    except ImportError:
        pass
    package = types.ModuleType("transformers")
    package.__path__ = []
    utils = types.ModuleType("transformers.utils")
    utils.is_triton_available = lambda: importlib.util.find_spec("triton") is not None
    package.utils = utils
    sys.modules["transformers"], sys.modules["transformers.utils"] = package, utils
