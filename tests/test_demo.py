"""The demo (``python -m rlfuse.demo``): a tiny transformers + peft LoRA policy trained by each
loss. Under ``make test`` the fused path runs the kernels through the Triton interpreter."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from rlfuse.demo import run  # noqa: E402
from rlfuse.demo.__main__ import main  # noqa: E402
from rlfuse.demo.model import EOS  # noqa: E402
from rlfuse.demo.rollout import Batch, collect, verify  # noqa: E402

from conftest import APPROX  # noqa: E402

METHODS = ["ggpo", "gppo", "gr_opd"]
# Small enough for the interpreter: 2 steps of 2 groups of 2 responses of 3 tokens.
TINY = dict(steps=2, prompts_per_step=2, group_size=2, max_new_tokens=3)


@pytest.mark.parametrize("method", METHODS)
def test_cli_runs_and_prints_summary(method, capsys):
    results = main(["--method", method, "--steps", "2", "--prompts-per-step", "2",
                    "--group-size", "2", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert "losses: " in out and "summary" in out
    assert f"{method}: reward " in out
    (result,) = results
    assert [r["step"] for r in result.history] == [1, 2]
    assert all(r["loss"] is None or math.isfinite(r["loss"]) for r in result.history)
    assert 0.0 <= result.reward_before <= 1.0 and 0.0 <= result.reward_after <= 1.0


@pytest.mark.parametrize("method", METHODS)
def test_reference_and_fused_follow_the_same_trajectory(method):
    fused = run(method, impl="fused", **{**TINY, "steps": 4})
    ref = run(method, impl="reference", **{**TINY, "steps": 4})
    assert "Triton" in fused.path, fused.path  # the suite runs the kernels (interpreter or CUDA)
    assert "reference" in ref.path
    trained = 0
    for a, b in zip(fused.history, ref.history):
        assert a["reward"] == b["reward"] and a["groups"] == b["groups"]  # same sampled tokens
        if a["loss"] is None:
            assert b["loss"] is None
            continue
        trained += 1
        assert a["loss"] == pytest.approx(b["loss"], **APPROX["demo_steps"])
        assert a["metrics"].keys() == b["metrics"].keys()
        for key in a["metrics"]:
            assert a["metrics"][key] == pytest.approx(b["metrics"][key],
                                                      **APPROX["demo_steps"]), key
    assert trained > 0
    assert fused.reward_after == pytest.approx(ref.reward_after, **APPROX["demo_reward"])


def test_distill_lowers_the_divergence(capsys):
    """``--method distill --divergence jsd``: a teacher of its own, the divergence on the
    student's samples before and after training printed; training lowers it."""
    (result,) = main(["--method", "distill", "--divergence", "jsd", "--steps", "3",
                      "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert "distill/jsd: reward " in out and "distill/jsd  " in out and "divergence " in out
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in result.history)
    assert 0 < result.divergence_after < result.divergence_before


def test_distill_runs_each_divergence_by_default(monkeypatch):
    """Without ``--divergence`` the demo distils with each divergence in turn."""
    import rlfuse.demo.__main__ as demo_main

    calls = []
    monkeypatch.setattr(demo_main, "run", lambda method, **kw: calls.append(
        kw.get("divergence")) or run_result(method))
    demo_main.main(["--method", "distill", "--steps", "1"])
    assert calls == ["forward_kl", "reverse_kl", "jsd"]


def run_result(method):
    from rlfuse.demo.train import RunResult

    return RunResult(method, "fused", "", 0.0, 0.0, 0.0, [], 1.0, 0.5)


def test_distill_fused_and_reference_follow_the_same_trajectory():
    settings = {**TINY, "steps": 3, "eval_samples": 4}
    fused = run("distill", impl="fused", divergence="reverse_kl", **settings)
    ref = run("distill", impl="reference", divergence="reverse_kl", **settings)
    assert "Triton" in fused.path
    for a, b in zip(fused.history, ref.history):
        assert a["reward"] == b["reward"]
        assert a["loss"] == pytest.approx(b["loss"], **APPROX["demo_steps"])
    for name in ("divergence_before", "divergence_after"):
        assert getattr(fused, name) == pytest.approx(getattr(ref, name), **APPROX["demo_steps"])


def test_distill_refuses_a_split_vocabulary():
    with pytest.raises(SystemExit):
        main(["--method", "distill", "--tp", "2"])


def test_linear_head_and_logits_follow_the_same_trajectory():
    """The default learner is a LinearHead (hidden states + lm_head, no [B, L, V] logits); the
    whole-output Logits form trains the same way."""
    linear = run("gppo", **{**TINY, "steps": 3})
    logits = run("gppo", policy="logits", **{**TINY, "steps": 3})
    for a, b in zip(linear.history, logits.history):
        assert a["reward"] == b["reward"]
        assert (a["loss"] is None) == (b["loss"] is None)
        if a["loss"] is not None:
            assert a["loss"] == pytest.approx(b["loss"], **APPROX["demo_forms"])
    assert linear.reward_after == pytest.approx(logits.reward_after, **APPROX["demo_reward"])


def test_verifier_counts_bytes_before_eos():
    responses = torch.tensor([[2, 4, 1, 3], [2, 4, 6, 1], [2, EOS, 1, 1], [EOS, EOS, EOS, EOS]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert verify(responses, mask).tolist() == [0.0, 1.0, 0.0, 0.0]


class _Fixed(torch.nn.Module):
    """A 'model' whose next-token distribution is fixed: uniform over two bytes (one even)."""

    def forward(self, input_ids, use_cache=False):
        logits = torch.full((*input_ids.shape, EOS + 1), -1e9)
        logits[..., 2] = logits[..., 3] = 0.0
        return type("Out", (), {"logits": logits})()


def test_collect_keeps_only_mixed_groups_and_splits_whole_groups():
    prompts = torch.randint(0, 256, (6, 5))
    generator = torch.Generator().manual_seed(0)
    batch, stats = collect(_Fixed(), prompts, group_size=2, max_new_tokens=1, generator=generator,
                           mixed_only=True, max_resamples=3)
    assert isinstance(batch, Batch) and 0.0 <= stats["reward"] <= 1.0
    groups = batch.rewards.view(-1, 2)
    assert (groups.amax(1) > groups.amin(1)).all()
    assert torch.allclose(batch.old_logprobs, torch.full_like(batch.old_logprobs, math.log(0.5)))
    parts = batch.minibatches(2, 2)
    assert sum(len(p.rewards) for p in parts if p is not None) == len(batch.rewards)
    assert all(len(p.rewards) % 2 == 0 for p in parts if p is not None)


def test_import_rlfuse_does_not_need_transformers():
    code = ("import sys, rlfuse, rlfuse.demo; "
            "assert 'transformers' not in sys.modules and 'peft' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tp_takes_one_gpu_per_local_rank(monkeypatch):
    """On CUDA each process of ``--tp`` takes the GPU of its local rank; a local rank without
    one is told so before any process group forms."""
    from rlfuse.demo.__main__ import vocab_parallel_group

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    with pytest.raises(SystemExit, match="has no GPU of its own"):
        vocab_parallel_group(2, torch.device("cuda"))
    assert vocab_parallel_group(1, torch.device("cuda")) == (None, torch.device("cuda"))


@pytest.mark.skipif(torch.cuda.device_count() == 1,
                    reason="--tp 2 on CUDA takes one GPU per process: this machine has one")
@pytest.mark.parametrize("form", ["linear", "logits"])
def test_tp2_trains_as_one_process(form, tmp_path):
    """``torchrun --nproc_per_node 2 -m rlfuse.demo --tp 2``: the head's vocabulary (257 ids,
    padded to 258) split over two gloo processes trains step for step as one process does."""
    out = tmp_path / "tp2.json"
    args = ["--method", "gppo", "--steps", "3", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "3", "--policy", form]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "rlfuse.demo", "--tp", "2", "--json", str(out), *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "split over 2 processes" in proc.stdout
    (split,) = json.loads(out.read_text())
    whole = run("gppo", policy=form, **{**TINY, "steps": 3})
    trained = 0
    for a, b in zip(split["history"], whole.history):
        assert a["reward"] == b["reward"] and a["groups"] == b["groups"]
        if b["loss"] is not None:
            trained += 1
            assert a["loss"] == pytest.approx(b["loss"], **APPROX["demo_split"])
    assert trained > 0
    assert split["reward_after"] == pytest.approx(whole.reward_after, **APPROX["demo_reward"])
