"""DTensor policies: a vocabulary split read from the tensors themselves.

``Logits`` whose logits are a DTensor sharded on the vocabulary (``Shard(-1)``: torchtitan's
loss-parallel layout) and ``LinearHead`` whose weight is sharded on its rows (``Shard(0)``: a
column-parallel output layer, or an FSDP2 parameter) run as a vocabulary split over that mesh
dimension's process group: each rank's local shard (``to_local``, so that the gradient lands in
the DTensor's own layout) and the group, exactly as ``vocab_parallel_group`` does; the logits
and the head are never gathered. The other tensors of the policy may be DTensors replicated on
the same mesh (their local tensors are used) or plain tensors.

A ``LinearHead``'s hidden states say whose rows they are: a DTensor (replicated) holds the same
rows on every rank of the group (tensor parallelism); a plain tensor holds this rank's own rows
(data parallelism, as FSDP2 runs): ``scaleout.rank_rows`` then gathers the rows (never the head)
and each rank gets its own rows' results.

Every check reads metadata only (placements, shapes, the mesh), the same on every rank: a bad
layout raises on every rank before any collective, so nothing hangs.
"""
from __future__ import annotations

try:
    from torch.distributed.tensor import DTensor
except ImportError:   # a torch without distributed support has no DTensors either
    DTensor = None


def is_dtensor(x) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def _vocab_mesh_dim(name: str, x, vocab_dim: int) -> int:
    """The mesh dimension over which DTensor ``x`` is sharded on its dim ``vocab_dim``, every
    other mesh dimension replicated, the vocabulary split evenly and in rank order."""
    placements = x.placements
    shards = [i for i, p in enumerate(placements) if p.is_shard()]
    want = vocab_dim % x.dim()
    if len(shards) != 1 or placements[shards[0]].dim != want or \
            not all(p.is_replicate() for i, p in enumerate(placements) if i != shards[0]):
        raise ValueError(f"{name}: expected a DTensor sharded on the vocabulary "
                         f"(Shard({want})) over one mesh dimension and replicated over the "
                         f"others, got placements {tuple(placements)}")
    mesh_dim, mesh = shards[0], x.device_mesh
    size, vocab = mesh.size(mesh_dim), x.shape[want]
    if vocab % size:
        raise ValueError(f"{name}: the vocabulary ({vocab}) must split evenly over the "
                         f"{size} ranks of its mesh dimension {mesh_dim}")
    ranks = mesh.mesh.movedim(mesh_dim, -1)
    if ranks.shape[-1] > 1 and not bool((ranks.diff(dim=-1) > 0).all()):
        raise ValueError(f"{name}: the ranks along mesh dimension {mesh_dim} must increase "
                         f"(rank r of its group holds the r-th shard), got the mesh "
                         f"{mesh.mesh.tolist()}")
    return mesh_dim


def _replicated(name: str, x, mesh):
    """``x``'s tensor: ``x`` itself, or the local tensor of a DTensor replicated on ``mesh``."""
    if not is_dtensor(x):
        return x
    if x.device_mesh != mesh or not all(p.is_replicate() for p in x.placements):
        raise ValueError(f"{name}: expected a plain tensor or a DTensor replicated on the "
                         f"vocabulary's mesh {mesh}, got {tuple(x.placements)} on "
                         f"{x.device_mesh}")
    return x.to_local()


def _sharded_like(name: str, x, weight, mesh_dim: int):
    """The local shard of ``x`` (a bias) sharded as ``weight`` is, on its dim 0."""
    if not is_dtensor(x) or x.device_mesh != weight.device_mesh or \
            _vocab_mesh_dim(name, x, 0) != mesh_dim:
        raise ValueError(f"{name}: expected a DTensor sharded as policy.weight is (Shard(0) "
                         f"over mesh dimension {mesh_dim} of {weight.device_mesh})")
    return x.to_local()


def local_fields(policy, vocab_name: str, vocab, vocab_dim: int, others: dict):
    """The local tensors of a form whose vocabulary tensor ``vocab`` (``policy.<vocab_name>``,
    its vocabulary on dim ``vocab_dim``) may be a DTensor sharded on the vocabulary, beside
    ``others`` (its other tensor fields by name: plain, or DTensors replicated on the same
    mesh; a ``bias`` sharded as a weight is): None where ``vocab`` is a plain tensor (and so is
    every other field); else ``(fields, mesh, mesh_dim)``, the fields' local tensors (the
    vocabulary's under its field name) and where the vocabulary is split."""
    if not is_dtensor(vocab):
        for field, x in others.items():
            if is_dtensor(x):
                raise ValueError(f"policy.{field}: a DTensor beside a plain {vocab_name}: pass "
                                 f"{vocab_name} as a DTensor sharded on the vocabulary, or "
                                 f"plain tensors throughout")
        return None
    if policy.vocab_parallel_group is not None:
        raise ValueError(f"policy.vocab_parallel_group: {vocab_name} is a DTensor, whose mesh "
                         f"gives the split: pass None")
    if getattr(policy, "sequence_parallel", False):
        raise ValueError("policy.sequence_parallel: a DTensor head takes its rows from the "
                         "hidden states' placement; sequence parallelism takes plain tensors")
    mesh_dim = _vocab_mesh_dim(vocab_name, vocab, vocab_dim)
    mesh = vocab.device_mesh
    fields = {field: _replicated(f"policy.{field}", x, mesh)
              for field, x in others.items() if field != "bias"}
    if others.get("bias") is not None:
        fields["bias"] = _sharded_like("policy.bias", others["bias"], vocab, mesh_dim)
    fields[vocab_name.split(".")[-1]] = vocab.to_local()
    return fields, mesh, mesh_dim
