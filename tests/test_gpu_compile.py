"""Every kernel compiles for a GPU (CUDA sm_90) without register spills: ``tools.gpu_compile``
in processes of its own (two at once, as the GPU check's warm-up runs it: each compiles its share
of the kernel variants, and the checks are over both), since this one runs the kernels through
the Triton interpreter."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _nvidia_backend():
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.slow
@pytest.mark.skipif(not _nvidia_backend(), reason="this triton has no NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite compiles and runs them")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")   # compile, don't reuse
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_compile", "--arch", "90", "--jobs",
                           "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "(2 process(es)); 0 failed" in proc.stdout
