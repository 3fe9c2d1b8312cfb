"""Study v4's comparison flattens: how exact must Iso-C be for training? Study-only, not exported.

Each is an in-place flatten of a [B, m, n] batch, like the library's methods (isoloco_kernels/flatten/registry.py),
and `register()` adds them to the library's registry for one process, so `IsoLoCo(method=...)` and the
training loop's `iso_method` can run them:

- "ns5": Muon's Newton–Schulz orthogonalisation as a flatten. X ← Δ / ‖Δ‖_F, then 5 steps of the quintic
  X ← a·X + (b·A + c·A²)·X, A = X Xᵀ, (a, b, c) = (3.4445, −4.7750, 2.0315), GEMMs in bfloat16, then
  Δ ← (⟨Δ, X⟩ / r0)·X. The quintic does not converge to 1: it leaves the singular values of X spread over
  roughly [0.7, 1.2], so the output spectrum is not flat.
- "pe_bf16": the library's Polar Express schedule (polar.COEFFS) with every GEMM in bfloat16, no float32
  steps, no rank certificate and no fallback; then the same s̄ = ⟨Δ, Q⟩ / r0.
- "svd_noise1e-1", "svd_noise3e-1": the exact flatten (reference.py, float64) plus Gaussian noise of that
  relative Frobenius size, per matrix. The noise is drawn from a generator seeded by the bytes of Δ, so a
  run stays deterministic and draws nothing from torch's global generator (the loop's data order).
- "svd_cut1e-3", "svd_cut1e-2", "svd_cut3e-2": the exact flatten with a rank cut τ: singular values
  σ_i < τ·σ_1 are set to zero before the mean, s̄ = Σ_{σ_i ≥ τσ_1} σ_i / r0, and their directions are
  dropped: out = s̄ · Σ_{σ_i ≥ τσ_1} u_i v_iᵀ (reference.py's own cut, ~5e-7, applies below τ).

`error_and_flatness` measures a method's output against reference.py: the relative Frobenius error and the
flatness (tests/helpers.py's definition: the largest |σ_i(out)/s̄ − 1| over the directions outside
reference.py's rank cut, s̄ the mean of all r0 singular values of Δ; a cut direction counts as 1).
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

from isoloco_kernels.flatten import polar
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import iso_flatten_ref, rank_tol

NS5_COEFFS = (3.4445, -4.7750, 2.0315)  # Muon's quintic (Jordan et al., 2024)
NS5_STEPS = 5
NOISE = {"svd_noise1e-1": 1e-1, "svd_noise3e-1": 3e-1}  # relative Frobenius size of the noise on the exact flatten
CUTS = {"svd_cut1e-3": 1e-3, "svd_cut1e-2": 1e-2, "svd_cut3e-2": 3e-2}  # rank cuts τ: σ < τ·σ₁ zeroed before the mean


def _scale_and_write_(x3: torch.Tensor, q: torch.Tensor) -> None:
    """x3 ← (⟨Δ, Q⟩ / r0)·Q per matrix, the scale in float64 (all-or-nothing: one copy_ at the end)."""
    r0 = min(x3.shape[-2:])
    x64, q64 = x3.to(torch.float64), q.to(torch.float64)
    sbar = (x64 * q64).sum((-2, -1), keepdim=True) / r0
    x3.copy_((sbar * q64).to(x3.dtype))


def ns5_factor(x3: torch.Tensor) -> torch.Tensor:
    """Muon's NS5 iterate X for a [B, m, n] batch (bfloat16 GEMMs), in float32, x3's orientation."""
    tall = x3.shape[-2] > x3.shape[-1]
    x = (x3.mT if tall else x3).to(torch.float32)
    fro = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = (x / (fro + 1e-7)).to(torch.bfloat16)
    a, b, c = NS5_COEFFS
    for _ in range(NS5_STEPS):
        am = x @ x.mT
        bm = b * am + c * (am @ am)
        x = a * x + bm @ x
    x = x.to(torch.float32)
    return x.mT if tall else x


def flatten_ns5_(x3: torch.Tensor) -> None:
    if x3.numel():
        _scale_and_write_(x3, ns5_factor(x3))


def flatten_pe_bf16_(x3: torch.Tensor) -> None:
    """Polar Express with every GEMM in bfloat16 (the library's schedule and scaling), no checks."""
    if x3.numel():
        q, _ = polar.polar_factor(x3, gemm_dtypes=(torch.bfloat16,) * polar.STEPS)
        _scale_and_write_(x3, q)


def _seed_of(t: torch.Tensor) -> int:
    t = t.detach().to("cpu", torch.float32).contiguous()
    return int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], "little")


def noisy_exact(x3: torch.Tensor, rel: float) -> torch.Tensor:
    """reference.py's flatten of each matrix plus Gaussian noise N with ‖N‖_F = rel·‖iso(Δ)‖_F (float64)."""
    ref = iso_flatten_ref(x3)
    g = torch.Generator().manual_seed(_seed_of(x3))
    noise = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    nn = torch.linalg.vector_norm(noise, dim=(-2, -1), keepdim=True).clamp_min(1e-300)
    return ref + noise * (rel * torch.linalg.vector_norm(ref, dim=(-2, -1), keepdim=True) / nn)


def cut_exact(x3: torch.Tensor, tau: float) -> torch.Tensor:
    """The exact flatten (float64 SVD) with σ_i < τ·σ₁ set to zero before the mean and dropped."""
    m, n = x3.shape[-2:]
    x64 = x3.detach().to("cpu", torch.float64)
    u, s, vh = torch.linalg.svd(x64, full_matrices=False)
    keep = (s >= tau * s[..., :1]) & (s > rank_tol(m, n, x3.dtype) * s[..., :1])
    kept = torch.where(keep, s, torch.zeros_like(s))
    sbar = kept.sum(-1) / min(m, n)
    return sbar[..., None, None] * ((u * keep.unsqueeze(-2).to(u.dtype)) @ vh)


def _writer(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], None]:
    def run(x3: torch.Tensor) -> None:
        if x3.numel():
            x3.copy_(fn(x3).to(device=x3.device, dtype=x3.dtype))

    return run


def _noise_run(rel: float):
    return _writer(lambda x3: noisy_exact(x3, rel))


def _cut_run(tau: float):
    return _writer(lambda x3: cut_exact(x3, tau))


STUDY_FLATTENS: dict[str, Callable[[torch.Tensor], None]] = {
    "ns5": flatten_ns5_,
    "pe_bf16": flatten_pe_bf16_,
    **{name: _noise_run(rel) for name, rel in NOISE.items()},
    **{name: _cut_run(tau) for name, tau in CUTS.items()},
}


def register(methods=None) -> list[str]:
    """Add the study's flattens to the library's registry (`flatten.METHODS` by default) for this
    process; returns their names. Idempotent."""
    methods = flatten.METHODS if methods is None else methods
    for name, run in STUDY_FLATTENS.items():
        methods.setdefault(name, flatten.Method(run=run))
    return list(STUDY_FLATTENS)


def run_method(name: str, x: torch.Tensor) -> torch.Tensor:
    """The flatten of a copy of x ([m, n] or [B, m, n], float32) by a library or study method."""
    out = x.detach().clone()
    out3 = out if out.ndim == 3 else out.unsqueeze(0)
    if name in STUDY_FLATTENS:
        STUDY_FLATTENS[name](out3)
    else:
        flatten.check_method(name)
        flatten.iso_flatten_impl(out3, name)
    return out


def flatness(out: torch.Tensor, x: torch.Tensor) -> float:
    """The largest |σ_i(out)/s̄ − 1| over x's directions outside reference.py's rank cut (s̄: the mean of
    all r0 singular values of x), worst matrix of a batch; σ_i(out)/s̄ itself where x's direction is cut."""
    x64 = x.detach().to("cpu", torch.float64)
    x64 = x64 if x64.ndim == 3 else x64.unsqueeze(0)
    o64 = out.detach().to("cpu", torch.float64).reshape(x64.shape)
    m, n = x64.shape[-2:]
    sx, so = torch.linalg.svdvals(x64), torch.linalg.svdvals(o64)
    keep = sx > rank_tol(m, n, x.dtype) * sx[..., :1]
    sbar = (sx.sum(-1, keepdim=True) / min(m, n)).clamp_min(torch.finfo(torch.float64).tiny)
    dev = torch.where(keep, (so / sbar - 1).abs(), so / sbar)
    return float(dev.max()) if dev.numel() else 0.0


def error_and_flatness(name: str, x: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error vs reference.py, flatness) of method `name` on the matrix x."""
    out = run_method(name, x)
    ref = iso_flatten_ref(x)
    den = float(ref.norm())
    err = float((out.to(torch.float64) - ref).norm())
    return (err / den if den else err), flatness(out, x)
