"""The training-grade Iso-C flatten (method "fast"): precise first, bfloat16 after, certified.

    X ← Δ scaled to σ_max ≤ 1
    steps 1..PRECISE_STEPS:   X ← p_t(X)   float32-accurate GEMMs (3xTF32 on CUDA, tf32.py)
    certificate:              λ_min(X Xᵀ) ≥ (LIFT_FLOOR·ℓ_h)²   one float64 Gram + one Cholesky
    remaining steps:          X ← p_t(X)   bfloat16 GEMMs (tensor cores)
    Δ ← (⟨Δ, X⟩ / r0)·X

with p_t the Polar Express quintics of polar.py (same schedule, same scaling).

Why this order. Rounding the iterate to bfloat16 perturbs every direction by ~2^-9·σ_max. While a
singular value is still small that perturbation replaces its direction (and, in the null space of
a rank-deficient Δ, creates one, which the later steps lift to 1); once the schedule has lifted it
near 1 the same perturbation is harmless. The first PRECISE_STEPS steps lift every singular value
that started above ELL·σ_max to at least ℓ_h = p_h∘…∘p_1(ELL) (3.5e-3 for 3 steps), far above
anything round-off leaves in a null direction (~1e-7·amplification ≈ 1e-5).

The certificate. After the precise steps, a Cholesky factorisation of X Xᵀ − c·I (float64,
c = (LIFT_FLOOR·ℓ_h)², zero rows of Δ masked) succeeds exactly when every singular value of X is
above √c: then every direction of Δ started above LIFT_FLOOR·ELL and the exact schedule maps it
to 1 within 0.5 % (so the output spectrum is flat), and Δ has no null direction for the bfloat16
steps to fill. A matrix that fails it (rank-deficient, or condition number beyond ~1e5) is
recomputed by "polar" (float32-accurate, residual-checked, itself falling back to gram/SVD), with
a FlattenFallbackWarning. So "fast" never returns a spread spectrum or a filled null space.

Contract (tests/helpers.py, row "fast"): every output singular value within ±10 % of s̄ outside the
rank cut (measured ≤ 1 %), relative Frobenius error vs reference.py ≤ 5e-2 at condition number
≤ 1e2, ≤ 0.15 at 1e3, ≤ 0.3 on real pseudo-gradients (bench/data/captured; measured 0.02–0.05).
"""

from __future__ import annotations

import functools

import torch

from . import polar
from ._validate import compute_dtype
from .iteration_stats import Recorder

__all__ = ["PRECISE_STEPS", "LIFT_FLOOR", "flatten_fast_", "fast_work", "lift_floor", "last_stats"]

PRECISE_STEPS = 3  # float32-accurate steps before the bfloat16 ones
LIFT_FLOOR = 0.5  # certify σ ≥ LIFT_FLOOR·ℓ_h after them: the exact schedule ends ≥ 0.9957 there

RECORDER = Recorder("fast")
last_stats = RECORDER.last
reset_stats = RECORDER.reset


@functools.lru_cache(maxsize=None)
def lift_floor(steps: int = PRECISE_STEPS) -> float:
    """LIFT_FLOOR·ℓ_h: where the first `steps` quintics of polar.COEFFS take ELL, times the floor."""
    s = polar.ELL
    for a, b, c in polar.COEFFS[:steps]:
        s = a * s + b * s**3 + c * s**5
    return LIFT_FLOOR * s


def fast_work(k: int, r: int) -> dict[str, float]:
    """Modelled FLOPs of one r×k matrix (r ≤ k) per GEMM unit: the precise steps ("tf32x3", as a
    tensor-core GPU runs them; the CPU runs them in float32), the bfloat16 steps, and the
    certificate's float64 Gram and Cholesky."""
    return {
        polar.TF32X3: polar.polar_flops(k, r, PRECISE_STEPS),
        "bf16": polar.polar_flops(k, r, polar.STEPS - PRECISE_STEPS),
        "fp64": polar.certificate_flops(k, r),
    }


def flatten_fast_(x3: torch.Tensor, *, precise=None) -> None:
    """In place Iso-C of a [B, m, n] batch at training grade (module docstring); all-or-nothing.

    precise: the GEMM mode of the precise steps (a dtype, or polar.TF32X3); default
    `polar.precise_mode(x3)` (3xTF32 on CUDA with TF32 tensor cores, else the compute dtype).
    Tests pass polar.TF32X3 on the CPU to run the GPU's numerics (emulated).
    """
    cd = compute_dtype(x3.dtype)
    hi = polar.precise_mode(x3) if precise is None else precise
    steps = polar.STEPS
    gd = (hi,) * PRECISE_STEPS + (torch.bfloat16,) * (steps - PRECISE_STEPS)
    floor = lift_floor()
    verdict = {}

    def observe(t: int, x: torch.Tensor) -> None:
        if t == PRECISE_STEPS - 1:
            verdict["ok"] = polar.certify(x, floor)

    with polar.ieee_fp32_matmul(x3.is_cuda and cd == torch.float32):
        q, resid = polar.polar_factor(x3, gemm_dtypes=gd, observe=observe)
    ok = verdict["ok"]
    flagged = (~ok).nonzero().flatten()
    polar.finish_flatten_(
        x3,
        q,
        flagged,
        _fallback,
        "fast",
        RECORDER,
        resid,
        why="a singular value below the certified floor: rank-deficient or condition number beyond ~1e5",
        by='by "polar"',
    )


def _fallback(sub: torch.Tensor) -> None:
    """The flagged matrices, by the float32-accurate polar flatten (which hands on what its own
    residual check misses); its warnings are folded into fast's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", polar.RECORDER.warning)
        polar.flatten_polar_(sub)
