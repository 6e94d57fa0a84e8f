"""The Triton interpreter made to round as a GPU does (``round_bf16_as_a_gpu``), for the tests
and the tools that read bf16 results off it."""
from __future__ import annotations

import numpy as np
import torch


def round_bf16_as_a_gpu() -> None:
    """Triton's interpreter casts fp32 to bf16 by truncation (its cast takes no rounding mode);
    a GPU's cast (``cvt.rn.bf16.f32``) rounds to nearest even. The interpreter is made to round
    as the GPU does (torch's own conversion), so that a bf16 output here has the bits it has
    there. Call it once TRITON_INTERPRET=1 is set; again, it changes nothing."""
    import triton.language as tl
    from triton.runtime import interpreter

    cast_impl = interpreter.InterpreterBuilder.cast_impl
    if getattr(cast_impl, "rounds_bf16", False):
        return

    def rounded(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(bits.view(torch.int16).numpy().view(np.uint16),
                                            dst_type.scalar)
        return cast_impl(self, src, dst_type)

    rounded.rounds_bf16 = True
    interpreter.InterpreterBuilder.cast_impl = rounded
