"""Compiles every rlfuse kernel for a GPU, on a machine without one.

The Triton interpreter runs the kernels' Python, not the compiler: a type mismatch between the
branches of a runtime ``if``, a loop-carried value that changes dtype or an op the backend cannot
lower passes every interpreter test and fails on the first GPU call. This script drives the public
API on CPU tensors with Triton's driver replaced by one that only compiles (for the target given,
default CUDA sm_90): each launch compiles its kernel to a cubin and returns without running, and
kernel outputs are zero-filled so the host-side logic goes on. It prints one line per compiled
kernel with its registers and local (spill) memory, read from the cubin by ``cuobjdump``, and
for a kernel with a stack, the local-memory accesses inside its vocabulary loops (``tools.sass``:
the inner loops that load from global memory).

    python -m tools.gpu_compile [--arch 90] [--json out.json] [--jobs 8]

It must run in a process of its own, without ``TRITON_INTERPRET=1`` (``tests/test_gpu_compile.py``
starts it). Exit status 1 if a kernel failed to compile, or accesses local memory inside a
vocabulary loop, where a spill costs per logit (float64 kernels excepted: a testing dtype). A
spill outside those loops, once per row, is reported: ptxas may trade a register of the scalar
code between a row's two passes for occupancy (the single pass's fp64 trust region and its
subroutine calls live there).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import pkgutil
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("tools.gpu_compile: unset TRITON_INTERPRET (the kernels must be compiled, not "
             "interpreted)")
os.environ["TRITON_INTERPRET"] = "0"     # bench, imported by the drive, would choose it off CUDA

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import rlfuse  # noqa: E402
import rlfuse.kernels  # noqa: E402
from bench import cases, measure  # noqa: E402
from rlfuse import divergences  # noqa: E402
from rlfuse._names import GEOMETRIES, TOPOLOGIES  # noqa: E402
from rlfuse._types import compute_dtype  # noqa: E402
from rlfuse.divergences import JSD  # noqa: E402
from rlfuse.kernels.rows import single_pass, surrogate  # noqa: E402
from rlfuse.kernels.rows.distill import DISTILL_STATS, distill_fwd  # noqa: E402
from rlfuse.fused_losses.head.linear_head import chunk_tokens_for  # noqa: E402
from rlfuse.kernels.lib.head_functions import HeadParams  # noqa: E402
from rlfuse.kernels.rows.single_pass import single_pass_config  # noqa: E402
from rlfuse.kernels.lib.utils import vocab_launch_config  # noqa: E402
from tools import compile_only, sass  # noqa: E402



def kernel_modules():
    """Every module of ``rlfuse.kernels``: a kernel in none of them the drive never reaches."""
    return [importlib.import_module(m.name)
            for m in pkgutil.walk_packages(rlfuse.kernels.__path__, "rlfuse.kernels.")]

# Launch configurations of the single pass compiled besides the default (RLFUSE_SINGLE_PASS text):
# every candidate of the GPU sweep, then each switch alone (bf16: the table's 8192-wide blocks and
# 16 warps), the last all of them at once.
SINGLE_PASS_VARIANTS = tuple(c for c in single_pass.CANDIDATES if c != "default") + (
    "order=forward", "num_stages=2", "num_stages=3", "block_v=2048", "block_v=4096",
    "num_warps=8,block_v=4096", "num_warps=16,block_v=4096",
    "evict=1,programs_per_sm=2,order=forward,num_warps=8,block_v=4096,num_stages=3",
)


# The warm-up drives the headline's cases first, each launch with the key it has in the headline
# (Triton's cache of compiled kernels: the kernel, the constexprs, and of an integer argument
# whether it is 1 or a multiple of 16), at a cost a CPU drives in seconds: the headline's [B, T]
# side itself (B 16, T 1024, the same seed: the same mask, hence the same number of actor
# tokens), a vocabulary of the headline's launch configuration and divisibility (12288: blocks
# of 8192 in 16 warps, as 151936 in bf16; more than one block) and a head of H 64 whose chunks
# hold as many tokens as the headline's default chunk (RLFUSE_CHUNK_BYTES).
# tests/test_gpu_compile.py compares these keys with those of ``python -m bench --headline``.
HEADLINE_STAND_IN = dict(V=12288, hidden=64)


@contextlib.contextmanager
def headline_stand_in(V: int = HEADLINE_STAND_IN["V"],
                      hidden: int = HEADLINE_STAND_IN["hidden"]):
    """The headline's shape with vocabulary ``V`` and hidden size ``hidden`` and, inside, a
    chunk budget that gives its head the headline's chunks; ValueError for a ``V`` whose
    launches would differ from the headline's."""
    headline = cases.HEADLINE
    config = vocab_launch_config(headline.V, headline.element_size)
    if V % 16 != headline.V % 16 or V <= config[0] or \
            vocab_launch_config(V, headline.element_size) != config:
        raise ValueError(f"V={V}: expected a multiple of 16 above {config[0]} with the "
                         f"headline's launch configuration {config}")
    shape = dataclasses.replace(headline, V=V, hidden=hidden)
    weight = torch.empty(headline.V, headline.hidden, dtype=headline.dtype, device="meta")
    chunk_bytes = chunk_tokens_for(weight, None, headline.N) * V * headline.element_size
    saved = os.environ.get("RLFUSE_CHUNK_BYTES")
    os.environ["RLFUSE_CHUNK_BYTES"] = str(chunk_bytes)
    try:
        yield shape
    finally:
        if saved is None:
            del os.environ["RLFUSE_CHUNK_BYTES"]
        else:
            os.environ["RLFUSE_CHUNK_BYTES"] = saved


def _drive_headline():
    """Every case of ``python -m bench --headline`` (fused), through the benchmark's own calls,
    at the headline's stand-in (``headline_stand_in``)."""
    with headline_stand_in() as shape:
        x = cases.make_inputs(shape, "cpu")
        for name in cases.HEADLINE_OPS:
            op = cases.OPS[name]
            forward = cases.forward_fn(op, "fused", rlfuse, x)
            for mode in cases.HEADLINE_MODES:
                if mode in cases.modes_for(op, "fused"):
                    measure.make_step(forward, mode)()


def _drive():
    """The headline's cases (``_drive_headline``), then every public entry point, over the
    dtypes and the kernels' constexpr variants, with a real vocabulary size (the launch
    configuration, hence the register use, depends on it)."""
    _drive_headline()
    g = torch.Generator().manual_seed(0)
    B, T, V, m = 4, 3, 151936, 2

    def logits_of(dtype):
        return torch.randn(B, T + 1, V, generator=g).to(dtype)[:, :-1].requires_grad_()

    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, -1] = False
    old = -torch.rand(B, T, generator=g)
    teacher = -torch.rand(B, T, generator=g)
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0])
    adv_seq = torch.tensor([0.5, -0.5, 1.0, -1.0])

    def backward(out):
        out.backward() if out.dim() == 0 else out.sum().backward()

    # token_logprobs: dtypes x mask x entropy x temperature; backward with and without dentropy.
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for with_mask in (False, True):
            for entropy in (False, True):
                x = logits_of(dtype)
                out = rlfuse.token_logprobs(x, targets, mask=mask if with_mask else None,
                                            temperature=0.7, return_entropy=entropy)
                if entropy:
                    lp, ent = out
                    (lp.sum() + ent.sum()).backward()
                    lp, ent = rlfuse.token_logprobs(x, targets, return_entropy=True)
                    lp.sum().backward()
                else:
                    backward(out)

    # Distillation between two Logits: each divergence's example, bf16 / fp32 / fp64, a teacher of
    # another dtype; the loss (a single pass) and the per-token divergence (two passes).
    for dtype, teacher_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32,
                                                                    torch.bfloat16),
                                 (torch.float64, torch.float64)):
        for divergence in (cls.example() for cls in divergences.DIVERGENCES):
            models = (rlfuse.Logits(logits_of(dtype), targets, 0.7),
                      rlfuse.Logits(logits_of(teacher_dtype).detach(), targets))
            backward(rlfuse.distill_loss(*models, mask, divergence).loss)
            backward(rlfuse.token_divergence(*models, divergence, mask))
        # a split vocabulary's pass of the divergence terms (the whole rows' statistics given)
        rows = logits_of(dtype).detach()
        distill_fwd(rows, rows, mask, HeadParams(0.7), HeadParams(), JSD(0.5).terms(),
                    stats=torch.zeros(B * T, len(DISTILL_STATS), dtype=compute_dtype(dtype)))

    for dtype in (torch.float32, torch.float64):
        lp = old.to(dtype).clone().requires_grad_()
        for clip in (None, 0.25):
            backward(rlfuse.ggpo_loss(lp, old.to(dtype), rewards.to(dtype), mask, group_size=m,
                                      beta=0.5, clip_radius=clip).loss)
        backward(rlfuse.gr_opd_loss(lp, old.to(dtype), teacher.to(dtype), mask,
                                    group_size=m).loss)
        weights = torch.rand(B, T, generator=g).to(dtype)
        for ppo in (dict(clip=(0.2, 0.28), dual_clip=3.0, weights=weights),
                    dict(ratio_level="sequence", agg="seq-mean-token-mean"),
                    dict(agg="token-sum")):
            backward(rlfuse.ppo_loss(lp, old.to(dtype), adv_seq.to(dtype), mask, **ppo).loss)
        backward(rlfuse.ppo_loss(lp, None, adv_seq.to(dtype), mask).loss)
        for geometry in GEOMETRIES:
            for topology in TOPOLOGIES:
                rlfuse.gppo_bounds(old.to(dtype), geometry=geometry, topology=topology,
                                   delta=0.1)
                if dtype == torch.float32:
                    for adv in (adv_seq, adv_seq[:, None].expand(B, T)):
                        backward(rlfuse.gppo_loss(lp, old, adv, mask, geometry=geometry,
                                                  topology=topology, delta=0.1).loss)

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = logits_of(dtype)
        policy = rlfuse.Logits(x, targets, temperature=0.7)
        backward(rlfuse.ggpo_loss(policy, old, rewards, mask, group_size=m, beta=0.5).loss)
        backward(rlfuse.gr_opd_loss(policy, old, teacher, mask, group_size=m).loss)
        backward(rlfuse.gppo_loss(policy, old, adv_seq, mask).loss)
        backward(rlfuse.ppo_loss(policy, old, adv_seq, mask, clip=(0.2, 0.28), dual_clip=3.0,
                                 weights=torch.rand(B, T, generator=g)).loss)
        backward(rlfuse.ppo_loss(policy, None, adv_seq, mask).loss)
        backward(rlfuse.ppo_loss(policy, old, adv_seq, mask, ratio_level="sequence").loss)
        with torch.no_grad():
            rlfuse.gppo_loss(policy, old, adv_seq, mask)
    # The single pass's launch configurations: the GPU sweep's candidates and each switch alone,
    # at the real vocabulary in bf16; a combination also in fp32 (the table's block), without
    # dlogits and on policy.
    for text in SINGLE_PASS_VARIANTS:
        with single_pass_config(text):
            policy = rlfuse.Logits(logits_of(torch.bfloat16), targets)
            backward(rlfuse.gppo_loss(policy, old, adv_seq, mask).loss)
    with single_pass_config(SINGLE_PASS_VARIANTS[-1]), torch.no_grad():
        rlfuse.gppo_loss(policy, old, adv_seq, mask)
    with single_pass_config("evict=1,programs_per_sm=2,order=forward,num_stages=3"):
        policy = rlfuse.Logits(logits_of(torch.float32), targets, temperature=0.7)
        backward(rlfuse.ppo_loss(policy, None, adv_seq, mask).loss)
        with torch.no_grad():
            rlfuse.gppo_loss(policy, old, adv_seq, mask)
    x = logits_of(torch.bfloat16)
    for geometry in GEOMETRIES:
        for topology in TOPOLOGIES:
            backward(rlfuse.gppo_loss(rlfuse.Logits(x, targets), old, adv_seq, mask,
                                      geometry=geometry, topology=topology, delta=0.1).loss)

    # policy_loss: every objective with each KL estimator and the entropy bonus, from log-probs,
    # logits and a LinearHead (the single pass's KL and entropy variants); kl_penalty.
    from rlfuse import objectives, terms
    from rlfuse._names import KL_ESTIMATORS

    weight = torch.randn(V, 64, generator=g).to(torch.bfloat16)
    hidden = torch.randn(B, T, 64, generator=g).to(torch.bfloat16).requires_grad_()
    # a trainable head: its gradients' fp32 accumulators scaled and cast in the backward
    trainable = rlfuse.LinearHead(hidden, weight.clone().requires_grad_(), targets)
    backward(rlfuse.ppo_loss(trainable, old, adv_seq, mask, validate=False).loss)
    # every objective of the registry (a token-local one's per-token function in the surrogate
    # kernels; GSPO's ratio modes; the batch-level ones run the log-prob kernels)
    for objective in (cls.example() for cls in objectives.OBJECTIVES.values()):
        for estimator in (KL_ESTIMATORS + ("k3+",) if objective.name == "clip" else ("k3",)):
            kw = dict(ref_logprobs=teacher, validate=False,
                      kl=terms.KLPenalty(0.01, estimator, importance_weighted=estimator == "k1"))
            lp = old.clone().requires_grad_()
            backward(rlfuse.policy_loss(lp, old, adv_seq, mask, objective, **kw).loss)
            for policy in (rlfuse.Logits(logits_of(torch.bfloat16), targets),
                           rlfuse.Logits(logits_of(torch.float32), targets, temperature=0.7),
                           rlfuse.LinearHead(hidden, weight, targets)):
                backward(rlfuse.policy_loss(policy, old, adv_seq, mask, objective,
                                            entropy=terms.EntropyBonus(0.01), **kw).loss)
        rlfuse.kl_penalty(old, teacher, "low_var_kl")

    # A head's logit scale and softcap (SOFTCAP): the log-prob kernels (with entropy) and the
    # single pass with its terms, in bf16 and fp64 (the fp64 tanh's longer polynomial).
    for dtype in (torch.bfloat16, torch.float64):
        capped = rlfuse.LinearHead(hidden.detach().to(dtype).requires_grad_(), weight.to(dtype),
                                   targets, logit_scale=0.5, softcap=30.0, temperature=0.7)
        lp, ent = rlfuse.policy_logprobs(capped, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
        backward(rlfuse.policy_loss(capped, old, adv_seq, mask, "clip", ref_logprobs=teacher,
                                    kl=terms.KLPenalty(0.01), entropy=terms.EntropyBonus(0.01),
                                    validate=False).loss)
        # distillation between two capped heads (S_SOFTCAP, T_SOFTCAP), each divergence
        for divergence in (cls.example() for cls in divergences.DIVERGENCES):
            backward(rlfuse.distill_loss(capped, capped._replace(hidden=capped.hidden.detach(),
                                                                 temperature=1.0), mask,
                                         divergence).loss)

    # The batch-invariant head (kernels.tiles.matmul, kernels.tiles.head_tiles: the logits, the
    # hidden
    # states' and the weight's gradients), in bf16, fp32 and fp64 with a bias, from the
    # log-probs and a loss, and batch-invariant log-probs of logits in memory.
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        leaves = [x.detach().to(dtype).requires_grad_()
                  for x in (hidden, weight, torch.randn(V, generator=g))]
        invariant = rlfuse.LinearHead(leaves[0], leaves[1], targets, bias=leaves[2],
                                      batch_invariant=True)
        lp, ent = rlfuse.policy_logprobs(invariant, return_entropy=True)
        (lp.sum() + ent.sum()).backward()
        backward(rlfuse.ppo_loss(invariant, old, adv_seq, mask, validate=False).loss)
        # distillation from a batch-invariant head (kernels.tiles.distill_tiles), capped and not,
        # beside a batch-invariant teacher head and the teacher's logits: the two passes and
        # the single pass
        teacher_head = invariant._replace(hidden=leaves[0].detach(), temperature=1.3)
        teacher_logits = rlfuse.Logits(torch.randn(B, T + 1, V, generator=g).to(dtype),
                                       targets, temperature=1.3)
        for student in (invariant, invariant._replace(softcap=30.0, logit_scale=0.5)):
            divergence = divergences.JSD(0.5)
            for teacher_model in (teacher_head, teacher_logits):
                rlfuse.token_divergence(student, teacher_model, divergence,
                                        mask).sum().backward()
                backward(rlfuse.distill_loss(student, teacher_model, mask, divergence).loss)
        rlfuse.head_logits(*leaves).float().square().sum().backward()
        # logits in memory reduced in the same fixed blocks (vocab_blocks.block_stats)
        lp, ent = rlfuse.token_logprobs(torch.randn(B, T, V, generator=g).to(dtype), targets,
                                        return_entropy=True, batch_invariant=True)

    # The single pass over a shard of a split vocabulary (ROW_STATS: the whole rows'
    # statistics given, gathered over the group), with the terms, as a LinearHead chunk calls it.
    for dtype in (torch.bfloat16, torch.float32):
        chunk = torch.randn(B * T, 1, V, generator=g).to(dtype)
        row_stats = torch.zeros(B * T, len(surrogate.ROW_STAT_COLUMNS))
        ones = torch.ones(B * T)
        surrogate.surrogate_logits_fwd(
            chunk, targets.reshape(-1, 1), mask.reshape(-1, 1), old.reshape(-1, 1), ones, None,
            ones, ("clip", "ppo_clip", "mc", 0.2, 0.28, (3.0, math.inf), 20.0),
            head=HeadParams(0.7),
            dlogits=chunk, ref_lp=teacher.reshape(-1, 1), kl=terms.KLTerm("k3", 0.01),
            kl_scale=ones, entropy_scale=ones, row_stats=row_stats)

    # The group kernels hold a whole group: large groups must not spill either.
    for group in (256, 1024):
        lp = -torch.rand(group, 64, generator=g, requires_grad=True)   # a full tile
        ones = torch.ones(group, 64, dtype=torch.bool)
        rewards_g = torch.rand(group, generator=g)
        for clip in (None, 0.25):
            backward(rlfuse.ggpo_loss(lp, lp.detach(), rewards_g, ones, group_size=group,
                                      beta=0.5, clip_radius=clip).loss)
        rlfuse.gr_opd_advantages(lp.detach(), lp.detach() - 0.5, ones, group_size=group)


def _local_in_loops(kernel) -> int:
    """The local-memory instructions (LDL, STL) inside the kernel's vocabulary loops."""
    instructions, labels = sass.parse_sass(sass.disassemble(kernel.asm["cubin"]))
    return sum(ins.base in ("LDL", "STL") for loop in sass.find_loops(instructions, labels)
               if loop.inner and loop.loads for ins in loop.instructions)


def _compile_share(arch: int) -> dict:
    """This process's share of the launches compiled: ``{"kernels": rows, "failed": [...],
    "launched": names}``."""
    compile_only.install(arch)
    _drive()
    rows = []
    for (name, _), (kernel, constexprs) in sorted(compile_only.COMPILED.items(),
                                                  key=lambda item: item[0]):
        res = compile_only.resources(kernel)
        if res.get("local", 0) or res.get("stack", 0):
            res["local_in_loops"] = _local_in_loops(kernel)
        rows.append({"kernel": name, "num_warps": kernel.metadata.num_warps, **res,
                     "constexprs": constexprs})
        print(f"{name:28s} warps {kernel.metadata.num_warps:2d} " +
              " ".join(f"{k} {v:4d}" for k, v in res.items()) + "  " +
              " ".join(f"{k}={v}" for k, v in constexprs.items()), flush=True)
    launched = {name for name, _ in compile_only.COMPILED} | \
        {name for name, _ in compile_only.FAILED}
    return {"kernels": rows, "failed": list(compile_only.FAILED), "launched": sorted(launched)}


def _compile_in_processes(arch: int, jobs: int) -> dict:
    """The shares of ``jobs`` processes, each driving every call and compiling the variants of
    its share (``_share``), merged."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = [os.path.join(tmp, f"job{i}.json") for i in range(jobs)]
        procs = [subprocess.Popen([sys.executable, "-m", "tools.gpu_compile", "--arch", str(arch),
                                   "--jobs", str(jobs), "--job", str(i), "--json", path])
                 for i, path in enumerate(paths)]
        for proc in procs:
            proc.wait()
        merged = {"kernels": [], "failed": [], "launched": set()}
        for i, (proc, path) in enumerate(zip(procs, paths)):
            if not os.path.exists(path):
                merged["failed"].append((f"job {i}", f"exit code {proc.returncode}, no report"))
                continue
            with open(path) as f:
                share = json.load(f)
            merged["kernels"] += share["kernels"]
            merged["failed"] += [tuple(x) for x in share["failed"]]
            merged["launched"] |= set(share["launched"])
    return merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90)")
    p.add_argument("--json", help="write the per-kernel table here")
    p.add_argument("--jobs", type=int, default=1,
                   help="compile in this many processes at once, each driving every call and "
                        "compiling its share of the kernel variants (the GPU check's warm-up of "
                        "Triton's cache); the report and the checks are over all of them")
    p.add_argument("--job", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    if args.job is not None:           # one share of --jobs: its report, no checks
        compile_only.SHARD[:] = [args.job, args.jobs]
        with open(args.json, "w") as f:
            json.dump(_compile_share(args.arch), f)
        return 0
    report = _compile_in_processes(args.arch, args.jobs) if args.jobs > 1 else \
        _compile_share(args.arch)
    rows, failed = report["kernels"], list(report["failed"])
    kernels = {obj.fn.__name__ for module in kernel_modules() for obj in vars(module).values()
               if isinstance(obj, JITFunction) and obj.fn.__name__.endswith("_kernel")}
    for name in sorted(kernels - set(report["launched"])):
        failed.append((name, "never launched by the drive: add a call that reaches it"))
    # A spill in a vocabulary loop of a float64 kernel (a testing dtype) is reported; in the
    # others it fails. One outside the loops, once per row, is reported.
    stacked = [r for r in rows if (r.get("local", 0) or r.get("stack", 0))
               and r["constexprs"].get("ACC") != "fp64"]
    spilling = [r for r in stacked if r["local_in_loops"]]
    print(f"\n{len(rows)} kernels compiled for sm_{args.arch} with triton {triton.__version__} "
          f"in {time.monotonic() - t0:.0f} s ({args.jobs} process(es)); {len(failed)} failed; "
          f"{len(spilling)} non-fp64 kernels use local memory in a vocabulary loop "
          f"({len(stacked) - len(spilling)} outside the loops only)")
    for name, error in failed:
        print(f"FAILED {name}: {error}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "triton": triton.__version__, "kernels": rows,
                       "failed": failed}, f, indent=1)
    return 1 if failed or spilling or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
