"""The output heads of ``transformers`` causal LMs as ``rlfuse.LinearHead`` fields: what a
model does to the logits after its output projection, read from its config, and a check that
the head so described gives the model's own logits.

A model's ``forward`` runs the backbone, the output projection and then, in some families, a
scale or a softcap: Cohere multiplies by ``logit_scale``, Granite divides by
``logits_scaling`` (HyperCLOVA X multiplies by it), Falcon-H1 multiplies by
``lm_head_multiplier``, Gemma 2/3 and PaliGemma softcap with ``final_logit_softcapping``
(MuseGlimmer multiplies by ``output_multiplier`` first).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .._math import head_logits

# config field -> how the logits use it (per model_type where families differ)
_MULTIPLIERS = ("logit_scale", "lm_head_multiplier", "output_multiplier")
_DIVISORS = ("logits_scaling",)
_MULTIPLYING_LOGITS_SCALING = ("hyperclovax",)


def head_fields(config) -> Dict[str, Optional[float]]:
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


def check_head(model, fields: Dict[str, Optional[float]], backbone_and_head: Callable) -> None:
    """Raises unless the model's own logits on a short input equal its last hidden state
    through the output head and ``fields`` (a model doing something else after its backbone,
    which rlfuse would silently miss). ``backbone_and_head(input_ids)``: ``(hidden, weight,
    bias)`` as the trainer forms them. Runs the model in eval mode (no dropout), without
    gradients."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model.get_output_embeddings().weight.device
    ids = (torch.arange(6, device=device) * 7919 % vocab).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            own = model(input_ids=ids, use_cache=False).logits.float()
            hidden, weight, bias = backbone_and_head(ids)
            ours = head_logits(torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias),
                               fields["logit_scale"], fields["softcap"]).float()
    finally:
        model.train(training)
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
