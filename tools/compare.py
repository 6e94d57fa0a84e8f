"""rlfuse beside the kernels a trainer would run instead, op by op on the same inputs, measured on
the CPU (``python -m tools.compare``): TRL 1.16's Triton log-probs and entropy
(``selective_log_softmax_and_entropy``) and Liger-Kernel's Triton GRPO loss. For each shared op
(``PEERS``): the rows of logits each implementation moves per actor row in its training step
(the Triton interpreter's count, ``tools.traffic``) and its error against float64 (the value and
the gradient to the logits, each relative to the float64 result's scale) in bf16 and fp32.

Bytes and errors, not time: the GPU headline run (``bench/gpu_check.sh``) times the same peers.
The interpreter runs every peer's own Triton kernels; a peer that is not installed is left out
of the table with its reason.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import List, Optional, Sequence, Tuple

import torch

from tools import traffic
from tools.interpreter import round_bf16_as_a_gpu

# (op of bench.cases, the peer implementation that does the same work)
PEERS = (("token_logprobs", "trl"), ("token_logprobs_entropy", "trl"), ("ppo_logits", "liger"))
LABELS = {"trl": "TRL 1.16 `selective_log_softmax_and_entropy`",
          "liger": "Liger `GrpoLossFunction`"}
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


def _step(op, impl: str, x) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """``impl``'s outputs of ``op`` and their gradient to the ``[B, T, V]`` logits, for one fixed
    upstream gradient per output (the same for every implementation): 1 for a loss (a
    trainer's ``loss.backward()``), random numbers for per-token outputs."""
    from bench import cases as bench_cases

    outs, leaves = bench_cases.forward_fn(op, impl, bench_cases.load_impl(impl), x)()
    upstream = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i),
                            dtype=torch.float64).to(o.dtype) if o.dim() else torch.ones_like(o)
                for i, o in enumerate(outs)]
    (grad,) = torch.autograd.grad(outs, leaves, upstream)
    if impl == "liger":         # its leaf is the whole [B, T + 1, V] output
        grad = grad[:, :-1]
    return [o.detach() for o in outs], grad


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(1.0, want.abs().max().item())
    return (got.double() - want).abs().max().item() / scale


def errors(op, impl: str, x, truth) -> Tuple[float, float]:
    """``(value error, gradient error)`` of ``impl`` on ``x`` against ``truth`` (the float64
    reference's ``_step``)."""
    outs, grad = _step(op, impl, x)
    want_outs, want_grad = truth
    return max(_error(o, w) for o, w in zip(outs, want_outs)), _error(grad, want_grad)


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
                row[impl] = {"traffic": traffic.run_case(op, x, "fwd+bwd", impl)
                             .per_row.get("actor"),
                             "errors": errors(op, impl, x, truth)}
            rows.append(row)
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def format_table(rows: List[dict], V: int) -> str:
    """The markdown table of ``compare``'s rows, the ratio rlfuse / peer in every column."""
    lines = [
        f"rlfuse beside the peer that does the same work, on the same inputs (V = {V}, "
        f"B = {traffic.TRAFFIC_BATCH}, T = {traffic.TRAFFIC_T}), counted on the CPU by "
        "`python -m tools.compare`: rows of logits read (distinct) / written per actor row in "
        "the training step (Triton interpreter), and the max error against float64 of the "
        "values and of the gradient to the logits, relative to the float64 result's scale. "
        "Not time.", "",
        "| op | peer | dtype | rlfuse R (distinct) / W | peer R (distinct) / W | "
        "R ratio | value error rlfuse / peer | gradient error rlfuse / peer |",
        "|" + "---|" * 8]
    for row in rows:
        if "missing" in row:
            lines.append(f"| {row['op']} | {LABELS[row['peer']]} | | not installed: "
                         f"{row['missing']} | | | | |")
            continue
        ours, theirs = row["fused"], row[row["peer"]]
        (v_ours, g_ours), (v_theirs, g_theirs) = ours["errors"], theirs["errors"]
        lines.append("| " + " | ".join([
            row["op"], LABELS[row["peer"]], row["dtype"], _rw(ours["traffic"]),
            _rw(theirs["traffic"]), _ratio(ours["traffic"][0], theirs["traffic"][0]),
            f"{v_ours:.1e} / {v_theirs:.1e}", f"{g_ours:.1e} / {g_theirs:.1e}"]) + " |")
    return "\n".join(lines)


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
