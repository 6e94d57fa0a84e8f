"""Compiles the batch-invariant head's kernels (``kernels.tiles.head_tiles``: the forward's block
statistics, the backward's two products; ``kernels.tiles.distill_tiles``: a divergence between two
such heads, or such a head and logits in memory, and its two products) for sm_90 without a GPU (``tools.compile_only``) and prints,
per kernel, dtype and softcap, its tensor-core instructions, local-memory accesses and
resources as JSON lines; run without ``TRITON_INTERPRET``."""
import json
import re
import sys
from collections import Counter

import torch

from tools import compile_only, sass

compile_only.install(90)

from rlfuse.divergences import JSD  # noqa: E402
from rlfuse.kernels.tiles.distill_tiles import (HEAD_PAIR_FLAGS, TwoHeads,  # noqa: E402
                                               distill_blocks, distill_head_backward)
from rlfuse.kernels.lib.head_functions import HeadParams  # noqa: E402
from rlfuse.kernels.tiles.head_tiles import head_backward, head_blocks  # noqa: E402

C, H, V = 70, 256, 1000
for dtype in (torch.bfloat16, torch.float32):
    for head in (HeadParams(0.8), HeadParams(0.9, 0.5, 3.0)):
        before = set(compile_only.COMPILED)
        hidden, weight = torch.randn(C, H).to(dtype), torch.randn(V, H).to(dtype)
        bias, targets = torch.randn(V).to(dtype), torch.zeros(C, dtype=torch.long)
        rows, keep = torch.zeros(C), torch.ones(C, dtype=torch.bool)
        head_blocks(hidden, weight, bias, targets, *head.kernel_args(), True)
        head_backward(hidden, weight, bias, targets, keep, torch.zeros(C, 2), rows, rows, rows,
                      *head.kernel_args(), torch.zeros(C, H), torch.zeros(V, H), torch.zeros(V))
        heads = TwoHeads(hidden, weight, bias, head, hidden, weight, bias, head, keep,
                         JSD(0.5).terms())
        distill_blocks(heads, torch.zeros(C, 5))
        distill_head_backward(heads, torch.zeros(C, 5), rows, torch.zeros(C, H),
                              torch.zeros(V, H), torch.zeros(V))
        logits = torch.randn(C, V).to(dtype)       # a teacher's logits: no softcap
        heads = TwoHeads(hidden, weight, bias, head, logits, None, None, HeadParams(1.2), keep,
                         JSD(0.5).terms(), t_rows=torch.arange(C) * V)
        distill_blocks(heads, torch.zeros(C, 5))
        distill_head_backward(heads, torch.zeros(C, 5), rows, torch.zeros(C, H),
                              torch.zeros(V, H), torch.zeros(V))
        for key in set(compile_only.COMPILED) - before:
            kernel, constexprs = compile_only.COMPILED[key]
            if key[0] == "_sum_blocks_kernel":
                continue
            text = sass.disassemble(kernel.asm["cubin"])
            counts = Counter(re.findall(r"\b(HGMMA|HMMA|LDL|STL)\b", text))
            print(json.dumps({"kernel": key[0], "dtype": str(dtype).split(".")[1],
                              "softcap": bool(head.softcap),
                              "teacher_logits": key[0].startswith("_distill") and
                              HEAD_PAIR_FLAGS.reads(constexprs["FLAGS"], "T_LOGITS"), **counts,
                              **compile_only.resources(kernel)}))
sys.exit(1 if compile_only.FAILED else 0)
