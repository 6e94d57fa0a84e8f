"""What rlfuse reads from a ``transformers`` causal LM, each checked against the model's own
forward on a short input: its output head as ``rlfuse.LinearHead`` fields (what the model
does to the logits after its output projection, read from its config), its forward split at
the last hidden state (``add_head_forward``), and an MoE model's router loss.

A model's ``forward`` runs the backbone, the output projection and then, in some families, a
scale or a softcap: Cohere multiplies by ``logit_scale``, Granite divides by
``logits_scaling`` (HyperCLOVA X multiplies by it), Falcon-H1 multiplies by
``lm_head_multiplier``, Gemma 2/3 and PaliGemma softcap with ``final_logit_softcapping``
(MuseGlimmer multiplies by ``output_multiplier`` first).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Dict, List, Optional

import torch

from ..shared.head import scaled_logits

# config field -> how the logits use it (per model_type where families differ)
_MULTIPLIERS = ("logit_scale", "lm_head_multiplier", "output_multiplier")
_DIVISORS = ("logits_scaling",)
_MULTIPLYING_LOGITS_SCALING = ("hyperclovax",)


def config_head(config) -> Dict[str, Optional[float]]:
    """``{"logit_scale": s, "softcap": cap or None}`` of a model's (text) ``config``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = 1.0
    for name in _MULTIPLIERS + _DIVISORS:
        value = getattr(text, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        multiplies = name in _MULTIPLIERS or \
            getattr(text, "model_type", None) in _MULTIPLYING_LOGITS_SCALING
        scale = scale * value if multiplies else scale / value
    softcap = getattr(text, "final_logit_softcapping", None)
    return dict(logit_scale=float(scale), softcap=None if softcap is None else float(softcap))


@contextlib.contextmanager
def _probing(model):
    """A short input ``[1, 6]`` of ids for ``model``, which meanwhile runs in eval mode (no
    dropout) and without gradients."""
    head = model.get_output_embeddings().weight
    ids = (torch.arange(6, device=head.device) * 7919 % head.shape[0]).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield ids
    finally:
        model.train(training)


def check_head(model, fields: Dict[str, Optional[float]], backbone_and_head: Callable,
               own_forward: Optional[Callable] = None) -> None:
    """Raises unless the model's own logits on a short input equal its last hidden state
    through the output head and ``fields`` (a model doing something else after its backbone,
    which rlfuse would silently miss). ``backbone_and_head(input_ids)``: ``(hidden, weight,
    bias)`` as the trainer forms them; ``own_forward(model, **inputs)``: the model's own
    forward (default: ``model``'s)."""
    forward = own_forward or (lambda module, **inputs: module(**inputs))
    with _probing(model) as ids:
        own = forward(model, input_ids=ids, use_cache=False).logits.float()
        hidden, weight, bias = backbone_and_head(ids)
        ours = scaled_logits(torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias),
                             fields["logit_scale"], fields["softcap"]).float()
    # the same matmul on both sides: what may differ is the transform's rounding in the
    # logits' dtype (one unit of it at the logits' scale)
    tol = 4 * torch.finfo(weight.dtype).eps * max(1.0, own.abs().max().item())
    err = (own - ours).abs().max().item()
    if not err <= tol:
        raise ValueError(
            f"the model's logits differ from its last hidden state through its output head "
            f"(max difference {err:.3g}; logit_scale={fields['logit_scale']}, "
            f"softcap={fields['softcap']} read from its config): its forward does something "
            f"after the backbone that rlfuse does not know")


def add_head_forward(model) -> None:
    """``model(..., rlfuse_head=fn)`` runs the backbone and returns ``fn(hidden, weight, bias)``
    of its last hidden state and output head, inside the model's forward: a data-parallel
    wrapper around the model sees the call (DDP synchronises gradients only after its own
    forward). Without ``rlfuse_head`` the forward is the model's. The head's scale and softcap
    are read from the model's config and checked against its own logits here, once."""
    if hasattr(model, "get_base_model"):   # PEFT: the transformers model under the adapters
        model = model.get_base_model()
    original = model.forward

    @functools.wraps(original)
    def forward(*args, rlfuse_head=None, rlfuse_router=False, **kwargs):
        if rlfuse_head is None:
            return original(*args, **kwargs)
        backbone = getattr(model, model.base_model_prefix)
        if rlfuse_router:
            kwargs["output_router_logits"] = True
        out = backbone(*args, use_cache=False, **kwargs)
        head = model.get_output_embeddings()
        result = as_forward_of(head, lambda hidden: rlfuse_head(hidden, head.weight, head.bias),
                               out.last_hidden_state)
        if not rlfuse_router:
            return result
        return result, router_loss(model, out.router_logits, kwargs.get("attention_mask"))

    model.forward = forward
    model_head(model)


def as_forward_of(module: torch.nn.Module, fn: Callable, *args):
    """``fn(*args)`` called as ``module``'s forward, so that the hooks an engine keeps on the
    module run around it: DeepSpeed ZeRO-3 gathers the module's partitioned parameters before
    its forward and again before its backward (the gradient of ``fn``'s outputs), and
    partitions them after each."""
    own = module.__dict__.get("forward")
    module.forward = fn
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def router_loss(model, router_logits, attention_mask):
    """The MoE load-balancing loss the model's own forward adds (its module's
    ``load_balancing_loss_func`` over the backbone's router logits)."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    balance = sys.modules[type(model).__module__].load_balancing_loss_func
    return balance(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def router_loss_problems(model) -> List[str]:
    """Why the router loss of ``model`` cannot be reproduced, if it cannot: the model's
    forward must give, on a short input, the loss ``router_loss`` computes."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    module = sys.modules[type(model).__module__]
    if not (hasattr(module, "load_balancing_loss_func") and hasattr(model, "num_experts") and
            hasattr(model, "num_experts_per_tok")):
        return [f"the router aux loss of {type(model).__name__} (no load_balancing_loss_func "
                f"with num_experts / num_experts_per_tok, as the MoE models of transformers "
                f"have)"]
    with _probing(model) as ids:
        own = model(input_ids=ids, output_router_logits=True, use_cache=False).aux_loss
        backbone = getattr(model, model.base_model_prefix)
        ours = router_loss(model, backbone(input_ids=ids, output_router_logits=True,
                                           use_cache=False).router_logits, None)
    if not torch.allclose(ours.float(), own.float(), rtol=1e-5, atol=1e-7):
        return [f"the router aux loss of {type(model).__name__} (its forward gives {own.item()}, "
                f"its load_balancing_loss_func {ours.item()})"]
    return []


@contextlib.contextmanager
def _without_mixed_precision(model):
    """``model`` whose forward is its own meanwhile, not accelerate's mixed-precision wrapper of
    it (a prepared model's forward runs under autocast; the check compares the model's math)."""
    wrapper, original = model.__dict__.get("forward"), getattr(model, "_original_forward", None)
    if wrapper is None or original is None:
        yield
        return
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapper


def _backbone_and_head(model, input_ids):
    """``(last hidden state, head weight, head bias)`` of ``model`` on ``input_ids``."""
    out = getattr(model, model.base_model_prefix)(input_ids=input_ids, use_cache=False)
    head = model.get_output_embeddings()
    return out.last_hidden_state, head.weight, head.bias


def model_head(model) -> dict:
    """The ``LinearHead`` fields of ``model``'s output head (``config_head``), checked
    against the model's own logits the first time."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    fields = getattr(model, "_rlfuse_head", None)
    if fields is None:
        fields = config_head(model.config)
        with _without_mixed_precision(model):
            check_head(model, fields, functools.partial(_backbone_and_head, model))
        model._rlfuse_head = fields
    return fields
