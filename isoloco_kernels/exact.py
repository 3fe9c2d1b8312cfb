"""Exact Iso-C flatten backends: LAPACK/cuSOLVER SVD, and eigh of the small Gram matrix.

Both take a [B, m, n] tensor (any view; written back with `copy_`, so transposed or strided views
are updated in place) and are all-or-nothing: the result is computed aside and copied in last.

Tolerances (which directions count as nonzero, σ_i > tol·σ_1):
- svd:  tol = sqrt(max(m, n))·eps(compute dtype) — float32 for float16/bfloat16/float32 inputs.
        Rounding a rank-deficient matrix to float32 leaves spurious singular values of about
        0.5–3·eps·σ_1 (measured, 10×8 to 4096×256), so the cut sits above that noise floor; the
        common max(m, n)·eps would be 1.5e-2·σ_1 for a 128256×2048 embedding and drop real
        directions of well-conditioned matrices.
- eigh: the Gram matrix is formed in float64, so σ is resolved down to about sqrt(eps64)·σ_1;
        tol = sqrt(max(m, n))·eps(float32) for float16/bfloat16/float32 inputs (as svd) and
        max(sqrt(max(m, n))·eps64, 1e-7) for float64 inputs. Forming Δ Δᵀ squares the condition
        number, so for float64 input eigh is accurate to float64 only up to cond ~1e4 (1.4e-8 at
        cond 1e5, measured); method="auto" therefore uses svd for float64.

Scaling: Iso-C is positively homogeneous, iso(c·Δ) = c·iso(Δ), so each matrix is divided by a
power of two near its largest entry before the decomposition and the result multiplied back (both
exact): every finite input whose result fits the output dtype gets it, however large or small (an
unscaled 1e37 matrix overflows σ or the Gram matrix). A result that does not fit the output dtype
(float16/bfloat16 outputs, or float32 near its max) raises ResultOverflowError naming the matrix,
with nothing written.
"""
from __future__ import annotations

import torch

from ._validate import check_result_fits, compute_dtype, pow2_scale


def _write(x3: torch.Tensor, sbar: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, method: str) -> None:
    """x3 ← scale·s̄·Q (s̄ of the scaled matrix), once every result is known to fit x3's dtype.
    Rows and columns that are exactly zero in Δ are exactly zero in Q (in exact arithmetic);
    LAPACK leaves ~eps there, so they are masked to keep "zero in, zero out" exact."""
    nz = x3 != 0
    mask = nz.any(-1, keepdim=True) & nz.any(-2, keepdim=True)
    out = torch.where(mask, (sbar * scale.to(sbar.dtype))[:, None, None].to(q.dtype) * q, 0)
    check_result_fits(out, x3.dtype, f"iso_flatten_ ({method})")
    x3.copy_(out)


def flatten_svd_(x3: torch.Tensor) -> None:
    """In place Iso-C via torch.linalg.svd (the fallback and the published code's way)."""
    _, m, n = x3.shape
    cd = compute_dtype(x3.dtype)
    scale = pow2_scale(x3, cd)
    a = x3.to(cd) / scale[:, None, None]
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    tol = max(m, n) ** 0.5 * torch.finfo(cd).eps
    keep = s > tol * s[:, :1]
    q = (u * keep.unsqueeze(1).to(cd)) @ vh
    _write(x3, s.sum(-1) / min(m, n), q, scale, "svd")


def flatten_eigh_(x3: torch.Tensor) -> None:
    """In place Iso-C from eigh of the short-side Gram matrix, in float64.

    With a [r, k] view (r ≤ k, tall inputs transposed) and A Aᵀ = V diag(λ) Vᵀ, σ = sqrt(λ):
    Q = V_r diag(1/σ_r) V_rᵀ A. Costs two r×r×k matmuls and one r×r eigh, far cheaper than an SVD
    of a wide matrix on a CPU.
    """
    _, m, n = x3.shape
    tall = m > n
    scale = pow2_scale(x3, torch.float64)
    a = x3.to(torch.float64) / scale[:, None, None]
    if tall:
        a = a.mT
    lam, v = torch.linalg.eigh(a @ a.mT)
    sig = lam.clamp_min(0).sqrt()  # ascending
    if x3.dtype == torch.float64:
        tol = max(max(m, n) ** 0.5 * torch.finfo(torch.float64).eps, 1e-7)
    else:
        tol = max(m, n) ** 0.5 * torch.finfo(torch.float32).eps
    keep = sig > tol * sig[:, -1:]
    inv = torch.where(keep, 1.0 / torch.where(keep, sig, 1.0), 0.0)
    q = ((v * inv.unsqueeze(1)) @ v.mT) @ a
    if tall:
        q = q.mT
    # σ below tol are Gram round-off (≈ sqrt(eps64)·σ_1), not signal: they join neither Q nor s̄.
    _write(x3, (sig * keep).sum(-1) / min(m, n), q, scale, "eigh")
