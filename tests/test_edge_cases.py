"""Edge cases every loss handles the same way in both implementations."""
import pytest
import torch

import rlfuse
from rlfuse import reference


def empty_call(fn, name, device="cpu"):
    kw = dict(dtype=torch.float64, device=device)
    lp = torch.zeros(0, 5, requires_grad=True, **kw)
    z, mask = torch.zeros(0, 5, **kw), torch.zeros(0, 5, dtype=torch.bool, device=device)
    if name == "ggpo":
        out = fn(lp, z, torch.zeros(0, **kw), mask, group_size=2, beta=1.0)
    elif name == "gppo":
        out = fn(lp, z, torch.zeros(0, **kw), mask)
    else:
        out = fn(lp, z, z, mask, group_size=2)
    out.loss.backward()
    return out, lp.grad


@pytest.mark.parametrize("name", ["ggpo", "gppo", "gr_opd"])
def test_empty_batch(name, device):
    fused, grad = empty_call(getattr(rlfuse, f"{name}_loss"), name, device)
    ref, _ = empty_call(getattr(reference, f"{name}_loss"), name)
    assert fused.loss.item() == ref.loss.item() == 0 and grad.shape == (0, 5)
    assert fused.metrics.keys() == ref.metrics.keys()
    for key, value in fused.metrics.items():
        assert value.item() == ref.metrics[key].item() == 0, key
