"""Instructions and MUFU operations per logit of the kernels one training step of an op launches,
rlfuse's or a peer's (``tools.compare``), read from their sm_90 SASS without a GPU
(``tools.compile_only``, ``tools.sass``' loop finder): each Triton kernel the step compiles,
once, its vocabulary loops (inner loops that load from global memory) counted per logit as
``tools.sass`` counts rlfuse's row kernels (body instructions x 32 x num_warps / the block of
logits one iteration covers, ``BLOCK_NAMES``), summed over the step's kernels; a kernel without
such a loop (one block per program, a grid over the row's blocks: TRL's backward) counts its
every instruction per block, taken or not (an upper bound). A head's matmuls (cuBLAS, or on the
CPU torch's) are not Triton kernels and are not counted.

    python -m tools.step_sass --json OUT token_logprobs:fused token_logprobs:trl ...

It compiles, so it runs in a process of its own with ``TRITON_INTERPRET=0``
(``step_counts`` starts it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
# The constexpr that holds the logits one iteration of a kernel's vocabulary loop covers:
# rlfuse's row kernels, TRL 1.16's, Liger's GRPO loss
BLOCK_NAMES = ("BLOCK_V", "BLOCK_SIZE", "BLOCK_N")
ARCH = 90


def _count(name: str, kernel, constexprs: Dict[str, str]) -> Optional[Tuple[float, float]]:
    """``(instructions, MUFU)`` per logit in a compiled kernel's vocabulary loops; None for a
    kernel without a vocabulary block (a matmul, a reduction over ``[B, T]``)."""
    from tools import sass

    block = next((int(constexprs[n]) for n in BLOCK_NAMES if n in constexprs), None)
    if block is None:
        return None
    instructions, labels = sass.parse_sass(sass.disassemble(kernel.asm["cubin"]), name)
    loops = [lp for lp in sass.find_loops(instructions, labels) if lp.inner and lp.loads]
    per_thread = block / (32 * kernel.metadata.num_warps)
    if loops:
        body = [i for lp in loops for i in lp.instructions]
    else:       # one block per program (a grid over the row's blocks): the whole kernel
        body = [i for i in instructions if sass.issued(i, labels)]
    return len(body) / per_thread, sum(i.cls == "mufu" for i in body) / per_thread


def worker(pairs: Sequence[Tuple[str, str]]) -> Dict[str, dict]:
    """``{"op:impl": {"instructions", "mufu", "kernels"}}`` of each pair's fwd+bwd step in
    bf16 (this process compiles: ``TRITON_INTERPRET`` unset or 0)."""
    import torch

    from tools import compile_only, sass

    launched = []      # (kernel name, hash) of each launch

    def recording(compile_run):
        def record_run(self, *args, **kwargs):
            kernel = compile_run(self, *args, **kwargs)
            if kernel is not None:
                launched.append((self.fn.__name__, kernel.hash))
            return kernel
        return record_run

    compile_only.install(ARCH, recording)
    from bench import cases

    out = {}
    for op_name, impl in pairs:
        # the headline vocabulary: the blocks its launches choose
        shape = cases.Shape(N=6, V=sass.HEADLINE_V, dtype=torch.bfloat16, batch=2,
                            group_size=2, hidden=8)
        op, x = cases.OPS[op_name], cases.make_inputs(shape, "cpu")
        launched.clear()
        with cases.trl_triton_everywhere():
            outs, leaves = cases.forward_fn(op, impl, cases.load_impl(impl), x)()
            torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])
        counts = {}
        for key in sorted(set(launched)):
            kernel, constexprs = compile_only.COMPILED[key]
            counted = _count(key[0], kernel, constexprs)
            if counted is not None:
                counts[key] = counted
        out[f"{op_name}:{impl}"] = {
            "instructions": sum(c[0] for c in counts.values()),
            "mufu": sum(c[1] for c in counts.values()),
            "kernels": {f"{name} {digest[:8]}": c for (name, digest), c in counts.items()}}
    if compile_only.FAILED:
        raise RuntimeError(f"tools.step_sass: failed to compile {compile_only.FAILED}")
    return out


def step_counts(pairs: Sequence[Tuple[str, str]], out: Path) -> Dict[str, dict]:
    """``worker``'s counts, from a process of its own (the caller may run the interpreter)."""
    env = dict(os.environ, TRITON_INTERPRET="0")     # bench/__init__ would choose 1
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "tools.step_sass", "--json", str(out),
                           *(f"{op}:{impl}" for op, impl in pairs)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"tools.step_sass failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.step_sass",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("pairs", nargs="+", help="op:impl (an op of bench.cases, fused or a peer)")
    p.add_argument("--json", required=True, help="write the counts here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        p.error("it compiles: set TRITON_INTERPRET=0")
    counts = worker([tuple(pair.split(":")) for pair in args.pairs])
    Path(args.json).write_text(json.dumps(counts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
