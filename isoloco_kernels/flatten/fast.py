"""The training-grade Iso-C flatten (method "fast"): precise first, bfloat16 after, certified.

    X ← Δ scaled to σ_max ≤ 1
    steps 1..PRECISE_STEPS:   X ← p_t(X)   float32-accurate GEMMs (3xTF32 on CUDA, tf32.py)
    certificate:              λ_min(X Xᵀ) ≥ (LIFT_FLOOR·ℓ_h)²   one float64 Gram + one Cholesky
    remaining steps:          X ← p_t(X)   bfloat16 GEMMs (tensor cores)
    Δ ← (⟨Δ, X⟩ / r0)·X

with p_t the Polar Express quintics of `COEFFS` (polar.py's scaling; a schedule of 9 steps from polar.ELL,
the fewest that keep "polar"'s accuracy here: 8 steps end 4 % off 1 at the floor and measured 4–7 %
flatness and 3 % error at κ 1e2, most of the contract's slack; 9 match the 10 of polar's schedule
within the bfloat16 noise, 0.3–0.6 % flatness, tests/test_fast.py).

Why this order. Rounding the iterate to bfloat16 perturbs every direction by ~2^-9·σ_max. While a
singular value is still small that perturbation replaces its direction (and, in the null space of
a rank-deficient Δ, creates one, which the later steps lift to 1); once the schedule has lifted it
near 1 the same perturbation is harmless. The first PRECISE_STEPS steps lift every singular value
that started above ELL·σ_max to at least ℓ_h = p_h∘…∘p_1(ELL) (3.5e-3 for 3 steps), far above
anything round-off leaves in a null direction (~1e-7·amplification ≈ 1e-5).

The certificate. After the precise steps, a Cholesky factorisation of X Xᵀ − c·I (float64,
c = (LIFT_FLOOR·ℓ_h)², zero rows of Δ masked) succeeds exactly when every singular value of X is
above √c: then every direction of Δ started above LIFT_FLOOR·ELL and the exact schedule maps it
to 1 within 0.8 % (so the output spectrum is flat), and Δ has no null direction for the bfloat16
steps to fill. A matrix that fails it (rank-deficient, or condition number beyond ~1e5) is
recomputed by "polar" (float32-accurate, residual-checked, itself falling back to gram/SVD), with
a FlattenFallbackWarning. So "fast" never returns a spread spectrum or a filled null space.

Two routes, chosen per bucket by the modelled time of its shape (`route_for`): the direct iteration
above, and the Gram route of fast_gram.py: the short side's Gram matrix once in float64, its r×r
part (on CUDA the schedule, certified from the Gram matrix it formed anyway; on the CPU LAPACK's
eigh; what neither certifies, gram.py's exact float64 schedule on the same Gram matrix, then the
SVD), one float32-accurate application; same contract, far fewer FLOPs on wide matrices. On an
H200 the Gram route serves buckets from k ≈ 5.5·r (the vocabulary matrices), a CPU from k ≈ 1.15·r.

The bfloat16 steps run in bfloat16 on CUDA and on CPUs with bfloat16 units (AVX512-BF16, AMX:
faster than float32 there); on other CPUs bfloat16 GEMMs are several times slower than float32, so
those steps run in float32 (`low_dtype`; more accurate, same contract). Tests pass low= to pick.

Contract (tests/helpers.py, row "fast"): every output singular value within ±10 % of s̄ outside the
rank cut (measured ≤ 1 %), relative Frobenius error vs reference.py ≤ 5e-2 at condition number
≤ 1e2, ≤ 0.15 at 1e3, ≤ 0.3 on real pseudo-gradients (bench/data/captured; measured 0.02–0.05).
"""

from __future__ import annotations

import functools

import torch

from .._validate import compute_dtype
from . import exact, fast_gram, polar
from .iteration_stats import Recorder

__all__ = [
    "PRECISE_STEPS",
    "LIFT_FLOOR",
    "ROUTES",
    "flatten_fast_",
    "fast_work",
    "lift_floor",
    "low_dtype",
    "route_for",
    "last_stats",
]

PRECISE_STEPS = 3  # float32-accurate steps before the bfloat16 ones
LIFT_FLOOR = 0.8  # certify σ ≥ LIFT_FLOOR·ℓ_h after them: the schedule ends ≥ 0.9925 there
COEFFS = fast_gram.COEFFS  # coefficients.schedule(polar.ELL, 9): |1 − σ| ≤ 5.6e-5 on [ELL, 1]
STEPS = len(COEFFS)

RECORDER = Recorder("fast")
last_stats = RECORDER.last
reset_stats = RECORDER.reset


@functools.lru_cache(maxsize=None)
def lift_floor(steps: int = PRECISE_STEPS) -> float:
    """LIFT_FLOOR·ℓ_h: where the first `steps` quintics of COEFFS take ELL, times the floor."""
    s = polar.ELL
    for a, b, c in COEFFS[:steps]:
        s = a * s + b * s**3 + c * s**5
    return LIFT_FLOOR * s


ROUTES = ("direct", "gram")


@functools.lru_cache(maxsize=None)
def _cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 GEMM units (oneDNN's own check: AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def device_kind(x: torch.Tensor) -> str:
    """The key of fast_gram.RATES that prices routes for x's device."""
    if x.is_cuda:
        return "cuda"
    return "cpu" if _cpu_has_bf16() else "cpu-no-bf16"


def low_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMM dtype of the steps after the certificate: bfloat16 where it is fast (CUDA, CPUs with
    bfloat16 units), else x's compute dtype (module docstring)."""
    return torch.bfloat16 if device_kind(x) != "cpu-no-bf16" else compute_dtype(x.dtype)


def route_for(m: int, n: int, kind: str = "cuda") -> str:
    """ "gram" where fast_gram.py's route is modelled faster for an m×n matrix on a device of `kind`
    (fast_gram.RATES), else "direct"."""
    k, r = max(m, n), min(m, n)
    return "gram" if r > 0 and fast_gram.prefers_gram(k, r, kind, PRECISE_STEPS, STEPS) else "direct"


def fast_work(k: int, r: int, kind: str = "cuda") -> dict[str, float]:
    """Modelled FLOPs of one r×k matrix (r ≤ k) on the route `route_for` picks on a device of `kind`:
    direct, the precise steps ("tf32x3", as a tensor-core GPU runs them; the CPU runs them in
    float32), the bfloat16 steps, and the certificate's float64 Gram and Cholesky; or the Gram
    route's (fast_gram.gram_work)."""
    if route_for(r, k, kind) == "gram":
        return fast_gram.gram_work(k, r, "iterate" if kind == "cuda" else "eigh")
    return fast_gram.direct_work(k, r, PRECISE_STEPS, STEPS)


SYM_GEMMS = ("torch", "triton")


def flatten_fast_(x3: torch.Tensor, *, precise=None, low=None, route: str | None = None, sym: str = "torch") -> None:
    """In place Iso-C of a [B, m, n] batch at training grade (module docstring); all-or-nothing.

    precise: the GEMM mode of the direct route's precise steps (a dtype, or polar.TF32X3); default
    `polar.precise_mode(x3)` (3xTF32 on CUDA with TF32 tensor cores, else the compute dtype);
    low: the GEMM dtype of its other steps, default `low_dtype(x3)`. Tests pass polar.TF32X3 and
    torch.bfloat16 on the CPU to run the GPU's numerics (emulated).
    route: "direct" or "gram" (fast_gram.py); default `route_for` the bucket's shape and device.
    sym: the direct route's symmetric products (X·Xᵀ and the polynomial in A) in every step not run
    as 3xTF32 (the bfloat16 steps; on the CPU and GPUs without TF32 the float32 ones too; float64
    input's stay on torch): "torch" (a full GEMM, the default) or "triton" (triton/sym_gram.py: one
    triangle, half the FLOPs; the default once a GPU run measures it faster, bench/device_check.sh
    times both). precise, low and sym are the direct route's: the Gram route ignores them.
    """
    if sym not in SYM_GEMMS:
        raise ValueError(f"flatten_fast_: sym must be one of {SYM_GEMMS}, got {sym!r}")
    if route is None:
        route = route_for(x3.shape[-2], x3.shape[-1], device_kind(x3))
    if route not in ROUTES:
        raise ValueError(f"flatten_fast_: route must be one of {ROUTES}, got {route!r}")
    if route == "gram":
        fast_gram.flatten_fast_gram_(x3, exact.flatten_svd_, RECORDER)
        return
    cd = compute_dtype(x3.dtype)
    hi = polar.precise_mode(x3) if precise is None else precise
    lo = low_dtype(x3) if low is None else low
    gd = (hi,) * PRECISE_STEPS + (lo,) * (STEPS - PRECISE_STEPS)
    floor = lift_floor()
    verdict = {}

    def observe(t: int, x: torch.Tensor) -> None:
        if t == PRECISE_STEPS - 1:
            verdict["ok"] = polar.certify(x, floor)

    with polar.ieee_fp32_matmul(x3.is_cuda and cd == torch.float32):
        q, resid = polar.polar_factor(x3, COEFFS, gemm_dtypes=gd, observe=observe, steps=_sym_steps(sym, x3))
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


def _sym_steps(sym: str, x: torch.Tensor):
    """polar_factor's step pieces for `sym` (None: its own torch GEMMs)."""
    if sym == "torch":
        return None
    from .. import triton as tk

    if not tk.usable_for(x):
        raise RuntimeError(f"flatten_fast_: sym='triton' cannot run on this {x.device.type} tensor here (Triton)")
    from ..triton.sym_gram import SymSteps

    return SymSteps


def _fallback(sub: torch.Tensor) -> None:
    """The flagged matrices, by the float32-accurate polar flatten (which hands on what its own
    residual check misses); its warnings are folded into fast's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", polar.RECORDER.warning)
        polar.flatten_polar_(sub)
