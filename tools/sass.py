"""Instructions per logit of every row kernel, read from its SASS on a machine without a GPU
(``python -m tools.sass``).

Each row kernel variant that the benchmark's cases (``bench.cases``) launch at the headline
vocabulary is compiled for sm_90 and sm_80 by the compile-only driver (``tools.compile_only``)
(Triton's driver replaced by one that compiles and returns), its cubin disassembled by the
``nvdisasm`` shipped with Triton, and
the inner vocabulary loops found from the control flow:

* basic blocks split at branch targets and after branches; a **back edge** is a branch to a
  block at or before the branch's own address; the **natural loop** of a back edge is its target
  (the header) and every block that reaches the branch without passing the header;
* an **inner loop** contains no other loop's header; a **vocabulary loop** is an inner loop that
  loads from global memory (the loop that only stores the zeros of a masked row is listed, not
  counted).

One iteration of a vocabulary loop processes ``BLOCK_V`` logits with ``32 x num_warps``
threads, ``BLOCK_V / (32 num_warps)`` logits per thread, and every thread (every warp, since
the body is the same for all) executes the body once. So

    instructions per logit = body instructions x 32 x num_warps / BLOCK_V

counts per-thread (lane) instructions per logit; the warp-instructions issued per logit, what
the schedulers see, are that over 32. A kernel's count is the sum over its vocabulary loops (the
single pass: the logsumexp loop and the dlogits loop). The logits loaded per thread per iteration
are read back from the width of the loop's loads, as a check that the loop is neither unrolled
nor split.

The model (``tools.gpus.GPUS``, rates with their sources) turns the counts into time at the headline
shape (N = 16384 rows, V = 151936): ``issue`` is the warp-instructions over 4 per clock per SM,
``MUFU`` the MUFU lane operations over 16 per clock per SM, ``memory`` the kernel's logical bytes
per logit (one read; one read + one write for a kernel that writes dlogits) over 90% of the peak
HBM bandwidth. A row runs each loop body once per block it covers: ``V // BLOCK_V`` times for a
loop whose global loads carry no predicate (it reads whole blocks only; the row's partial block
is code outside it), ``ceil(V / BLOCK_V)`` times for a masked loop (the masked tail lanes issue
too); and the code outside the loops once, counted as every instruction there, taken or not (an
upper bound: 4-31% of a row's instructions at V = 151936, the most in the single pass), a loop
there without memory accesses (a fixed computation of the row, like a root find) once per
iteration, its count read from its counter (``trip_count``; a count it cannot read fails).
A kernel's row pins two counts (``pinned``): per logit in the vocabulary loops, and over the
whole row at the headline vocabulary.
The ratios issue / memory and MUFU / memory say which limit binds; they are a model from SASS,
not a timing.

    python -m tools.sass                           # sm_90 and sm_80, prints the tables
    python -m tools.sass --arch 90 --out DIR       # DIR/sass.json and DIR/sm_90/*.sass
    python -m tools.sass --write-pins tests/sass_pins.json   # refresh the CI pins

The compilation runs in processes of their own without ``TRITON_INTERPRET`` (one per arch, in
parallel); ``tests/test_sass.py`` runs this and holds each kernel's count to its pin.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from tools.gpus import GPUS

ROOT = Path(__file__).resolve().parent.parent
ARCHS = (90, 80)

# --------------------------------------------------------------------------------------------
# The model: the headline shape and the rates of an SM, with their sources (the GPUs:
# tools.gpus)
# --------------------------------------------------------------------------------------------

HEADLINE_N, HEADLINE_V = 16384, 151936
# Hopper and Ampere SMs have four sub-partitions, each with a warp scheduler that dispatches one
# warp-instruction per clock (NVIDIA A100 Tensor Core GPU Architecture whitepaper, "A100 SM
# architecture"; NVIDIA H100 Tensor Core GPU Architecture whitepaper, "H100 SM architecture").
ISSUE_PER_CLOCK_PER_SM = 4
# MUFU (ex2, lg2, rcp, rsqrt, sin, cos): 16 results per clock per SM on compute capability 8.0
# and 9.0 (CUDA C++ Programming Guide, "Arithmetic Instructions", throughput of native arithmetic
# instructions), against 4 x 32 lanes of issue: one MUFU costs as much as 8 issued instructions.
MUFU_PER_CLOCK_PER_SM = 16
# The fraction of the peak HBM bandwidth a streaming kernel sustains (an assumption of the model;
# bench measures the copy bandwidth of each GPU it runs on).
HBM_EFFICIENCY = 0.9


# Per-SM limits that set occupancy (CUDA C++ Programming Guide, "Compute Capabilities",
# technical specifications per compute capability): 64 resident warps, 32 resident blocks,
# 64K 32-bit registers allocated per warp in units of 256, shared memory per SM (228 KB on 9.0,
# 164 KB on 8.0) of which 1 KB per block is reserved by the system.
MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM, REGISTERS_PER_SM, REGISTER_UNIT = 64, 32, 65536, 256
SHARED_PER_SM = {90: 228 * 1024, 80: 164 * 1024}
SHARED_RESERVED_PER_BLOCK = 1024


def occupancy(arch: int, registers: int, num_warps: int, shared: int) -> dict:
    """Resident blocks and warps per SM of a kernel, and which limit sets them."""
    per_warp = math.ceil(max(registers, 1) * 32 / REGISTER_UNIT) * REGISTER_UNIT
    limits = {"warps": MAX_WARPS_PER_SM // num_warps,
              "registers": REGISTERS_PER_SM // (per_warp * num_warps),
              "blocks": MAX_BLOCKS_PER_SM}
    if shared:
        limits["shared"] = SHARED_PER_SM[arch] // (shared + SHARED_RESERVED_PER_BLOCK)
    blocks = min(limits.values())
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
            "occupancy": blocks * num_warps / MAX_WARPS_PER_SM,
            "limited_by": min(limits, key=limits.get)}


# --------------------------------------------------------------------------------------------
# SASS: instructions, classes, control flow
# --------------------------------------------------------------------------------------------

# Instruction classes, in the order of the table, with what goes in each.
CLASSES = {
    "fp32": "floating-point arithmetic: FADD, FMUL, FFMA, FMNMX (fp16x2 and fp64 ops too)",
    "mufu": "the multi-function unit: MUFU.EX2, .LG2, .RCP, ...",
    "cvt": "conversion and unpack: F2F, F2I, I2F, F2FP, PRMT, and the bf16 -> fp32 widening "
           "done on the integer units (SHF.L by 16, IMAD.U32 by 0x10000, LOP3 & 0xffff0000)",
    "int": "integer and address arithmetic: IADD3, IMAD, LEA, LOP3, SHF, ... (uniform U* too)",
    "pred": "compare, predicate and select: ISETP, FSETP, SEL, FSEL, PLOP3, ...",
    "sync": "shuffle, barrier, shared memory: SHFL, BAR, LDS, STS, ...",
    "mem": "global and constant memory: LDG, STG, LDC, ULDC, ATOM, LDGSTS, ...",
    "branch": "control flow: BRA, EXIT, BSSY, BSYNC, CALL, ...",
    "other": "moves, special registers, NOP: MOV, IMAD.MOV, S2R, CS2R, ...",
}
_OPCODE_CLASS = {}
for _cls, _ops in {
    "fp32": "FADD FMUL FFMA FMNMX FADD32I FMUL32I FFMA32I FSWZADD FCHK DADD DMUL DFMA DMNMX "
            "HADD2 HMUL2 HFMA2 HMNMX2 HADD2_32I HMUL2_32I HFMA2_32I",
    "mufu": "MUFU",
    "cvt": "F2F F2I I2F I2FP F2FP F2IP I2I I2IP FRND PRMT",
    "int": "IADD3 IADD IADD32I IMAD IMAD32I IMUL IMNMX ISCADD LEA LOP3 LOP LOP32I SHF SHL SHR "
           "IABS POPC FLO BREV BMSK SGXT VIADD VIMNMX VIADDMNMX IDP IMMA",
    "pred": "ISETP FSETP DSETP HSETP2 PSETP PLOP3 SEL FSEL P2R R2P FSET ISET VOTEU",
    "sync": "SHFL BAR LDS STS ATOMS LDSM MEMBAR DEPBAR REDUX VOTE WARPSYNC FENCE ERRBAR CCTL "
            "SYNCS ARRIVES MATCH",
    "mem": "LDG STG LDC LD ST LDL STL RED ATOM ATOMG LDGSTS LDGDEPBAR UBLKCP UTMALDG UTMASTG "
           "UTMAPF UTMACCTL",
    "branch": "BRA BRX JMP JMX CALL RET EXIT BSSY BSYNC BREAK BMOV KILL BPT YIELD",
    "other": "MOV MOV32I NOP CS2R S2R S2UR R2UR B2R",
}.items():
    for _op in _ops.split():
        _OPCODE_CLASS[_op] = _cls

_JUMPS = {"BRA", "BRX", "JMP", "JMX"}
_ENDS = {"EXIT", "RET", "KILL"}
_GLOBAL_LOADS = {"LDG", "LDGSTS"}
_GLOBAL_STORES = {"STG"}
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*([.$\w]+):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")
_SECTION = re.compile(r"^\s*\.section\s+\.text\.([\w$.]+)")


@dataclasses.dataclass
class Instruction:
    addr: int
    text: str            # without the address and the ';'
    predicated: bool     # under a predicate other than PT
    opcode: str          # e.g. LDG.E.128
    target: Optional[str]   # the label a jump goes to

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def cls(self) -> str:
        return classify(self)


def classify(ins: Instruction) -> str:
    """The class (a key of ``CLASSES``) of one instruction."""
    op, text = ins.base, ins.text
    if op == "IMAD" and ".MOV" in ins.opcode:
        return "other"                       # IMAD.MOV: a move on the FMA pipe
    if op == "HFMA2" and ".MMA" in ins.opcode and "-RZ, RZ" in text:
        return "other"                       # HFMA2.MMA Rd, -RZ, RZ, c: a constant move
    # bf16 -> fp32: the 16 bits moved to the top of the word on the integer units
    if op == "SHF" and ".L." in ins.opcode + "." and re.search(r",\s*0x10,", text):
        return "cvt"
    if op == "IMAD" and ".U32" in ins.opcode and re.search(r",\s*0x10000,", text):
        return "cvt"
    if op == "LOP3" and "0xffff0000" in text:
        return "cvt"
    if op in _OPCODE_CLASS:
        return _OPCODE_CLASS[op]
    if op.startswith("U") and op[1:] in _OPCODE_CLASS:   # the uniform datapath
        cls = _OPCODE_CLASS[op[1:]]
        return "mem" if op == "ULDC" else cls
    return "other"


def access_bytes(ins: Instruction) -> int:
    """Bytes per thread of a global load or store (``.128``: 16; no width: 4)."""
    for part in ins.opcode.split(".")[1:]:
        if part in _WIDTH:
            return _WIDTH[part]
    return 4


def parse_sass(text: str, function: Optional[str] = None
               ) -> Tuple[List[Instruction], Dict[str, int]]:
    """The instructions and labels of ``function``'s code section in ``nvdisasm -c`` output (the
    first code section when None)."""
    instructions, labels = [], {}
    section, pending = None, []
    for line in text.splitlines():
        m = _SECTION.match(line)
        if m:
            if section is not None and instructions:
                break                        # the function's section is over
            section = m.group(1)
            continue
        if section is None or (function is not None and section != function):
            continue
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        addr, body = int(m.group(1), 16), m.group(2).strip()
        predicated = False
        if body.startswith("@"):
            guard, body = body.split(None, 1)
            predicated = guard not in ("@PT", "@!PT")
        opcode = body.split(None, 1)[0]
        target = _TARGET.search(body)
        instructions.append(Instruction(addr, body, predicated, opcode,
                                        target.group(1) if target else None))
        for label in pending:
            labels[label] = addr
        pending = []
    return instructions, labels


@dataclasses.dataclass
class Loop:
    header: int          # address of the first instruction of the header block
    latch: int           # address of the (last) back-edge branch
    blocks: List[int]    # start addresses of the blocks in the loop
    instructions: List[Instruction]
    inner: bool = True

    @property
    def loads(self) -> bool:
        return any(i.base in _GLOBAL_LOADS for i in self.instructions)

    @property
    def full_blocks(self) -> bool:
        """No global load of the loop is predicated: it never reads past the row, so it runs
        over whole blocks only (the row's partial block is code outside it)."""
        return not any(i.predicated for i in self.instructions if i.base in _GLOBAL_LOADS)

    @property
    def stores(self) -> bool:
        return any(i.base in _GLOBAL_STORES for i in self.instructions)

    @property
    def classes(self) -> Dict[str, int]:
        counts = Counter(i.cls for i in self.instructions)
        return {c: counts.get(c, 0) for c in CLASSES}

    def global_bytes(self, kind) -> int:
        ops = _GLOBAL_LOADS if kind == "load" else _GLOBAL_STORES
        return sum(access_bytes(i) for i in self.instructions if i.base in ops)


def find_loops(instructions: List[Instruction], labels: Dict[str, int]) -> List[Loop]:
    """The natural loops of the control-flow graph, one per header, by address; ``inner`` marks
    those that hold no other loop's header."""
    if not instructions:
        return []
    index = {ins.addr: k for k, ins in enumerate(instructions)}
    jumps_to = {k: index[labels[ins.target]] for k, ins in enumerate(instructions)
                if ins.base in _JUMPS and ins.target in labels}
    # basic blocks: leaders at the entry, at jump targets, after a jump or an end
    leaders = {0, *jumps_to.values()}
    for k, ins in enumerate(instructions[:-1]):
        if ins.base in _JUMPS or ins.base in _ENDS:
            leaders.add(k + 1)
    starts = sorted(leaders)
    ends = [s - 1 for s in starts[1:]] + [len(instructions) - 1]
    block_of = {}
    for b, (s, e) in enumerate(zip(starts, ends)):
        for k in range(s, e + 1):
            block_of[k] = b
    succ = {b: set() for b in range(len(starts))}
    for b, e in enumerate(ends):
        last = instructions[e]
        falls_through = (last.predicated or ".DIV" in last.opcode   # BRA.DIV: when diverged
                         or not (last.base in _JUMPS or last.base in _ENDS))
        if e in jumps_to:
            succ[b].add(block_of[jumps_to[e]])
        if falls_through and b + 1 < len(starts):
            succ[b].add(b + 1)
    pred = {b: set() for b in succ}
    for b, targets in succ.items():
        for t in targets:
            pred[t].add(b)

    bodies, latches = {}, {}
    for b, targets in succ.items():
        for h in targets:
            if starts[h] <= ends[b]:         # a back edge b -> h
                body, stack = {h, b}, [b]
                while stack:
                    x = stack.pop()
                    if x == h:
                        continue
                    for p in pred[x]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies.setdefault(h, set()).update(body)
                latches[h] = max(latches.get(h, 0), instructions[ends[b]].addr)
    loops = []
    for h, body in sorted(bodies.items()):
        blocks = sorted(body)
        first = instructions[starts[h]]
        if len(body) == 1 and starts[h] == ends[h] and not first.predicated and \
                first.base == "BRA":
            continue                         # "L: BRA L", the trap after the last EXIT
        loops.append(Loop(
            header=instructions[starts[h]].addr, latch=latches[h],
            blocks=[instructions[starts[b]].addr for b in blocks],
            instructions=[instructions[k] for b in blocks for k in range(starts[b], ends[b] + 1)],
            inner=not any(other != h and other in body for other in bodies)))
    return loops


def nvdisasm_path() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm_path(), "-c", f.name], text=True, capture_output=True,
                              check=True).stdout


# --------------------------------------------------------------------------------------------
# Per kernel: the counts and the model
# --------------------------------------------------------------------------------------------

# Logical bytes per logit of each row kernel, in units of the logits' element size: (reads,
# writes). The floor the model holds each kernel to.
def floor_of(kernel: str, constexprs: Dict[str, str]):
    if kernel == "_token_logprobs_fwd_kernel":
        return 1, 0
    if kernel == "_token_logprobs_bwd_kernel":
        return 1, 1                          # read the logits, write dlogits
    if kernel == "_surrogate_logits_kernel":
        # the single pass: one read and one write of dlogits (its second read of a row is an L2
        # hit at best); without dlogits one read
        from rlfuse.kernels.rows.surrogate import SINGLE_PASS_FLAGS

        writes = SINGLE_PASS_FLAGS.reads(constexprs["FLAGS"], "WRITE_DLOGITS")
        return (1, 1) if writes else (1, 0)
    if kernel == "_scale_rows_kernel":
        return 1, 1
    # distillation, per logit of the vocabulary: the student's and the teacher's rows read
    # (each twice forward: statistics, then terms; the second an L2 hit at best), the student's
    # gradient written backward; the loss's single pass both (its re-reads L2 hits at best)
    if kernel == "_distill_fwd_kernel":
        return 2, 0
    if kernel in ("_distill_bwd_kernel", "_distill_single_pass_kernel"):
        return 2, 1
    raise KeyError(f"tools/sass.py: no memory floor for {kernel}; add it to floor_of")


_IMMEDIATE = re.compile(r"^-?(0x[0-9a-f]+|\d+)$")


def _operands(ins: Instruction) -> List[str]:
    parts = ins.text.split(None, 1)
    return [o.strip().split(".reuse")[0] for o in parts[1].split(",")] if len(parts) > 1 else []


def _immediate(text: str) -> Optional[int]:
    return int(text, 0) if _IMMEDIATE.match(text) else None


def trip_count(loop: Loop, instructions: List[Instruction]) -> int:
    """The iterations of a loop that counts: a register the loop steps by one
    (``(U)IADD3 X, X, -0x1``), set to an immediate before the header (``(U)MOV X, n`` or
    ``IMAD.MOV.U32 X, RZ, RZ, n``), counting down to 0 or up to an immediate it is compared
    with. A loop outside the vocabulary loops whose count this cannot read fails the count,
    rather than be left out of it."""
    for ins in loop.instructions:
        ops = _operands(ins)
        if ins.base not in ("IADD3", "UIADD3") or len(ops) < 3 or ops[0] != ops[1] or \
                _immediate(ops[2]) not in (1, -1):
            continue
        counter, step = ops[0], _immediate(ops[2])
        start = None
        for before in reversed([i for i in instructions if i.addr < loop.header]):
            written = _operands(before)
            if written and written[0] == counter:
                start = _immediate(written[-1]) if before.base in ("MOV", "UMOV", "IMAD") \
                    else None
                break
        if start is None:
            continue
        if step < 0:
            return start
        limits = [_immediate(o) for i in loop.instructions if i.base in ("ISETP", "UISETP")
                  for o in _operands(i) if counter in _operands(i)]
        limits = [n for n in limits if n is not None]
        if len(limits) == 1:
            return limits[0] - start
    raise ValueError(f"tools/sass.py: the loop at {loop.header:#06x} runs outside the "
                     f"vocabulary loops and its trip count is not read from a counter")


def vocab_trips(full_blocks: bool, block_v: int, vocab: int) -> int:
    """Iterations of a vocabulary loop over a row of ``vocab``: whole blocks only for a loop
    whose loads carry no predicate, every block (the masked tail too) otherwise."""
    return vocab // block_v if full_blocks else math.ceil(vocab / block_v)


def row_counts(row: dict, vocab: int) -> Tuple[int, int]:
    """A thread's (instructions, MUFU operations) over one row of ``vocab``: each vocabulary
    loop's body once per block it runs over, and the row's code outside them."""
    body, mufu = row["per_row"], row["per_row_mufu"]
    for lp in row["loops"]:
        if lp["counted"]:
            trips = vocab_trips(lp["full_blocks"], row["BLOCK_V"], vocab)
            body += trips * lp["instructions"]
            mufu += trips * lp["classes"]["mufu"]
    return body, mufu


def issued(ins: Instruction, labels: Dict[str, int]) -> bool:
    """Whether an instruction issues: not a NOP, nor the branch to itself that ends a kernel."""
    return ins.base != "NOP" and not (ins.base == "BRA" and labels.get(ins.target) == ins.addr)


def analyse(label: str, dtype: str, kernel: str, constexprs: Dict[str, str], num_warps: int,
            resources: Dict[str, int], shared: int, arch: int, sass: str) -> dict:
    """One kernel variant's row of the table: its loops, counts per logit and the model."""
    instructions, labels = parse_sass(sass, kernel)
    loops = find_loops(instructions, labels)
    block_v = int(constexprs["BLOCK_V"])
    per_thread = block_v / (32 * num_warps)          # logits per thread per iteration
    element = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}[dtype]
    counted = [lp for lp in loops if lp.inner and lp.loads]
    body = sum(len(lp.instructions) for lp in counted)
    # a row's code outside the vocabulary loops: every instruction there once, taken or not,
    # and a fixed loop's (no memory access: the row's own math) once per iteration; a loop that
    # only stores (a masked row's zeros) is what a masked row runs instead
    fixed = {lp.header: trip_count(lp, instructions) for lp in loops
             if lp.inner and not lp.loads and not lp.stores}
    repeats = {i.addr: fixed.get(lp.header, 0) for lp in loops if lp.inner
               for i in lp.instructions}
    per_row = [i for i in instructions if issued(i, labels)
               for _ in range(repeats.get(i.addr, 1))]
    classes = Counter()
    for lp in counted:
        classes.update(lp.classes)
    reads, writes = floor_of(kernel, constexprs)
    row = {
        "label": label, "kernel": kernel, "dtype": dtype, "arch": arch,
        "constexprs": constexprs, "BLOCK_V": block_v, "num_warps": num_warps,
        "registers": resources.get("reg", 0), "local": resources.get("local", 0),
        "shared": shared, **occupancy(arch, resources.get("reg", 0), num_warps, shared),
        "instructions": len(instructions),
        "loops": [{"header": f"{lp.header:#06x}", "latch": f"{lp.latch:#06x}",
                   "blocks": len(lp.blocks), "instructions": len(lp.instructions),
                   "inner": lp.inner, "loads": lp.loads, "stores": lp.stores,
                   "counted": lp in counted, "trips": fixed.get(lp.header),
                   "full_blocks": lp.full_blocks, "classes": lp.classes,
                   "calls": sum(i.base == "CALL" for i in lp.instructions),
                   "logits_loaded_per_thread": lp.global_bytes("load") / element,
                   "logits_stored_per_thread": lp.global_bytes("store") / element}
                  for lp in loops],
        "logits_per_thread": per_thread,
        "body": body,
        "body_mufu": classes.get("mufu", 0),
        "per_row": len(per_row),
        "per_row_mufu": sum(i.cls == "mufu" for i in per_row),
        "instr_per_logit": body / per_thread,
        "classes_per_logit": {c: classes.get(c, 0) / per_thread for c in CLASSES},
        "floor": {"reads": reads, "writes": writes, "bytes_per_logit": (reads + writes) * element},
    }
    # the whole row's at the headline vocabulary
    row["row_instr_per_logit"] = row_counts(row, HEADLINE_V)[0] / (HEADLINE_V / (32 * num_warps))
    row["model"] = model(row, arch)
    return row


def model(row: dict, arch: int, n_rows: int = HEADLINE_N, vocab: int = HEADLINE_V) -> dict:
    """Issue, MUFU and memory time (ms) of one launch over ``n_rows x vocab`` logits on each GPU
    that runs this arch's SASS, and issue / memory and MUFU / memory."""
    body, mufu = row_counts(row, vocab)
    warp_instr = n_rows * row["num_warps"] * body
    mufu_lanes = n_rows * row["num_warps"] * 32 * mufu
    nbytes = n_rows * vocab * row["floor"]["bytes_per_logit"]
    out = {}
    for gpu in GPUS:
        if gpu.arch != arch:
            continue
        hz = gpu.clock_ghz * 1e9
        issue = warp_instr / (gpu.sms * ISSUE_PER_CLOCK_PER_SM * hz)
        mufu = mufu_lanes / (gpu.sms * MUFU_PER_CLOCK_PER_SM * hz)
        memory = nbytes / (HBM_EFFICIENCY * gpu.hbm_tbps * 1e12)
        out[gpu.name] = {"issue_ms": issue * 1e3, "mufu_ms": mufu * 1e3,
                         "memory_ms": memory * 1e3, "issue_over_memory": issue / memory,
                         "mufu_over_memory": mufu / memory}
    return out


# --------------------------------------------------------------------------------------------
# The variants: what the benchmark's cases launch at the headline vocabulary
# --------------------------------------------------------------------------------------------

# (label, bench op, what of its step: "fwd" / "bwd" / "no grad", dtypes): each row kernel the
# cases launch, under the label of its row (and of its pin). The single pass writes dlogits in
# the forward; its backward only scales them.
VARIANTS = (
    ("token_logprobs fwd", "token_logprobs", "fwd", ("bf16", "fp32")),
    ("token_logprobs bwd", "token_logprobs", "bwd", ("bf16", "fp32")),
    ("token_logprobs fwd + entropy", "token_logprobs_entropy", "fwd", ("bf16", "fp32")),
    ("token_logprobs bwd + entropy", "token_logprobs_entropy", "bwd", ("bf16", "fp32")),
    ("single pass GPPO chi2/atomic", "gppo_logits", "fwd", ("bf16", "fp32")),
    ("scale_rows (upstream grad != 1)", "gppo_logits", "bwd", ("bf16", "fp32")),
    ("single pass PPO clip", "ppo_logits", "fwd", ("bf16", "fp32")),
    ("single pass GPPO, no grad", "gppo_logits", "no grad", ("bf16", "fp32")),
    ("GGPO fwd (log-probs)", "ggpo_logits", "fwd", ("bf16",)),
    ("GGPO bwd (dlogits)", "ggpo_logits", "bwd", ("bf16",)),
    ("distill JSD fwd", "token_divergence_logits", "fwd", ("bf16", "fp32")),
    ("distill JSD bwd", "token_divergence_logits", "bwd", ("bf16", "fp32")),
    ("distill JSD single pass", "distill_logits", "fwd", ("bf16", "fp32")),
)
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Every GPPO cell's single pass (bf16, with the gradient), off policy, and on policy where that
# compiles another region (the root-found cells: regions.row_region), besides chi2/atomic above.
CELL_DTYPE = "bf16"


def cell_variants():
    """(label, geometry, topology, on policy) of the GPPO cells' single passes."""
    from rlfuse._names import GEOMETRIES, TOPOLOGIES
    from rlfuse.kernels.lib.regions import ROOT_FOUND

    cells = [(f"single pass GPPO {g}/{t}", g, t, False) for g in GEOMETRIES for t in TOPOLOGIES
             if (g, t) != ("chi2", "atomic")]
    return cells + [(f"single pass GPPO {g}/{t}, on policy", g, t, True) for g, t in ROOT_FOUND]

_CURRENT_LABEL: List[Optional[str]] = [None]
LAUNCHES = []    # (label, kernel name, compiled kernel, constexprs), in launch order


class _Labelled:
    def __init__(self, label):
        self.label = label

    def __enter__(self):
        _CURRENT_LABEL[0] = self.label

    def __exit__(self, *exc):
        _CURRENT_LABEL[0] = None


def _drive(dtype_names):
    """Each variant's step of its bench case, under the label of its row. Every launch compiles
    (the driver only compiles) and returns zero-filled outputs."""
    import torch

    import rlfuse
    from bench import cases

    for name in dtype_names:
        shape = cases.Shape(N=6, V=HEADLINE_V, dtype=getattr(torch, DTYPES[name]), batch=2,
                            group_size=2, hidden=8)
        for label, op_name, step, dtypes in VARIANTS:
            if name not in dtypes:
                continue
            op, x = cases.OPS[op_name], cases.make_inputs(shape, "cpu")
            if step == "no grad":
                with torch.no_grad(), _Labelled(f"{label}, {name}"):
                    op.run(rlfuse, x)
                continue
            with _Labelled(f"{label}, {name}" if step == "fwd" else None):
                outputs = cases.as_tuple(op.run(rlfuse, x))
            if step == "bwd":
                with _Labelled(f"{label}, {name}"):
                    torch.autograd.grad(outputs, x.logits, [torch.ones_like(o) for o in outputs])
        if name != CELL_DTYPE:
            continue
        x = cases.make_inputs(shape, "cpu")
        for label, geometry, topology, on_policy in cell_variants():
            with _Labelled(f"{label}, {name}"):
                rlfuse.gppo_loss(rlfuse.Logits(x.logits, x.targets), None if on_policy
                                 else x.old_lp, x.advantages, x.mask, geometry=geometry,
                                 topology=topology)


def worker(arch: int, dtypes, sass_dir: Optional[Path]) -> dict:
    """Compiles the variants for ``arch`` (in this process: TRITON_INTERPRET unset) and counts
    their loops."""
    import triton

    from tools import compile_only

    def recording(compile_run):
        def record_run(self, *args, grid, warmup, **kwargs):
            kernel = compile_run(self, *args, grid=grid, warmup=warmup, **kwargs)
            if kernel is not None and _CURRENT_LABEL[0] is not None:
                constexprs = compile_only.COMPILED[(self.fn.__name__, kernel.hash)][1]
                if "BLOCK_V" in constexprs:      # a row kernel
                    LAUNCHES.append((_CURRENT_LABEL[0], self.fn.__name__, kernel, constexprs))
            return kernel
        return record_run

    compile_only.install(arch, recording)

    t0 = time.monotonic()
    _drive(dtypes)
    rows, seen = [], {}
    for label, name, kernel, constexprs in LAUNCHES:
        if seen.setdefault(label, kernel.hash) != kernel.hash:
            raise RuntimeError(f"bench --sass: {label!r} launched two row kernels; give each "
                               f"its own label")
        if any(row["label"] == label for row in rows):
            continue
        sass = disassemble(kernel.asm["cubin"])
        if sass_dir is not None:
            sass_dir.mkdir(parents=True, exist_ok=True)
            (sass_dir / (re.sub(r"[^\w]+", "_", label).strip("_") + ".sass")).write_text(sass)
        rows.append(analyse(label, label.rsplit(", ", 1)[1], name, constexprs,
                            kernel.metadata.num_warps, compile_only.resources(kernel),
                            kernel.metadata.shared, arch, sass))
    return {"arch": arch, "triton": triton.__version__,
            "elapsed_s": round(time.monotonic() - t0, 1), "kernels": rows,
            "failed": compile_only.FAILED}


# --------------------------------------------------------------------------------------------
# Tables, pins, the command line
# --------------------------------------------------------------------------------------------

def pinned(row: dict) -> List[Tuple[str, float]]:
    """A kernel's pinned counts: instructions per logit in its vocabulary loops, and over its
    whole row at the headline vocabulary (the code outside the loops included)."""
    return [(row["label"], round(row["instr_per_logit"], 2)),
            (f"{row['label']} (whole row)", round(row["row_instr_per_logit"], 2))]


def render(result: dict) -> str:
    arch, rows = result["arch"], result["kernels"]
    gpus = [g for g in GPUS if g.arch == arch]
    lines = [f"sm_{arch} (triton {result['triton']}): instructions per logit in the inner "
             f"vocabulary loops (per thread: loop body x 32 x warps / BLOCK_V), by class; rest: "
             f"instructions per thread outside the loops, once per row (a fixed loop's once per "
             f"iteration); row: the whole row's per logit at V = {HEADLINE_V}", ""]
    width = max(len(r["label"]) for r in rows)
    head = (f"{'kernel':{width}s} {'BLOCK_V':>7s} {'warps':>5s} {'regs':>4s} {'occ':>4s} "
            f"{'loops':>5s} {'rest':>5s} {'row':>6s} {'instr':>6s} " +
            " ".join(f"{c:>6s}" for c in CLASSES))
    lines += [head, "-" * len(head)]
    for r in rows:
        n_loops = sum(lp["counted"] for lp in r["loops"])
        lines.append(
            f"{r['label']:{width}s} {r['BLOCK_V']:7d} {r['num_warps']:5d} {r['registers']:4d} "
            f"{r['occupancy']:4.0%} {n_loops:5d} {r['per_row']:5d} "
            f"{r['row_instr_per_logit']:6.2f} {r['instr_per_logit']:6.2f} " +
            " ".join(f"{r['classes_per_logit'][c]:6.2f}" for c in CLASSES))
    lines += ["", f"model at N = {HEADLINE_N} rows x V = {HEADLINE_V}: issue (warp-instructions "
              f"/ {ISSUE_PER_CLOCK_PER_SM} per clock per SM) and MUFU (/ "
              f"{MUFU_PER_CLOCK_PER_SM} lanes per clock per SM) over the memory floor (bytes "
              f"per logit / {HBM_EFFICIENCY:.0%} of peak HBM); a model from SASS, not a timing",
              "  " + "; ".join(f"{g.name}: {g.sms} SMs, {g.clock_ghz} GHz, {g.hbm_tbps} TB/s "
                               f"({g.source})" for g in gpus), ""]
    head = f"{'kernel':{width}s} {'floor':>6s} " + " ".join(
        f"{g.name + ' ' + k:>11s}" for g in gpus for k in ("issue", "MUFU", "mem ms"))
    lines += [head, "-" * len(head)]
    for r in rows:
        f = r["floor"]
        floor = f"{f['reads']}R" + (f"+{f['writes']}W" if f["writes"] else "")
        cells = []
        for g in gpus:
            m = r["model"][g.name]
            cells += [f"{m['issue_over_memory']:10.2f}x", f"{m['mufu_over_memory']:10.2f}x",
                      f"{m['memory_ms']:11.3f}"]
        lines.append(f"{r['label']:{width}s} {floor:>6s} " + " ".join(cells))
    return "\n".join(lines)


def compare_pins(results: List[dict], pins: dict, tolerance: float):
    """(rises, drops, missing, unpinned): kernels whose count rose by more than ``tolerance``
    over their pin, fell below it, pins with no kernel, kernels with no pin."""
    rises, drops, missing, unpinned = [], [], [], []
    for result in results:
        arch_pins = dict(pins.get("pins", {}).get(f"sm_{result['arch']}", {}))
        for key, now in (pin for row in result["kernels"] for pin in pinned(row)):
            if key not in arch_pins:
                unpinned.append(f"sm_{result['arch']} {key}: {now:.2f}")
                continue
            pin = arch_pins.pop(key)
            if now > pin + tolerance:
                rises.append(f"sm_{result['arch']} {key}: {pin:.2f} -> {now:.2f} instructions "
                             f"per logit (+{now - pin:.2f} > {tolerance})")
            elif now < pin:
                drops.append(f"sm_{result['arch']} {key}: {pin:.2f} -> {now:.2f}")
        missing += [f"sm_{result['arch']} {key}" for key in arch_pins]
    return rises, drops, missing, unpinned


def write_pins(results: List[dict], path: Path):
    old = json.loads(path.read_text()) if path.exists() else {}
    pins = dict(old.get("pins", {}))
    for result in results:
        pins[f"sm_{result['arch']}"] = dict(pin for r in result["kernels"] for pin in pinned(r))
    path.write_text(json.dumps({
        "about": "instructions per logit in the inner vocabulary loops of each row kernel, and "
                 "over its whole row at V = 151936 (tools/sass.py); tests/test_sass.py fails a "
                 "rise of more than 0.5 over a pin. "
                 "Refresh: python -m tools.sass --write-pins tests/sass_pins.json",
        "triton": results[0]["triton"], "pins": pins}, indent=1, sort_keys=False) + "\n")


def _run_workers(archs, dtypes, sass_root: Optional[Path]) -> List[dict]:
    env = {k: v for k, v in os.environ.items() if k != "RLFUSE_SINGLE_PASS"}   # the default
    env["TRITON_INTERPRET"] = "0"            # compiled, not interpreted (bench/__init__ sets 1)
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            out = Path(tmp) / f"sm_{arch}.json"
            cmd = [sys.executable, "-m", "tools.sass", "--worker", "--arch", str(arch),
                   "--dtype", ",".join(dtypes), "--json", str(out)]
            if sass_root is not None:
                cmd += ["--sass-dir", str(sass_root / f"sm_{arch}")]
            procs.append((arch, out, subprocess.Popen(cmd, env=env, cwd=ROOT, text=True,
                                                      stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT)))
        results = []
        for arch, out, proc in procs:
            log = proc.communicate()[0]
            if proc.returncode != 0 or not out.exists():
                sys.stderr.write(log)
                raise RuntimeError(f"bench --sass: the sm_{arch} compile failed "
                                   f"(exit {proc.returncode})")
            results.append(json.loads(out.read_text()))
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.sass",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default=",".join(map(str, ARCHS)),
                   help="compute capabilities, comma list (default 90,80)")
    p.add_argument("--dtype", default="bf16,fp32",
                   help="logits dtypes, comma list of bf16, fp32 (default both)")
    p.add_argument("--out", help="directory for sass.json and the disassembly (DIR/sm_XX/)")
    p.add_argument("--write-pins", help="write the counts to this pins file (the CI's: "
                                        "tests/sass_pins.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--sass-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    archs = [int(a) for a in args.arch.split(",") if a]
    dtypes = [d for d in args.dtype.split(",") if d]
    for d in dtypes:
        if d not in ("bf16", "fp32"):
            p.error(f"--dtype: expected bf16 or fp32, got {d!r}")

    if args.worker:
        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            p.error("the worker compiles: unset TRITON_INTERPRET")
        result = worker(archs[0], dtypes, Path(args.sass_dir) if args.sass_dir else None)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 1 if result["failed"] else 0

    out = Path(args.out) if args.out else None
    t0 = time.monotonic()
    results = _run_workers(archs, dtypes, out)
    for result in results:
        print(render(result), end="\n\n")
        for name, error in result["failed"]:
            print(f"FAILED sm_{result['arch']} {name}: {error}", file=sys.stderr)
    print(f"{sum(len(r['kernels']) for r in results)} kernel variants, "
          f"{len(results)} archs, in {time.monotonic() - t0:.0f} s")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sass.json").write_text(json.dumps({
            "shape": {"N": HEADLINE_N, "V": HEADLINE_V},
            "model": {"issue_per_clock_per_sm": ISSUE_PER_CLOCK_PER_SM,
                      "mufu_per_clock_per_sm": MUFU_PER_CLOCK_PER_SM,
                      "hbm_efficiency": HBM_EFFICIENCY,
                      "gpus": [dataclasses.asdict(g) for g in GPUS]},
            "classes": CLASSES, "results": results}, indent=1) + "\n")
        print(f"wrote {out / 'sass.json'}")
    if args.write_pins:
        write_pins(results, Path(args.write_pins))
        print(f"wrote {args.write_pins}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
