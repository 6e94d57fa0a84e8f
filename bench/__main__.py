"""``python -m bench``: time every (op, shape, implementation, mode), measure the copy bandwidth
in the same run, write one results JSON and render it (markdown table, PNG plot).

Examples::

    python -m bench                                  # the full grid (on a GPU)
    python -m bench --op token_logprobs,gppo_logits --N 16384 --V 151936
    python -m bench --headline                       # the GPU check's cases
    TRITON_INTERPRET=1 python -m bench --quick       # CPU smoke through the Triton interpreter

The byte counts and the SASS counts of the same cases are development tools:
``python -m tools.traffic``, ``python -m tools.sass``.

On a GPU results go to ``bench/results/<gpu>-<commit>.json`` (or ``$OUT``); on the CPU to a
temporary directory unless ``--out`` is given: speed claims come from GPU runs only.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import rlfuse  # bench/__init__.py has chosen the Triton interpreter on a CPU-only machine
from rlfuse._dispatch import use_kernels

from . import cases, measure, report

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
def _split(values, convert=str):
    """Repeatable and comma-separated options: ``--op a,b --op c`` -> [a, b, c]."""
    return [convert(v) for value in values or () for v in value.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", action="append",
                   help=f"op(s), repeatable or comma list (default all: {', '.join(cases.OPS)})")
    p.add_argument("--impls", action="append",
                   help=f"implementation(s) of {', '.join(cases.IMPLS)} (default: all on CUDA; "
                        "fused, reference on the CPU)")
    p.add_argument("--mode", action="append", help="fwd, bwd, fwd+bwd (default all)")
    p.add_argument("--dtype", action="append",
                   help="logits dtype(s): bf16, fp16, fp32 (default bf16 + fp32 at one shape)")
    p.add_argument("--N", action="append", help="tokens B*T (default 16384,4096; B = 16)")
    p.add_argument("--V", action="append", help="vocabulary (default 151936,128256,32000)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke run")
    p.add_argument("--hidden", type=int, default=None,
                   help="H of the LinearHead ops (default 4096; 32 with --quick)")
    p.add_argument("--headline", action="store_true",
                   help="the headline cases only (what the GPU check runs): N 16384, V 151936, "
                        "bf16, fwd and fwd+bwd, every op on logits or a LinearHead (H 4096), "
                        "token_logprobs, gppo_logits and gppo_head first; --N/--V/--dtype/--op/"
                        "--mode still override")
    p.add_argument("--out", help="directory for the results (default: bench/results, or $OUT "
                                 "when set; on the CPU a temporary directory)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new cases after this many seconds (results so far kept)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench rep (CUDA)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup (CUDA)")
    p.add_argument("--cpu-reps", type=int, default=None,
                   help="timed repeats on the CPU (default 3; 2 with --quick)")
    p.add_argument("--memory", action="store_true",
                   help="peak memory only: one untimed step per case (no times, no floors)")
    p.add_argument("--compile-all", action="store_true",
                   help="torch.compile the reference at every shape (default: at each op's "
                        "first shape only; compilation time dominates)")
    p.add_argument("--no-validate", action="store_true",
                   help="pass validate=False to the losses (skips the [B, T] value checks)")
    p.add_argument("--no-report", action="store_true", help="write the JSON only")
    p.add_argument("--commit", help="commit to record (default: $RLFUSE_COMMIT, else git)")
    args = p.parse_args(argv)
    if args.headline:
        args.op = args.op or [",".join(cases.HEADLINE_OPS)]
        args.mode = args.mode or [",".join(cases.HEADLINE_MODES)]
        args.N = args.N or [str(cases.HEADLINE.N)]
        args.V = args.V or [str(cases.HEADLINE.V)]
        args.dtype = args.dtype or [str(cases.HEADLINE.dtype).replace("torch.", "")]
    args.op = _split(args.op) or list(cases.OPS)
    for name in args.op:
        if name not in cases.OPS:
            p.error(f"--op: unknown op {name!r}; expected some of {', '.join(cases.OPS)}")
    args.mode = _split(args.mode) or list(cases.MODES)
    for mode in args.mode:
        if mode not in cases.MODES:
            p.error(f"--mode: expected some of {', '.join(cases.MODES)}, got {mode!r}")
    args.impls = _split(args.impls)
    for impl in args.impls:
        if impl not in cases.IMPLS:
            p.error(f"--impls: expected some of {', '.join(cases.IMPLS)}, got {impl!r}")
    try:
        args.dtype = [DTYPES[d] for d in _split(args.dtype)]
    except KeyError as e:
        p.error(f"--dtype: expected some of {', '.join(DTYPES)}, got {e.args[0]!r}")
    args.N, args.V = _split(args.N, int), _split(args.V, int)
    if args.cpu_reps is None:
        args.cpu_reps = 2 if args.quick else 3
    args.commit = args.commit or _git_commit()
    return args


def _git_commit() -> str:
    """$RLFUSE_COMMIT when set (the device machines get a copy of the tree without .git), else
    git's short hash, "-dirty" with uncommitted changes to tracked files."""
    if os.environ.get("RLFUSE_COMMIT"):
        return os.environ["RLFUSE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _fused_backend(device: torch.device) -> str:
    if not use_kernels(device):
        return "reference fallback (set TRITON_INTERPRET=1 before importing rlfuse)"
    return "triton" if device.type == "cuda" else "triton interpreter"


def run(args, checkpoint=None) -> dict:
    """The whole benchmark; returns ``{"header": ..., "rows": [...]}``. ``checkpoint(results)``
    is called after every (shape, op, impl) case, so a run killed from outside keeps its rows."""
    t_start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    notes, errors, missing = [], [], {}
    impls = args.impls or (list(cases.IMPLS) if device.type == "cuda" else ["fused", "reference"])
    if device.type != "cuda" and not args.impls:
        notes.append("CPU: compiled, liger and trl not run (name them in --impls to force)")
    libs = {}
    for impl in impls:
        try:
            libs[impl] = cases.load_impl(impl)
        except Exception as e:   # an optional peer not installed or broken: a note, no rows
            missing[impl] = f"{type(e).__name__}: {e}"
    if device.type == "cuda" and hasattr(torch, "_dynamo"):
        # One compiled graph per shape (dynamic=False); --compile-all needs more than 8.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    shapes = cases.make_shapes(args.N, args.V, args.dtype, quick=args.quick,
                               hidden=args.hidden)
    ops = [cases.OPS[name] for name in args.op]
    plan, compiled_at = [], {}
    for shape in shapes:
        for op in ops:
            if op.from_logits != (shape.V is not None):
                continue
            for impl in libs:
                if impl == "compiled" and not args.compile_all:
                    if compiled_at.setdefault(op.name, shape) != shape:
                        continue
                plan.append((shape, op, impl))
    for op_name, shape in compiled_at.items():
        notes.append(f"compiled: {op_name} at {shape} only (--compile-all for every shape)")
    # Compilation takes longest and matters least: the compiled cases go last, so a time budget
    # drops them first.
    plan.sort(key=lambda case: case[2] == "compiled")

    bandwidth = measure.copy_bandwidth_GBps(device)
    timing = None if args.memory else dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                                           cpu_reps=args.cpu_reps)
    gemms = {}       # "rows x H x V dtype" -> ms of the plain GEMMs of a head's step

    def gemm_ms(shape, rows: int) -> float:
        key = f"{rows}x{shape.hidden}x{shape.V} {str(shape.dtype).replace('torch.', '')}"
        if key not in gemms:
            gemms[key] = measure.head_gemms_ms(rows, shape.hidden, shape.V, shape.dtype, device,
                                               **timing)
        return gemms[key]

    rows, truncated = [], False

    def results():
        return {"header": {
            "gpu": _device_name(device), "device": device.type, "torch": torch.__version__,
            "triton": _triton_version(), "rlfuse": rlfuse.__version__,
            "commit": args.commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "copy_bandwidth_GBps": bandwidth, "head_gemms_ms": gemms,
            "missing_impls": missing,
            "fused_backend": _fused_backend(device),
            "layout": {"B": shapes[0].batch, "group_size": shapes[0].group_size,
                       "mask": "padded responses, ~85% actor tokens"},
            "timing": "none: peak memory only (--memory)" if args.memory else (
                       f"triton.testing.do_bench median, p20, p80 (warmup {args.warmup_ms:g} ms, "
                       f"rep {args.rep_ms:g} ms)" if device.type == "cuda" else
                       f"wall clock, median of {args.cpu_reps} after one warm-up"),
            "validate": not args.no_validate, "truncated": truncated,
            "elapsed_s": round(time.monotonic() - t_start, 1), "notes": notes, "errors": errors,
        }, "rows": rows}

    print(f"# {_device_name(device)}: copy bandwidth {bandwidth:.0f} GB/s; fused = "
          f"{_fused_backend(device)}; {len(plan)} (shape, op, impl) cases", flush=True)
    if checkpoint is not None:
        checkpoint(results())
    x, x_shape = None, None
    for shape, op, impl in plan:
        if args.budget_s is not None and time.monotonic() - t_start > args.budget_s:
            truncated = True
            notes.append(f"time budget of {args.budget_s:.0f} s spent: cases from {op.name} "
                         f"{impl} at {shape} on were not run")
            break
        if shape != x_shape:
            x = None
            _free(device)
            x, x_shape = cases.make_inputs(shape, device, validate=not args.no_validate), shape
        forward = cases.forward_fn(op, impl, libs[impl], x)
        if forward is None:
            continue
        for mode in args.mode:
            if mode not in cases.modes_for(op, impl):
                continue
            where = f"{op.name} {impl} {mode} at {shape}"
            try:
                row = _measure(timing, device, bandwidth, gemm_ms, shape, op, impl, mode,
                               forward, int(x.mask.sum()))
            except OOM:
                notes.append(f"{where}: out of memory, skipped")
                _free(device)
                continue
            except Exception as e:  # noqa: BLE001  (recorded; the run goes on)
                traceback.print_exc()
                errors.append(f"{where}: {type(e).__name__}: {e}")
                _free(device)
                continue
            rows.append(row)
            print(f"{op.name:24s} {impl:9s} {mode:7s} {str(shape):32s} " + (
                f"peak {row['peak_mem_bytes'] / 2 ** 20:10.1f} MiB" if timing is None else
                f"{row['ms']:10.4f} ms  floor {row['fraction_of_floor']:6.1%}"), flush=True)
        if checkpoint is not None:
            checkpoint(results())
    x = None
    _free(device)
    return results()


def _measure(timing, device, bandwidth, gemm_ms, shape, op, impl, mode, forward, actor_rows
             ) -> dict:
    step = measure.make_step(forward, mode)
    dtype = str(shape.dtype).replace("torch.", "")
    if timing is None:     # --memory
        return {"op": op.name, "impl": impl, "mode": mode, "dtype": dtype, "N": shape.N,
                "V": shape.V, "actor_rows": actor_rows, "ms": None, "ms_p20": None,
                "ms_p80": None, "peak_mem_bytes": measure.peak_memory(step, device),
                "floor_ms": None, "fraction_of_floor": None, "bytes": None, "flops": None,
                "floor_ms_dense": None, "fraction_of_floor_dense": None, "bytes_dense": None,
                "GBps": None, "TFLOPs": None}
    ms, p20, p80 = measure.time_ms(step, device, **timing)
    peak = measure.peak_memory(step, device)

    def floor(rows):
        """(bytes, flops, ms): the minimal HBM bytes over the copy bandwidth, or for the
        LinearHead ops the time of plain GEMMs of their matmuls (``rows`` of the head)."""
        nbytes, flops = op.bytes(shape, mode, rows), op.flops(shape, mode, rows)
        if flops is None:
            return nbytes, flops, nbytes / (bandwidth * 1e9) * 1e3
        # the three GEMMs timed, scaled to the op's matmuls (distillation: the teacher's too)
        gemms = gemm_ms(shape, shape.N if rows is None else rows) * op.matmuls[mode] / 3
        return nbytes, flops, gemms

    # the floor of the actor rows (masked rows: one write of zeros), and the dense one (every
    # row read and written as an actor's)
    nbytes, flops, floor_ms = floor(actor_rows)
    dense_bytes, _, dense_ms = floor(None)
    return {"op": op.name, "impl": impl, "mode": mode, "dtype": dtype, "N": shape.N,
            "V": shape.V, "actor_rows": actor_rows, "ms": ms, "ms_p20": p20, "ms_p80": p80,
            "peak_mem_bytes": peak, "floor_ms": floor_ms,
            "fraction_of_floor": floor_ms / ms if ms > 0 else None, "bytes": nbytes,
            "flops": flops, "floor_ms_dense": dense_ms,
            "fraction_of_floor_dense": dense_ms / ms if ms > 0 else None,
            "bytes_dense": dense_bytes,
            # the floor's bytes (or FLOPs) over the time: the effective rate of the step
            "GBps": nbytes / (ms * 1e6) if ms > 0 else None,
            "TFLOPs": flops / (ms * 1e9) if flops is not None and ms > 0 else None}


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "none"


def out_dir(args, device_type: str) -> Path:
    if args.out:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    if device_type == "cuda":
        return RESULTS_DIR
    return Path(tempfile.mkdtemp(prefix="rlfuse-bench-"))   # CPU numbers never land in the repo


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    directory = out_dir(args, device)
    directory.mkdir(parents=True, exist_ok=True)
    gpu = _slug(_device_name(torch.device(device))) if device == "cuda" else "cpu"
    path = directory / f"{gpu}-{_slug(args.commit)}.json"

    def save(results):   # every file, after every case: a run stopped from outside keeps them
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        tmp.replace(path)
        return None if args.no_report else report.render(results, path.with_suffix(""))

    print(f"# results: {path}", flush=True)
    results = run(args, checkpoint=save)
    table = save(results)
    header = results["header"]
    print(f"\nwrote {path}")
    if table is not None:
        print(table)
    for line in header["notes"]:
        print(f"note: {line}")
    for line in header["errors"]:
        print(f"ERROR: {line}", file=sys.stderr)
    return 1 if header["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
