"""The instruction counts of the row kernels, read from their SASS (``tools/sass.py``): the loop
finder on a hand-written listing, then every row kernel variant compiled for sm_90 and sm_80 in
processes of their own (compiled, not interpreted), the table printed (``pytest -s``), its
structure checked, and each kernel's instructions per logit held to its pin in
``tests/sass_pins.json``: a rise of more than ``TOLERANCE`` fails, a drop is reported. After a
kernel change that lowers (or knowingly raises) a count, refresh the pins with

    python -m tools.sass --write-pins tests/sass_pins.json

Pins hold for the Triton that wrote them (``"triton"`` in the file): another compiler version
emits other code, so there the counts are printed and checked, not compared.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import nvidia_backend, process_env

from rlfuse._names import GEOMETRIES, TOPOLOGIES
from rlfuse.kernels.lib.regions import ROOT_FOUND
from rlfuse.kernels.rows.surrogate import SINGLE_PASS_FLAGS
from tools import sass

ROOT = Path(__file__).resolve().parent.parent

PINS = ROOT / "tests" / "sass_pins.json"
TOLERANCE = 0.5          # instructions per logit a kernel may add before the test fails

# The variants the counter compiles, per dtype: a row kernel dropped from the drive fails here.
LABELS = ("token_logprobs fwd", "token_logprobs bwd", "token_logprobs fwd + entropy",
          "token_logprobs bwd + entropy", "single pass GPPO chi2/atomic",
          "scale_rows (upstream grad != 1)", "single pass PPO clip",
          "single pass GPPO, no grad", "distill JSD fwd", "distill JSD bwd",
          "distill JSD single pass")
BF16_ONLY = ("GGPO fwd (log-probs)", "GGPO bwd (dlogits)")
# Distillation's kernels read a student's and a teacher's row: the forward reduces each to its
# statistics (one loop each), then reads both in its divergence loop; the backward reads both
# in its one loop; the loss's single pass runs both. Per logit of the vocabulary they move 2
# elements forward (each read twice) and 3 backward or in the single pass, and issue more than
# those bytes take by the model (docs/distillation.md): held to their pins, not to the issue
# budget.
DISTILL_LOOPS = {"distill JSD fwd": (1, 1, 2), "distill JSD bwd": (2,),
                 "distill JSD single pass": (1, 1, 2, 2)}
# every GPPO cell but chi2/atomic (above) off policy, the root-found cells on policy too
CELLS = {f"single pass GPPO {g}/{t}{', on policy' if on else ''}, bf16"
         for g in GEOMETRIES for t in TOPOLOGIES for on in (False, True)
         if (g, t) != ("chi2", "atomic") and (not on or (g, t) in ROOT_FOUND)}
EXPECTED = ({f"{label}, bf16" for label in LABELS + BF16_ONLY} |
            {f"{label}, fp32" for label in LABELS} | CELLS)
assert len(CELLS) == 16 and EXPECTED == (
    {f"{label}, {dtype}" for label, _, _, dtypes in sass.VARIANTS for dtype in dtypes} |
    {f"{label}, {sass.CELL_DTYPE}" for label, *_ in sass.cell_variants()})


# A listing in nvdisasm's form: an outer loop (0x20-0xf0) around an inner loop (0x30-0xc0) that
# loads, with a forward branch inside it; a loop that only stores (0x100-0x110); the trap after
# EXIT (0x130) is no loop.
LISTING = """
//--------------------- .text._token_logprobs_fwd_kernel --------------------------
        .section        .text._token_logprobs_fwd_kernel,"ax",@progbits
_token_logprobs_fwd_kernel:
.text._token_logprobs_fwd_kernel:
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   MOV R1, RZ ;
.L_x_0:
        /*0020*/                   IADD3 R1, R1, 0x1, RZ ;
.L_x_1:
        /*0030*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0040*/                   PRMT R8, R4, 0x7632, R8 ;
        /*0050*/                   SHF.L.U32 R9, R4, 0x10, RZ ;
        /*0060*/                   FFMA R10, R9, R9, R10 ;
        /*0070*/                   MUFU.EX2 R11, R10 ;
        /*0080*/                   FSETP.GEU.AND P1, PT, R11, -126, PT ;
        /*0090*/              @!P1 BRA `(.L_x_2) ;
        /*00a0*/                   SHFL.BFLY PT, R12, R11, 0x10, 0x1f ;
.L_x_2:
        /*00b0*/                   ISETP.GE.AND P0, PT, R1, R13, PT ;
        /*00c0*/              @!P0 BRA `(.L_x_1) ;
        /*00d0*/                   STG.E [R2.64], R10 ;
        /*00e0*/                   ISETP.GE.AND P2, PT, R1, R14, PT ;
        /*00f0*/              @!P2 BRA `(.L_x_0) ;
.L_x_3:
        /*0100*/                   STG.E.128 [R2.64], RZ ;
        /*0110*/               @P3 BRA `(.L_x_3) ;
        /*0120*/                   EXIT ;
.L_x_4:
        /*0130*/                   BRA `(.L_x_4);
        /*0140*/                   NOP;
"""


def test_loop_finder_on_a_listing():
    instructions, labels = sass.parse_sass(LISTING, "_token_logprobs_fwd_kernel")
    assert len(instructions) == 21 and labels[".L_x_1"] == 0x30
    loops = sass.find_loops(instructions, labels)
    assert [(lp.header, lp.latch, lp.inner, lp.loads, lp.stores) for lp in loops] == [
        (0x20, 0xf0, False, True, True), (0x30, 0xc0, True, True, False),
        (0x100, 0x110, True, False, True)]
    inner = loops[1]
    assert inner.blocks == [0x30, 0xa0, 0xb0] and len(inner.instructions) == 10
    assert inner.classes == {"fp32": 1, "mufu": 1, "cvt": 2, "int": 0, "pred": 2, "sync": 1,
                             "mem": 1, "branch": 2, "other": 0}
    assert inner.global_bytes("load") == 16

    # 1024 logits per iteration over 4 warps: 8 per thread; 10 instructions / 8 = 1.25 per logit
    row = sass.analyse("listing, bf16", "bf16", "_token_logprobs_fwd_kernel",
                       {"BLOCK_V": "1024"}, 4, {"reg": 40}, 0, 90, LISTING)
    assert row["logits_per_thread"] == 8 and row["instr_per_logit"] == 1.25
    assert [lp["counted"] for lp in row["loops"]] == [False, True, False]
    assert row["loops"][1]["logits_loaded_per_thread"] == 8
    assert sum(row["classes_per_logit"].values()) == pytest.approx(1.25)
    # outside the inner loops: S2R, MOV, the outer loop's own IADD3, STG, ISETP, BRA, and EXIT
    # (the trap and the padding are not code; the store-only loop is a masked row's)
    assert row["per_row"] == 7
    # 40 registers x 128 threads: 12 blocks of 4 warps by registers, 16 by warps
    assert row["blocks_per_sm"] == 12 and row["occupancy"] == 0.75
    assert row["limited_by"] == "registers"
    h200 = row["model"]["H200"]
    assert set(row["model"]) == {"H200", "H100"}
    assert h200["issue_over_memory"] > 0 and h200["mufu_over_memory"] > 0


# A row's fixed loop outside the vocabulary loop (0x40-0x70: no memory access, the counter UR5
# set to 48 before it and stepped down to 0), as a root find compiles.
FIXED_LOOP = """
        .section        .text._surrogate_logits_kernel,"ax",@progbits
        /*0000*/                   S2R R0, SR_TID.X ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   UMOV UR5, 0x30 ;
        /*0030*/                   MOV R3, R2 ;
.L_x_5:
        /*0040*/                   DADD R6, R6, R2 ;
        /*0050*/                   UIADD3 UR5, UR5, -0x1, URZ ;
        /*0060*/                   ISETP.NE.U32.AND P1, PT, RZ, UR5, PT ;
        /*0070*/               @P1 BRA `(.L_x_5) ;
        /*0080*/                   EXIT ;
"""


def test_a_fixed_loop_counts_once_per_iteration():
    flags = str(SINGLE_PASS_FLAGS.word(**{n: n == "WRITE_DLOGITS"
                                          for n in SINGLE_PASS_FLAGS.names}))
    row = sass.analyse("fixed, bf16", "bf16", "_surrogate_logits_kernel",
                       {"BLOCK_V": "1024", "FLAGS": flags}, 4, {"reg": 40}, 0, 90, FIXED_LOOP)
    assert [lp["trips"] for lp in row["loops"]] == [48]
    assert row["per_row"] == 5 + 48 * 4
    # no counter set to an immediate before the loop: the count fails rather than leave it out
    unreadable = FIXED_LOOP.replace("UMOV UR5, 0x30", "UMOV UR5, UR7")
    with pytest.raises(ValueError, match="trip count"):
        sass.analyse("fixed, bf16", "bf16", "_surrogate_logits_kernel",
                     {"BLOCK_V": "1024", "FLAGS": flags}, 4, {"reg": 40}, 0, 90, unreadable)


def test_pins_fail_a_rise_only():
    kernels = [{"label": label, "instr_per_logit": n, "row_instr_per_logit": row}
               for label, n, row in (("held", 10.4, 12.0), ("rose", 10.6, 12.0),
                                     ("fell", 9.0, 12.0), ("new", 5.0, 6.0),
                                     ("row rose", 10.0, 12.6))]
    pins = {"pins": {"sm_90": {"held": 10.0, "rose": 10.0, "fell": 10.0, "gone": 1.0,
                               "row rose": 10.0, "row rose (whole row)": 12.0,
                               **{f"{k} (whole row)": 12.0 for k in ("held", "rose", "fell")}}}}
    rises, drops, missing, unpinned = sass.compare_pins([{"arch": 90, "kernels": kernels}], pins,
                                                        TOLERANCE)
    assert [line.split(":")[0] for line in rises] == ["sm_90 rose", "sm_90 row rose (whole row)"]
    assert [line.split(":")[0] for line in drops] == ["sm_90 fell"]
    assert missing == ["sm_90 gone"]
    assert [line.split(":")[0] for line in unpinned] == ["sm_90 new", "sm_90 new (whole row)"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """``python -m tools.sass`` for sm_90 and sm_80 in a process of its own; its sass.json."""
    out = tmp_path_factory.mktemp("sass")
    env = process_env(drop=("TRITON_INTERPRET",))
    proc = subprocess.run([sys.executable, "-m", "tools.sass", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads((out / "sass.json").read_text())


@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
def test_every_row_kernel_counted(counted):
    assert sorted(r["arch"] for r in counted["results"]) == [80, 90]
    for result in counted["results"]:
        assert not result["failed"]
        rows = {r["label"]: r for r in result["kernels"]}
        assert set(rows) == EXPECTED, f"sm_{result['arch']}"
        for label, r in rows.items():
            where = f"sm_{result['arch']} {label}"
            loops = [lp for lp in r["loops"] if lp["counted"]]
            assert loops, f"{where}: no vocabulary loop found"
            rows = DISTILL_LOOPS.get(label.rsplit(", ", 1)[0])
            if rows is None:    # the rows each loop reads
                rows = (1, 1) if label.startswith("single pass") and "no grad" not in label \
                    else (1,)
            assert len(loops) == len(rows), where
            for lp, n in zip(loops, rows):  # a block of each row per iteration: not unrolled
                assert lp["logits_loaded_per_thread"] == n * r["logits_per_thread"], where
            assert sum(r["classes_per_logit"].values()) == pytest.approx(r["instr_per_logit"])
            assert r["instr_per_logit"] > 0 and 0 < r["occupancy"] <= 1, where
            assert r["registers"] > 0 and r["local"] == 0, where
            for gpu, m in r["model"].items():
                assert m["issue_over_memory"] > 0 and m["memory_ms"] > 0, f"{where} {gpu}"
                assert m["mufu_over_memory"] >= 0, f"{where} {gpu}"
                if r["classes_per_logit"]["mufu"]:
                    assert m["mufu_over_memory"] > 0, f"{where} {gpu}"


@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
def test_every_row_kernel_within_the_issue_budget(counted):
    """Counted over the whole row (the code outside the vocabulary loops with its fixed loops),
    every row kernel issues its instructions in less time than it moves its bytes at the
    headline shape, on each GPU of the model: memory-bound by the model, every GPPO cell
    included (distillation's kernels: ``DISTILL_LOOPS``)."""
    for result in counted["results"]:
        for r in result["kernels"]:
            if r["label"].rsplit(", ", 1)[0] in DISTILL_LOOPS:
                continue
            for gpu, m in r["model"].items():
                assert m["issue_over_memory"] < 1, (f"sm_{result['arch']} {r['label']} {gpu}: "
                                                    f"{m['issue_over_memory']:.2f}")


@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
def test_counts_held_to_their_pins(counted):
    pins = json.loads(PINS.read_text())
    version = counted["results"][0]["triton"]
    if version.split(".")[:2] != pins["triton"].split(".")[:2]:
        pytest.skip(f"pins written with triton {pins['triton']}, this is {version}: counted, "
                    f"not compared")
    rises, drops, missing, unpinned = sass.compare_pins(counted["results"], pins, TOLERANCE)
    refresh = "refresh with: python -m tools.sass --write-pins tests/sass_pins.json"
    for line in drops:
        print(f"fewer instructions per logit than pinned (lower the pin; {refresh}): {line}")
    assert not rises, "instructions per logit rose:\n" + "\n".join(rises)
    assert not missing, f"pinned kernels no longer counted ({refresh}):\n" + "\n".join(missing)
    assert not unpinned, f"kernels without a pin ({refresh}):\n" + "\n".join(unpinned)


@pytest.mark.skipif(not nvidia_backend(), reason="this triton has no NVIDIA backend")
def test_the_head_kernels_use_the_tensor_cores_without_spills():
    """The batch-invariant head's kernels (``kernels.tiles.head_tiles``: the forward's block
    statistics, the backward's two products; ``kernels.tiles.distill_tiles``: a divergence between
    two such heads, or such a head and logits in memory, and its two products), compiled for sm_90 (``head_sass_worker.py``):
    bf16 multiplies on the tensor cores (HGMMA), no kernel touches local memory (no spill,
    no stack), bf16 and fp32, with and without a softcap."""
    env = process_env(drop=("TRITON_INTERPRET",))
    proc = subprocess.run([sys.executable, "tests/head_sass_worker.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    distill = ("_distill_blocks_kernel", "_distill_dhidden_kernel", "_distill_dweight_kernel")
    assert {(r["kernel"], r["dtype"], r["softcap"], r["teacher_logits"]) for r in rows} == {
        (k, d, s, t) for k in ("_head_blocks_kernel", "_head_dhidden_kernel",
                               "_head_dweight_kernel") + distill
        for d in ("bfloat16", "float32") for s in (False, True)
        for t in ((False, True) if k in distill else (False,))}
    for r in rows:
        where = f"{r['kernel']} {r['dtype']} softcap={r['softcap']}"
        assert r.get("LDL", 0) == r.get("STL", 0) == r["stack"] == r["local"] == 0, where
        assert r["dtype"] != "bfloat16" or r.get("HGMMA", 0) > 0, where
