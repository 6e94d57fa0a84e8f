"""Triton's driver replaced by one that compiles and does not launch, for a GPU that is not
there: what ``tools.gpu_compile`` and ``tools.sass`` both drive the public API through.

``install(arch)`` makes every ``JITFunction`` launch compile its kernel for CUDA ``sm_<arch>``
(recorded in ``COMPILED``, a failure in ``FAILED``) and return without running, CPU tensors take
the kernel path, and kernel outputs are zero-filled so the host-side logic goes on; with
``SHARD`` set, a process compiles only its share of the variants; ``install(arch,
keys_only=True)`` compiles nothing and records each launch's key in Triton's cache of compiled
kernels (``KEYS``: the kernel, its arguments' specialisation and its options, as Triton 3.3+
computes it). It must run in a process of its own, without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import traceback
import zlib

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

COMPILED = {}     # (kernel name, hash) -> (compiled kernel, its constexpr arguments)
FAILED = []       # (kernel, error)
SHARD = [0, 1]    # [this process's share, the number of shares]
KEYS = []         # (kernel name, cache key) of each launch, with keys_only


class CompileOnlyDriver:
    """What ``JITFunction.run`` asks of the active driver, for a GPU that is not there."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


def _share(name: str, args: tuple, kwargs: dict) -> int:
    """The share (of ``SHARD``) a launch belongs to, from what its compiled variant depends on
    (the kernel, its tensors' dtypes, its constexpr and launch options; not the runtime values):
    every launch of one variant falls in one share, so no variant is compiled twice."""
    def kind(key, v):
        if isinstance(v, torch.Tensor):
            return str(v.dtype)
        if isinstance(v, tuple):
            return "(" + ",".join(kind("", x) for x in v) + ")"
        return repr(v) if key.isupper() or key.startswith("num_") else type(v).__name__
    parts = [name] + [kind("", v) for v in args] + [f"{k}={kind(k, v)}"
                                                    for k, v in sorted(kwargs.items())]
    return zlib.crc32(" ".join(parts).encode()) % SHARD[1]


def compile_only(run):
    """``JITFunction.run`` made to compile each launch (this process's share) and return the
    compiled kernel, or None."""
    def compile_run(self, *args, grid, warmup, **kwargs):
        if SHARD[1] > 1 and _share(self.fn.__name__, args, kwargs) != SHARD[0]:
            return None                        # another process's share
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as e:  # noqa: BLE001  (recorded, the drive goes on)
            FAILED.append((self.fn.__name__, f"{type(e).__name__}: {e} <- {e.__cause__!r}"))
            traceback.print_exc()
            return None
        constexprs = {k: str(v) for k, v in kwargs.items() if k.isupper()}
        COMPILED.setdefault((self.fn.__name__, kernel.hash), (kernel, constexprs))
        return kernel
    return compile_run


def target_gpu(arch: int):
    """(SMs, L2 bytes) of the GPU the kernels are compiled for, which size the single pass's
    grid and its registers (``single_pass.SinglePassConfig.grid``): this machine's GPU, else
    the first of ``tools.gpus.GPUS`` of that arch (the H200 for sm_90)."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.multi_processor_count, props.L2_cache_size
    from tools.gpus import GPUS

    gpu = next(gpu for gpu in GPUS if gpu.arch == arch)
    return gpu.sms, gpu.l2_mib * 2 ** 20


def launch_key(self, *args, grid, warmup, **kwargs):
    """``JITFunction.run`` made to record the launch's key in the kernel's cache (``KEYS``) and
    return None: two launches with one key run one compiled kernel."""
    from triton.runtime.jit import compute_cache_key

    *_, binder = self.device_caches[driver.active.get_current_device()]
    _, specialization, options = binder(*args, **kwargs)
    KEYS.append((self.fn.__name__, compute_cache_key({}, specialization, options)))


def install(arch: int, wrap=None, keys_only: bool = False) -> None:
    """The compile-only driver for ``sm_<arch>``, every launch through ``compile_only`` (and
    then ``wrap(compile_run)``, when given) or, ``keys_only``, ``launch_key``; CPU tensors on
    the kernel path, kernel outputs zero-filled (the launches write nothing); the single pass's
    grid sized for the GPU (``target_gpu``)."""
    import rlfuse._dispatch
    from rlfuse.kernels.rows import single_pass
    from rlfuse.kernels.lib import utils

    single_pass.INTERPRETER_SM_COUNT, single_pass.INTERPRETER_L2_BYTES = target_gpu(arch)

    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    run = launch_key if keys_only else compile_only(JITFunction.run)
    JITFunction.run = run if wrap is None else wrap(run)
    rlfuse._dispatch.INTERPRET = True
    utils.OUTPUT_FILL = 0


def resources(kernel) -> dict:
    """Registers and local memory per thread of the kernel's cubin (``cuobjdump``)."""
    cuobjdump = shutil.which("cuobjdump") or os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], text=True,
                              capture_output=True, check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()}
