"""TSV-M and Iso-CTS batched over a bucket and its K workers (definitions: merges/reference.py).

Weighted (normalized weights ω, every one > 0): each worker's share is ω_i·Δ_i instead of Δ_i/K, the
rest unchanged (their sum is the weighted mean; K is the number of workers given).

Input: one bucket x = [B, K, m, n] of B same-shaped worker stacks, in the compute dtype (float32
for half, bfloat16 and float32 input; float64 for float64), each stack scaled by a power of two so
that its largest entry is in [1, 2) (exact; the result is scaled back by the caller). Output:
[B, m, n] merged matrices at the mean's scale.

Where the work goes (r = min(m, n)): one batched thin SVD of the B·K worker matrices (TSV-M) or of
the B means plus B·K residuals (Iso-CTS) — torch.linalg.svd, LAPACK on the CPU, cuSOLVER's batched
Jacobi on CUDA — then two orthogonal polar factors per matrix (U: m × K·k, V: n × K·k), each by the
library's Iso-C flatten (`polar_factor`: an orthogonal polar factor is Iso-C without its scale),
and one GEMM to recombine. Singular directions below reference.rank_tol are zeroed before the
polar factors, so rank-deficient workers add no arbitrary LAPACK basis (docs/merges.md).
"""

from __future__ import annotations

import torch

from .._validate import rank_tol
from ..api import iso_flatten
from .reference import task_share

__all__ = ["polar_factor", "tsv_merge", "iso_cts_merge"]


def polar_factor(a: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """The orthogonal polar factor U_r V_rᵀ of every matrix of a [B, m, n] batch, through the
    Iso-C flatten: iso(A) = s̄·Q with s̄ = Σσ / r0 and ⟨A, Q⟩ = Σσ, so s̄² = ⟨A, iso(A)⟩ / r0 and
    Q = iso(A) / s̄ (a zero matrix gives zero)."""
    flat = iso_flatten(a, method=method)
    r0 = min(a.shape[-2:])
    sbar2 = (a * flat).sum((-2, -1), keepdim=True) / r0
    sbar = sbar2.clamp_min(0).sqrt()
    return torch.where(sbar > 0, flat / torch.where(sbar > 0, sbar, 1), torch.zeros_like(flat))


def _svd_cut(x: torch.Tensor, dtype: torch.dtype):
    """Batched thin SVD with the triplets below the rank cut zeroed: (U, σ, V), V = Vhᵀ."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    m, n = x.shape[-2:]
    keep = (s > rank_tol(m, n, dtype) * s[..., :1]).to(s.dtype)
    return u * keep[..., None, :], s * keep, vh.mT * keep[..., None, :]


def _side_by_side(t: torch.Tensor) -> torch.Tensor:
    """[B, K, d, k] → [B, d, K·k]: the workers' columns concatenated in worker order."""
    b, kk, d, k = t.shape
    return t.permute(0, 2, 1, 3).reshape(b, d, kk * k)


def _share(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Each worker's share of the merge: Δ_i / K, or ω_i·Δ_i under normalized weights ω ([K], x's dtype)."""
    return x / x.shape[1] if weights is None else x * weights[None, :, None, None]


def tsv_merge(
    x: torch.Tensor, dtype: torch.dtype, keep: int | None = None, method: str = "auto", weights=None
) -> torch.Tensor:
    """TSV-M of a bucket [B, K, m, n] (module docstring); dtype: the input's, for the rank cut; weights: the
    K workers' normalized weights (None: 1/K each), every one > 0."""
    b, K, m, n = x.shape
    r = min(m, n)
    k = min(r, keep if keep is not None else max(1, r // K))
    u, s, v = _svd_cut(_share(x, weights), dtype)
    u, s, v = _side_by_side(u[..., :k]), s[..., :k].reshape(b, K * k), _side_by_side(v[..., :k])
    return (polar_factor(u, method) * s[:, None, :]) @ polar_factor(v, method).mT


def iso_cts_merge(
    x: torch.Tensor, dtype: torch.dtype, common_fraction: float = 0.8, method: str = "auto", weights=None
) -> torch.Tensor:
    """Iso-CTS of a bucket [B, K, m, n] (module docstring); dtype: the input's, for the rank cut; weights: the
    K workers' normalized weights (None: 1/K each), every one > 0."""
    b, K, m, n = x.shape
    common, per = task_share(min(m, n), K, common_fraction)
    xs = _share(x, weights)
    uc, sc, vc = _svd_cut(xs.sum(1), dtype)
    uc, sc, vc = uc[..., :common], sc[..., :common], vc[..., :common]
    if per:
        resid = xs - uc[:, None] @ (uc.mT[:, None] @ xs)
        ut, st, vt = _svd_cut(resid, dtype)
        u = torch.cat([_side_by_side(ut[..., :per]), uc], -1)
        v = torch.cat([_side_by_side(vt[..., :per]), vc], -1)
        s = torch.cat([st[..., :per].reshape(b, K * per), sc], -1)
    else:
        u, v, s = uc, vc, sc
    sbar = s.mean(-1)[:, None, None]
    return sbar * (polar_factor(u, method) @ polar_factor(v, method).mT)
