"""The counter hash of the Triton kernels that draw random bits: lowbias32 on uint32.

mix32 is the 32-bit mixer the torch paths use too (merges/reference.py's mix32, compress/codec.py's
mix32), here in uint32 arithmetic (wrapping multiplies), so a kernel's draws are bit for bit the
torch path's. Used by sparse_merge.py (DARE's drops) and quant.py (stochastic rounding).
"""

from __future__ import annotations

import triton
import triton.language as tl  # noqa: F401  (Triton's interpreter wants it among a jit function's globals)


@triton.jit
def mix32(x):
    """lowbias32 of the uint32 tensor x."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)
