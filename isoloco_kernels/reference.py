"""The Iso-C contract in float64: the truth every backend is tested against.

For one matrix Δ (m×n), r0 = min(m, n), SVD Δ = U diag(σ) Vᵀ:

    iso(Δ) = s̄ · U_r V_rᵀ,    s̄ = (σ_1 + … + σ_r0) / r0

The rank cut, one definition for every method (`rank_tol`): σ_i is numerically zero when

    σ_i ≤ max(m, n)·eps(float64)·σ_1,

σ being the singular values of the input's values as given, in float64 (a float32 or half input is
exact data: its rounding is not undone). U_r, V_r keep the other directions; s̄ sums every σ. The
line sits at float64 round-off, far below what a float32 or half input can carry (rounding a
low-rank matrix to float32 leaves singular values of ~0.1·eps32·σ_1: data of that float32 matrix,
kept), so no direction of any input is cut for its dtype: a κ 1e6 float32 matrix keeps all of
them. Every method computes this: svd in float64, eigh where its float64 Gram matrix resolves the
spectrum (svd elsewhere), and the polar and gram iterations map every σ they keep to 1 and send
the matrices their residual check cannot certify (rank-deficient, or beyond their condition
range) on to svd. A zero row or column stays zero and a zero matrix stays zero (never NaN). For a full-rank Δ this is the published Iso-C merge,
U diag(mean σ) Vᵀ (Marczak et al., 2025).

The IsoLoCo outer step (Iso-C, then Nesterov momentum without dampening) is `nesterov_ref`.

Nothing here is fast: tests and the benchmark's error column use it; the kernels import only
`rank_tol`, so the cut has one definition.
"""
from __future__ import annotations

import torch

__all__ = ["iso_flatten_ref", "polar_ref", "nesterov_ref", "isoloco_step_ref", "rank_tol"]

_EPS64 = torch.finfo(torch.float64).eps


def rank_tol(m: int, n: int) -> float:
    """The rank cut relative to σ_1 for an m×n matrix (module docstring): max(m, n)·eps64."""
    return max(m, n) * _EPS64


def _svd64(x: torch.Tensor):
    x64 = x.detach().to(device="cpu", dtype=torch.float64)
    return x64, torch.linalg.svd(x64, full_matrices=False)


def polar_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, nuclear norm) of a [..., m, n] tensor in float64 on the CPU: Q = U_r V_rᵀ, Σσ."""
    if x.ndim < 2:
        raise ValueError(f"polar_ref needs a matrix, got shape {tuple(x.shape)}")
    m, n = x.shape[-2:]
    if x.numel() == 0:
        z = torch.zeros(x.shape, dtype=torch.float64)
        return z, torch.zeros(x.shape[:-2], dtype=torch.float64)
    _, (u, s, vh) = _svd64(x)
    keep = s > rank_tol(m, n) * s[..., :1]
    q = (u * keep.unsqueeze(-2).to(u.dtype)) @ vh
    return q, s.sum(-1)


def iso_flatten_ref(x: torch.Tensor) -> torch.Tensor:
    """iso(Δ) for a [m, n] or [B, m, n] tensor, in float64 on the CPU (a new tensor)."""
    m, n = x.shape[-2:]
    q, nuc = polar_ref(x)
    if q.numel() == 0:
        return q
    return (nuc / min(m, n))[..., None, None] * q


def nesterov_ref(p, buf, update, lr: float, momentum: float, scale=1.0):
    """One Nesterov outer step in float64; returns (new_p, new_buf).

    buf ← μ·buf + s·u ;  p ← p − lr·(s·u + μ·buf). With buf starting at zero the first step gives
    buf = s·u, exactly as torch.optim.SGD(nesterov=True, dampening=0) does.
    """
    p64, b64, u64 = (t.detach().to("cpu", torch.float64) for t in (p, buf, update))
    g = u64 * float(scale)
    b64 = momentum * b64 + g
    return p64 - lr * (g + momentum * b64), b64


def isoloco_step_ref(params, bufs, grads, lr: float, momentum: float, iso: bool = True):
    """The whole IsoLoCo outer step in float64: M = iso(Δ) for 2-D params (else Δ), then Nesterov."""
    new_p, new_b = [], []
    for p, b, g in zip(params, bufs, grads):
        m = iso_flatten_ref(g) if (iso and g.ndim == 2) else g.detach().to("cpu", torch.float64)
        np_, nb = nesterov_ref(p, b, m, lr, momentum)
        new_p.append(np_)
        new_b.append(nb)
    return new_p, new_b
