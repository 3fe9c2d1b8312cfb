"""The Iso-C scale epilogue: s̄ = ⟨Δ, Q⟩ / min(m, n) per matrix, then Δ ← s̄·Q.

Since Q = U_r V_rᵀ is the polar factor of Δ, ⟨Δ, Q⟩ = Σσ is the nuclear norm, so this turns a
polar factor into the Iso-C result without an SVD. This is the torch implementation (the CPU path and
the last CUDA fallback); csrc/, CuPy and Triton serve CUDA first (dispatch/table.py).
"""

from __future__ import annotations

import torch

from .._validate import compute_dtype


def iso_scale_torch(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    m, n = x.shape[-2:]
    cd = compute_dtype(x.dtype)
    xc, qc = x.to(cd), q.to(cd)
    sbar = (xc * qc).sum((-2, -1)) / max(min(m, n), 1)  # 0, not NaN, for empty matrices
    x.copy_(sbar[..., None, None] * qc)
    return sbar.to(torch.float32) if cd != torch.float64 else sbar
