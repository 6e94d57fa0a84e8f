"""Every kernel compiles for a GPU (CUDA sm_90) without register spills: ``tools.gpu_compile``
in processes of its own (two at once, as the GPU check's warm-up runs it: each compiles its share
of the kernel variants, and the checks are over both), since this one runs the kernels through
the Triton interpreter. The warm-up compiles the headline benchmark's own kernel variants."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import nvidia_backend, process_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite compiles and runs them")
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = process_env(drop=("TRITON_INTERPRET",),
                      TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))   # compile, don't reuse
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_compile", "--arch", "90", "--jobs",
                           "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "(2 process(es)); 0 failed" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU check compiles on the GPU itself")
def test_warmup_compiles_the_headlines_own_kernels(tmp_path):
    """The GPU check's warm-up drives the headline's cases with the keys they have in Triton's
    cache of compiled kernels when ``python -m bench --headline`` launches them (the kernel, its
    constexprs, the specialisation of its arguments): recorded without compiling, at two
    stand-in vocabularies (``tools.gpu_compile.headline_stand_in``), they are the same keys."""
    from bench import cases

    env = process_env(drop=("TRITON_INTERPRET",))
    out = tmp_path / "keys.json"
    proc = subprocess.run([sys.executable, "tests/launch_keys_worker.py", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    keys = json.loads(out.read_text())
    assert keys["bench_errors"] == []
    expected = {(op, mode) for op in cases.HEADLINE_OPS for mode in cases.HEADLINE_MODES
                if mode in cases.modes_for(cases.OPS[op], "fused")}
    assert {tuple(case) for case in keys["bench_cases"]} == expected
    warmup, bench = ({tuple(key) for key in keys[side]} for side in ("warmup", "bench"))
    assert bench and warmup == bench
