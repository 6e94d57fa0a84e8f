"""Launch configurations of the single pass from logits (``surrogate._surrogate_logits_kernel``).

The single pass reads each logits row twice: the logsumexp pass, then the pass that writes
dlogits. The second read costs nothing only while the row is still in L2, that is while the
rows in flight between the two reads, over all SMs, fit in the L2 beside the stream of reads and
writes. One program per row keeps as many rows in flight as an SM holds programs (4 of 16 warps):
on an H200 (132 SMs, 50 MB of L2, a bf16 row of V = 151936 is 304 KB) 160 MB, and the re-read
goes to HBM. The default is a persistent grid sized from the L2 (``programs_per_sm=l2``): k
programs an SM, each looping over rows, with k the most whose rows fit in ``L2_BUDGET`` of the
L2 (at least 1, at most what an SM holds at once): at the headline 132 rows, 40 MB
(``tools.traffic --l2`` models each configuration on each GPU). What the L2 makes of it, and of
the other levers, only a GPU measures: each is a switch here, swept by ``python -m bench.sweep``.

    evict            0 | 1         1: the first pass's loads ask L2 to keep the row (evict_last),
                                   the second pass's loads and the dlogits stores go first
                                   (evict_first)
    programs_per_sm  l2 | none | k   l2: a persistent grid sized from the L2 (above); k: k x
                                   (SM count) programs, each looping over rows pid, pid +
                                   programs, ...; none: one program per row (a persistent
                                   program may use the registers that let k of them share an
                                   SM: ``maxnreg``)
    order            backward | forward   block order of the second pass (last to first, or
                                   first to last)
    num_warps        none | 1, 2, 4, 8, 16, 32      none: the table (``vocab_launch_config``)
    block_v          none | a power of two 16..65536 none: the table
    num_stages       none | 1..8   the vocabulary loops as ``tl.range(num_stages=k)``; none: the
                                   compiler's own pipelining

What the compiler makes of the hints (PTX, sm_90): Triton 3.6 and 3.9 emit L2 cache policies
(``createpolicy`` and ``L2::cache_hint``), Triton 3.2 only L1 ones (``L1::evict_last``), which
leave L2 alone; in a loop pipelined by ``num_stages`` (``cp.async``) the loads keep their hint
on Triton 3.9 only.

A configuration is chosen at each launch, not at import: the innermost ``single_pass_config``
context, else the environment variable ``RLFUSE_SINGLE_PASS`` (``key=value`` pairs separated by
commas, e.g. ``evict=1,programs_per_sm=2,order=forward,num_stages=3``; empty or ``default``: the
default), else the default.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Optional, Tuple, Union

import torch

from ..lib.row_functions import BLOCK_ORDERS, COMPILER_STAGES
from ..lib.utils import vocab_launch_config

ENV_VAR = "RLFUSE_SINGLE_PASS"

# Off CUDA (the interpreter) the persistent grid is sized by these stand-ins for the SM count and
# the L2: small, so that a test's programs each loop over several rows.
INTERPRETER_SM_COUNT = 2
INTERPRETER_L2_BYTES = 8 * 1024
# The share of the L2 that the rows in flight between a row's two reads may take (the rest: the
# dlogits stores and the next rows' first reads streaming through; H100's L2 is two partitions,
# each SM nearer one). A model's choice, which the GPU sweep tests against its neighbours.
L2_BUDGET = 0.5
L2_SIZED = "l2"

# A persistent grid's programs never finish early, so k of them must be resident on an SM at
# once or the rest wait for them: a program gets the registers of 1/k of an SM (ptxas would
# otherwise trade registers for an occupancy the grid does not use, or exceed 1/k).
REGISTERS_PER_SM = 65536        # sm_70 to sm_90
WARPS_PER_SM = 64               # resident at most, sm_80 and sm_90
_MAX_REGISTERS = 255            # a thread's, in PTX
_REGISTER_UNIT = 8              # a thread's registers are allocated in units of 8

_WARPS = (1, 2, 4, 8, 16, 32)
_BLOCK_RANGE = (16, 65536)
_STAGES_RANGE = (1, 8)
# What each key accepts, as the error messages spell it.
ACCEPTED = {
    "evict": "0 or 1",
    "programs_per_sm": f"{L2_SIZED}, none or a positive integer",
    "order": " or ".join(BLOCK_ORDERS),
    "num_warps": "none or one of " + ", ".join(map(str, _WARPS)),
    "block_v": f"none or a power of two from {_BLOCK_RANGE[0]} to {_BLOCK_RANGE[1]}",
    "num_stages": f"none or an integer from {_STAGES_RANGE[0]} to {_STAGES_RANGE[1]}",
}


@dataclasses.dataclass(frozen=True)
class SinglePassConfig:
    """One launch configuration of the single pass (the module docstring has each field)."""
    evict: bool = False
    programs_per_sm: Union[int, str, None] = L2_SIZED
    order: str = "backward"
    num_warps: Optional[int] = None
    block_v: Optional[int] = None
    num_stages: Optional[int] = None

    def __post_init__(self):
        def check(key, ok):
            if not ok:
                raise ValueError(f"single pass config: {key}={getattr(self, key)!r}; expected "
                                 f"{ACCEPTED[key]}")

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        check("evict", isinstance(self.evict, bool) or self.evict in (0, 1))
        object.__setattr__(self, "evict", bool(self.evict))
        check("programs_per_sm", self.programs_per_sm in (None, L2_SIZED)
              or (is_int(self.programs_per_sm) and self.programs_per_sm > 0))
        check("order", self.order in BLOCK_ORDERS)
        check("num_warps", self.num_warps is None or (is_int(self.num_warps)
                                                      and self.num_warps in _WARPS))
        check("block_v", self.block_v is None or (
            is_int(self.block_v) and _BLOCK_RANGE[0] <= self.block_v <= _BLOCK_RANGE[1]
            and self.block_v & (self.block_v - 1) == 0))
        check("num_stages", self.num_stages is None or (
            is_int(self.num_stages) and _STAGES_RANGE[0] <= self.num_stages <= _STAGES_RANGE[1]))

    def __str__(self) -> str:
        """The ``RLFUSE_SINGLE_PASS`` text of this configuration (its fields off the default)."""
        default = SinglePassConfig()
        parts = [f"{f.name}={_text(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != getattr(default, f.name)]
        return ",".join(parts) or "default"

    # What the launcher needs --------------------------------------------------------------

    @property
    def persistent(self) -> bool:
        return self.programs_per_sm is not None

    @property
    def stages_code(self) -> int:
        """The kernels' NUM_STAGES: the depth, or ``COMPILER_STAGES``."""
        return self.num_stages if self.num_stages is not None else COMPILER_STAGES.value

    @property
    def order_code(self) -> int:
        return BLOCK_ORDERS.index(self.order)

    def block_and_warps(self, vocab_size: int, element_size: int):
        """(BLOCK_V, num_warps): the table's, or this configuration's."""
        return vocab_launch_config(vocab_size, element_size, self.block_v, self.num_warps)

    def programs_per_sm_on(self, sms: int, l2: int, row_bytes: int, num_warps: int
                           ) -> Optional[int]:
        """Programs an SM of a persistent grid on a GPU of ``sms`` SMs and ``l2`` bytes of L2,
        over rows of ``row_bytes`` in programs of ``num_warps`` warps (``l2``: the most whose
        rows fit in ``L2_BUDGET`` of the L2, at least 1, at most what an SM holds at once);
        None: one program per row."""
        if self.programs_per_sm != L2_SIZED:
            return self.programs_per_sm
        fit = int(L2_BUDGET * l2) // max(row_bytes, 1)
        return max(1, min(max(1, WARPS_PER_SM // num_warps), fit // sms))

    def grid(self, n_rows: int, row_bytes: int, num_warps: int, device: torch.device
             ) -> Tuple[int, Optional[int]]:
        """(programs, maxnreg) of a launch over ``n_rows`` rows of ``row_bytes`` in programs of
        ``num_warps`` warps on ``device``: one program per row, or a persistent grid
        (``programs_per_sm_on``) whose programs get the registers that let that many share an
        SM (None: the compiler's choice)."""
        if not self.persistent:
            return n_rows, None
        sms = sm_count(device)
        per_sm = self.programs_per_sm_on(sms, l2_bytes(device), row_bytes, num_warps)
        return max(1, min(n_rows, per_sm * sms)), _maxnreg(per_sm, num_warps)


def _maxnreg(programs_per_sm: int, num_warps: int) -> Optional[int]:
    """The register cap of a program of ``num_warps`` warps that lets ``programs_per_sm`` of
    them share an SM (None where they hold more warps than an SM)."""
    warps = programs_per_sm * num_warps
    if warps > WARPS_PER_SM:
        return None
    share = REGISTERS_PER_SM // (warps * 32)
    return min(_MAX_REGISTERS, share) // _REGISTER_UNIT * _REGISTER_UNIT


def _text(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


def _value(key: str, text: str):
    """The field value of ``key`` written as ``text`` (validated by the dataclass)."""
    text = text.strip().lower()
    if key == "order" or (key == "programs_per_sm" and text == L2_SIZED):
        return text
    if text == "none" and key != "evict":
        return None
    try:
        return int(text)
    except ValueError:
        return text   # rejected by the dataclass with the accepted values


@functools.lru_cache(maxsize=64)
def parse(text: str) -> SinglePassConfig:
    """The configuration written as ``RLFUSE_SINGLE_PASS`` text; ValueError naming the variable
    and what each key accepts."""
    fields = {}
    try:
        if text.strip().lower() not in ("", "default"):
            for item in text.split(","):
                key, sep, value = (part.strip() for part in item.partition("="))
                if not sep or key not in ACCEPTED:
                    raise ValueError(f"{item.strip()!r} is not key=value with a known key")
                if key in fields:
                    raise ValueError(f"{key} given twice")
                fields[key] = _value(key, value)
        return SinglePassConfig(**fields)
    except ValueError as e:
        keys = "; ".join(f"{key}: {accepted}" for key, accepted in ACCEPTED.items())
        raise ValueError(f"{ENV_VAR}={text!r}: {e}. Expected comma-separated key=value pairs "
                         f"(or 'default'), keys and values: {keys}") from None


# What a GPU run chooses from: the launch configurations ``bench.sweep`` times at the headline
# shape (bf16, V = 151936: the table's 8192-wide blocks and 16 warps), the default first (sized
# from the L2: one program an SM there, 132 rows of 304 KB, 40 MB, on an H200), then one program
# per row (4 an SM in flight, 160 MB: beyond the L2), then from the likeliest winners down (a time
# budget cuts the tail): the eviction hints, pipelining to keep enough bytes in flight when few
# programs share an SM, and 8 warps where k programs need the registers (``maxnreg``).
CANDIDATES = (
    "default",
    "programs_per_sm=none",
    "evict=1",
    "evict=1,num_stages=3",
    "num_stages=3",
    "evict=1,programs_per_sm=none",
    "evict=1,programs_per_sm=2",
    "evict=1,programs_per_sm=2,num_warps=8,block_v=4096,num_stages=3",
    "evict=1,programs_per_sm=2,order=forward,num_warps=8,block_v=4096",
    "evict=1,programs_per_sm=4,num_warps=8,block_v=4096",
)

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("rlfuse_single_pass", default=None)


def current() -> SinglePassConfig:
    """The configuration of a launch now: the innermost ``single_pass_config``, else
    ``RLFUSE_SINGLE_PASS``, else the default."""
    config = _CURRENT.get()
    return config if config is not None else parse(os.environ.get(ENV_VAR, ""))


@contextlib.contextmanager
def single_pass_config(config: Union[SinglePassConfig, str, None] = None, **fields):
    """Launches of the single pass inside use ``config`` (a ``SinglePassConfig`` or its
    ``RLFUSE_SINGLE_PASS`` text) or the configuration of ``fields``, over the environment."""
    if isinstance(config, str):
        config = parse(config)
    if config is None:
        config = SinglePassConfig(**fields)
    elif fields:
        config = dataclasses.replace(config, **fields)
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _properties(device: torch.device):
    return _cuda_properties(device.index if device.index is not None
                            else torch.cuda.current_device())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; ``INTERPRETER_SM_COUNT`` off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return _properties(device).multi_processor_count


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of ``device`` in bytes; ``INTERPRETER_L2_BYTES`` off CUDA."""
    if device.type != "cuda":
        return INTERPRETER_L2_BYTES
    return _properties(device).L2_cache_size
