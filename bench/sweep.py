"""``python -m bench.sweep DIR``: rank the single pass's launch configurations by time.

``bench/sweep.sh`` runs ``python -m bench`` once per configuration (``RLFUSE_SINGLE_PASS``,
``rlfuse.kernels.single_pass``) with ``--out DIR/<name>``, and writes the configuration's text
into ``DIR/<name>/single_pass.txt``. This reads every ``DIR/*/*.json``, ranks the configurations
of each case (op, impl, mode, dtype, N, V) by median time, names the fastest, and writes the
ranking as JSON and markdown.

    python -m bench.sweep DIR [--json PATH] [--md PATH]    # default DIR/sweep.json, DIR/sweep.md
    python -m bench.sweep --list                           # the candidates, one per line
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CONFIG_FILE = "single_pass.txt"
CASE_KEYS = ("op", "impl", "mode", "dtype", "N", "V")
DEFAULT = "default"


def load(directory: Path):
    """``(runs, failed)``: runs are ``(config text, results JSON)`` of each subdirectory with
    results; ``failed`` maps a configuration to why it has no rows."""
    runs, failed = [], {}
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
        config_file = sub / CONFIG_FILE
        config = config_file.read_text().strip() if config_file.exists() else sub.name
        results = sorted(sub.glob("*.json"))
        if not results:
            failed[config] = "no results JSON (the run failed or was not started)"
            continue
        data = json.loads(results[-1].read_text())
        if not data.get("rows"):
            errors = data.get("header", {}).get("errors") or ["no rows"]
            failed[config] = "; ".join(errors)
            continue
        runs.append((config, data))
    return runs, failed


def rank(runs):
    """One entry per case: the configurations by median ms, fastest first, each with its
    ``fraction_of_floor`` columns and its time relative to the default's."""
    cases = {}
    for config, data in runs:
        for row in data["rows"]:
            entry = {"config": config, "ms": row["ms"], "ms_p20": row.get("ms_p20"),
                     "ms_p80": row.get("ms_p80"),
                     **{k: v for k, v in row.items() if k.startswith("fraction_of_floor")}}
            cases.setdefault(tuple(row.get(k) for k in CASE_KEYS), []).append(entry)
    ranked = []
    for key, entries in cases.items():
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
             f"{header.get('timing', '')}", ""]
    for case in ranked:
        c = case["case"]
        fractions = sorted({k for e in case["ranking"] for k in e if
                            k.startswith("fraction_of_floor")})
        lines += [f"## {c['op']} {c['impl']} {c['mode']}, N={c['N']} V={c['V']} {c['dtype']}",
                  "", f"best: `{case['best']}`", "",
                  "| rank | RLFUSE_SINGLE_PASS | ms | p20 | p80 | "
                  + " | ".join(fractions) + (" | " if fractions else "") + "vs default |",
                  "|---:|---|---:|---:|---:|" + "---:|" * len(fractions) + "---:|"]
        for i, e in enumerate(case["ranking"], 1):
            cells = [str(i), f"`{e['config']}`", _fmt(e["ms"], ".4f"), _fmt(e["ms_p20"], ".4f"),
                     _fmt(e["ms_p80"], ".4f")] + [_fmt(e.get(k), ".1%") for k in fractions]
            cells.append(_fmt(e["vs_default"], ".3f"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    for config, why in failed.items():
        lines.append(f"- no time for `{config}`: {why}")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("dir", nargs="?", help="the sweep directory (one subdirectory per config)")
    p.add_argument("--json", help="ranking JSON (default DIR/sweep.json)")
    p.add_argument("--md", help="ranking markdown (default DIR/sweep.md)")
    p.add_argument("--list", action="store_true", help="print the candidate configurations")
    args = p.parse_args(argv)
    if args.list:
        from rlfuse.kernels.single_pass import CANDIDATES

        print("\n".join(CANDIDATES))
        return 0
    if not args.dir:
        p.error("DIR is required (or --list)")
    directory = Path(args.dir)
    runs, failed = load(directory)
    ranked = rank(runs)
    header = runs[0][1]["header"] if runs else {}
    summary = {"header": {k: header.get(k) for k in ("gpu", "torch", "triton", "commit",
                                                    "date", "copy_bandwidth_GBps", "timing")},
               "cases": ranked, "failed": failed}
    text = markdown(ranked, failed, header)
    Path(args.json or directory / "sweep.json").write_text(json.dumps(summary, indent=1) + "\n")
    Path(args.md or directory / "sweep.md").write_text(text)
    print(text, end="")
    for case in ranked:
        print(f"best for {case['case']['op']} {case['case']['mode']}: {case['best']}")
    return 0 if ranked else 1


if __name__ == "__main__":
    sys.exit(main())
