"""Compiles the batch-invariant head's kernels (``kernels.head_blocks``: the forward's block
statistics, the backward's two products) for sm_90 without a GPU (``tools.compile_only``) and
prints, per kernel and dtype, its tensor-core instructions, local-memory accesses and
resources as JSON lines; run without ``TRITON_INTERPRET``."""
import json
import re
import sys
from collections import Counter

import torch

from tools import compile_only, sass

compile_only.install(90)

from rlfuse.kernels.head import HeadParams  # noqa: E402
from rlfuse.kernels.head_blocks import head_backward, head_blocks  # noqa: E402

C, H, V = 70, 256, 1000
for dtype in (torch.bfloat16, torch.float32):
    for head in (HeadParams(0.8), HeadParams(0.9, 0.5, 3.0)):
        hidden, weight = torch.randn(C, H).to(dtype), torch.randn(V, H).to(dtype)
        bias, targets = torch.randn(V).to(dtype), torch.zeros(C, dtype=torch.long)
        rows = torch.zeros(C)
        head_blocks(hidden, weight, bias, targets, *head.kernel_args(), True)
        head_backward(hidden, weight, bias, targets, torch.ones(C, dtype=torch.bool),
                      torch.zeros(C, 2), rows, rows, rows, *head.kernel_args(),
                      torch.zeros(C, H), torch.zeros(V, H), torch.zeros(V))
for (name, _), (kernel, constexprs) in compile_only.COMPILED.items():
    text = sass.disassemble(kernel.asm["cubin"])
    counts = Counter(re.findall(r"\b(HGMMA|HMMA|LDL|STL)\b", text))
    print(json.dumps({"kernel": name, "dtype": constexprs.get("LOGITS"),
                      "softcap": constexprs.get("SOFTCAP"), **counts,
                      **compile_only.resources(kernel)}))
sys.exit(1 if compile_only.FAILED else 0)
