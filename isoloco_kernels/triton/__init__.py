"""Triton kernels, one file per kernel family.

    iso_scale.py   _iso_dot_kernel / _iso_write_kernel: s̄ = ⟨Δ, Q⟩ / min(m, n), Δ ← s̄·Q
    nesterov.py    the multi-tensor Nesterov outer update (see that file)
    sparse_merge.py  the fused TIES / DARE merge of one worker stack
    sym_gram.py    one-triangle symmetric products α·X·Xᵀ + β·B + γ·I (fast(sym="triton"), opt-in)
    quant.py       compressed exchange: fused quantize + error feedback + pack; unpack + accumulate (compress/)
    mix.py         mix32, the counter hash of sparse_merge.py's drops and quant.py's stochastic rounding

AVAILABLE says whether triton imports. With TRITON_INTERPRET=1 set when these modules are first
imported, the kernels are built for Triton's interpreter and take CPU tensors (that is how the
tests run them without a GPU); `interpreted()` says which kind was built. The polar iteration's
GEMMs run on cuBLAS (Triton GEMM kernels for it were removed: never measured faster); sym_gram's
one-triangle products are opt-in until a GPU run measures them against cuBLAS.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401

    AVAILABLE = True
except Exception:  # triton missing or broken: the torch paths serve
    AVAILABLE = False


def interpreted() -> bool:
    """Whether the kernels were built for the interpreter (CPU tensors) rather than a GPU."""
    if not AVAILABLE:
        return False
    from . import iso_scale

    return type(iso_scale._iso_dot_kernel).__name__ == "InterpretedFunction"


def usable_for(x) -> bool:
    """Whether the Triton kernels can run on tensor x here (CUDA, or CPU under the interpreter)."""
    if not AVAILABLE:
        return False
    return x.device.type == "cpu" if interpreted() else x.is_cuda


# ----------------------------------------------------------------------------------------------
# Launch helpers every kernel wrapper uses

#: CUDA caps grid axes 1 and 2 at 65535 blocks; batches on those axes are launched in chunks.
MAX_GRID_YZ = 65535


def on_device(t):
    """Launch under t's device: Triton launches on the current CUDA device and its current
    stream, so tensors on cuda:1 need cuda:1 current (no-op for CPU tensors, the interpreter)."""
    import contextlib

    import torch

    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def batch_chunks(nb: int, limit=None):
    """[b0, b1) ranges of at most `limit` (default MAX_GRID_YZ) matrices covering a batch of nb."""
    limit = limit or MAX_GRID_YZ
    for b0 in range(0, nb, limit):
        yield b0, min(nb, b0 + limit)


def needs_int64(*tensors) -> bool:
    """Whether an offset inside one matrix (the last two dims, any strides) can reach 2^31: then
    kernels must form their in-matrix offsets in 64 bits (batch offsets always are)."""
    for t in tensors:
        extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape[-2:], t.stride()[-2:]) if s > 0)
        if extent >= 2**31:
            return True
    return False
