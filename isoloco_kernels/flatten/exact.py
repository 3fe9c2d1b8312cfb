"""Exact Iso-C flatten methods: LAPACK/cuSOLVER SVD, and eigh of the small Gram matrix.

Both take a [B, m, n] tensor (any view; written back with `copy_`, so transposed or strided views
are updated in place) and are all-or-nothing: the result is computed aside in float64 and copied
in last. Float64 throughout also makes them immune to TF32 settings.

The rank cut is reference.py's (`reference.rank_tol`): σ_i ≤ τ·σ_1 is zero, τ = 4·eps(compute
dtype) + max(m, n)·eps64.
- svd:  float64 torch.linalg.svd of the input's values (half, bfloat16 and float32 inputs too: a
        float32 SVD carries ~eps32·κ error, 2e-4 at condition number 1e4), cut at rank_tol.
- eigh: float64 eigh of the short-side Gram matrix. Forming Δ Δᵀ squares the condition number,
        so σ is resolved only down to ~1e-8·σ_1: eigh keeps the r largest directions, r the exact
        rank bound min(#nonzero rows, #nonzero columns) (the others are exactly zero), and only
        where σ_r ≥ `EIGH_MIN_RATIO`·σ_1 (measured error at that ratio: 3e-6 for float32 input,
        ~4e-11 for float64); every other matrix (ill-conditioned or rank-deficient) is
        recomputed by svd, so both methods give reference.py's result.

Scaling: Iso-C is positively homogeneous, iso(c·Δ) = c·iso(Δ), so each matrix is divided by a
power of two near its largest entry before the decomposition and the result multiplied back after
Q is applied (both exact): every finite input whose result fits the output dtype gets it, however
large or small. A result that does not fit the output dtype raises ResultOverflowError naming the
matrix, with nothing written.
"""

from __future__ import annotations

import torch

from .._validate import check_result_fits, pow2_scale, rank_tol

F64 = torch.float64
#: eigh serves a matrix only when σ_r / σ_1 is at least this (per input dtype), else svd does.
EIGH_MIN_RATIO = {torch.float64: 1e-3, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def _result(x3: torch.Tensor, sbar: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale·(s̄·Q) in float64 (s̄ of the scaled matrix: Q first, then the power of two, so no
    intermediate overflows). Rows and columns that are exactly zero in Δ are exactly zero in Q
    (in exact arithmetic); LAPACK leaves ~eps there, so they are masked to keep "zero in, zero
    out" exact."""
    nz = x3 != 0
    mask = nz.any(-1, keepdim=True) & nz.any(-2, keepdim=True)
    return torch.where(mask, (sbar[:, None, None] * q) * scale[:, None, None], 0)


def _store(x3: torch.Tensor, out: torch.Tensor, method: str) -> None:
    check_result_fits(out, x3.dtype, f"iso_flatten_ ({method})")
    x3.copy_(out)


def _scaled(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = pow2_scale(x3, F64)
    return x3.to(F64) / scale[:, None, None], scale


def svd_result(x3: torch.Tensor) -> torch.Tensor:
    """Iso-C of a [B, m, n] batch by float64 SVD (a new float64 tensor; x3 is not written)."""
    _, m, n = x3.shape
    a, scale = _scaled(x3)
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    keep = s > rank_tol(m, n, x3.dtype) * s[:, :1]
    q = (u * keep.unsqueeze(1).to(F64)) @ vh
    return _result(x3, s.sum(-1) / min(m, n), q, scale)


def svd_flops(k: int, r: int) -> float:
    """Modelled FLOPs of one r×k matrix (r ≤ k): thin R-SVD computing Σ, U₁, V (6kr² + 20r³,
    Golub & Van Loan, Matrix Computations, 4th ed., §8.6) plus Q = U·Vᵀ (2kr²)."""
    return 8.0 * k * r * r + 20.0 * r**3


def eigh_flops(k: int, r: int) -> float:
    """Modelled FLOPs of one r×k matrix (r ≤ k): the Gram matrix A·Aᵀ and Q = (V Σ⁻¹ Vᵀ)·A
    (2kr² each), the symmetric eigensolver with vectors (~9r³), V Σ⁻¹ Vᵀ (2r³)."""
    return 4.0 * k * r * r + 11.0 * r**3


def flatten_svd_(x3: torch.Tensor) -> None:
    """In place Iso-C via float64 torch.linalg.svd (the fallback and the published code's way)."""
    _store(x3, svd_result(x3), "svd")


def eigh_polar(g: torch.Tensor, rank: torch.Tensor, m: int, n: int, dtype: torch.dtype):
    """The eigh step shared by `flatten_eigh_` and the DTensor Gram route: (P, Σσ, ok) from the
    short-side Gram matrices g = A Aᵀ [B, k, k] (float64) of m×n matrices of `dtype` whose rank is
    at most `rank` [B] (an exact bound, e.g. the number of nonzero lines).

    With g = V diag(σ²) Vᵀ, P = V_r diag(1/σ_r) V_rᵀ over the `rank` largest σ, so Q = P·A, and Σσ
    sums them. ok: eigh resolves the matrix, i.e. it has rank 0 or its `rank`-th σ is at least
    max(EIGH_MIN_RATIO, reference.rank_tol)·σ_1 (so every kept direction is above the rank cut
    and the bound is the rank); a matrix that is not ok needs svd."""
    k = g.shape[-1]
    lam, v = torch.linalg.eigh(g)
    sig = lam.clamp_min(0).sqrt()  # ascending
    keep = torch.arange(k, device=g.device) >= (k - rank)[:, None]  # the `rank` largest
    sig_r = sig.gather(1, (k - rank).clamp_max(k - 1)[:, None]).squeeze(1)
    floor = max(EIGH_MIN_RATIO[dtype], rank_tol(m, n, dtype))
    ok = (rank == 0) | (sig_r >= floor * sig[:, -1])
    inv = torch.where(keep, 1.0 / torch.where(keep & (sig > 0), sig, 1.0), 0.0)
    return (v * inv.unsqueeze(1)) @ v.mT, (sig * keep).sum(-1), ok


def flatten_eigh_(x3: torch.Tensor) -> None:
    """In place Iso-C from eigh of the short-side Gram matrix, in float64.

    With a [r, k] view (r ≤ k, tall inputs transposed) and A Aᵀ = V diag(λ) Vᵀ, σ = sqrt(λ):
    Q = V_r diag(1/σ_r) V_rᵀ A (`eigh_polar`). Costs two r×r×k matmuls and one r×r eigh, far
    cheaper than an SVD of a wide matrix on a CPU. Matrices eigh cannot resolve go to svd (module
    docstring).
    """
    _, m, n = x3.shape
    k = min(m, n)
    a, scale = _scaled(x3)
    if m > n:
        a = a.mT
    nz = a != 0
    rank = torch.minimum(nz.any(-1).sum(-1), nz.any(-2).sum(-1))  # exact bound, ≥ the rank
    pm, nuc, ok = eigh_polar(a @ a.mT, rank, m, n, x3.dtype)
    q = pm @ a
    if m > n:
        q = q.mT
    out = _result(x3, nuc / k, q, scale)
    redo = (~ok).nonzero().flatten()
    if redo.numel():
        out[redo] = svd_result(x3[redo])
    _store(x3, out, "eigh")
