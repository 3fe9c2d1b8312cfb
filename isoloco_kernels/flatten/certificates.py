"""Rank certificates of the iterative flattens, from one float64 Gram pass (no float64 copy).

`certify(x, floor)`: every singular value of a [B, r, k] batch off its zero rows is ≥ floor (what
"fast" checks after its bfloat16 steps); `full_rank(x3)`: σ_min ≥ RANK_FLOOR·σ_max (what
"polar_bf16" checks before its bfloat16 steps would lift a null direction to 1). Both are the
Cholesky of a float64 Gram matrix minus the floor, summed over column blocks of at most
`CERTIFY_BLOCK_BYTES`; `certificate_flops` models their work. Re-exported by polar.py.
"""

from __future__ import annotations

import torch

from .._validate import pow2_scale

__all__ = ["CERTIFY_BLOCK_BYTES", "RANK_FLOOR", "certificate_flops", "certify", "full_rank"]

# "polar_bf16" certifies rank first (`full_rank`): a singular value below RANK_FLOOR·σ_max is a
# null direction of the input for its bfloat16 steps (float32 rounding leaves ≤ ~1·eps32·σ_max
# there; reference.py cuts at ~4.8e-7) which they would lift to 1: such matrices go to the fallback.
RANK_FLOOR = 1e-6
CERTIFY_BLOCK_BYTES = 256 << 20  # `certify`'s float64 scratch for a slice of the iterate


def certificate_flops(k: int, r: int) -> float:
    """Modelled float64 FLOPs of `certify` on one r×k matrix: its Gram matrix and Cholesky."""
    return 2.0 * k * r * r + r**3 / 3.0


def _gram64(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[B, r, r] float64 Gram matrices of (x / scale) for [B, r, k] x, summed over column blocks of
    at most CERTIFY_BLOCK_BYTES in float64: never a float64 copy of x, and x is never written."""
    b, r, k = x.shape
    step = max(1, CERTIFY_BLOCK_BYTES // (8 * max(b * r, 1)))
    gram = torch.zeros(b, r, r, dtype=torch.float64, device=x.device)
    for j in range(0, k, step):
        xb = x[..., j : j + step].to(torch.float64)
        if scale is not None:
            xb = xb / scale[:, None, None]  # out of place: for float64 x, xb is x itself
        gram.baddbmm_(xb, xb.mT)
    return gram


def _lambda_min_at_least(gram: torch.Tensor, x: torch.Tensor, floor2) -> torch.Tensor:
    """[B] bool: λ_min(gram) ≥ floor2 off x's zero rows (Cholesky of gram − floor2·I, the zero
    rows' diagonal set to 1; gram is consumed)."""
    zero_rows = (x == 0).all(-1)
    floor2 = torch.as_tensor(floor2, dtype=torch.float64, device=gram.device)
    gram.diagonal(dim1=-2, dim2=-1).add_(zero_rows.to(torch.float64) - floor2.reshape(-1, 1))
    _, info = torch.linalg.cholesky_ex(gram)
    return info == 0


def certify(x: torch.Tensor, floor: float) -> torch.Tensor:
    """[B] bool: every singular value of the [B, r, k] matrices x (r ≤ k) off their zero rows is
    ≥ `floor` (Cholesky of x xᵀ − floor²·I in float64). False for a rank-deficient x (zero rows
    aside) and for x with a singular value below the floor."""
    return _lambda_min_at_least(_gram64(x), x, floor * floor)


def full_rank(x3: torch.Tensor) -> torch.Tensor:
    """[B] bool: each matrix of the [B, m, n] batch has σ_min ≥ RANK_FLOOR·‖x‖_F/√r (so ≥ that
    fraction of σ_max) off its zero lines, from one float64 Gram pass over x scaled by a power of
    two near its largest entry (no float64 copy; ‖x‖_F² is the Gram matrix's trace; zero columns
    of the long side count as rank loss only when they leave fewer columns than rows)."""
    x = x3.mT if x3.shape[-2] > x3.shape[-1] else x3
    scale = pow2_scale(x, torch.float64)
    gram = _gram64(x, scale)
    fro2 = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    return _lambda_min_at_least(gram, x, RANK_FLOOR**2 * fro2 / max(x.shape[-2], 1))
