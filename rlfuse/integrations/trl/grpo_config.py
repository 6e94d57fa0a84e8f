"""The config of ``rlfuse.integrations.trl``'s trainer: ``RLFuseGRPOConfig`` (``GRPOConfig`` and
the rlfuse loss with its hyper-parameters) and every setting of it the rlfuse loss cannot honour
(``unsupported_options``), refused at construction, each named."""
from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional

from trl import GRPOConfig

from rlfuse._names import GEOMETRIES, TOPOLOGIES
from rlfuse.checks.policy import check_bool
from rlfuse.checks.values import (check_choice, check_chunk_tokens, check_dual_clip,
                                  check_positive, check_sides)

LOSSES = ("ppo", "gppo", "ggpo", "gr_opd")
# TRL 1.16's loss types: every one with rlfuse_loss="ppo"; GPPO takes the aggregation of the
# first four
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
# the loss types TRL normalises by the generation batch's tokens (not by the accumulation)
TOKEN_COUNT_LOSS_TYPES = ("dapo", "cispo", "vespo")


_TRL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)
                 if f.name in ("ref_model_mixup_alpha", "beta")}
# GGPO's β where unset: the paper gives none (TRL's default, 0, is no GGPO); the temperature of
# its Gibbs target over rewards of order 1, as the demo trains it
GGPO_BETA = 0.1


@dataclasses.dataclass
class RLFuseGRPOConfig(GRPOConfig):
    """``GRPOConfig`` and the rlfuse loss with its hyper-parameters."""

    rlfuse_loss: str = dataclasses.field(default="ppo", metadata={"help": "ppo, gppo, ggpo or "
                                                                           "gr_opd"})
    rlfuse_geometry: str = "chi2"
    rlfuse_topology: str = "atomic"
    rlfuse_delta: float = 0.04
    rlfuse_dual_clip: Optional[float] = None
    rlfuse_gr_opd_gamma: float = 0.99
    rlfuse_gr_opd_lam: float = 0.25
    rlfuse_gr_opd_feedback_clip: float = 5.0
    rlfuse_gr_opd_adv_clip: float = 5.0
    rlfuse_chunk_tokens: Optional[int] = None
    rlfuse_batch_invariant: bool = False
    rlfuse_ggpo_mixed_groups_only: bool = True
    # TRL's reference sync and KL weight; unset: as TRL for every loss but GGPO, which the paper
    # trains with its reference refreshed by a copy of the policy (on, alpha 1) and a β > 0
    sync_ref_model: Optional[bool] = None
    ref_model_mixup_alpha: Optional[float] = None
    beta: Optional[float] = None

    def __post_init__(self):
        ggpo = self.rlfuse_loss == "ggpo"
        if self.sync_ref_model is None:
            self.sync_ref_model = ggpo
        if self.ref_model_mixup_alpha is None:
            self.ref_model_mixup_alpha = 1.0 if ggpo else _TRL_DEFAULTS["ref_model_mixup_alpha"]
        if self.beta is None:
            self.beta = GGPO_BETA if ggpo else _TRL_DEFAULTS["beta"]
        super().__post_init__()


def _bad_rlfuse_fields(args) -> List[str]:
    """The ``rlfuse_*`` fields out of their range, named as the user wrote them (the checks of
    the functional API)."""
    checks = {
        "rlfuse_geometry": lambda name, v: check_choice(name, v, GEOMETRIES),
        "rlfuse_topology": lambda name, v: check_choice(name, v, TOPOLOGIES),
        "rlfuse_delta": lambda name, v: check_sides(name, v, check_positive),
        "rlfuse_dual_clip": lambda name, v: check_dual_clip(v, name),
        "rlfuse_chunk_tokens": check_chunk_tokens,
        "rlfuse_gr_opd_gamma": check_positive,
        "rlfuse_gr_opd_feedback_clip": check_positive,
        "rlfuse_gr_opd_adv_clip": check_positive,
        "rlfuse_batch_invariant": check_bool,
        "rlfuse_ggpo_mixed_groups_only": check_bool,
    }
    problems = []
    for name, check in checks.items():
        try:
            check(name, getattr(args, name))
        except (TypeError, ValueError) as error:
            problems.append(str(error))
    return problems


def as_rlfuse_config(args, model):
    """The trainer's config: ``args`` if an ``RLFuseGRPOConfig`` (or not a config at all:
    ``unsupported_options`` names it); TRL's default for ``model`` when None (``GRPOTrainer``'s
    own: output in ``<model name>-GRPO``); a plain ``GRPOConfig`` as it is (its fields as TRL
    resolved them, not resolved again) with rlfuse's defaults for rlfuse's own."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return RLFuseGRPOConfig(f"{name.split('/')[-1]}-GRPO")
    if isinstance(args, GRPOConfig) and not isinstance(args, RLFuseGRPOConfig):
        converted = copy.copy(args)
        converted.__class__ = RLFuseGRPOConfig
        own = {f.name for f in dataclasses.fields(GRPOConfig)}
        for field in dataclasses.fields(RLFuseGRPOConfig):
            if field.name not in own:
                setattr(converted, field.name, field.default)
        return converted
    return args


def unsupported_options(args, teacher_model) -> List[str]:
    """Every option of ``args`` (an ``RLFuseGRPOConfig``) the rlfuse loss cannot honour."""
    if not isinstance(args, RLFuseGRPOConfig):
        return [f"args of type {type(args).__name__} (expected RLFuseGRPOConfig)"]
    loss = args.rlfuse_loss
    problems = []
    if loss not in LOSSES:
        problems.append(f"rlfuse_loss={loss!r} (expected one of {', '.join(LOSSES)})")
    problems += _bad_rlfuse_fields(args)
    types = LOSS_TYPES if loss == "ppo" else CLIP_LOSS_TYPES
    if args.loss_type not in types:
        problems.append(f"loss_type={args.loss_type!r} with rlfuse_loss={loss!r} (expected one "
                        f"of {', '.join(types)})")
    if args.rlfuse_dual_clip is not None and (args.loss_type not in CLIP_LOSS_TYPES or
                                              args.importance_sampling_level != "token"):
        problems.append("rlfuse_dual_clip with a loss other than the token-level clip")
    generations = args.num_generations or 1
    if loss == "ggpo":
        if not args.beta > 0:
            problems.append(f"beta={args.beta} with rlfuse_loss='ggpo' (beta is GGPO's KL "
                            f"weight, > 0; {GGPO_BETA} where unset)")
        if args.per_device_train_batch_size % generations:
            problems.append("per_device_train_batch_size not a multiple of num_generations with "
                            "rlfuse_loss='ggpo' (GGPO's loss couples a group)")
        if args.steps_per_generation % args.gradient_accumulation_steps:
            problems.append("steps_per_generation not a multiple of gradient_accumulation_steps "
                            "with rlfuse_loss='ggpo' (its normaliser counts each optimizer "
                            "step's tokens from its generation batch)")
    if loss == "ggpo":
        # GGPO's loss already is a KL-regularised regression to its Gibbs target
        for name, default in (("off_policy_mask_threshold", None), ("top_entropy_quantile", 1.0),
                              ("entropy_coef", 0.0), ("use_adaptive_entropy", False),
                              ("delta", None)):
            value = getattr(args, name, default)
            if value != default:
                problems.append(f"{name}={value!r} with rlfuse_loss='ggpo' (GGPO takes no "
                                f"terms: its beta and reference already are its KL, a bonus "
                                f"or mask would move it off its Gibbs target)")
    if loss == "gppo" and args.delta is not None:
        problems.append(f"delta={args.delta!r} with rlfuse_loss='gppo' (TRL's ratio cap of its "
                        f"clip; GPPO's trust region is rlfuse_geometry and rlfuse_delta)")
    if loss == "gr_opd":
        if teacher_model is None:
            problems.append("rlfuse_loss='gr_opd' without teacher_model")
        if (args.per_device_train_batch_size * (args.steps_per_generation or 1)) % generations:
            problems.append("a per-process generation batch that splits a group, with "
                            "rlfuse_loss='gr_opd'")
    return problems
