"""How the benchmark measures: the timed step of each mode, time, peak memory, copy bandwidth,
the plain GEMMs of a head."""
from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Callable, Optional, Tuple

import torch

QUANTILES = (0.5, 0.2, 0.8)


def make_step(forward: Callable, mode: str) -> Callable:
    """The callable that is timed. ``fwd``: the training forward (autograd recording, saves for
    backward). ``fwd+bwd``: forward, then the gradient w.r.t. the leaf. ``bwd``: the backward
    alone, again and again over ONE forward graph (``retain_graph=True``). Gradients come from
    ``torch.autograd.grad``, so nothing accumulates into ``.grad`` (that would add a read and a
    write of a logits-sized buffer to every step)."""
    if mode == "fwd":
        return forward
    if mode == "fwd+bwd":
        def step():
            outs, leaves = forward()
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
        return step
    if mode == "bwd":
        outs, leaf = forward()
        seeds = [torch.ones_like(o) for o in outs]
        return lambda: torch.autograd.grad(outs, leaf, seeds, retain_graph=True)
    raise ValueError(f"mode: expected fwd, bwd or fwd+bwd, got {mode!r}")


def synced(step: Callable, device: torch.device) -> Callable:
    """``step`` followed by a device synchronisation (for wall-clock timers)."""
    if device.type != "cuda":
        return step
    return lambda: (step(), torch.cuda.synchronize())


def time_ms(step: Callable, device: torch.device, *, warmup_ms: float = 25, rep_ms: float = 100,
            cpu_reps: int = 3) -> Tuple[float, float, float]:
    """(median, 20th, 80th percentile) in ms: ``triton.testing.do_bench`` on CUDA (which also
    flushes L2 between runs); on the CPU a warm-up call and the wall clock of ``cpu_reps``."""
    if device.type == "cuda":
        import triton.testing

        return tuple(triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms,
                                             quantiles=list(QUANTILES)))
    step()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    q = torch.tensor(times, dtype=torch.float64).quantile(torch.tensor(QUANTILES,
                                                                        dtype=torch.float64))
    return tuple(float(v) for v in q)


def peak_memory(step: Callable, device: torch.device) -> Optional[int]:
    """Bytes allocated by one ``step`` beyond what was allocated before it (inputs, and in bwd
    mode the forward graph): on CUDA the allocator's peak; on the CPU the highest running total
    of the allocations the profiler records during the step, less their frees (a buffer from
    before the step is not seen freed: in bwd mode an upper bound). Triton's interpreter keeps
    a kernel's temporaries in numpy, outside it, as a GPU keeps them in registers. None
    elsewhere."""
    if device.type == "cpu":
        return _cpu_peak(step)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - before)


def _cpu_peak(step: Callable) -> int:
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()        # no garbage from before the step freed during it
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0
    # the profiler's running total counts what was allocated before the step too
    before = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return int(max(e["args"]["Total Allocated"] for e in memory) - before)


def head_gemms_ms(rows: int, hidden: int, vocab: int, dtype: torch.dtype,
                  device: torch.device, **timing) -> float:
    """The median ms of the three plain GEMMs (cuBLAS on CUDA) a ``LinearHead`` training step
    needs at least, in ``dtype``: the logits ``[rows, H] x [H, V]``, then with their gradient
    ``dhidden = dlogits [rows, V] x [V, H]`` and ``dweight = dlogits^T x hidden`` ``[V, H]``."""
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, hidden, device=device, generator=gen).to(dtype)
    w = torch.randn(vocab, hidden, device=device, generator=gen).to(dtype)
    g = torch.randn(rows, vocab, device=device, generator=gen).to(dtype)

    def step():
        h @ w.t()
        g @ w
        g.t() @ h

    ms, _, _ = time_ms(step, device, **timing)
    return ms


def copy_bandwidth_GBps(device: torch.device, nbytes: Optional[int] = None) -> float:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time, over a buffer far
    larger than any cache (2 GiB on CUDA, 64 MiB on the CPU)."""
    nbytes = nbytes or ((2 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms, _, _ = time_ms(lambda: dst.copy_(src), device, cpu_reps=5)
    return 2 * nbytes / (ms * 1e-3) / 1e9
