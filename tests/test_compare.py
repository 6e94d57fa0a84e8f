"""``python -m tools.compare``: rlfuse beside TRL 1.16's and Liger's kernels on the same inputs
(bytes per actor row in the interpreter, errors against float64), and its table in
docs/performance.md."""
from pathlib import Path

import pytest
import torch

from tools import compare

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("trl")
    pytest.importorskip("liger_kernel")
    return compare.compare(300)


def test_every_peer_is_measured(rows):
    assert [(r["op"], r["peer"], r["dtype"]) for r in rows] == [
        (op, peer, dtype) for op, peer in compare.PEERS for dtype in ("bfloat16", "float32")]
    for row in rows:
        reads, distinct, writes = row["fused"]["kernels"]
        assert reads >= distinct > 0 and writes > 0, row["op"]
        reads, distinct, writes = row[row["peer"]]["kernels"]
        assert reads >= distinct >= 0 and writes >= 0, row["op"]
        # a peer in torch (Liger's fused-linear JSD) moves its rows in torch ops only
        assert min(row[row["peer"]]["total"]) > 0, row["op"]


def test_rlfuse_moves_no_more_than_its_peers(rows):
    """The goal the table states, on the bytes: every shared op at most the peer's reads and
    writes per actor row in all, the kernels' (distinct reads: the single pass reads a row
    twice, once from memory) and the torch ops'."""
    for row in rows:
        ours, theirs = row["fused"]["total"], row[row["peer"]]["total"]
        assert ours[0] <= theirs[0] and ours[1] <= theirs[1], row


def test_errors_are_against_float64(rows):
    """fp32: every implementation within a few fp32 ulps of float64. bf16: the error is the
    inputs' and the head's logits' rounding to bf16 (the float64 result rounds nothing), the
    same for both sides; rlfuse's gradient error at most the peer's (the goal)."""
    for row in rows:
        ours, theirs = row["fused"]["errors"], row[row["peer"]]["errors"]
        for impl, (value, grad) in (("fused", ours), (row["peer"], theirs)):
            if row["dtype"] == "float32":
                assert value < 1e-6 and grad < 1e-6, (row["op"], impl)
        if row["dtype"] == "bfloat16":
            assert ours[1] <= 1.01 * theirs[1], row
    # the measure itself: a gradient off by one bf16 unit is seen
    x = torch.ones(3)
    assert compare._error(x + 2.0 ** -8, x.double()) == pytest.approx(2.0 ** -8)


def test_peak_memory_is_measured(rows):
    """The step's extra peak memory per actor token, both sides: from logits at least the
    gradient the step returns (a row of logits per token), rlfuse's at most the peer's (the
    goal); a head's above nothing."""
    for row in rows:
        ours, theirs = row["fused"]["peak"], row[row["peer"]]["peak"]
        assert ours > 0 and theirs > 0, row["op"]
        if not row["op"].endswith("_head"):
            row_bytes = 300 * getattr(torch, row["dtype"]).itemsize
            assert ours >= row_bytes, row
            assert ours <= theirs, row


def test_rlfuse_issues_no_more_instructions_than_its_peers(rows):
    """The goal on the instructions: per logit in the step's Triton kernels (sm_90 SASS, bf16),
    rlfuse at most the peer's, wherever the peer has Triton kernels (Liger's fused-linear JSD
    is torch)."""
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    assert bf16 and all(r["sass"] is not None for r in bf16), [r.get("sass_missing") for r in bf16]
    for row in bf16:
        ours, theirs = row["sass"]["fused"], row["sass"][row["peer"]]
        assert ours["kernels"] and ours["instructions"] > 0 and ours["mufu"] > 0, row["op"]
        if theirs["kernels"]:
            assert ours["instructions"] <= theirs["instructions"], (row["op"], ours, theirs)


def test_the_table_in_the_docs_is_the_tools():
    text = (ROOT / "docs" / "performance.md").read_text()
    table = text[text.index(compare.MARK_BEGIN):text.index(compare.MARK_END)]
    lines = compare.format_table([], 1).splitlines()
    header = next(line for line in lines if line.startswith("| op |"))
    assert header in table and lines[2] in table      # the second paragraph: no V in it
    for op, peer in compare.PEERS:
        assert f"| {op} | {compare.LABELS[op, peer]} |" in table
