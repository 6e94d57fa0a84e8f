"""rlfuse benchmarks: fused kernels against the eager reference, ``torch.compile(reference)`` and
Liger-Kernel, with the HBM floor of each op measured in the same run.

``python -m bench --help`` for the CLI, ``python -m bench.report`` for tables and plots,
``bench/README.md`` for how to run it on a GPU.
"""
import os
import warnings

import torch

if not torch.cuda.is_available():
    # Without a GPU the kernels run through the Triton interpreter, which must be chosen before
    # triton is imported (as in tests/conftest.py); otherwise "fused" would silently be the
    # reference fallback.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# As in pytest.ini: the interpreter runs kernels on numpy, which warns about IEEE results (log 0,
# inf/inf) in lanes that the kernels compute and then discard with tl.where.
warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
