"""What every kernel moves, counted on the CPU (``python -m tools.traffic``), what a
vocabulary split sends per call (``python -m tools.traffic --comm``), and the single pass's
rows in flight against each GPU's L2 (``python -m tools.traffic --l2``, a model).

The Triton interpreter runs the real kernels; ``KernelCounter`` records the address of every
element each launch loads and stores (unmasked lanes only) and ``TorchPasses`` every torch op
that touches a logits-sized tensor outside the kernels. ``measure_case`` turns both into the
traffic of one op per row of logits: how many times an actor row is read (``reads``), how many
of those reads are of bytes not read before in the launch (``unique``), how many times it is
written, the same for masked rows and for rows outside a full output's window, the ``[B, T]``
side bytes per token, and the torch passes and allocations over logits-sized tensors.

These are bytes, not time: what the L2 cache of a GPU makes of a re-read only a GPU shows.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The classes of a row of logits: an actor token's, a masked token's, a row of a full model
# output outside the window [offset, offset + T), a row of a LinearHead chunk.
ROW_CLASSES = ("actor", "masked", "outside", "chunk")
ACTOR, MASKED, OUTSIDE, CHUNK = range(len(ROW_CLASSES))


def _element_size(tl_dtype) -> int:
    return max(1, tl_dtype.primitive_bitwidth // 8)


@dataclasses.dataclass
class Launch:
    """One kernel launch: its tensor arguments and the byte addresses it loaded and stored."""
    kernel: str
    tensors: List[torch.Tensor]
    loads: List[Tuple[np.ndarray, int]] = dataclasses.field(default_factory=list)
    stores: List[Tuple[np.ndarray, int]] = dataclasses.field(default_factory=list)

    def bytes(self, kind: str) -> int:
        return sum(a.size * size for a, size in getattr(self, kind))


class KernelCounter(contextlib.AbstractContextManager):
    """Records every interpreted launch (``launches``) while active; ``in_kernel`` is True while
    a launch runs (the interpreter's own host copies are not the op's traffic)."""

    def __init__(self):
        self.launches: List[Launch] = []
        self.in_kernel = False

    def __enter__(self):
        from triton.runtime import interpreter

        if not isinstance(interpreter.interpreter_builder, interpreter.InterpreterBuilder):
            raise RuntimeError("tools.traffic: set TRITON_INTERPRET=1 before triton is imported")
        builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
        load, store, call = builder.create_masked_load, builder.create_masked_store, \
            executor.__call__
        counter = self

        def record(kind, ptrs, mask):
            addresses = ptrs.data[np.broadcast_to(mask.data, ptrs.data.shape)]
            getattr(counter.launches[-1], kind).append(
                (addresses.astype(np.int64), _element_size(ptrs.get_element_ty())))

        def masked_load(ptrs, mask, other, cache_policy, is_volatile):
            record("loads", ptrs, mask)
            return load(ptrs, mask, other, cache_policy, is_volatile)

        def masked_store(ptrs, value, mask, cache_policy):
            record("stores", ptrs, mask)
            return store(ptrs, value, mask, cache_policy)

        def tensors_of(args):     # the kernels take some tensors inside tuples
            for a in args:
                if isinstance(a, torch.Tensor):
                    yield a
                elif isinstance(a, tuple):
                    yield from tensors_of(a)

        def launch(grid_executor, *args, **kwargs):
            tensors = list(tensors_of((*args, *kwargs.values())))
            counter.launches.append(Launch(grid_executor.fn.__name__, tensors))
            counter.in_kernel = True
            try:
                return call(grid_executor, *args, **kwargs)
            finally:
                counter.in_kernel = False

        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        executor.__call__ = launch
        self._restore = lambda: (delattr(builder, "create_masked_load"),
                                 delattr(builder, "create_masked_store"),
                                 setattr(executor, "__call__", call))
        return self

    def __exit__(self, *exc):
        self._restore()
        return False


# Ops that allocate without touching memory, and ops whose output is a view.
_ALLOCATIONS = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"}


def _copied(func, args, out) -> bool:
    """A cast (``aten.to``, whose schema may alias its input) that made a new tensor: a pass."""
    return func.overloadpacket.__name__ == "to" and isinstance(out, torch.Tensor) and \
        isinstance(args[0], torch.Tensor) and out.data_ptr() != args[0].data_ptr()


class TorchPasses(TorchDispatchMode):
    """Every torch op outside the kernels with a logits-sized tensor among its inputs or outputs
    (``is_logits``): ``passes`` ``(op, rows read, rows written)`` and ``allocations`` (rows),
    in rows of logits. rlfuse's custom ops are entered, so what they run is seen op by op."""

    def __init__(self, is_logits: Callable[[torch.Tensor], bool], row_bytes: int,
                 counter: KernelCounter):
        super().__init__()
        self.is_logits, self.row_bytes, self.counter = is_logits, row_bytes, counter
        self.passes: List[Tuple[str, float, float]] = []
        self.allocations: List[Tuple[str, float]] = []

    def _rows(self, tensors) -> float:
        return sum(t.numel() * t.element_size() for t in tensors
                   if isinstance(t, torch.Tensor) and self.is_logits(t)) / self.row_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._library.custom_ops import _maybe_get_opdef

        kwargs = kwargs or {}
        opdef = _maybe_get_opdef(func) if func.namespace == "rlfuse" else None
        if opdef is not None:          # run its implementation under this mode
            with self:
                return opdef._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.counter.in_kernel or (func.is_view and not _copied(func, args, out)):
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        name = func.overloadpacket.__name__
        written = self._rows(outs)
        if name in _ALLOCATIONS:
            if written:
                self.allocations.append((name, written))
            return out
        read = self._rows(torch.utils._pytree.tree_leaves((args, kwargs)))
        if name == "gather" and read:   # the indexed elements only
            read = args[2].numel() * args[0].element_size() / self.row_bytes
        if name in ("scatter_add", "scatter_add_") and (read or written):   # and here written
            read = written = args[2].numel() * args[0].element_size() / self.row_bytes
        if read or written:
            self.passes.append((name, read, written))
        return out


# --------------------------------------------------------------------------------------------
# Rows of logits
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Geometry:
    """The logits a case works on: ``[B, S, V]`` rows ``[offset, offset + T)`` predict the
    ``[B, T]`` tokens, ``mask`` the actor ones; ``hidden`` the width of a LinearHead's hidden
    states (its chunks are ``[rows, V]``), else None."""
    B: int
    S: int
    T: int
    V: int
    offset: int
    mask: torch.Tensor
    element_size: int
    hidden: Optional[int] = None
    tile: int = 0       # a peer head's vocabulary tiles' width (0: it forms whole rows)

    @property
    def row_counts(self) -> Dict[str, int]:
        actor = int(self.mask.sum())
        return (actor, self.B * self.T - actor, self.B * (self.S - self.T),
                actor if self.hidden is not None else 0)

    def is_logits(self, t: torch.Tensor) -> bool:
        """A tensor of rows of logits (or their gradient), a LinearHead chunk or its transpose,
        or a tile of a chunk's vocabulary ``[R, tile]`` (the last one narrower); not the
        head's weight ``[V, H]``."""
        if t.dim() < 2 or (self.hidden is not None and self.hidden in t.shape):
            return False
        if self.V in t.shape:
            return t.numel() >= 2 * self.V
        return bool(self.tile) and t.dim() == 2 and t.is_floating_point() and \
            t.shape[-1] in (self.tile, self.V % self.tile)

    def row_classes(self, t: torch.Tensor) -> Optional[np.ndarray]:
        """The class of each row of ``t`` if it is a kernel's rows of logits (``[B, S, V]`` or
        its window ``[B, T, V]``, or ``[R, V]`` for a LinearHead chunk), else None."""
        if t.dim() < 2 or t.shape[-1] != self.V or t.stride(-1) != 1:
            return None
        if self.hidden is not None:   # a chunk, [R, V] or [R, 1, V]
            return np.full(tuple(t.shape[:-1]) + ((1,) if t.dim() == 2 else ()), CHUNK,
                           dtype=np.int8)
        window = np.where(self.mask.cpu().numpy().astype(bool), ACTOR, MASKED)
        if t.dim() == 3 and t.shape[0] == self.B and t.shape[1] == self.T:
            return window.astype(np.int8)
        classes = np.full((self.B, self.S), OUTSIDE, dtype=np.int8)
        classes[:, self.offset:self.offset + self.T] = window
        if t.dim() == 3 and t.shape[0] == self.B and t.shape[1] == self.S:
            return classes
        if t.shape[:-1].numel() == self.B * self.S and (t.dim() == 2 or t.shape[1:-1].numel()
                                                        == 1):   # the rows packed, [N(, 1), V]
            return classes.reshape(tuple(t.shape[:-1]))
        return None


def _row_of(t: torch.Tensor, addresses: np.ndarray, size: int):
    """(in-tensor selector, row index tuple, column) of byte addresses within ``t``'s rows."""
    offsets = (addresses - t.data_ptr()) // size
    lead = t.shape[:-1]
    inside = (offsets >= 0)
    index, rest = [], offsets.copy()
    for dim in range(len(lead)):
        stride = t.stride(dim)
        i = rest // stride
        rest = rest - i * stride
        inside &= (i >= 0) & (i < lead[dim])
        index.append(i)
    inside &= (rest >= 0) & (rest < t.shape[-1])
    if len(lead) == 1:
        index.append(np.zeros_like(offsets))
    return inside, tuple(i[inside] for i in index)


def _whole_chunk_rows(t: torch.Tensor, geometry: Geometry) -> torch.Tensor:
    """A chunk's rows of logits taken in vocabulary blocks (``[R, NB, W]`` or ``[R, 1, W]``
    within rows of ``V``, a batch-invariant head's blocks read as rows) as the whole rows
    ``[R, 1, V]`` they lie in; any other tensor as it is."""
    V = geometry.V
    if geometry.hidden is None or t.dim() != 3 or t.shape[-1] == V or t.stride(0) != V or \
            t.stride(-1) != 1 or t.shape[1] * t.shape[2] > V:
        return t
    start = t.storage_offset() - t.storage_offset() % V
    return t.as_strided((t.shape[0], 1, V), (V, V, 1), start)


def launch_rows(launch: Launch, geometry: Geometry) -> Tuple[np.ndarray, int]:
    """``[row class, (reads, unique reads, writes)]`` in elements of logits rows, and the
    distinct bytes the launch loaded and stored outside them (the ``[B, T]`` side data: a value
    every lane reads, such as a row's advantage, is one read)."""
    spaces, seen = [], set()
    for t in launch.tensors:
        if t.dim() == 2 and t.shape[0] == geometry.V and t.stride(0) == 1 and \
                t.shape[1] != geometry.V:
            t = t.t()   # rows of logits read transposed (a matmul's dlogits^T)
        t = _whole_chunk_rows(t, geometry)
        classes = geometry.row_classes(t)
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if classes is not None and key not in seen:
            seen.add(key)
            spaces.append((t, classes))
    totals = np.zeros((len(ROW_CLASSES), 3), dtype=np.int64)
    side = 0

    def count(column, t, classes, addresses, size):
        inside, index = _row_of(t, addresses, size)
        totals[:, column] += np.bincount(classes[index], minlength=len(ROW_CLASSES))
        return inside

    for kind, column in (("loads", 0), ("stores", 2)):
        rest: Dict[int, List[np.ndarray]] = {}
        for addresses, size in getattr(launch, kind):
            for t, classes in spaces:
                if t.element_size() == size and addresses.size:
                    addresses = addresses[~count(column, t, classes, addresses, size)]
            rest.setdefault(size, []).append(addresses)
        side += sum(np.unique(np.concatenate(a)).size * size for size, a in rest.items())
    for t, classes in spaces:   # unique reads: the distinct addresses the launch loaded
        loaded = [a for a, size in launch.loads if size == t.element_size()]
        if loaded:
            count(1, t, classes, np.unique(np.concatenate(loaded)), t.element_size())
    return totals, side


# --------------------------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Traffic:
    """What one case moved: ``per_row[class] = (reads, unique reads, writes)`` in rows of
    logits per row of that class (classes with no rows left out), the same per kernel, the
    ``[B, T]`` side bytes per token, and the torch ops outside the kernels."""
    kernels: Dict[str, Dict[str, Tuple[float, float, float]]]
    per_row: Dict[str, Tuple[float, float, float]]
    side_bytes_per_token: float
    passes: List[Tuple[str, float, float]]        # (op, rows read, rows written)
    allocations: List[Tuple[str, float]]          # (op, rows)


def measure_case(run: Callable, geometry: Geometry) -> Traffic:
    """The traffic of ``run()`` over logits of ``geometry``."""
    from rlfuse.kernels.lib import utils

    if utils.OUTPUT_FILL is not None:
        raise RuntimeError("tools.traffic: OUTPUT_FILL adds a write to every output")
    counter = KernelCounter()
    passes = TorchPasses(geometry.is_logits, max(1, geometry.V) * geometry.element_size,
                         counter)
    with counter, passes:
        run()
    counts = geometry.row_counts

    def per_row(totals):
        return {ROW_CLASSES[c]: tuple(float(x) / (counts[c] * geometry.V) for x in totals[c])
                for c in range(len(ROW_CLASSES)) if counts[c] and geometry.V}

    kernels: Dict[str, np.ndarray] = {}
    side = 0
    for launch in counter.launches:
        totals, launch_side = launch_rows(launch, geometry)
        kernels[launch.kernel] = kernels.get(launch.kernel, 0) + totals
        side += launch_side
    everything = sum(kernels.values(), np.zeros((len(ROW_CLASSES), 3), dtype=np.int64))
    return Traffic(kernels={name: per_row(t) for name, t in kernels.items()},
                   per_row=per_row(everything),
                   side_bytes_per_token=side / max(1, geometry.B * geometry.T),
                   passes=passes.passes, allocations=passes.allocations)


# --------------------------------------------------------------------------------------------
# The cases: every op of the benchmark in every mode, and the forms a trainer uses
# --------------------------------------------------------------------------------------------

# Small N (the interpreter runs every lane), with masked rows; H distinct from every other size
# so that no [B, T]-sized tensor passes for rows of logits.
TRAFFIC_BATCH, TRAFFIC_T, TRAFFIC_GROUP, TRAFFIC_HIDDEN = 4, 4, 2, 24
TRAFFIC_MODES = ("fwd", "bwd", "fwd+bwd")
TRAFFIC_V = 151936   # Qwen2/2.5: the headline vocabulary


def cases():
    """The registry's ops and variants (``bench.cases``) whose traffic is counted."""
    from bench import cases as bench_cases

    return {**bench_cases.OPS, **bench_cases.VARIANTS}


def modes_of(op) -> Tuple[str, ...]:
    """The modes of ``op`` the fused implementation has."""
    return tuple(m for m in TRAFFIC_MODES if m in op.fused_modes)


def run_case(op, x, mode: str, impl: str = "fused") -> Traffic:
    """The traffic of the registry's ``op`` in ``mode`` by ``impl`` (rlfuse's fused kernels, or
    a peer's: ``bench.cases.IMPLS``): ``fwd`` the forward alone (no gradient recorded), ``bwd``
    the backward alone (after an uncounted forward), ``fwd+bwd`` both."""
    from bench import cases as bench_cases

    forward = bench_cases.forward_fn(op, impl, bench_cases.load_impl(impl), x)

    def grad(outs, leaves):
        torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs])

    if mode == "fwd":
        def run():
            with torch.no_grad():
                forward()
    elif mode == "bwd":
        outs, leaves = forward()
        run = lambda: grad(outs, leaves)  # noqa: E731
    else:
        run = lambda: grad(*forward())  # noqa: E731
    window = op.window or (lambda x: (x.shape.T, 0))
    if impl == "liger":         # Liger reads the whole [B, T + 1, V] output
        window = lambda x: (x.shape.T + 1, 0)  # noqa: E731
    S, offset = window(x) if x.shape.V else (x.shape.T, 0)
    geometry = Geometry(B=x.shape.batch, S=S, T=x.shape.T, V=x.shape.V or 0, offset=offset,
                        mask=x.mask, element_size=x.shape.element_size if x.shape.V else 4,
                        hidden=x.shape.hidden if op.matmuls is not None else None,
                        tile=bench_cases.vocab_tile(op, impl))
    return measure_case(run, geometry)


def traffic_inputs(V: Optional[int], dtype: torch.dtype, *, seed: int = 0):
    from bench import cases as bench_cases

    shape = bench_cases.Shape(TRAFFIC_BATCH * TRAFFIC_T, V, dtype, TRAFFIC_BATCH, TRAFFIC_GROUP,
                              TRAFFIC_HIDDEN)
    x = bench_cases.make_inputs(shape, "cpu", seed=seed, full_output=V is not None)
    if x.mask.all() or not x.mask.any():
        raise RuntimeError("tools.traffic: the inputs need actor and masked rows")
    return x


def floor_of(op, mode: str) -> Optional[Tuple[int, int, int]]:
    """``(reads, writes, side bytes per token)`` of the op's floor (None: a LinearHead, whose
    floor is its matmuls)."""
    return None if op.matmuls is not None else op.floor[mode]


def measure_all(V: int, dtype: torch.dtype, names: Sequence[str] = (), seed: int = 0
                ) -> List[dict]:
    """One row per (case, mode): the per-row counts, per kernel, and the floor. ``names``: ops
    (with their variants) or variants."""
    rows = []
    x_logits, x_lp = traffic_inputs(V, dtype, seed=seed), traffic_inputs(None, torch.float32,
                                                                         seed=seed)
    for name, op in cases().items():
        if names and name not in names and name.split(",")[0] not in names:
            continue
        x = x_logits if op.from_logits else x_lp
        for mode in modes_of(op):
            t = run_case(op, x, mode)
            rows.append({"case": name, "mode": mode, "floor": floor_of(op, mode),
                         "per_row": t.per_row, "kernels": t.kernels,
                         "side_bytes_per_token": t.side_bytes_per_token,
                         "passes": t.passes, "allocations": t.allocations})
    return rows


def _rw(counts, unique=True) -> str:
    if counts is None:
        return ""
    reads, unique_reads, writes = counts
    u = f" ({unique_reads:.2f})" if unique and abs(unique_reads - reads) > 0.005 else ""
    return f"{reads:.2f}{u} / {writes:.2f}"


def _torch_ops(row, actor_rows) -> str:
    totals: Dict[str, List[float]] = {}
    for name, read, written in row["passes"]:
        t = totals.setdefault(name, [0.0, 0.0])
        t[0] += read / actor_rows
        t[1] += written / actor_rows
    return ", ".join(f"{name} {r:.2f}/{w:.2f}" for name, (r, w) in totals.items()) or "none"


def format_table(rows: List[dict], header: dict) -> str:
    """The markdown table of ``measure_all``'s rows."""
    actor = header["actor_rows"]
    lines = [
        f"Bytes counted in the Triton interpreter ({header['dtype']}, V = {header['V']}, "
        f"B = {header['B']}, T = {header['T']}, {actor} actor rows): rows of logits read / "
        "written per row of each kind (reads in parentheses: the distinct bytes of a launch, "
        "what an L2 that holds a row would leave of the re-read). Not time.", "",
        "| op | mode | actor row R / W | floor R / W | masked row R / W | outside row R / W "
        "| LinearHead chunk row R / W | torch ops over logits, R/W per actor row "
        "| logits-sized allocations (rows per window row) | [B, T] bytes per token (floor) |",
        "|" + "---|" * 10]
    for row in rows:
        per_row, floor = row["per_row"], row["floor"]
        allocated = sum(r for _, r in row["allocations"]) / (header["B"] * header["T"])
        floor_rw = f"{floor[0]} / {floor[1]}" if floor and header["V"] else "matmuls" \
            if floor is None else ""
        side = f"{row['side_bytes_per_token']:.1f}" + (f" ({floor[2]})" if floor else "")
        lines.append("| " + " | ".join([
            row["case"], row["mode"], _rw(per_row.get("actor")), floor_rw,
            _rw(per_row.get("masked"), False), _rw(per_row.get("outside"), False),
            _rw(per_row.get("chunk")), _torch_ops(row, actor),
            f"{allocated:.2f}" if allocated else "0", side]) + " |")
    return "\n".join(lines)


MARK_BEGIN, MARK_END = "<!-- traffic:begin -->", "<!-- traffic:end -->"


def traffic(V: int, dtype: torch.dtype, names: Sequence[str] = (), out: Optional[str] = None,
            readme: Optional[str] = None) -> dict:
    """``python -m tools.traffic``: measure, print the table, write ``traffic.json`` and
    ``traffic.md`` under ``out``, and the table between a page's traffic markers."""
    import json
    import os

    x = traffic_inputs(V, dtype)
    header = {"V": V, "dtype": str(dtype).replace("torch.", ""), "B": x.shape.batch,
              "T": x.shape.T, "actor_rows": int(x.mask.sum()),
              "unit": "rows of logits per row (reads, distinct reads, writes)"}
    rows = measure_all(V, dtype, names)
    table = format_table(rows, header)
    print(table, flush=True)
    results = {"header": header, "rows": rows}
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "traffic.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out, "traffic.md"), "w") as f:
            f.write(table + "\n")
    if readme:
        from bench.report import replace_between

        replace_between(readme, MARK_BEGIN, MARK_END, f"\n{table}\n\n`python -m tools.traffic "
                        f"--V {V}` ({header['dtype']}).\n")
    return results


# --------------------------------------------------------------------------------------------
# A vocabulary split over W ranks: what crosses ranks per call (rlfuse.scaleout.vocab)
# --------------------------------------------------------------------------------------------

def communication(N: int, V: int, H: int, world: int, element_size: int) -> List[dict]:
    """Bytes each rank sends per call with the vocabulary split over ``world`` ranks, beside
    the bytes of its shard of logits: forward, one all-gather of the ``[N, 4]`` fp32 shard
    statistics (and of one int64 with ``validate``); backward, nothing for ``Logits``, one
    all-reduce of the ``[N, H]`` hidden-state gradient for a ``LinearHead``, in fp32 (a ring
    sends ``2 (W - 1) / W`` of a buffer). The single pass of a ``LinearHead`` sends the same
    bytes, all in the forward: the statistics chunk by chunk, then the hidden-state gradient."""
    from rlfuse.scaleout.vocab import SHARD_COLUMNS

    stats = N * len(SHARD_COLUMNS) * 4
    gather = (world - 1) * stats               # each rank's block to every other rank
    dhidden = 2 * (world - 1) * N * H * 4 // world   # summed in fp32
    shard = N * (V // world) * element_size
    return [{"form": "Logits", "forward": gather, "backward": 0, "logits_shard": shard},
            {"form": "LinearHead", "forward": gather, "backward": dhidden,
             "logits_shard": shard}]


def communication_table(N: int, V: int, H: int, element_size: int,
                        worlds: Sequence[int] = (2, 4, 8)) -> str:
    lines = [f"Vocabulary split over W ranks, N = {N} rows, V = {V}, H = {H}, "
             f"{element_size}-byte logits: bytes each rank sends per call (computed), beside "
             "the bytes of its shard of logits (the LinearHead forms them chunk by chunk).", "",
             "| W | form | forward | backward | shard of logits | sent / shard |",
             "|---|---|---|---|---|---|"]
    for world in worlds:
        for row in communication(N, V, H, world, element_size):
            sent = row["forward"] + row["backward"]
            lines.append(f"| {world} | {row['form']} | {_mib(row['forward'])} | "
                         f"{_mib(row['backward'])} | {_mib(row['logits_shard'])} | "
                         f"{sent / row['logits_shard']:.2%} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The single pass's rows in flight against the L2 (a model, from the launch configuration)
# --------------------------------------------------------------------------------------------

# The vocabularies and dtypes of the benchmark's logits shapes, the headline first.
L2_SHAPES = ((151936, 2), (128256, 2), (32000, 2), (151936, 4))


def rows_in_flight(config, V: int, element_size: int, gpu) -> dict:
    """What the single pass in launch configuration ``config`` (a ``SinglePassConfig``) keeps
    in flight on ``gpu`` (a ``tools.gpus.GPU``) over rows of ``V`` logits. A program holds one
    row between its two reads (the logsumexp pass, then the write pass), so the rows in flight
    are the programs resident at once: a persistent grid's programs an SM (at most what an SM
    holds: the rest wait), or with one program per row as many as an SM holds (its warps'
    limit; registers can hold fewer: ``tools.sass``'s occupancy). The second read is served by
    the L2 at best while those rows fit in it, else by HBM: the HBM's bytes per logit, 1 read +
    1 write or 2 reads + 1 write, and the floor (1 + 1) over them, the most of the floor the
    kernel can reach."""
    from tools.sass import MAX_WARPS_PER_SM

    _, num_warps = config.block_and_warps(V, element_size)
    row, l2 = V * element_size, gpu.l2_mib * 2 ** 20
    resident = MAX_WARPS_PER_SM // num_warps
    per_sm = config.programs_per_sm_on(gpu.sms, l2, row, num_warps)
    per_sm = resident if per_sm is None else min(per_sm, resident)
    in_flight = per_sm * gpu.sms * row
    reads = 1 if in_flight <= l2 else 2
    return {"config": str(config), "gpu": gpu.name, "V": V, "element_size": element_size,
            "num_warps": num_warps, "programs_per_sm": per_sm,
            "bytes_in_flight_per_sm": per_sm * row, "bytes_in_flight": in_flight,
            "l2_bytes": l2, "hbm_reads": reads, "floor_fraction_bound": 2 / (reads + 1)}


def l2_table(configs: Sequence[str] = ()) -> str:
    """``rows_in_flight`` of each configuration (default: the GPU sweep's candidates) on each GPU
    of ``tools.gpus.GPUS``, at each of ``L2_SHAPES``."""
    from rlfuse.kernels.rows.single_pass import CANDIDATES, parse
    from tools.gpus import GPUS

    lines = ["The single pass's rows in flight between a row's two reads against the L2 (a model "
             "from the launch configuration; `tools.traffic.rows_in_flight`): where they fit, "
             "the re-read can come from L2 (1 read + 1 write of HBM a logit), else from HBM "
             "(2 + 1); floor bound: the most of the floor (1 + 1) those bytes allow, not a "
             "time.", "",
             "| GPU | V | bytes | configuration | programs / SM | in flight / SM | in flight | "
             "L2 | re-read from | floor bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for gpu in GPUS:
        for V, element_size in L2_SHAPES:
            for text in configs or CANDIDATES:
                m = rows_in_flight(parse(text), V, element_size, gpu)
                lines.append(
                    f"| {gpu.name} | {V} | {element_size} | {text} | {m['programs_per_sm']} | "
                    f"{m['bytes_in_flight_per_sm'] / 2 ** 20:.2f} MiB | "
                    f"{m['bytes_in_flight'] / 2 ** 20:.0f} MiB | {gpu.l2_mib} MiB | "
                    f"{'L2' if m['hbm_reads'] == 1 else 'HBM'} | "
                    f"{m['floor_fraction_bound']:.0%} |")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:,.2f} MiB"


def main(argv=None) -> int:
    import argparse
    import os
    import subprocess
    import sys

    from bench import cases as bench_cases

    p = argparse.ArgumentParser(prog="python -m tools.traffic", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--V", type=int, default=TRAFFIC_V, help="vocabulary")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="logits dtype")
    p.add_argument("--op", action="append", default=[],
                   help="ops of bench.cases (with their variants), repeatable; default all")
    p.add_argument("--out", help="directory for traffic.json and traffic.md")
    p.add_argument("--readme", help="write the table between the traffic markers of this page")
    p.add_argument("--comm", action="store_true",
                   help="print the bytes a vocabulary split over 2, 4, 8 ranks sends per call "
                        "(computed) at --N rows, --V and --dtype")
    p.add_argument("--N", type=int, default=max(bench_cases.DEFAULT_N), help="rows, for --comm")
    p.add_argument("--l2", action="store_true",
                   help="print the single pass's rows in flight against each GPU's L2 (a "
                        "model) for the sweep's candidates, or --config")
    p.add_argument("--config", action="append", default=[],
                   help="an RLFUSE_SINGLE_PASS configuration for --l2, repeatable")
    args = p.parse_args(argv)
    if args.l2:
        print(l2_table(args.config))
        return 0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.comm:
        print(communication_table(args.N, args.V, bench_cases.HIDDEN,
                                  torch.finfo(dtype).bits // 8))
        return 0
    from rlfuse.kernels.lib.utils import INTERPRET

    if not INTERPRET:   # the interpreter is chosen before triton is imported: a new process
        argv = sys.argv[1:] if argv is None else list(argv)
        return subprocess.call([sys.executable, "-m", "tools.traffic", *argv],
                               env=dict(os.environ, TRITON_INTERPRET="1"))
    traffic(args.V, dtype, args.op, args.out, args.readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
