"""Render benchmark results: a markdown table, a PNG plot, and the README's table.

    python -m bench.report RESULTS.json [--md OUT.md] [--png OUT.png] [--mode fwd+bwd]
    python -m bench.report --readme docs/performance.md     # newest GPU results in bench/results

The README's table sits between ``<!-- bench:begin -->`` and ``<!-- bench:end -->``; it is only
ever filled from a GPU run (CPU timings go through the Triton interpreter and mean nothing).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MARK_BEGIN, MARK_END = "<!-- bench:begin -->", "<!-- bench:end -->"
IMPL_ORDER = ("fused", "reference", "compiled", "liger", "trl")
MODE_ORDER = ("fwd", "bwd", "fwd+bwd")


def load(path) -> dict:
    return json.loads(Path(path).read_text())


def _ms(value: Optional[float]) -> str:
    if value is None:
        return "—"
    if value >= 1000:
        return f"{value:.0f}"
    return f"{value:.3g}" if value >= 1e-3 else f"{value:.1e}"


def _mib(nbytes: Optional[int]) -> str:
    return "—" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def _rate(row) -> str:
    if not row:
        return "—"
    if row.get("TFLOPs") is not None:
        return f"{row['TFLOPs']:.3g} TFLOP/s"
    return "—" if row.get("GBps") is None else f"{row['GBps']:,.0f} GB/s"


def _impls(rows) -> list:
    seen = {r["impl"] for r in rows}
    return [i for i in IMPL_ORDER if i in seen] + sorted(seen - set(IMPL_ORDER))


def summary_line(header: dict) -> str:
    line = (f"{header['gpu']} · torch {header['torch']} · triton {header['triton']} · "
            f"commit `{header['commit']}` · {header['date']} · copy bandwidth "
            f"{header['copy_bandwidth_GBps']:,.0f} GB/s")
    if header.get("missing_impls"):
        line += " · unavailable: " + "; ".join(f"{impl} ({why})" for impl, why in
                                               header["missing_impls"].items())
    for gemm, ms in (header.get("head_gemms_ms") or {}).items():
        line += f" · plain GEMMs {gemm}: {_ms(ms)} ms"
    return line


def markdown(results: dict, modes: Optional[Iterable[str]] = None) -> str:
    """One table row per (op, mode, dtype, N, V): the median ms of every implementation, the
    fused speed-up over the reference (and Liger), the fused share of the HBM floor, and the
    peak extra memory of each implementation (on CUDA the allocator's, on the CPU the
    profiler's: measure.peak_memory)."""
    header = results["header"]
    modes = tuple(modes or MODE_ORDER)
    rows = [r for r in results["rows"] if r["mode"] in modes]
    impls = _impls(rows)
    ops = list(dict.fromkeys(r["op"] for r in rows))
    groups = {}
    for r in rows:
        groups.setdefault((r["op"], r["mode"], r["dtype"], r["N"], r["V"]), {})[r["impl"]] = r
    order = sorted(groups, key=lambda k: (ops.index(k[0]), MODE_ORDER.index(k[1]), k[2],
                                          -k[3], -(k[4] or 0)))
    has_mem = any(r["peak_mem_bytes"] is not None for r in rows)
    peers = [p for p in IMPL_ORDER[1:] if p in impls]

    cols = ["op", "mode", "dtype", "N", "V", "floor ms"] + [f"{i} ms" for i in impls]
    cols += [f"fused vs {p}" for p in peers] + ["fused % of floor", "fused GB/s or TFLOP/s"]
    cols += [f"peak MiB {i}" for i in impls] if has_mem else []
    lines = [summary_line(header), "", "| " + " | ".join(cols) + " |",
             "|" + "|".join("---" if i < 3 else "---:" for i in range(len(cols))) + "|"]
    for key in order:
        by_impl = groups[key]
        any_row = next(iter(by_impl.values()))
        fused = by_impl.get("fused")
        cells = [key[0], key[1], key[2], str(key[3]), str(key[4] or "—"),
                 _ms(any_row["floor_ms"])]
        cells += [_ms(by_impl[i]["ms"]) if i in by_impl else "—" for i in impls]
        for p in peers:
            ok = fused and p in by_impl and (fused["ms"] or 0) > 0 and by_impl[p]["ms"]
            cells.append(f"{by_impl[p]['ms'] / fused['ms']:.2f}×" if ok else "—")
        frac = fused and fused["fraction_of_floor"]
        dense = fused and fused.get("fraction_of_floor_dense")
        cells.append(("—" if frac is None or not fused else f"{frac:.0%}")
                     + (f" ({dense:.0%})" if dense is not None and fused else ""))
        cells.append(_rate(fused))
        if has_mem:
            cells += [_mib(by_impl[i]["peak_mem_bytes"]) if i in by_impl else "—" for i in impls]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "ms: median per step; floor: the op's minimal HBM bytes (see `bench/cases.py`) "
              "over the measured copy bandwidth — each actor row read as often as the op "
              "must, every row's gradient written once (a masked row's: zeros); in "
              "parentheses the dense floor, every row counted as an actor's — for the `_head` "
              "ops (LinearHead, H = 4096) the time of the three plain GEMMs (cuBLAS) of the "
              "same shapes, timed in the same run (`distill_head`: four, the teacher's "
              "logits besides); fused vs X: X's time over fused's; GB/s: "
              "the floor's bytes over fused's time, TFLOP/s (the `_head` ops): the GEMMs' "
              "FLOPs over it; peak: bytes allocated during one step beyond its inputs."]
    if header.get("truncated"):
        lines.append("The run hit its time budget: some cases are missing.")
    return "\n".join(lines) + "\n"


def plot(results: dict, path, mode: str = "fwd+bwd") -> Optional[Path]:
    """Time against V per implementation (log-log), one panel per op taking logits, at the
    largest N and the most common dtype, with the HBM floor dashed. None without matplotlib."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not getattr(plot, "told", False):    # once a run, not after every case
            print("matplotlib is not installed: no PNG (pip install matplotlib)")
            plot.told = True
        return None
    rows = [r for r in results["rows"] if r["V"] and r["mode"] == mode and r["ms"] is not None]
    if not rows:          # none, or peak memory only (bench --memory)
        return None
    dtypes = [r["dtype"] for r in rows]
    dtype = max(set(dtypes), key=dtypes.count)
    n = max(r["N"] for r in rows)
    rows = [r for r in rows if r["dtype"] == dtype and r["N"] == n]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(3.6 * len(ops), 3.4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sel = [r for r in rows if r["op"] == op]
        for impl in _impls(sel):
            pts = sorted((r["V"], r["ms"]) for r in sel if r["impl"] == impl)
            ax.plot(*zip(*pts), marker="o", label=impl)
        floor = sorted({(r["V"], r["floor_ms"]) for r in sel})
        ax.plot(*zip(*floor), "k--", label="HBM floor")
        vs = [v for v, _ in floor]
        ax.set(xscale="log", yscale="log", title=op, xlabel="V")
        ax.set_xticks(vs, [f"{v / 1000:.0f}k" if v >= 1000 else str(v) for v in vs])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel(f"ms ({mode})")
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"{results['header']['gpu']} · {dtype} · N = {n}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def render(results: dict, stem) -> str:
    """Writes ``<stem>.md`` (every mode) and ``<stem>.png``; returns the fwd+bwd table and the
    paths, for the console."""
    stem = Path(stem)
    md = stem.with_name(stem.name + ".md")
    md.write_text(markdown(results))
    png = plot(results, stem.with_name(stem.name + ".png"))
    paths = f"wrote {md}" + (f" and {png}" if png else "")
    return markdown(results, modes=("fwd+bwd",)) + "\n" + paths


def newest_gpu_results(results_dir=RESULTS_DIR):
    """``(path, results)`` of the newest GPU results file in ``results_dir``, or None."""
    found = []
    for path in Path(results_dir).glob("*.json"):
        try:
            results = load(path)
        except (OSError, ValueError):
            continue
        if results.get("header", {}).get("device") == "cuda":
            found.append((results["header"].get("date", ""), path, results))
    if not found:
        return None
    _, path, results = max(found, key=lambda t: (t[0], t[1].name))
    return path, results


def update_readme(readme, results_dir=RESULTS_DIR) -> bool:
    """Replaces the README text between the markers with the fwd+bwd table of the newest GPU
    results. Returns False (and says so) when there are none; ValueError without markers."""
    found = newest_gpu_results(results_dir)
    if found is None:
        print(f"no GPU results in {results_dir}: {readme} left as it is (README speed claims "
              f"come from GPU runs only)")
        return False
    path, results = found
    readme = Path(readme)
    try:
        shown = path.resolve().relative_to(readme.resolve().parent)
    except ValueError:
        shown = path
    table = markdown(results, modes=("fwd+bwd",))
    replace_between(readme, MARK_BEGIN, MARK_END,
                    f"\n{table}\nFrom `{shown}` (every mode: `python -m bench.report {shown}`).\n")
    print(f"{readme}: benchmark table replaced from {path}")
    return True


def replace_between(readme, begin_mark: str, end_mark: str, body: str) -> None:
    """The text of ``readme`` between the two markers replaced by ``body``; ValueError without
    them."""
    readme = Path(readme)
    text = readme.read_text()
    begin, end = text.find(begin_mark), text.find(end_mark)
    if begin < 0 or end < begin:
        raise ValueError(f"{readme}: expected the markers {begin_mark} ... {end_mark}")
    readme.write_text(text[:begin + len(begin_mark)] + body + text[end:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="?", help="a results JSON written by python -m bench")
    p.add_argument("--md", help="write the markdown here (default: print it)")
    p.add_argument("--png", help="write the plot here")
    p.add_argument("--mode", action="append", help="modes in the table (default all)")
    p.add_argument("--readme", help="refresh this README's table from the newest GPU results")
    p.add_argument("--results-dir", default=str(RESULTS_DIR), help="where --readme looks")
    args = p.parse_args(argv)
    if args.readme:
        try:
            update_readme(args.readme, args.results_dir)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    if not args.results:
        p.error("give a results JSON, or --readme docs/performance.md")
    results = load(args.results)
    md = markdown(results, modes=args.mode)
    if args.md:
        Path(args.md).write_text(md)
    else:
        print(md)
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
