"""The matmul-only Iso-C flatten (method "polar"): Polar Express for Q, then s̄ = ⟨Δ, Q⟩ / min(m, n).

    X ← Δ scaled to σ_max ≤ 1;   10×: X ← a_t·X + (b_t·A + c_t·A²)·X,  A = X Xᵀ;   Δ ← (⟨Δ, X⟩ / r0)·X

(Polar Express, arXiv:2505.16932; `COEFFS` from coefficients.py.) Float32 error ≤ 1e-3 to condition
number 1e4; a per-matrix residual check sends what it cannot resolve to gram/SVD
(`FlattenFallbackWarning`, `last_stats()`). The GEMMs run on torch (cuBLAS / CPU BLAS). The rank certificates ("polar_bf16"'s `full_rank`, "fast"'s
`certify`) are certificates.py. Derivation, accuracy and the check: docs/polar.md;
measurements: bench/results/polar_accuracy.md.
"""

from __future__ import annotations

import contextlib

import torch

from .._validate import check_result_fits, compute_dtype, pow2_scale
from . import tf32
from .certificates import CERTIFY_BLOCK_BYTES, RANK_FLOOR, certificate_flops, certify, full_rank  # noqa: F401
from .iteration_stats import FlattenFallbackWarning, FlattenStats, Recorder

__all__ = [
    "ELL",
    "STEPS",
    "CHECK_TOL",
    "COEFFS",
    "polar_factor",
    "flatten_polar_",
    "polar_flops",
    "polar_work",
    "FlattenStats",
    "FlattenFallbackWarning",
    "last_stats",
    "reset_stats",
]

ELL = 2.5e-5  # smallest scaled singular value the schedule covers: 1e-4 / (65536^{1/8} = 4)
STEPS = 10  # 9 reach 2e-4, the 10th reaches round-off (needed by the residual check)
CHECK_TOL = 5e-4  # flag a matrix when |r − ‖X‖_F²| > CHECK_TOL·√r (relative error bound of X)
# The same check for float64 input, which iterates in float64: the schedule leaves |1 − σ| ≤ 4.3e-12
# on [ELL, 1], so a lifted matrix has |r − ‖X‖_F²| / √r ≤ 8.6e-12·√r (≤ 7.8e-10 to r 8192); a
# direction below ELL ends further off and is flagged (float32's 5e-4 let 1.6e-4 through at κ 4e4).
CHECK_TOL_F64 = 1e-9
BF16_FP32_STEPS = 2  # "polar_bf16": all steps but the last two run their GEMMs in bfloat16
TF32X3 = "tf32x3"  # a GEMM mode of `polar_factor`: float32 through three TF32 GEMMs (tf32.py)
TF32X2 = (
    "tf32x2"  # a work unit: X·Xᵀ and A² in that mode, two TF32 GEMMs (the cross terms are one GEMM and its transpose)
)


# ----------------------------------------------------------------------------------------------
# Coefficients


# The Polar Express schedule for ℓ_0 = ELL, STEPS steps, derived offline by
# isoloco_kernels/flatten/coefficients.py (`python -m isoloco_kernels.flatten.coefficients 2.5e-5 10` prints it;
# tests/test_polar.py regenerates and compares). The comment on each row bounds |1 − σ| after
# that step for every σ that started in [ELL, 1] (all steps but the last keep a safety margin).
COEFFS = (
    (8.239027264703385, -22.99944761343482, 16.531457811585994),  # |1 − σ| ≤ 1.0e+00
    (4.118601331055138, -2.8748863999847094, 0.5167064744241613),  # |1 − σ| ≤ 1.0e+00
    (4.114425362817658, -2.8738173775400564, 0.5168463180588528),  # |1 − σ| ≤ 1.0e+00
    (4.09733817149322, -2.8694619332677904, 0.5174297650760099),  # |1 − σ| ≤ 9.9e-01
    (4.028890545749679, -2.8523327720399356, 0.5199567215964717),  # |1 − σ| ≤ 9.4e-01
    (3.758709091215832, -2.7532128947337804, 0.522925039709084),  # |1 − σ| ≤ 7.8e-01
    (2.9057973942475894, -2.1313855825956574, 0.4538979124390287),  # |1 − σ| ≤ 3.9e-01
    (2.039587858889295, -1.4005924111860786, 0.37560792800759585),  # |1 − σ| ≤ 4.5e-02
    (1.858525033246525, -1.2155115503442169, 0.3570226123986866),  # |1 − σ| ≤ 1.9e-04
    (1.8750000592631568, -1.250000084661656, 0.3750000253984968),  # |1 − σ| ≤ 4.3e-12
)


# ----------------------------------------------------------------------------------------------
# Statistics and warnings


RECORDER = Recorder("polar")
last_stats = RECORDER.last  # a copy of the running statistics of the polar flatten (`FlattenStats`)
reset_stats = RECORDER.reset


# ----------------------------------------------------------------------------------------------
# Work


def polar_flops(k: int, r: int, steps: int = STEPS) -> float:
    """Modelled FLOPs of `steps` steps on one r×k matrix (r ≤ k): A = X·Xᵀ (2kr²), A² (2r³) and
    (bA + cA²)·X (2kr²) per step."""
    return steps * (4.0 * k * r * r + 2.0 * r**3)


def polar_work(k: int, r: int, mode: str = "fp32") -> dict[str, float]:
    """Modelled FLOPs of one r×k matrix per GEMM dtype: "compute" (the input's compute dtype) for
    every step of mode "fp32"; for mode "tf32x3" the products of a step split by how many TF32 GEMMs
    they take: (bA + cA²)·X as "tf32x3" (three, counted once: the unit's ceiling is a third of TF32's),
    X·Xᵀ and A² as "tf32x2" (symmetric: two, tf32.py); mode "bf16" runs all but the
    last `BF16_FP32_STEPS` in "bf16", and its rank certificate in "fp64"."""
    if mode == "fp32":
        return {"compute": polar_flops(k, r)}
    if mode == "tf32x3":
        return {TF32X3: STEPS * 2.0 * k * r * r, TF32X2: STEPS * (2.0 * k * r * r + 2.0 * r**3)}
    hi = min(BF16_FP32_STEPS, STEPS)
    return {"bf16": polar_flops(k, r, STEPS - hi), "compute": polar_flops(k, r, hi), "fp64": certificate_flops(k, r)}


# ----------------------------------------------------------------------------------------------
# The iteration


def polar_factor(
    x3: torch.Tensor,
    coeffs=COEFFS,
    *,
    gemm_dtypes=None,
    steps=None,
    observe=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q, residual) for a [B, m, n] batch: Q ≈ U_r V_rᵀ in the compute dtype (float32, or float64
    for float64 input), residual[b] = |r − ‖Q_b‖_F²| / √r (see the module docstring; 0 for r = 0).

    gemm_dtypes: one per step for the GEMM operands: a dtype, or TF32X3 ("tf32x3": float32
    operands through three TF32 GEMMs, tf32.py); default: the compute dtype throughout;
    steps: an object with gram / square / step like `TorchSteps` (default: `TorchSteps`, cuBLAS / CPU BLAS; the
    accuracy benchmark passes one that rounds GEMM operands to TF32);
    observe: called as observe(t, X) with the compute-dtype iterate after step t (wide
    orientation, σ_max ≤ 1 scaling), for checks between steps ("fast" certifies its spectrum so).
    """
    if x3.ndim != 3:
        raise ValueError(f"polar_factor: expected [B, m, n], got shape {tuple(x3.shape)}")
    cd = compute_dtype(x3.dtype)
    tall = x3.shape[-2] > x3.shape[-1]
    x = x3.mT if tall else x3
    x = x.to(cd).contiguous()
    if gemm_dtypes is None:
        gemm_dtypes = (cd,) * len(coeffs)
    if len(gemm_dtypes) != len(coeffs):
        raise ValueError(f"polar_factor: {len(coeffs)} steps but {len(gemm_dtypes)} gemm dtypes")
    ops = steps if steps is not None else TorchSteps

    # Exact rank bound r = min(#nonzero rows, #nonzero columns): the residual check's target.
    nz = x != 0
    rank = torch.minimum(nz.any(-1).sum(-1), nz.any(-2).sum(-1)).to(torch.float64)

    # σ_max ≤ 1: amax, then Frobenius (no overflow), then s = ‖A²‖_F^{1/4} on the reused A, A².
    amax = x.abs().amax((-2, -1), keepdim=True)
    x = x / torch.where(amax > 0, amax, 1)
    fro = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    x = x / torch.where(fro > 0, fro, 1)

    def pick(g):  # (operand dtype, step pieces) of one step's GEMM choice
        if isinstance(g, str):
            if g != TF32X3 or cd != torch.float32:
                raise ValueError(f"polar_factor: GEMM mode {g!r} needs float32 compute (only {TF32X3!r})")
            return cd, tf32.Tf32x3Steps
        return g, ops

    g, sops = pick(gemm_dtypes[0])
    a_mat = sops.gram(x.to(g))
    a2 = sops.square(a_mat)
    s2 = torch.linalg.vector_norm(a2.to(cd), dim=(-2, -1), keepdim=True).sqrt()  # ≥ σ_max²
    s2 = torch.where(s2 > 0, s2, 1)
    x = x / s2.sqrt()
    a_mat = (a_mat / s2.to(a_mat.dtype)).to(g)
    a2 = (a2 / (s2 * s2).to(a2.dtype)).to(g)

    for t, ((a, b, c), mode) in enumerate(zip(coeffs, gemm_dtypes)):
        g, sops = pick(mode)
        xg = x.to(g)
        if t > 0:
            a_mat = sops.gram(xg)
            a2 = None
        x = sops.step(xg, a_mat, a2, a, b, c).to(cd)
        if observe is not None:
            observe(t, x)

    fro2 = x.square().sum((-2, -1), dtype=torch.float64)
    resid = (rank - fro2).abs() / rank.clamp_min(1).sqrt()
    q = x.mT if tall else x
    return q, resid


@contextlib.contextmanager
def ieee_fp32_matmul(on: bool = True):
    """Full-precision (IEEE, no TF32) float32 GEMMs on CUDA inside; every setting restored after.

    TF32 breaks polar's 1e-3 bound (bench/results/polar_accuracy.md measures 2e-3 to 5e-3 with
    TF32-rounded operands). Works whichever API the user set TF32 with: on torch >= 2.9 with
    `torch.backends.cuda.matmul.fp32_precision` (or the global `torch.backends.fp32_precision`,
    which makes `torch.get_float32_matmul_precision()` raise), that setting is saved, set to
    "ieee" and restored; when the legacy state is readable (`allow_tf32`,
    `set_float32_matmul_precision`, or nothing set) it is switched to "highest" as well, so
    both APIs agree inside and neither getter raises. Older torch: the legacy setting only.

    The switch is process-global, as torch's setting is: float32 matmuls that other threads run
    on CUDA while a flatten is inside also run without TF32.
    """
    if not on:
        yield
        return
    with tf32.cuda_fp32_matmul("highest", "ieee"):
        yield


class TorchSteps:
    """The step pieces through torch.matmul / baddbmm (cuBLAS on CUDA, BLAS on the CPU)."""

    @staticmethod
    def gram(x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, x.mT)

    @staticmethod
    def square(a: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, a)

    @staticmethod
    def step(x, a_mat, a2, a: float, b: float, c: float) -> torch.Tensor:
        """a·X + (b·A + c·A²)·X; A² is formed here unless given."""
        if a2 is None:
            bm = torch.baddbmm(a_mat, a_mat, a_mat, beta=b, alpha=c)
        else:
            bm = b * a_mat + c * a2
        return torch.baddbmm(x, bm, x, beta=a)


# ----------------------------------------------------------------------------------------------
# The in-place flatten


def _exact_flatten(sub: torch.Tensor) -> None:
    """The fallback for flagged matrices: for float32 compute the Gram-space float64 iteration
    (gram.py, exact to condition number ~1e5 for float32, matmul-only), which itself recomputes the
    matrices it cannot resolve (cond beyond ~1e7, rank-deficient) with the SVD, whose rank cut is
    the closest to reference.py's; for float64 the SVD itself (the Gram matrix would square the
    condition number past float64's own accuracy)."""
    from . import exact, gram

    if sub.dtype == torch.float64:
        exact.flatten_svd_(sub)
    else:
        gram.flatten_gram_(sub)


def precise_mode(x: torch.Tensor) -> str | torch.dtype:
    """The GEMM mode of "fast"'s float32-accurate steps for x: TF32X3 for float32 compute on a
    CUDA device with TF32 tensor cores (compute capability ≥ 8.0: A100, H100, H200, …), else the
    compute dtype (IEEE float32 without TF32; float64 for float64 input; the CPU's BLAS)."""
    cd = compute_dtype(x.dtype)
    if cd == torch.float32 and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 8:
        return TF32X3
    return cd


MODES = ("fp32", "tf32x3", "bf16")


def _gemm_modes(x3: torch.Tensor, mode: str):
    """polar_factor's gemm_dtypes for a flatten mode (`flatten_polar_`)."""
    if mode not in MODES:
        raise ValueError(f"flatten_polar_: mode must be one of {MODES}, got {mode!r}")
    cd = compute_dtype(x3.dtype)
    if mode == "fp32":
        return (cd,) * len(COEFFS)
    if mode == "tf32x3":
        return ((TF32X3 if cd == torch.float32 else cd),) * len(COEFFS)
    k = max(len(COEFFS) - BF16_FP32_STEPS, 0)
    return (torch.bfloat16,) * k + (cd,) * (len(COEFFS) - k)


def flatten_polar_(x3: torch.Tensor, *, mode: str = "fp32") -> None:
    """In place Iso-C of a [B, m, n] batch through the polar iteration; all-or-nothing.

    mode "fp32": GEMMs in the compute dtype (IEEE float32, float64 for float64 input).
    mode "tf32x3": float32 input's GEMMs as 3xTF32 (tf32.py: tensor cores at about float32
    accuracy; on the CPU emulated, what the GPU computes); float64 input stays float64. The method
    "polar_tf32x3": a candidate exact grade, not yet what "auto" runs (unmeasured on a GPU).
    mode "bf16": GEMMs in bfloat16 except the last `BF16_FP32_STEPS` steps (tensor-core speed).
    Rounding X to bfloat16 moves its small singular directions by ~2^-8·σ_max, so the error grows
    with the condition number: ~1e-2 at cond 1e2, O(1) at cond 1e4 (bench/results/
    polar_accuracy.md); the residual check sees singular values, not directions, and does not
    catch that. Use it only for well-conditioned updates ("fast" is the training grade).
    Matrices that fail the residual check (and, in mode "bf16", the rank certificate `full_rank`:
    its bfloat16 steps would fill a null space) are recomputed exactly, with a
    FlattenFallbackWarning.
    """
    gd = _gemm_modes(x3, mode)
    with ieee_fp32_matmul(x3.is_cuda and compute_dtype(x3.dtype) == torch.float32):
        q, resid = polar_factor(x3, gemm_dtypes=gd)
    tol = CHECK_TOL_F64 if compute_dtype(x3.dtype) == torch.float64 else CHECK_TOL
    fail = ~(resid <= tol)  # NaN counts as failed
    if mode == "bf16":
        fail |= ~full_rank(x3)
    flagged = fail.nonzero().flatten()
    finish_flatten_(
        x3,
        q,
        flagged,
        _exact_flatten,
        "polar",
        RECORDER,
        resid,
        why="condition number ≫ 1e4 or rank-deficient",  # polar_bf16's rank certificate too
        by="exactly",
    )


def finish_flatten_(
    x3: torch.Tensor,
    q: torch.Tensor,
    flagged: torch.Tensor,
    fallback,
    name: str,
    recorder: Recorder,
    resid: torch.Tensor,
    *,
    why: str,
    by: str,
) -> None:
    """The epilogue of the iterative flattens: x3 ← (⟨Δ, Q⟩ / r0)·Q, with the `flagged` matrices
    recomputed by `fallback` (an in-place flatten of a [b, m, n] compute-dtype batch); all-or-nothing.
    The method's `recorder` records the call (largest `resid`, the flagged matrices, `why` they missed
    the check, `by` what recomputed them) and warns after every check and before x3 is written: a
    warning filtered into an error then leaves x3 untouched.

    Δ is scaled by a power of two near its largest entry for the scale s̄ (exact, Iso-C is
    homogeneous), so finite input never overflows there; a result that does not fit x3's dtype
    raises ResultOverflowError naming the matrix. Either way x3 is then untouched.
    """
    cd = compute_dtype(x3.dtype)
    scale = pow2_scale(x3, cd)[:, None, None]
    if x3.shape[-2] > x3.shape[-1]:
        # Tall: q is the transpose of the iteration's contiguous [B, n, m] result. Run the
        # epilogue on the transposed pair (⟨Δᵀ, Qᵀ⟩ = ⟨Δ, Q⟩, same r0), both contiguous, so no
        # kernel reads q with stride m and the extension copies neither operand.
        out_t = torch.empty(x3.shape[0], x3.shape[-1], x3.shape[-2], dtype=cd, device=x3.device)
        out_t.copy_(x3.mT).div_(scale.mT)
        sbar = torch.ops.isoloco.iso_scale_(out_t, q.mT)
        out = out_t.mT
    else:
        out = x3.to(cd, copy=True).div_(scale)
        sbar = torch.ops.isoloco.iso_scale_(out, q)
    # Non-finite s̄ can only come from a non-finite Δ here (inputs are checked finite by callers).
    bad = (~torch.isfinite(sbar)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"iso_flatten_ ({name}): matrix {i} gave a non-finite scale s̄ = {float(sbar[i])} "
            f"(|Δ| up to {float(x3[i].abs().max())}: Δ is not finite); nothing was written"
        )
    if flagged.numel():
        sub = x3[flagged].to(cd).div_(scale[flagged])
        fallback(sub)
        out[flagged] = sub
    out.mul_(scale)
    check_result_fits(out, x3.dtype, f"iso_flatten_ ({name})")
    recorder.finish(
        x3.shape, flagged.tolist(), float(resid.max()) if x3.shape[0] else 0.0, why=why, by=by, stacklevel=4
    )
    x3.copy_(out)
