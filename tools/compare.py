"""rlfuse beside the kernels a trainer would run instead, op by op on the same inputs, measured on
the CPU (``python -m tools.compare``): TRL 1.16's Triton log-probs and entropy
(``selective_log_softmax_and_entropy``) and Liger-Kernel's Triton GRPO loss. For each shared op
(``PEERS``): the rows of logits each implementation moves per actor row in its training step
(the Triton interpreter's count, ``tools.traffic``), its error against float64 (the value and
the gradient to the logits, each relative to the float64 result's scale) in bf16 and fp32, and
the instructions and MUFU operations per logit of its Triton kernels in bf16 (their sm_90 SASS,
``tools.step_sass``).

Bytes and errors, not time: the GPU headline run (``bench/gpu_check.sh``) times the same peers.
The interpreter runs every peer's own Triton kernels; a peer that is not installed is left out
of the table with its reason.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional, Sequence, Tuple

import torch

from tools import traffic
from tools.interpreter import round_bf16_as_a_gpu

# (op of bench.cases, the peer implementation that does the same work)
PEERS = (("token_logprobs", "trl"), ("token_logprobs_entropy", "trl"), ("ppo_logits", "liger"),
         ("ppo_head", "trl"), ("ppo_head", "liger"), ("distill_head", "trl"),
         ("distill_head", "liger"))
LABELS = {("token_logprobs", "trl"): "TRL 1.16 `selective_log_softmax_and_entropy`",
          ("token_logprobs_entropy", "trl"): "TRL 1.16 `selective_log_softmax_and_entropy`",
          ("ppo_logits", "liger"): "Liger `GrpoLossFunction`",
          ("ppo_head", "trl"): "TRL 1.16 `ChunkedLogProbFunction` (Triton), then the loss",
          ("ppo_head", "liger"): "Liger `LigerFusedLinearGRPOLoss`",
          ("distill_head", "trl"): "TRL 1.16 `ChunkedDivergenceFunction` (JSD)",
          ("distill_head", "liger"): "Liger `LigerFusedLinearJSDLoss`"}
DTYPES = (torch.bfloat16, torch.float32)
MARK_BEGIN, MARK_END = "<!-- compare:begin -->", "<!-- compare:end -->"


def as_float64(x: SimpleNamespace) -> SimpleNamespace:
    """``x`` with its floating tensors in float64 (the same values), leaves again leaves (the
    ``logits`` leaf a view of ``logits_full``'s storage, as ``bench.cases.make_inputs`` has
    them)."""
    out = SimpleNamespace(**vars(x))
    out.shape = dataclasses.replace(x.shape, dtype=torch.float64)
    for name, value in vars(x).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            setattr(out, name, value.detach().double().requires_grad_(value.requires_grad))
    if x.logits_full is not None:
        out.logits = out.logits_full.detach()[:, :-1].requires_grad_()
    return out


def _step(op, impl: str, x) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``impl``'s outputs of ``op`` and their gradients to its leaves (the ``[B, T, V]`` logits,
    or a head's hidden states and weight), for one fixed upstream gradient per output (the same
    for every implementation): 1 for a loss (a trainer's ``loss.backward()``), random numbers
    for per-token outputs."""
    from bench import cases as bench_cases

    with bench_cases.trl_triton_everywhere():
        outs, leaves = bench_cases.forward_fn(op, impl, bench_cases.load_impl(impl), x)()
        upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i),
                                dtype=torch.float64).to(o.dtype) if o.dim()
                    else torch.ones_like(o) for i, o in enumerate(outs)]
        grads = list(torch.autograd.grad(outs, leaves, upstream))
    if impl == "liger" and op.matmuls is None:   # its leaf: the whole [B, T + 1, V] output
        grads = [grads[0][:, :-1]]
    return [o.detach() for o in outs], grads


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(1.0, want.abs().max().item())
    return (got.double() - want).abs().max().item() / scale


def errors(op, impl: str, x, truth) -> Tuple[Tuple[float, float], float]:
    """``((value error, gradient error), extra peak bytes per actor token)`` of ``impl`` on
    ``x``: each error against ``truth`` (the float64 reference's ``_step``) the largest over
    the outputs or the gradients; the peak what the step allocates beyond its inputs at most
    at once (``bench.measure.peak_memory``: the CPU profiler's running total, the outputs and
    the gradients included), over the actor tokens."""
    from bench import measure

    result = []
    peak = measure.peak_memory(lambda: result.append(_step(op, impl, x)), torch.device("cpu"))
    (outs, grads), (want_outs, want_grads) = result[0], truth
    return ((max(_error(o, w) for o, w in zip(outs, want_outs)),
             max(_error(g, w) for g, w in zip(grads, want_grads))),
            peak / int(x.mask.sum()))


def _traffic(op, impl: str, x) -> dict:
    """Rows of logits per actor row (a head's chunk rows for the head ops) in the kernels, and
    the torch ops over logits-sized tensors outside them."""
    from bench import cases as bench_cases

    with bench_cases.trl_triton_everywhere():
        t = traffic.run_case(op, x, "fwd+bwd", impl)
    rows = t.per_row.get("chunk" if op.matmuls is not None else "actor") or (0.0, 0.0, 0.0)
    actor = int(x.mask.sum())
    torch_rw = tuple(sum(p[i] for p in t.passes) / actor for i in (1, 2))
    # in all: the kernels' distinct reads and their writes, and the torch ops'
    total = (rows[1] + torch_rw[0], rows[2] + torch_rw[1])
    return {"kernels": rows, "torch": traffic._torch_ops({"passes": t.passes}, actor),
            "total": total}


def compare(V: int, names: Sequence[str] = (), seed: int = 0) -> List[dict]:
    """One row per (op, peer, dtype): each implementation's rows of logits per actor row
    (reads, distinct reads, writes) in bf16 and its errors against float64."""
    from bench import cases as bench_cases

    round_bf16_as_a_gpu()       # bf16 results with a GPU's bits
    rows = []
    for name, peer in PEERS:
        if names and name not in names:
            continue
        op = bench_cases.OPS[name]
        try:
            bench_cases.load_impl(peer)
        except Exception as error:      # an optional peer not installed
            rows.append({"op": name, "peer": peer, "missing": f"{type(error).__name__}: "
                                                             f"{error}"})
            continue
        for dtype in DTYPES:
            x = traffic.traffic_inputs(V, dtype, seed=seed)
            # advantages at random (a batch this small can draw groups of equal rewards only)
            x.advantages = torch.randn(x.mask.shape[0],
                                       generator=torch.Generator().manual_seed(seed))
            truth = _step(op, "reference", as_float64(x))
            row = {"op": name, "peer": peer, "dtype": str(dtype).replace("torch.", "")}
            for impl in ("fused", peer):
                error, peak = errors(op, impl, x, truth)
                row[impl] = dict(_traffic(op, impl, x), errors=error, peak=peak)
            rows.append(row)
    _add_sass(rows)
    return rows


def _add_sass(rows: List[dict]) -> None:
    """Each bf16 row's instructions and MUFU operations per logit of rlfuse's and the peer's
    Triton kernels in the step (``tools.step_sass``, sm_90 compile-only); ``sass`` None where
    this Triton cannot compile for NVIDIA (no backend) with the reason."""
    import tempfile

    from tools import step_sass

    bf16 = [r for r in rows if r.get("dtype") == "bfloat16"]
    pairs = sorted({(r["op"], impl) for r in bf16 for impl in ("fused", r["peer"])})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            counts = step_sass.step_counts(pairs, Path(tmp) / "counts.json")
    except RuntimeError as error:
        for row in bf16:
            row["sass"] = None
            row["sass_missing"] = str(error).splitlines()[-1]
        return
    for row in bf16:
        row["sass"] = {impl: counts[f"{row['op']}:{impl}"] for impl in ("fused", row["peer"])}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def format_table(rows: List[dict], V: int) -> str:
    """The markdown table of ``compare``'s rows, the ratio rlfuse / peer of the reads in all
    (the kernels' distinct reads and the torch ops')."""
    lines = [
        f"rlfuse beside the peer that does the same work, on the same inputs (V = {V}, "
        f"B = {traffic.TRAFFIC_BATCH}, T = {traffic.TRAFFIC_T}), counted on the CPU by "
        "`python -m tools.compare`: rows of logits read (distinct) / written in the kernels "
        "per actor row of the training step (a head's: per row of its chunks), the torch ops "
        "over logits-sized tensors outside them (rows read / written per actor row: a head's "
        "matmuls, and on the CPU the casts of its weight gradient's accumulation; a peer "
        "written in torch has only these), the ratio rlfuse / peer of the reads in all (the "
        "kernels' distinct reads and the torch ops'), the instructions and MUFU operations "
        "per logit (per thread) in the vocabulary loops of the step's Triton kernels compiled "
        "for sm_90 in bf16 (`tools.step_sass`: a model, not time).", "",
        "The columns then give the max "
        "error against float64 of the values and of the gradients (to the logits; a head's: "
        "to the hidden states and the weight), relative to the float64 result's scale, and "
        "the extra peak memory of the step per actor token in units of one row of logits in "
        "the dtype (what it allocates beyond its inputs at most at once, its outputs and "
        "gradients included: the CPU profiler's count, `bench.measure.peak_memory`). Not "
        "time.", "",
        "| op | peer | dtype | rlfuse kernels R (distinct) / W | peer kernels R (distinct) / W "
        "| reads in all, ratio | torch ops rlfuse | torch ops peer | value error rlfuse / peer "
        "| gradient error rlfuse / peer | instructions / MUFU per logit, rlfuse | "
        "instructions / MUFU per logit, peer | peak memory per actor token, rlfuse / peer "
        "(rows of logits) |",
        "|" + "---|" * 13]
    for row in rows:
        if "missing" in row:
            lines.append(f"| {row['op']} | {LABELS[row['op'], row['peer']]} | | not installed: "
                         f"{row['missing']} | | | | | | | | | |")
            continue
        ours, theirs = row["fused"], row[row["peer"]]
        (v_ours, g_ours), (v_theirs, g_theirs) = ours["errors"], theirs["errors"]
        row_bytes = V * torch.empty((), dtype=getattr(torch, row["dtype"])).element_size()
        lines.append("| " + " | ".join([
            row["op"], LABELS[row["op"], row["peer"]], row["dtype"], _rw(ours["kernels"]),
            _rw(theirs["kernels"]), _ratio(ours["total"][0], theirs["total"][0]),
            ours["torch"], theirs["torch"], f"{v_ours:.1e} / {v_theirs:.1e}",
            f"{g_ours:.1e} / {g_theirs:.1e}", *_sass_cells(row),
            f"{ours['peak'] / row_bytes:.2f} / {theirs['peak'] / row_bytes:.2f}"]) + " |")
    return "\n".join(lines)


def _sass_cells(row: dict) -> List[str]:
    """The instructions / MUFU cells of a row: bf16 rows only (the SASS is bf16's); a peer
    without Triton kernels in the step (torch only) has none."""
    if row["dtype"] != "bfloat16":
        return ["", ""]
    if row.get("sass") is None:
        return ["not compiled: " + row.get("sass_missing", ""), ""]
    return [f"{c['instructions']:.1f} / {c['mufu']:.2f}" if c["kernels"] else "no Triton kernel"
            for c in (row["sass"]["fused"], row["sass"][row["peer"]])]


def _rw(counts: Optional[Tuple[float, float, float]]) -> str:
    reads, distinct, writes = counts
    return f"{reads:.2f} ({distinct:.2f}) / {writes:.2f}"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools.compare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--V", type=int, default=traffic.TRAFFIC_V, help="vocabulary")
    p.add_argument("--op", action="append", default=[], help="only these ops (repeatable)")
    p.add_argument("--readme", help="write the table between the compare markers of this page")
    args = p.parse_args(argv)
    table = format_table(compare(args.V, args.op), args.V)
    print(table)
    if args.readme:
        with open(args.readme) as f:
            text = f.read()
        start, end = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
        with open(args.readme, "w") as f:
            f.write(text[:start] + "\n" + table + "\n" + text[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
