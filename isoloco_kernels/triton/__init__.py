"""Triton kernels, one file per kernel family.

    gram.py        _gram_kernel:        A = X Xᵀ, lower-triangle tiles only, mirrored
    polar_step.py  _poly_kernel:        B = b·A + c·A·A (A symmetric), one kernel
                   _step_kernel:        X ← a·X + B·X, the axpy fused into the GEMM epilogue
    iso_scale.py   _iso_dot_kernel / _iso_write_kernel: s̄ = ⟨Δ, Q⟩ / min(m, n), Δ ← s̄·Q
    nesterov.py    the multi-tensor Nesterov outer update (see that file)

AVAILABLE says whether triton imports. With TRITON_INTERPRET=1 set when these modules are first
imported, the kernels are built for Triton's interpreter and take CPU tensors (that is how the
tests run them without a GPU); `interpreted()` says which kind was built.
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
    from . import gram

    return type(gram._gram_kernel).__name__ == "InterpretedFunction"


def usable_for(x) -> bool:
    """Whether the Triton kernels can run on tensor x here (CUDA, or CPU under the interpreter)."""
    if not AVAILABLE:
        return False
    return x.device.type == "cpu" if interpreted() else x.is_cuda
