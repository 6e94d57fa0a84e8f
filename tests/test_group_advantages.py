"""GRPO's ``group_advantages`` as both rlfuse and rlfuse.reference export it (one plain-torch
function on [B]-sized data): rewards centred within each group, against a Python loop, binary
rewards in fp32, and bad input."""
import statistics

import pytest
import torch

from conftest import TOL


def _loop_group_advantages(rewards, m, eps, normalize_std):
    out = []
    for g in range(len(rewards) // m):
        group = rewards[g * m:(g + 1) * m]
        mean, std = (0.0, 1.0) if m == 1 else (statistics.fmean(group), statistics.stdev(group))
        out += [(r - mean) / (std + eps) if normalize_std else r - mean for r in group]
    return out


def test_centred_within_groups(impl, device):
    """Each group's advantages sum to 0; a group of equal rewards gets 0 everywhere."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], device=device)
    a = impl.group_advantages(r, group_size=3).cpu()
    torch.testing.assert_close(a.view(2, 3).sum(-1), torch.zeros(2))
    assert (a[3:] == 0).all()


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_against_loop(m, normalize_std, impl, device):
    """fp64 advantages against the loop (mean, sample std + eps), group sizes 1 to 8, with and
    without the std, one group of equal rewards."""
    g = torch.Generator().manual_seed(m)
    rewards = torch.randn(16, generator=g, dtype=torch.float64)
    rewards[:m] = 1.0                                           # one group of equal rewards
    got = impl.group_advantages(rewards.to(device), group_size=m, eps=1e-4,
                                normalize_std=normalize_std)
    want = _loop_group_advantages(rewards.tolist(), m, 1e-4, normalize_std)
    torch.testing.assert_close(got.cpu(), torch.tensor(want, dtype=torch.float64), **TOL["fp64"])


def test_binary_rewards_fp32(impl, device):
    """fp32 0/1 rewards give fp32 advantages equal to the loop's (default eps 1e-6)."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    got = impl.group_advantages(rewards.to(device), group_size=4)
    assert got.dtype == torch.float32
    want = _loop_group_advantages(rewards.tolist(), 4, 1e-6, True)
    torch.testing.assert_close(got.cpu(), torch.tensor(want, dtype=torch.float32))


def test_bad_input(impl, device):
    """A group size that does not divide the batch or is 0, eps = 0, 2-D rewards and NaN
    rewards are refused, each error naming the argument."""
    rewards = torch.ones(6, device=device)
    with pytest.raises(ValueError, match="group_size.*multiple"):
        impl.group_advantages(rewards, group_size=4)
    with pytest.raises(ValueError, match="group_size"):
        impl.group_advantages(rewards, group_size=0)
    with pytest.raises(ValueError, match="eps"):
        impl.group_advantages(rewards, group_size=3, eps=0.0)
    with pytest.raises(ValueError, match="rewards"):
        impl.group_advantages(rewards[None], group_size=3)
    with pytest.raises(ValueError, match="rewards"):
        impl.group_advantages(torch.tensor([1.0, float("nan")], device=device), group_size=2)
