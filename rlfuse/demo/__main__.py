"""python -m rlfuse.demo: train a tiny byte-level LoRA policy with each rlfuse loss (GGPO, GPPO,
GR-OPD) on a rule-verified task and report the reward before and after training; --method
distill distils a tiny teacher into it with each divergence and reports the divergence."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import List, Optional

import torch

import rlfuse

from .methods import DIVERGENCES, METHODS
from .text import EVAL_PROMPTS
from .train import Settings, active_path, resolve_device, run

# what a run without --method trains (distill only when named)
DEFAULT_METHODS = ("ggpo", "gppo", "gr_opd")
TASK = ("task: continue a 12-byte window of the Zen of Python; the verifier rewards 1 when more "
        "than half of the response bytes are even")


class Progress:
    """A tqdm bar when tqdm is installed and stderr is a terminal, else a text bar in front of
    each step line."""

    def __init__(self, total: int, desc: str):
        self.total, self.done = total, 0
        self.bar = None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr)

    def step(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(line, file=sys.stdout)
        else:
            filled = 20 * self.done // self.total
            print(f"[{'#' * filled}{'.' * (20 - filled)}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def step_line(method: str, steps: int, record: dict) -> str:
    head = f"{method:6s} {record['step']:3d}/{steps}  reward {record['reward']:.2f}"
    if record["loss"] is None:
        return f"{head}  no mixed-reward group: step skipped"
    groups = f"groups {record['groups']}" + (f" (+{record['resampled']} resampled)"
                                             if record["resampled"] else "")
    metrics = " ".join(f"{k} {v:.3g}" for k, v in record["metrics"].items())
    speed = record["tokens"] / max(record["seconds"], 1e-9)
    return f"{head}  {groups}  loss {record['loss']:+.4f}  {metrics}  {speed:,.0f} tok/s"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    defaults = Settings()
    parser = argparse.ArgumentParser(prog="python -m rlfuse.demo", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--method", choices=list(METHODS), action="append",
                        help="repeatable; None: " + ", ".join(DEFAULT_METHODS) +
                             ", one after another")
    parser.add_argument("--divergence", choices=list(DIVERGENCES), action="append",
                        help="of --method distill, repeatable; None: each in turn")
    parser.add_argument("--steps", type=int, default=defaults.steps,
                        help="optimizer steps of each method")
    parser.add_argument("--group-size", type=int, default=defaults.group_size,
                        help="responses sampled per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step,
                        help="prompts of each rollout")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                        help="bytes generated per response")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="None: cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0, help="of the model, prompts and sampling")
    parser.add_argument("--impl", choices=["fused", "reference"], default="fused",
                        help="rlfuse (fused) or rlfuse.reference: same calls, same signatures")
    parser.add_argument("--policy", choices=["linear", "logits"], default=defaults.policy,
                        help="the learner as rlfuse.LinearHead (hidden states and lm_head, no "
                             "[B, L, V] logits; default) or rlfuse.Logits (the whole output)")
    parser.add_argument("--tp", type=int, default=1,
                        help="split the head's vocabulary over this many processes "
                             "(torchrun --nproc_per_node TP -m rlfuse.demo --tp TP; gloo on CPU)")
    parser.add_argument("--json", help="write the results (rewards, every step) to this file")
    args = parser.parse_args(argv)
    if args.tp > 1 and "distill" in (args.method or ()):
        parser.error("--method distill: distillation takes the whole vocabulary on one "
                     "process (a split vocabulary is not supported yet); leave --tp out")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False (a CPU build of torch, "
                     "or no GPU visible); use --device cpu or leave --device out")
    return args


def vocab_parallel_group(tp: int, device: torch.device):
    """``(group, device)``: the process group of ``--tp`` (None for 1), every process of a
    ``torchrun`` launch, and this process's device (on CUDA, one GPU per local rank)."""
    if tp == 1:
        return None, device
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        raise SystemExit(f"--tp {tp}: launch with torchrun --nproc_per_node {tp} -m "
                         f"rlfuse.demo --tp {tp}")
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"--tp {tp}: local rank {local_rank} has no GPU of its own "
                             f"({torch.cuda.device_count()} visible); use --device cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != tp:
        raise SystemExit(f"--tp {tp}: expected {tp} processes, got {dist.get_world_size()}")
    return dist.new_group(list(range(tp))), device


def main(argv: Optional[List[str]] = None) -> List:
    args = parse_args(argv)
    runs = [(method, {}) for method in args.method or DEFAULT_METHODS if method != "distill"]
    if "distill" in (args.method or ()):
        runs += [("distill", dict(divergence=d)) for d in args.divergence or DIVERGENCES]
    group, device = vocab_parallel_group(args.tp, resolve_device(args.device))
    if group is not None and torch.distributed.get_rank() != 0:   # rank 0 speaks for all
        sys.stdout = open(os.devnull, "w")
    settings = dict(steps=args.steps, group_size=args.group_size,
                    prompts_per_step=args.prompts_per_step, max_new_tokens=args.max_new_tokens,
                    lr=args.lr, policy=args.policy)
    print(f"rlfuse {rlfuse.__version__} demo on {device}; losses: {active_path(args.impl, device)}"
          + (f"; the head's vocabulary split over {args.tp} processes" if group else ""))
    print(TASK)
    print("policy: byte-level Llama (2 layers, hidden 64, random init) + LoRA on attention; "
          + ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(Settings(**settings)).items()))

    results, labels = [], []
    for method, extra in runs:
        label = f"{method}/{extra['divergence']}" if extra else method
        print(f"\n== {label}")
        progress = Progress(args.steps, label)
        try:
            result = run(method, impl=args.impl, device=str(device), seed=args.seed,
                         on_step=lambda r: progress.step(step_line(label, args.steps, r)),
                         vocab_parallel_group=group, **settings, **extra)
        finally:
            progress.close()
        results.append(result)
        labels.append(label)
        line = f"{label}: reward {result.reward_before:.3f} -> {result.reward_after:.3f}"
        if result.divergence_before is not None:
            line += (f", divergence {result.divergence_before:.4f} -> "
                     f"{result.divergence_after:.4f}")
        print(f"{line} in {result.seconds:.1f} s")

    print(f"\nsummary: mean reward on {EVAL_PROMPTS} held-out prompts x "
          f"{Settings().eval_samples} samples, before -> after training")
    for label, r in zip(labels, results):
        divergence = "" if r.divergence_before is None else \
            f"  divergence {r.divergence_before:.4f} -> {r.divergence_after:.4f}"
        print(f"  {label:6s}  {r.reward_before:.3f} -> {r.reward_after:.3f}  "
              f"({r.reward_after - r.reward_before:+.3f})  {len(r.history)} steps  "
              f"{r.seconds:.1f} s{divergence}")
    if args.json and (group is None or torch.distributed.get_rank() == 0):
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return results


if __name__ == "__main__":
    main()
