"""The Iso-C scale epilogue: s̄ = ⟨Δ, Q⟩ / min(m, n) per matrix, then Δ ← s̄·Q.

Since Q = U_r V_rᵀ is the polar factor of Δ, ⟨Δ, Q⟩ = Σσ is the nuclear norm, so this turns a
polar factor into the Iso-C result without an SVD. The CUDA kernel in csrc/ and the Triton kernel
do the same in one pass over Δ and Q.
"""
from __future__ import annotations

import torch

from ._validate import compute_dtype


def iso_scale_torch(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    m, n = x.shape[-2:]
    cd = compute_dtype(x.dtype)
    xc, qc = x.to(cd), q.to(cd)
    sbar = (xc * qc).sum((-2, -1)) / max(min(m, n), 1)  # 0, not NaN, for empty matrices
    x.copy_(sbar[..., None, None] * qc)
    return sbar.to(torch.float32) if cd != torch.float64 else sbar


_TRITON = None  # triton/iso_scale.iso_scale_triton once imported, False when triton is unusable


def _triton_iso_scale():
    global _TRITON
    if _TRITON is None:
        _TRITON = False
        from . import triton as tk

        if tk.AVAILABLE:
            try:
                from .triton.iso_scale import iso_scale_triton

                _TRITON = iso_scale_triton
            except Exception:  # a triton too old or broken for the kernel: torch serves
                _TRITON = False
    return _TRITON


def iso_scale_cuda(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What serves iso_scale_ on CUDA when the compiled extension is absent: the same CUDA kernels
    through CuPy (_cupy.py) when CuPy works here, else the Triton epilogue (triton/iso_scale.py,
    two launches, deterministic), else the torch one."""
    from . import _cupy

    if x.is_cuda and _cupy.available()[0]:
        return _cupy.iso_scale_(x, q)
    fn = _triton_iso_scale()
    if fn and x.is_cuda:
        return fn(x, q)
    return iso_scale_torch(x, q)
