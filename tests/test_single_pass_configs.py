"""The single pass from logits in every launch configuration (``RLFUSE_SINGLE_PASS``): each
switch and combinations against float64, bit-for-bit equal to the default where only the launch
differs, the text's parsing, and the GPU sweep's driver end to end on the CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlfuse
from rlfuse import reference
from rlfuse.kernels.rows import single_pass
from rlfuse.kernels.rows.single_pass import SinglePassConfig, parse, single_pass_config

from loss_harness import check_three_way, with_garbage

ROOT = Path(__file__).resolve().parent.parent
# Logits [B, S, V]: a model's whole output; rows OFFSET..OFFSET+T-1 predict the T targets, the
# others get zero rows. V = 301 is no multiple of any block: with BLOCK_V = 64, four full blocks
# and a tail of 45. B * S = 12 rows, more than a persistent grid's 2-6 programs
# (single_pass.INTERPRETER_SM_COUNT = 2 SMs off CUDA; the default sized from the L2 stand-in
# takes 2: an fp32 row of 301 is 1204 bytes).
B, S, T, OFFSET, V, M = 2, 6, 4, 1, 301, 2
BLOCK = "block_v=64"

CONFIGS = [
    "default",                     # the table's one block per row; programs sized from the L2
    "programs_per_sm=none",        # one program per row
    BLOCK,
    f"{BLOCK},evict=1",
    f"{BLOCK},programs_per_sm=1",
    f"{BLOCK},programs_per_sm=3",  # 6 programs: rows do not divide evenly
    f"{BLOCK},order=forward",
    f"{BLOCK},num_stages=2",
    "block_v=128,num_warps=2",
    "evict=1,programs_per_sm=2,order=forward,num_warps=8,block_v=64,num_stages=3",
    "evict=1,programs_per_sm=1,block_v=256,num_stages=2",
]


def logits_case(seed, dtype, *, empty_row=True):
    """(logits [B, S, V] float64 rounded to ``dtype``, targets, mask with masked positions and
    (``empty_row``) a fully masked row, old_lp, teacher_lp, advantages, per-token weights),
    ratios near 1."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, S, V, generator=gen, dtype=torch.float64) * 2).to(dtype).double()
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.3
    mask[:, 0] = True
    mask[1] = not empty_row        # a whole masked row, or none (GR-OPD needs an actor token)
    targets[~mask] = V + 3         # never read
    lp = torch.log_softmax(logits[:, OFFSET:OFFSET + T] / 0.9, -1).gather(
        -1, targets.clamp(0, V - 1)[..., None])[..., 0]
    noise = lambda s: torch.randn(B, T, generator=gen, dtype=torch.float64) * s  # noqa: E731
    return dict(logits=logits, targets=targets, mask=mask, lp=lp,
                old=with_garbage(lp + noise(0.3), mask),
                teacher=with_garbage(lp + noise(1.0), mask),
                adv=torch.randn(B, generator=gen, dtype=torch.float64),
                weights=torch.rand(B, T, generator=gen, dtype=torch.float64) * 2)


# name -> (fused, reference, args from the case, keyword arguments)
LOSSES = {
    "gppo": (rlfuse.gppo_loss, reference.gppo_loss, ("old", "adv"),
             dict(geometry="tv", topology="binary", delta=0.05)),
    "gr_opd": (rlfuse.gr_opd_loss, reference.gr_opd_loss, ("old", "teacher"),
               dict(group_size=M)),
    "ppo": (rlfuse.ppo_loss, reference.ppo_loss, ("old", "adv"),
            dict(clip=(0.2, 0.28), dual_clip=3.0)),
}


def check_against_float64(name, dtype, config, device):
    fused_fn, ref_fn, arg_names, kw = LOSSES[name]
    case = logits_case(len(name) + (dtype == torch.float32), dtype, empty_row=name != "gr_opd")
    if name == "ppo":
        kw = dict(kw, weights=case["weights"].float())
    args = tuple(case[a] for a in arg_names)
    lp_scale = case["lp"].abs().max().item()
    with single_pass_config(config):
        check_three_way(fused_fn, ref_fn, case["logits"], dtype=dtype, device=device,
                        logits_targets=case["targets"], temperature=0.9, offset=OFFSET,
                        args=tuple(a.float() for a in args) + (case["mask"],),
                        args64=args + (case["mask"],),
                        # log r = lp - old is rounded at the log-probs' magnitude (|lp| ~ 10
                        # here), and so are the loss and the metrics made of r
                        loss_scale=lp_scale,
                        metric_scales={"approx_kl": lp_scale, "ratio_mean": lp_scale}, **kw)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_switch_against_float64(name, config, device):
    """Loss, metrics and dlogits of the whole output (zero rows outside the window and at
    masked tokens), outputs poisoned, against float64 (conftest's three-way rule); bf16 and
    fp32 in turn, so that each dtype meets each loss and most switches."""
    turn = CONFIGS.index(config) + sorted(LOSSES).index(name)
    check_against_float64(name, (torch.bfloat16, torch.float32)[turn % 2], config, device)


def _single_pass_outputs(config, device, *, inplace=False, head=False):
    """(loss, metrics, gradients) of GPPO from the whole output (or a LinearHead) in ``config``."""
    case = logits_case(7, torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    with single_pass_config(config):
        if head:
            hidden = torch.randn(B, S, 16, generator=gen).to(device).requires_grad_(True)
            weight = (torch.randn(V, 16, generator=gen) * 0.5).to(device).requires_grad_(True)
            policy = rlfuse.LinearHead(hidden, weight, case["targets"].to(device), offset=OFFSET,
                                       chunk_tokens=5)
            leaves = (hidden, weight)
        else:
            x = case["logits"].to(torch.bfloat16).to(device).requires_grad_(True)
            policy = rlfuse.Logits(x if not inplace else x.clone(), case["targets"].to(device),
                                   0.9, inplace, offset=OFFSET)
            leaves = (x,)
        out = rlfuse.gppo_loss(policy, case["old"].float().to(device),
                               case["adv"].float().to(device), case["mask"].to(device))
        if inplace:   # written into the clone's buffer, handed on to x by the clone's backward
            out.loss.backward()
            grads = (x.grad,)
        else:
            grads = torch.autograd.grad(out.loss, leaves)
    return out.loss.detach(), {k: v.detach() for k, v in out.metrics.items()}, grads


@pytest.mark.parametrize("config", [
    "evict=1", "programs_per_sm=none", "programs_per_sm=1", "programs_per_sm=5",
    "order=forward", "num_stages=3", "num_warps=1", "evict=1,programs_per_sm=2,order=forward,num_warps=2,num_stages=2"])
def test_launch_alone_changes_no_bit(config, device):
    """With the same BLOCK_V the sums run in the same order, so a switch of the launch alone
    (eviction hints, grid, block order of the write pass, warps, pipelining) gives the same bits:
    from logits, in place, and from a LinearHead's chunks."""
    for kw in (dict(), dict(inplace=True), dict(head=True)):
        base = _single_pass_outputs(BLOCK, device, **kw)
        other = _single_pass_outputs(f"{BLOCK},{config}", device, **kw)
        assert torch.equal(base[0], other[0])
        assert base[1].keys() == other[1].keys()
        assert all(torch.equal(base[1][k], other[1][k]) for k in base[1])
        assert all(torch.equal(a, b) for a, b in zip(base[2], other[2]))


# --------------------------------------------------------------------------------------------
# The configuration's text
# --------------------------------------------------------------------------------------------

def test_parse_and_text():
    assert parse("") == parse("default") == parse(" Default ") == SinglePassConfig()
    config = parse("evict=1, programs_per_sm=2,order=forward,num_warps=8,block_v=4096,"
                   "num_stages=3")
    assert config == SinglePassConfig(True, 2, "forward", 8, 4096, 3)
    assert str(SinglePassConfig()) == "default"
    assert parse("programs_per_sm=l2,num_warps=None") == SinglePassConfig()
    assert parse("programs_per_sm=none") == SinglePassConfig(programs_per_sm=None)
    for text in single_pass.CANDIDATES:
        assert str(parse(text)) == text            # canonical: the sweep's names
    assert parse(str(config)) == config


@pytest.mark.parametrize("text, what", [
    ("evict=2", "evict=2"), ("evict=yes", "evict='yes'"), ("programs_per_sm=0", "programs_per"),
    ("order=random", "order='random'"), ("num_warps=3", "num_warps=3"),
    ("block_v=1000", "block_v=1000"), ("block_v=8", "block_v=8"),
    ("num_stages=0", "num_stages=0"), ("num_stages=x", "num_stages='x'"),
    ("warps=4", "'warps=4' is not key=value with a known key"), ("evict", "'evict' is not"),
    ("evict=1,evict=0", "evict given twice"), ("evict=1;order=forward", "evict=")])
def test_bad_text_raises(text, what, monkeypatch, device):
    with pytest.raises(ValueError) as info:
        parse(text)
    message = str(info.value)
    assert message.startswith(f"RLFUSE_SINGLE_PASS={text!r}") and what in message
    for key, accepted in single_pass.ACCEPTED.items():   # says what would do
        assert f"{key}: {accepted}" in message
    # read at launch, not at import: a loss launched with the bad text raises the same
    monkeypatch.setenv(single_pass.ENV_VAR, text)
    case = logits_case(3, torch.float32)
    policy = rlfuse.Logits(case["logits"][:, OFFSET:OFFSET + T].float().to(device),
                           case["targets"].to(device))
    with pytest.raises(ValueError, match="RLFUSE_SINGLE_PASS"):
        rlfuse.gppo_loss(policy, case["old"].float().to(device), case["adv"].float().to(device),
                         case["mask"].to(device))


def test_bad_fields_raise():
    for fields in (dict(num_warps=12), dict(block_v=96), dict(order="up"),
                   dict(programs_per_sm=-1), dict(num_stages=True)):
        with pytest.raises(ValueError, match="expected"):
            SinglePassConfig(**fields)
    with pytest.raises(ValueError, match="num_warps"):
        with single_pass_config(num_warps=5):
            pass


def test_environment_and_context(monkeypatch):
    """The innermost context, else the environment at the time of the launch, else default."""
    monkeypatch.delenv(single_pass.ENV_VAR, raising=False)
    assert single_pass.current() == SinglePassConfig()
    monkeypatch.setenv(single_pass.ENV_VAR, "evict=1")
    assert single_pass.current() == SinglePassConfig(evict=True)
    with single_pass_config("order=forward") as outer:
        assert single_pass.current() is outer and not outer.evict
        with single_pass_config(outer, programs_per_sm=4):
            assert single_pass.current() == SinglePassConfig(order="forward", programs_per_sm=4)
        assert single_pass.current() is outer
    assert single_pass.current() == SinglePassConfig(evict=True)


def test_launch_parameters():
    config = parse("programs_per_sm=3,block_v=4096")
    cpu = torch.device("cpu")
    sms = single_pass.INTERPRETER_SM_COUNT
    assert config.grid(1000, 8192, 8, cpu)[0] == 3 * sms
    assert config.grid(4, 8192, 8, cpu)[0] == 4                  # never more programs than rows
    assert parse("programs_per_sm=none").grid(1000, 8192, 16, cpu) == (1000, None)
    assert config.block_and_warps(151936, 2) == (4096, 8)   # the table's warps for the block
    assert config.block_and_warps(300, 2) == (512, 4)       # no block wider than the row
    assert parse("num_warps=2").block_and_warps(151936, 2) == (8192, 2)
    assert SinglePassConfig().block_and_warps(151936, 2) == (8192, 16)
    # a persistent program gets the registers that let programs_per_sm of them share an SM
    maxnreg = lambda text, warps: parse(text).grid(1000, 8192, warps, cpu)[1]  # noqa: E731
    assert maxnreg("programs_per_sm=2", 16) == 64
    assert maxnreg("programs_per_sm=2", 8) == 128
    assert maxnreg("programs_per_sm=1", 4) == 248                  # PTX's most, in 8s
    assert maxnreg("programs_per_sm=3", 8) == 80
    assert maxnreg("programs_per_sm=8", 16) is None                # more than an SM holds


def test_default_grid_is_sized_from_the_l2(monkeypatch):
    """The default keeps k programs an SM, each with one row in flight, the most whose rows fit
    in L2_BUDGET of the L2: at least one, at most what an SM holds at once."""
    cpu = torch.device("cpu")
    budget = int(single_pass.L2_BUDGET * single_pass.INTERPRETER_L2_BYTES)
    sms = single_pass.INTERPRETER_SM_COUNT
    default = SinglePassConfig()
    for row_bytes, per_sm in ((budget // sms + 1, 1), (budget // (3 * sms), 3),
                              (budget // (2 * sms), 2), (1, 4), (budget * 10, 1)):
        programs, maxnreg = default.grid(1000, row_bytes, 16, cpu)   # 16 warps: 4 an SM
        assert programs == per_sm * sms, row_bytes
        assert maxnreg == 65536 // (32 * 16 * per_sm) // 8 * 8        # k share an SM
        assert (programs * row_bytes <= budget) or per_sm == 1
    assert default.grid(3, 1, 16, cpu)[0] == 3                  # never more programs than rows
    # a GPU's own L2 and SM count: the H200's at the headline, one program an SM
    monkeypatch.setattr(single_pass, "sm_count", lambda device: 132)
    monkeypatch.setattr(single_pass, "l2_bytes", lambda device: 50 * 2 ** 20)
    assert default.grid(16 * 1025, 151936 * 2, 16, cpu) == (132, 128)
    assert default.grid(16 * 1025, 32000 * 2, 16, cpu)[0] == 3 * 132   # 64 KB rows: 3 an SM


# --------------------------------------------------------------------------------------------
# The GPU sweep's driver, end to end on the CPU
# --------------------------------------------------------------------------------------------

def test_sweep_end_to_end(tmp_path):
    """``python -m bench.sweep`` with a tiny shape through the interpreter: in one process each
    configuration checked against the default, then timed, then the ranking, which names a
    best configuration; a configuration whose gradient differs is listed as failed, untimed."""
    configs = ["default", "evict=1,programs_per_sm=1,block_v=64"]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.sweep", "--out", str(tmp_path), "--quick", "--N", "16",
         "--V", "300", "--configs", " ".join(configs)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep.json").read_text())
    (case,) = summary["cases"]
    assert case["case"]["op"] == "gppo_logits" and case["case"]["V"] == 300
    assert sorted(e["config"] for e in case["ranking"]) == sorted(configs)
    assert case["best"] == case["ranking"][0]["config"] in configs
    times = [e["ms"] for e in case["ranking"]]
    assert times == sorted(times) and all(e["fraction_of_floor"] > 0 for e in case["ranking"])
    assert [e["max_grad_diff"] for e in case["ranking"] if e["config"] == "default"] == [0.0]
    table = (tmp_path / "sweep.md").read_text()
    assert f"best: `{case['best']}`" in table and all(f"`{c}`" in table for c in configs)
    assert not summary["failed"]


def test_sweep_refuses_a_configuration_that_differs(tmp_path, monkeypatch):
    """A configuration whose gradient is not the default's gets no time."""
    from bench import sweep

    real = sweep._step_results

    def skewed(forward):
        outs, grads = real(forward)
        if single_pass.current().evict:        # the configuration under test computes wrong
            grads = [g * 1.1 for g in grads]
        return outs, grads

    monkeypatch.setattr(sweep, "_step_results", skewed)
    code = sweep.main(["--out", str(tmp_path), "--quick", "--N", "16", "--V", "300",
                       "--configs", "default evict=1"])
    summary = json.loads((tmp_path / "sweep.json").read_text())
    assert code == 1
    assert [e["config"] for e in summary["cases"][0]["ranking"]] == ["default"]
    assert "gradient differs from the default's" in summary["failed"]["evict=1"]
