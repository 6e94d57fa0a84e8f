"""The launch keys (``tools.compile_only``: the kernel, its arguments' specialisation and its
options, the key of Triton's cache of compiled kernels) of a batch-invariant head's steps at
several row counts, printed as JSON (``{rows: [key, ...]}``): its log-probs and entropies and
their gradients, and its distillation from a batch-invariant teacher head and from the
teacher's logits, forward and backward. Run without ``TRITON_INTERPRET``
(``tests/test_batch_invariant.py`` starts it); the kernels are not run."""
import json
import sys

from tools import compile_only

compile_only.install(90, keys_only=True)

import torch  # noqa: E402

import rlfuse  # noqa: E402
from rlfuse.divergences import JSD  # noqa: E402

H, V = 64, 1000
weight = torch.randn(V, H, dtype=torch.bfloat16, requires_grad=True)
t_weight = torch.randn(V, 32, dtype=torch.bfloat16)
keys = {}
for rows in map(int, sys.argv[1:]):
    compile_only.KEYS.clear()
    hidden = torch.randn(rows, 2, H, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.zeros(rows, 1, dtype=torch.long)
    student = rlfuse.LinearHead(hidden, weight, targets, offset=1, batch_invariant=True)
    lp, entropy = rlfuse.policy_logprobs(student, return_entropy=True)
    (lp.sum() + entropy.sum()).backward()
    teachers = (rlfuse.LinearHead(torch.randn(rows, 1, 32, dtype=torch.bfloat16), t_weight,
                                  targets, batch_invariant=True),
                rlfuse.Logits(torch.randn(rows, 1, V, dtype=torch.bfloat16), targets))
    for teacher in teachers:
        rlfuse.token_divergence(student, teacher, JSD(0.5)).sum().backward()
    keys[rows] = sorted({str(key) for key in compile_only.KEYS})
print(json.dumps(keys))
sys.exit(1 if compile_only.FAILED else 0)
