"""What a public function runs on: an implementation of rlfuse's math, and how a definition of
``rlfuse.api`` becomes a public function bound to one (``bind``).

A definition takes the implementation it runs on as its last, keyword-only argument ``run``
and picks the one for its first tensor with ``run.on(x)`` (``run.on(x, *others)``: policies
that go with it): ``Implementation.on`` is always itself (the reference binds
``rlfuse.reference.*`` to its own), ``rlfuse._dispatch.Dispatch.on`` the kernels where they
run on ``x``'s device and the reference elsewhere (``rlfuse.*``).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
from typing import Callable, NamedTuple



class Implementation(NamedTuple):
    """The functions an implementation provides, each on arguments the definition checked:

    - ``token_logprobs(logits, targets, mask, temperature, return_entropy, inplace_backward,
      validate)``: ``logp`` or ``(logp, entropy)``;
    - ``window_logprobs(policy, mask, *, validate, return_entropy)``: ``(logp, entropy)``
      ``[B, T]`` of a ``Logits`` / ``LinearHead`` (entropy unused without ``return_entropy``);
    - ``ggpo(policy, args, ref_logprobs, rewards, validate)``: the ``LossOutput``;
    - ``gppo_bounds(old_logprobs, surrogate)``: ``(lo, hi)`` of a ``TokenSurrogate``'s region;
    - ``gr_opd_advantages(old_logprobs, teacher_logprobs, mask, hyper, acc)``: ``(advantages
      [B], the mean clamped feedback)``;
    - ``policy_loss(policy, args, old_logprobs, ref_logprobs, generator, validate, *,
      entropy=None)``: the ``LossOutput`` of ``api.policy_loss.PolicyLossArgs`` (``entropy``: the
      entropies of ``[B, T]`` log-probs, when known);
    - ``kl_penalty(logprobs, ref_logprobs, estimator, straight, clamp)``: the estimates;
    - ``head_logits(hidden, weight, bias)``: the batch-invariant head's logits;
    - ``token_divergence(student, teacher, divergence, mask, validate)``: ``(divergence, the
      student's entropy, {extra metric: [B, T]})`` of a distillation (``api.distill``);
    - ``context_in_place``: under context parallelism ``policy_loss`` takes a rank's chunks of
      a token-local objective in place (the ``counts`` of ``api.policy_loss.PolicyLossArgs``,
      ``scaleout.context.in_place``), where
      otherwise the loss runs on the gathered whole sequences.
    """

    name: str
    token_logprobs: Callable
    window_logprobs: Callable
    ggpo: Callable
    gppo_bounds: Callable
    gr_opd_advantages: Callable
    policy_loss: Callable
    kl_penalty: Callable
    head_logits: Callable
    token_divergence: Callable
    context_in_place: bool = False

    @contextlib.contextmanager
    def on(self, x, *others):
        """``(self, x, *others)``, each policy holding DTensors made of its local tensors
        (``scaleout.dtensor``), a sequence-parallel head of every rank's rows
        (``scaleout.sequence``)."""
        yield (self, *(y.prepared() if hasattr(y, "prepared") else y for y in (x, *others)))


def bind(definition: Callable, run) -> Callable:
    """The public function of ``definition`` on ``run`` (an ``Implementation`` or a dispatch
    between them): a copy of the definition — its code, hence its own frame, no wrapper around
    it — whose keyword-only ``run`` defaults to ``run``; its signature without ``run``, its
    docstring."""
    public = types.FunctionType(definition.__code__, definition.__globals__, definition.__name__,
                                definition.__defaults__, definition.__closure__)
    public.__kwdefaults__ = {**(definition.__kwdefaults__ or {}), "run": run}
    functools.update_wrapper(public, definition, updated=())
    del public.__wrapped__
    signature = inspect.signature(definition)
    public.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name != "run"])
    return public
