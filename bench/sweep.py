"""``python -m bench.sweep``: the single pass's launch configurations, checked and timed in one
process, ranked.

Each configuration (``RLFUSE_SINGLE_PASS`` text, ``rlfuse/kernels/rows/single_pass.py``) runs the
training step of one op (default ``gppo_logits``) at the headline shape inside
``single_pass_config``; its loss and gradient are compared with the default configuration's
first, and only a configuration that agrees is timed (one that differs is listed as failed,
with the difference). The ranking names the fastest.

    python -m bench.sweep [--out DIR] [--op gppo_logits] [--N 16384] [--V 151936]
                          [--dtype bf16] [--configs "default evict=1 ..."] [--budget-s S]
    python -m bench.sweep --list            # the candidates, one per line

Writes ``DIR/sweep.json`` and ``DIR/sweep.md`` (default DIR: ``$OUT``, else a temporary one),
after every configuration, so that a run stopped from outside keeps what it has measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import rlfuse
from rlfuse.kernels.rows.single_pass import CANDIDATES, single_pass_config

from . import cases, measure
from .__main__ import DTYPES, _device_name, _git_commit, _triton_version

CASE_KEYS = ("op", "impl", "mode", "dtype", "N", "V")
DEFAULT = "default"
MODE = "fwd+bwd"


def rank(rows):
    """One entry per case: the configurations by median ms, fastest first, each with its
    ``fraction_of_floor`` and its time relative to the default's."""
    by_case = {}
    for row in rows:
        entry = {"config": row["config"], "ms": row["ms"], "ms_p20": row.get("ms_p20"),
                 "ms_p80": row.get("ms_p80"), "fraction_of_floor": row["fraction_of_floor"],
                 "max_grad_diff": row["max_grad_diff"]}
        by_case.setdefault(tuple(row.get(k) for k in CASE_KEYS), []).append(entry)
    ranked = []
    for key, entries in by_case.items():
        entries.sort(key=lambda e: e["ms"])
        default = next((e["ms"] for e in entries if e["config"] == DEFAULT), None)
        for e in entries:
            e["vs_default"] = e["ms"] / default if default else None
        ranked.append({"case": dict(zip(CASE_KEYS, key)), "best": entries[0]["config"],
                       "ranking": entries})
    return ranked


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def markdown(ranked, failed, header) -> str:
    lines = ["# Single-pass launch configurations", "",
             f"{header.get('gpu', '?')}, torch {header.get('torch', '?')}, triton "
             f"{header.get('triton', '?')}, commit {header.get('commit', '?')}; "
             f"{header.get('timing', '')}; every configuration's loss and gradient checked "
             f"against the default's before it is timed", ""]
    for case in ranked:
        c = case["case"]
        lines += [f"## {c['op']} {c['impl']} {c['mode']}, N={c['N']} V={c['V']} {c['dtype']}",
                  "", f"best: `{case['best']}`", "",
                  "| rank | RLFUSE_SINGLE_PASS | ms | p20 | p80 | fraction_of_floor | "
                  "max grad diff vs default | vs default |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for i, e in enumerate(case["ranking"], 1):
            cells = [str(i), f"`{e['config']}`", _fmt(e["ms"], ".4f"), _fmt(e["ms_p20"], ".4f"),
                     _fmt(e["ms_p80"], ".4f"), _fmt(e["fraction_of_floor"], ".1%"),
                     _fmt(e["max_grad_diff"], ".2g"), _fmt(e["vs_default"], ".3f")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for config, why in failed.items():
        lines.append(f"- no time for `{config}`: {why}")
    return "\n".join(lines).rstrip() + "\n"


def _step_results(forward):
    """The step's outputs and the gradients of its leaves, detached."""
    outs, leaves = forward()
    grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
    return [o.detach() for o in outs], [g.detach() for g in grads]


def _agreement(got, want, dtype):
    """``(max gradient difference, why not or None)``: the outputs (fp32 losses) to 1e-5
    relative, each gradient element to two units of rounding of its dtype at the gradient's
    largest magnitude (another block size or stage count only reorders fp32 sums)."""
    worst = 0.0
    for a, b in zip(got[0], want[0]):
        if not torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6):
            return None, f"output {a.tolist()} differs from the default's {b.tolist()}"
    for a, b in zip(got[1], want[1]):
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        worst = max(worst, diff)
        bound = 2 * torch.finfo(b.dtype).eps * max(b.float().abs().max().item(), 1e-30)
        if not diff <= bound:
            return diff, f"gradient differs from the default's by {diff:.3g} (> {bound:.3g})"
    return worst, None


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype]
    (shape,) = [s for s in cases.make_shapes([args.N], [args.V], [dtype], quick=args.quick)
                if s.V is not None]
    op = cases.OPS[args.op]
    x = cases.make_inputs(shape, device)
    forward = cases.forward_fn(op, "fused", rlfuse, x)
    actor_rows = int(x.mask.sum())
    bandwidth = measure.copy_bandwidth_GBps(device)
    floor_ms = op.bytes(shape, MODE, actor_rows) / (bandwidth * 1e9) * 1e3
    timing = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_reps=args.cpu_reps)
    header = {"gpu": _device_name(device), "device": device.type, "torch": torch.__version__,
              "triton": _triton_version(), "commit": args.commit,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "copy_bandwidth_GBps": bandwidth,
              "timing": (f"do_bench median (warmup {args.warmup_ms:g} ms, rep {args.rep_ms:g} ms)"
                         if device.type == "cuda" else
                         f"wall clock, median of {args.cpu_reps}")}
    rows, failed = [], {}
    with single_pass_config(DEFAULT):
        want = _step_results(forward)
    start = time.monotonic()
    for config in args.configs:
        if args.budget_s is not None and time.monotonic() - start > args.budget_s:
            failed[config] = f"not run: the sweep's budget of {args.budget_s:g} s was spent"
            continue
        try:
            with single_pass_config(config):
                diff, why = _agreement(_step_results(forward), want, dtype)
                if why is not None:
                    failed[config] = why
                    continue
                ms, p20, p80 = measure.time_ms(measure.make_step(forward, MODE), device,
                                               **timing)
        except Exception as e:  # noqa: BLE001  (recorded; the sweep goes on)
            failed[config] = f"{type(e).__name__}: {e}"
            continue
        rows.append({"config": config, "op": op.name, "impl": "fused", "mode": MODE,
                     "dtype": args.dtype, "N": shape.N, "V": shape.V, "ms": ms, "ms_p20": p20,
                     "ms_p80": p80, "fraction_of_floor": floor_ms / ms if ms > 0 else None,
                     "max_grad_diff": diff})
        save(args.out, header, rows, failed)
        print(f"{config:70s} {ms:10.4f} ms", flush=True)
    return save(args.out, header, rows, failed)


def save(out: Path, header, rows, failed) -> dict:
    ranked = rank(rows)
    summary = {"header": header, "cases": ranked, "failed": failed}
    (out / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "sweep.md").write_text(markdown(ranked, failed, header))
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="print the candidate configurations")
    p.add_argument("--out", help="directory for sweep.json / sweep.md (default $OUT or a "
                                 "temporary one)")
    p.add_argument("--op", default="gppo_logits", help="a single-pass op of bench/cases.py")
    p.add_argument("--N", type=int, default=16384)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="the quick shapes' batch and hidden size")
    p.add_argument("--configs", help="RLFUSE_SINGLE_PASS texts separated by spaces (default: "
                                     "the candidates, the default first)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no configuration after this many seconds")
    p.add_argument("--rep-ms", type=float, default=50.0)
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--cpu-reps", type=int, default=1)
    p.add_argument("--commit", help="commit to record (default: $RLFUSE_COMMIT, else git)")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(CANDIDATES))
        return 0
    if args.op not in cases.OPS or "fwd" not in cases.OPS[args.op].fused_modes or \
            not cases.OPS[args.op].from_logits:
        p.error(f"--op: expected an op on logits of bench/cases.py, got {args.op!r}")
    args.configs = args.configs.split() if args.configs else list(CANDIDATES)
    args.commit = args.commit or _git_commit()
    args.out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="rlfuse-sweep-"))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = run(args)
    print(markdown(summary["cases"], summary["failed"], summary["header"]), end="")
    for case in summary["cases"]:
        print(f"best for {case['case']['op']}: {case['best']}")
    return 0 if summary["cases"] and not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
