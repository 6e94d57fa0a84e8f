"""rlfuse as verl's fused-kernel backend: ``fused_kernels_backend="rlfuse"``.

verl's ``use_fused_kernels`` forward (one per model family, chosen by
``patch_forward_with_backends``) runs the backbone, rolls the labels (``shift_labels`` when the
engine passes them, as under Ulysses sequence parallelism, else ``labels`` or ``input_ids``
rolled by one) and hands the last hidden state, the output head's weight and the labels to
``FusedLinearForPPO(impl_backend=model._verl_fused_kernels_backend)``. With the backend
``"rlfuse"`` the model keeps verl's forward for its family (as verl's ``torch`` backend) and
that call is answered by ``rlfuse.LinearHead``: the head's bias, logit scale and softcap read
from the model (checked against its own logits once), no ``[N, V]`` logits beyond one chunk.
``linear_cross_entropy`` is verl's vocab-parallel ``linear_cross_entropy`` (Megatron's tensor
parallelism) over ``rlfuse``'s vocabulary split; ``patch_megatron`` routes verl's Megatron fused
forward through it.

verl's top-k distillation (``distillation_loss.loss_mode=forward_kl_topk``) reads the
divergence from the student's logits, which a fused forward never forms (verl's own backends
then have no ``distillation_losses``). With ``"rlfuse"`` the engine's packed forward hands the
model the teacher's top-k as verl's veomni engine does, and the divergence, ``student_mass`` and
``teacher_mass`` per token come from the same head by ``rlfuse.token_divergence`` (a
``LinearHead`` student, a ``TopK`` teacher, ``ForwardKL(log_prob_min_clamp)``), as the
``fused_linear_aux`` verl's engine reads.
"""
from __future__ import annotations

import functools
import types
import warnings
import weakref
from typing import Optional, Tuple

import torch
from verl.models.transformers import monkey_patch
from verl.utils import tensordict_utils as tu
from verl.utils.experimental import torch_functional
from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

import rlfuse
from rlfuse.divergences import ForwardKL
from rlfuse.scaleout.rank_rows import MeanOverRanks
from ..model_heads import check_head, config_head

BACKEND = "rlfuse"
# the backend with a batch-invariant head (``LinearHead(..., batch_invariant=True)``): the
# old-log-prob and the training passes give each token the same bits whatever their micro-batches
BATCH_INVARIANT = "rlfuse_batch_invariant"
BACKENDS = (BACKEND, BATCH_INVARIANT)
_VERL_PATCH = monkey_patch.patch_forward_with_backends
_VERL_FUSED_LINEAR = torch_functional.FusedLinearForPPO
_VERL_MODEL_INPUTS = FSDPEngineWithLMHead.prepare_model_inputs
_VERL_MODEL_OUTPUTS = FSDPEngineWithLMHead.prepare_model_outputs
# each model class's own forward, kept before verl replaces it on the class
_OWN_FORWARD = {}


class _Backend(str):
    """The string ``"rlfuse"`` verl stores as the model's backend, holding the model (weakly),
    so that ``FusedLinearForPPO(impl_backend=...)`` inside verl's forward finds its head."""

    def __new__(cls, model, name: str = BACKEND):
        backend = super().__new__(cls, name)
        backend.model = weakref.ref(model)
        backend.student = None      # the head of the forward in progress (``_keeping_head``)
        return backend

    def __deepcopy__(self, memo):     # a copied model holds its copy
        model = self.model()
        return _Backend(memo.get(id(model), model), str(self))

    def __reduce__(self):             # pickled: the plain name
        return str, (str(self),)

    @property
    def batch_invariant(self) -> bool:
        return str(self) == BATCH_INVARIANT


def head_fields(model) -> dict:
    """``LinearHead``'s ``logit_scale`` and ``softcap`` of ``model``, read from its config and
    checked against its own logits on a short input: raises if they differ; warns if the model
    cannot run that input where it is (e.g. a flash-attention model on the CPU, where verl
    patches it). Not checked: weights not materialised yet (verl's ranks other than 0), or a
    class whose forward verl replaced before rlfuse was imported."""
    fields = config_head(model.config)
    head = model.get_output_embeddings()
    own = _OWN_FORWARD.get(type(model))
    if own is None or head.weight.is_meta:
        return fields
    backbone = getattr(model, model.base_model_prefix)
    try:
        check_head(model, fields, lambda ids: (backbone(input_ids=ids, use_cache=False)
                                               .last_hidden_state, head.weight, head.bias),
                   own_forward=own)
    except ValueError:
        raise
    except Exception as e:   # noqa: BLE001  (whatever stops the model's own forward here)
        warnings.warn(f"rlfuse: the output head of {type(model).__name__} is taken from its "
                      f"config ({fields}) without the check against its own logits, whose "
                      f"forward failed on a short input here: {type(e).__name__}: {e}")
    return fields


def patch_forward_with_backends(model, use_fused_kernels: bool = False,
                                fused_kernels_backend: Optional[str] = None):
    """verl's ``patch_forward_with_backends``, which also accepts ``"rlfuse"``."""
    forward = type(model).forward
    if not forward.__module__.startswith("verl."):
        _OWN_FORWARD.setdefault(type(model), forward)
    if not (use_fused_kernels and fused_kernels_backend in BACKENDS):
        return _VERL_PATCH(model, use_fused_kernels=use_fused_kernels,
                           fused_kernels_backend=fused_kernels_backend)
    fields = head_fields(model)
    _VERL_PATCH(model, use_fused_kernels=True, fused_kernels_backend="torch")
    cls = type(model)
    if not hasattr(cls.forward, "__rlfuse_keeps_head__"):
        cls.forward = _keeping_head(cls.forward)
    model._rlfuse_head = fields
    model._verl_fused_kernels_backend = _Backend(model, fused_kernels_backend)
    print(f"rlfuse computes the log-probs and entropy of {type(model).__name__}")


def log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          temperature: float = 1.0, bias: Optional[torch.Tensor] = None,
                          group=None, **head) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-probs and entropy of ``labels`` (any shape) from ``hidden [..., H]`` through
    ``weight`` (and ``bias``, ``head``: ``LinearHead``'s ``logit_scale`` / ``softcap``), each
    shaped as ``labels``, differentiable in both."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels: expected the shape {tuple(hidden.shape[:-1])} of hidden "
                         f"without its last dim, got {tuple(labels.shape)}")
    policy = rlfuse.LinearHead(hidden.reshape(1, -1, hidden.shape[-1]), weight,
                               labels.reshape(1, -1).long(), bias, temperature=temperature,
                               vocab_parallel_group=group, **head)
    logp, entropy = rlfuse.policy_logprobs(policy, return_entropy=True)
    return logp.reshape(labels.shape), entropy.reshape(labels.shape)


class FusedLinearForPPO(_VERL_FUSED_LINEAR):
    """verl's ``FusedLinearForPPO``, which also accepts the backend ``"rlfuse"``."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        if impl_backend not in BACKENDS:
            super().__init__(chunk_size=chunk_size, impl_backend=impl_backend)
            return
        torch.nn.Module.__init__(self)
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        if self.impl_backend not in BACKENDS:
            return super().forward(hidden_states, vocab_weights, input_ids, temperature)
        model = self.impl_backend.model() if isinstance(self.impl_backend, _Backend) else None
        if model is None:
            raise ValueError("impl_backend: 'rlfuse' is set on a model by "
                             "patch_forward_with_backends(model, True, 'rlfuse') (verl's "
                             "apply_monkey_patch), which this call did not come from")
        head = model.get_output_embeddings()
        if vocab_weights is not head.weight:
            raise ValueError("vocab_weights: expected the weight of the model's output head")
        fields = dict(model._rlfuse_head, batch_invariant=self.impl_backend.batch_invariant)
        self.impl_backend.student = rlfuse.LinearHead(
            hidden_states.reshape(1, -1, hidden_states.shape[-1]), vocab_weights,
            input_ids.reshape(1, -1).long(), head.bias, temperature=temperature, **fields)
        return log_probs_and_entropy(hidden_states, vocab_weights, input_ids, temperature,
                                     head.bias, **fields)


def _keeping_head(verl_forward):
    """verl's fused forward of a class, which, for a model of the ``"rlfuse"`` backend, takes
    the teacher's top-k (``teacher_topk_ids`` / ``teacher_topk_log_probs``, as verl's veomni
    engine passes them: ``prepare_model_inputs``) and keeps the student's head on its output
    (``rlfuse_student``) for ``prepare_model_outputs``."""

    @functools.wraps(verl_forward)
    def forward(self, *args, teacher_topk_ids=None, teacher_topk_log_probs=None, **kwargs):
        backend = getattr(self, "_verl_fused_kernels_backend", None)
        if not isinstance(backend, _Backend):
            return verl_forward(self, *args, **kwargs)
        backend.student = None
        output = verl_forward(self, *args, **kwargs)
        output.rlfuse_student, backend.student = backend.student, None
        output.rlfuse_teacher = None if teacher_topk_ids is None else \
            rlfuse.TopK(teacher_topk_ids, teacher_topk_log_probs)
        return output

    forward.__rlfuse_keeps_head__ = True
    return forward


def _uses_rlfuse(engine) -> bool:
    module = getattr(engine.module, "module", engine.module)
    return isinstance(getattr(module, "_verl_fused_kernels_backend", None), _Backend)


def prepare_model_inputs(self, micro_batch):
    """The engine's ``prepare_model_inputs``; with top-k distillation on a model of the
    ``"rlfuse"`` backend, the teacher's top-k of the packed rows (sliced for Ulysses sequence
    parallelism as verl slices them) among the model's inputs."""
    model_inputs, output_args = _VERL_MODEL_INPUTS(self, micro_batch)
    if (tu.get_non_tensor_data(micro_batch, "distillation_use_topk", False)
            and tu.get_non_tensor_data(micro_batch, "use_fused_kernels", False)
            and _uses_rlfuse(self)):
        if not tu.get_non_tensor_data(micro_batch, "use_remove_padding", True):
            raise ValueError("use_remove_padding: top-k distillation with fused kernels takes "
                             "verl's packed rows (use_remove_padding=True)")
        teacher = [micro_batch[key].values().unsqueeze(0)
                   for key in ("teacher_ids", "teacher_logprobs")]
        if get_ulysses_sequence_parallel_world_size() > 1:
            teacher = [slice_input_tensor(x, dim=1) for x in teacher]
        model_inputs["teacher_topk_ids"], model_inputs["teacher_topk_log_probs"] = teacher
    return model_inputs, output_args


def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
    """The engine's ``prepare_model_outputs``; for a forward that kept the student's head and
    the teacher's top-k (``_keeping_head``), verl's per-token top-k distillation outputs
    computed from them first (``top_k_distillation``)."""
    teacher = getattr(output, "rlfuse_teacher", None)
    if teacher is not None and getattr(output, "fused_linear_aux", None) is None:
        output.fused_linear_aux = top_k_distillation(output.rlfuse_student, teacher,
                                                     logits_processor_func)
    return _VERL_MODEL_OUTPUTS(self, output, output_args, micro_batch, logits_processor_func)


def top_k_distillation(student, teacher, loss_function) -> types.SimpleNamespace:
    """verl's ``compute_forward_kl_topk`` outputs (``distillation_losses``, ``student_mass``,
    ``teacher_mass``, each ``[1, N]``) of a ``LinearHead`` student and a ``TopK`` teacher, with
    ``log_prob_min_clamp`` from the distillation config ``loss_function`` (verl's
    ``distillation_ppo_loss``) is bound to."""
    config = getattr(loss_function, "keywords", {}).get("distillation_config")
    if config is None:
        raise ValueError("logits_processor_func: expected verl's distillation_ppo_loss bound to "
                         "its distillation_config (top-k distillation)")
    if student is None:
        raise ValueError("rlfuse: the top-k distillation of this forward has no student head "
                         "(the model's forward did not reach FusedLinearForPPO)")
    divergence = ForwardKL(config.distillation_loss.log_prob_min_clamp)
    value, metrics = rlfuse.token_divergence(student, teacher, divergence=divergence,
                                             return_metrics=True)
    return types.SimpleNamespace(distillation_losses=value, **{
        name: metrics[name] for name in ("student_mass", "teacher_mass")})


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         temperature: float = 1.0, reduction: str = "none",
                         dist_process_group=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """verl's ``linear_cross_entropy`` (its mcore fused forward's): log-probs and entropy of
    ``labels`` from ``hidden [..., H]`` and ``weight [V_local, H]``, the vocabulary split over
    ``dist_process_group`` as Megatron splits its output layer (rank ``r`` holds the ids ``[r
    V_local, (r + 1) V_local)``; None: the whole vocabulary). Flat ``[N]`` fp32 results; with
    ``reduction`` ``"sum"`` or ``"mean"`` the log-probs are summed or averaged.

    Over a group of W ranks the hidden states' gradient on each rank is its share, 1 / W of
    the gradient, as verl's kernel leaves each rank its shard's partial gradient: verl's mcore
    forward gathers the hidden states from Megatron's sequence-parallel region before this call,
    and that gather's backward sums the ranks' gradients."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
    if dist_process_group is not None:
        hidden = MeanOverRanks.apply(hidden, torch.distributed.get_world_size(dist_process_group))
    logp, entropy = log_probs_and_entropy(hidden.reshape(-1, hidden.shape[-1]), weight,
                                          labels.reshape(-1), temperature,
                                          group=dist_process_group)
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, entropy


def patch_megatron() -> None:
    """Routes verl's Megatron fused forward (``verl.models.mcore.model_forward_fused``: its
    GPTModel forward and its output processor) through ``linear_cross_entropy``: the module's
    ``linear_cross_entropy``, which both look up at each call, replaced (needs megatron-core)."""
    from verl.models.mcore import model_forward_fused

    model_forward_fused.linear_cross_entropy = linear_cross_entropy


def install() -> None:
    """Makes ``"rlfuse"`` a backend of verl's ``patch_forward_with_backends`` (as
    ``apply_monkey_patch`` calls it) and of ``FusedLinearForPPO``, and lets verl's FSDP engine
    hand such a model the teacher's top-k."""
    monkey_patch.patch_forward_with_backends = patch_forward_with_backends
    torch_functional.FusedLinearForPPO = FusedLinearForPPO
    FSDPEngineWithLMHead.prepare_model_inputs = prepare_model_inputs
    FSDPEngineWithLMHead.prepare_model_outputs = prepare_model_outputs
