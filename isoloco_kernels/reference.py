"""The Iso-C contract in float64: the truth every flatten method and op backend is tested against.

For one matrix Δ (m×n), r0 = min(m, n), SVD Δ = U diag(σ) Vᵀ:

    iso(Δ) = s̄ · U_r V_rᵀ,    s̄ = (σ_1 + … + σ_r0) / r0

The rank cut, one definition for every method (`rank_tol`): σ_i is numerically zero when

    σ_i ≤ τ·σ_1,   τ = 4·eps(c) + max(m, n)·eps(float64),

c the input's compute dtype (float32 for float16/bfloat16/float32 input, float64 for float64) and
σ the singular values of the input's values, in float64. Rounding a rank-deficient matrix to c
(or forming it in c) leaves spurious singular values of up to ~1·eps(c)·σ_1 (measured for float32:
0.01–0.2·eps32 for ranks 1–16, 0.95·eps32 for a rank-500 1024×1024 product), and a float64 SVD
adds max(m, n)·eps64; τ sits above both, so a rank-one float32 outer product stays rank one, and
below the smallest direction a float32 matrix of condition number up to ~2e6 holds (κ 1e6 keeps
every direction). U_r, V_r keep the other directions; s̄ sums every σ. Every method computes this:
svd in float64, eigh where its float64 Gram matrix resolves the spectrum (svd elsewhere), and the
polar and gram iterations map every σ they keep to 1, and send on to svd the matrices their checks
cannot certify (rank-deficient, beyond their condition range, or gram's bound on the smallest kept
σ below τ). A zero row or column stays zero and a zero matrix stays zero (never NaN). For a full-rank Δ this is the published Iso-C merge,
U diag(mean σ) Vᵀ (Marczak et al., 2025).

The IsoLoCo outer step (Iso-C, then Nesterov momentum without dampening) is `nesterov_ref`.

Nothing here is fast: tests and the benchmark's error column use it; the kernels import only
`rank_tol` and `compute_dtype`, so the cut and the compute dtype have one definition each.
"""

from __future__ import annotations

import torch

from ._validate import compute_dtype, rank_tol

__all__ = ["iso_flatten_ref", "polar_ref", "nesterov_ref", "isoloco_step_ref", "rank_tol", "compute_dtype"]


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
    keep = s > rank_tol(m, n, x.dtype) * s[..., :1]
    q = (u * keep.unsqueeze(-2).to(u.dtype)) @ vh
    return q, s.sum(-1)


def iso_flatten_ref(x: torch.Tensor) -> torch.Tensor:
    """iso(Δ) for a [m, n] or [B, m, n] tensor, in float64 on the CPU (a new tensor)."""
    m, n = x.shape[-2:]
    q, nuc = polar_ref(x)
    if q.numel() == 0:
        return q
    return (nuc / min(m, n))[..., None, None] * q


def nesterov_ref(p, buf, update, lr: float, momentum: float):
    """One Nesterov outer step in float64; returns (new_p, new_buf).

    buf ← μ·buf + u ;  p ← p − lr·(u + μ·buf). With buf starting at zero the first step gives
    buf = u, exactly as torch.optim.SGD(nesterov=True, dampening=0) does. This is the rule of the
    `nesterov_outer_` op for every μ; the optimizers follow SGD at μ = 0 (`sgd_nesterov_ref`).
    """
    p64, b64, g = (t.detach().to("cpu", torch.float64) for t in (p, buf, update))
    b64 = momentum * b64 + g
    return p64 - lr * (g + momentum * b64), b64


def sgd_nesterov_ref(p, buf, update, lr: float, momentum: float):
    """The outer optimizers' Nesterov step in float64, torch.optim.SGD(nesterov=True)'s rule for any μ set
    between steps: at μ = 0, p ← p − lr·u and the buffer is neither made nor touched (returned as given, None
    when there is none); else `nesterov_ref` from the buffer (zeros when there is none). Returns (new_p, new_buf)."""
    if momentum == 0:
        return p.detach().to("cpu", torch.float64) - lr * update.detach().to("cpu", torch.float64), buf
    return nesterov_ref(p, torch.zeros_like(p) if buf is None else buf, update, lr, momentum)


def isoloco_step_ref(params, bufs, grads, lr: float, momentum: float, iso: bool = True):
    """The whole IsoLoCo outer step in float64: M = iso(Δ) for 2-D params (else Δ), then Nesterov
    (`sgd_nesterov_ref`: bufs may hold None, where a param has no buffer yet)."""
    new_p, new_b = [], []
    for p, b, g in zip(params, bufs, grads):
        m = iso_flatten_ref(g) if (iso and g.ndim == 2) else g.detach().to("cpu", torch.float64)
        np_, nb = sgd_nesterov_ref(p, b, m, lr, momentum)
        new_p.append(np_)
        new_b.append(nb)
    return new_p, new_b
