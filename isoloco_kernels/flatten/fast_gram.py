"""The Gram-space route of the training grade: "fast" on wide buckets, where the short side is small.

For a wide r×k X (k ≥ c·r, `prefers_gram`; tall inputs are transposed), every Polar Express iterate
is Y·X with Y a polynomial in A₀ = X Xᵀ, so the long side is read three times, never iterated on:

    A₀ = X̃ X̃ᵀ                    float64, column chunks (X̃ = X / max|X|)
    Ã₀ = A₀ / c²                  σ_max ≤ 1: gram.py's bound (c² = tr·‖B⁴‖_F^¼)
    certificate                   Cholesky of Ã₀ − ELL²·I, float64, zero rows masked: λ_min ≥ ELL²
    Y ← p_t(A)·Y,  A ← p_t·A·p_t   STEPS quintics designed for [ELL, 1], float64, r×r
    Δ ← t·Y·X̃·max|X|              float32-accurate GEMMs (3xTF32 on CUDA), column chunks, in place

Precision, stage by stage (float32 input; float64 input runs every stage in float64):
- A₀ must resolve eigenvalues down to ELL² ≈ 6e-10 of its largest. Float64 products leave an error of
  ~√k·2^-53 relative to ‖X̃‖² (k·2^-53 at worst: 1.1e-11 at k 1e5, 2 % of ELL²). Float32
  (~√k·2^-24 ≈ 5e-6 at k 8192) would not: any direction below ~2e-3·σ_max would be noise.
- The r×r iteration works on eigenvalues in [ELL², 1]: float64, for the same reason.
- The application Q = Y·X̃: Y's norm is at most ~1/ELL, so each direction of Q carries an error of
  ~u·κ relative (float32 u: ≤ 1e-3 at κ 1e4, inside the 5e-2 band). It cannot fill a null direction of X (Y·X stays in
  X's row space up to that rounding). bfloat16 there (2^-8·κ) breaks the contract; it is not used.

The certificate costs one r×r Cholesky on a matrix the iteration formed anyway: when it succeeds,
every singular value of X̃/c is ≥ ELL (off zero rows), so the schedule maps it within BOUND of 1 and
the output spectrum is flat to ~BOUND + u·κ. A matrix that fails it (rank-deficient off its zero
rows, condition number beyond ~1/(ELL·r^(1/16)), ~2e4 at r 2048), or whose Frobenius residual
|r − ‖Q‖_F²| / √r exceeds RESID_SLACK·BOUND·√r (NaN included), is recomputed from the same A₀ by
gram.py's exact float64 schedule (to κ ~1e7, its residual and rank-cut checks) and written by the same
streaming pass in float64; what that misses too (rank-deficient off its zero lines, κ beyond ~1e7) goes
to the SVD. Each with a FlattenFallbackWarning, before anything is written. Scratch: r×r float64
matrices per matrix of a sub-batch plus one column block (gram.py's plan): never a copy of the bucket,
except of a matrix the SVD recomputes (its input, aside).
"""

from __future__ import annotations

import math

import torch

from .._validate import _describe_nonfinite, compute_dtype, overflow_limit, rank_tol
from . import exact, gram, tf32
from .polar import TF32X2, TF32X3, certificate_flops, polar_flops

__all__ = ["ELL", "STEPS", "BOUND", "COEFFS", "flatten_fast_gram_", "gram_work", "direct_work", "prefers_gram"]

ELL = 2.5e-5  # polar.ELL: the direct route's range (σ ≥ 2.5e-5 of the σ_max bound, which is ≤ r^(1/16)·σ_max)
STEPS = 9  # fewest steps that take [ELL, 1] within 1e-4 of 1 (8 leave 4.0e-2)
BOUND = 5.6e-5  # |1 − p(σ)| after the schedule, for every σ in [ELL, 1]
RESID_SLACK = 4.0  # flag when |r − ‖Q‖_F²| / √r > RESID_SLACK·BOUND·√r: a certified matrix has ≤ 2·BOUND·√r

# coefficients.schedule(2.5e-5, 9) (tests/test_fast_gram.py regenerates and compares; print it with
# `python -m isoloco_kernels.flatten.coefficients 2.5e-5 9`)
COEFFS = (
    (8.239027264703385, -22.99944761343482, 16.531457811585994),  # |1 − σ| ≤ 1.0e+00
    (4.118601331055141, -2.8748863999847085, 0.516706474424161),  # |1 − σ| ≤ 1.0e+00
    (4.114425362817654, -2.873817377540051, 0.5168463180588517),  # |1 − σ| ≤ 1.0e+00
    (4.097338171493219, -2.8694619332677886, 0.5174297650760094),  # |1 − σ| ≤ 9.9e-01
    (4.028890545749681, -2.8523327720399343, 0.519956721596471),  # |1 − σ| ≤ 9.4e-01
    (3.758709091215852, -2.753212894733792, 0.522925039709085),  # |1 − σ| ≤ 7.8e-01
    (2.905797394247626, -2.131385582595687, 0.45389791243903244),  # |1 − σ| ≤ 3.9e-01
    (2.039587858889311, -1.4005924111860935, 0.37560792800759724),  # |1 − σ| ≤ 4.5e-02
    (1.877110283578972, -1.2523427658311588, 0.3752343537439564),  # |1 − σ| ≤ 5.6e-05
)


# ----------------------------------------------------------------------------------------------
# Work and the route


def gram_work(k: int, r: int, small: str = "iterate") -> dict[str, float]:
    """Modelled FLOPs of one r×k matrix (r ≤ k) on this route, per unit: A₀ ("fp64", 2kr²), the r×r
    part, and the application ("tf32x3": 2kr², float32 on the CPU). The r×r part: "iterate", all
    "fp64" (the bound 4r³, 4 products a step but the last's 2, Y·Ã₀ 2r³, the Cholesky r³/3);
    "eigh", the eigensolver ("eigh", ~9r³) and V·diag·Vᵀ ("fp64", 2r³)."""
    a0_apply = {"fp64": 2.0 * k * r * r, TF32X3: 2.0 * k * r * r}
    if small == "eigh":
        return {"fp64": a0_apply["fp64"] + 2.0 * r**3, "eigh": 9.0 * r**3, TF32X3: a0_apply[TF32X3]}
    small_f = (4.0 + 8.0 * (STEPS - 1) + 4.0 + 2.0) * r**3 + r**3 / 3.0
    return {"fp64": a0_apply["fp64"] + small_f, TF32X3: a0_apply[TF32X3]}


def direct_work(k: int, r: int, precise_steps: int, steps: int) -> dict[str, float]:
    """Modelled FLOPs of the direct route (fast.py): `precise_steps` 3xTF32 steps (X·Xᵀ and A² in
    two TF32 GEMMs, "tf32x2"; the product with X in three, "tf32x3"), the rest bfloat16, the float64
    certificate; 4kr² + 2r³ a step."""
    sym = 2.0 * k * r * r + 2.0 * r**3  # X·Xᵀ and A² of one step
    return {
        TF32X3: polar_flops(k, r, precise_steps) - precise_steps * sym,
        TF32X2: precise_steps * sym,
        "bf16": polar_flops(k, r, steps - precise_steps),
        "fp64": certificate_flops(k, r),
    }


# Relative rates per unit, for the route only (bench/time_model.py prices the methods): an H200's
# fitted rates (bench/results/time_model.md: fp64 43, 3xTF32 42 and its two-GEMM symmetric products 63,
# bf16 244 TFLOP/s); a CPU's float32 BLAS as 1, float64 at half of it, LAPACK's eigh's ~9r³ FLOPs at ~0.3
# (fitted where the two routes tied end to end on the 2-core reference machine, k ≈ r at r 256, with
# the 10-step direct route), and
# bfloat16 at 2.5 where the CPU has bfloat16 units (AVX512-BF16 / AMX; measured 2.6×), else those steps
# run in float32 (fast.low_dtype), at 1.
RATES = {
    "cuda": {"fp64": 43.0, TF32X3: 42.0, TF32X2: 63.0, "bf16": 244.0},
    "cpu": {"fp64": 0.5, "eigh": 0.3, TF32X3: 1.0, TF32X2: 1.0, "bf16": 2.5},
    "cpu-no-bf16": {"fp64": 0.5, "eigh": 0.3, TF32X3: 1.0, TF32X2: 1.0, "bf16": 1.0},
}


def workspace(m: int, n: int, elem: int = 4) -> int:
    """Modelled peak scratch (bytes) of one m×n matrix on this route: ~8 r×r float64 matrices (A₀,
    the iteration's A, p, Y, Y·Ã₀ and products; eigh's V and P) and the column blocks of the passes
    over X (gram._plan: at most gram.COLUMN_BLOCK_BYTES, or half the matrix, for the four it counts)."""
    r, k = min(m, n), max(m, n)
    return 8 * 8 * r * r + min(gram.COLUMN_BLOCK_BYTES, r * k * elem // 2)


def modelled_time(work: dict[str, float], rates: dict[str, float]) -> float:
    return sum(f / rates[u] for u, f in work.items())


def prefers_gram(k: int, r: int, kind: str, precise_steps: int, steps: int) -> bool:
    """Whether the Gram route is modelled faster than the direct one for an r×k matrix (k ≥ r) on a
    device of `kind` (a key of RATES), its r×r part as that device runs it (`small_side_for`): from
    k ≈ 5.5·r on an H200; on a CPU with bfloat16 units from k ≈ 1.15·r, on one without at every
    shape."""
    rates = RATES[kind]
    work = gram_work(k, r, "iterate" if kind == "cuda" else "eigh")
    return modelled_time(work, rates) < modelled_time(direct_work(k, r, precise_steps, steps), rates)


# ----------------------------------------------------------------------------------------------
# The flatten


def _apply(w: torch.Tensor, ch: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    """W·chunk at float32 accuracy: 3xTF32 on CUDA (tensor cores), the compute dtype elsewhere."""
    if ch.is_cuda and cd == torch.float32 and torch.cuda.get_device_capability(ch.device)[0] >= 8:
        return tf32.mm_tf32x3(w, ch)
    return torch.bmm(w, ch)


SMALL_SIDES = ("iterate", "eigh")


def small_side_for(x: torch.Tensor) -> str:
    """How the r×r part runs on x's device: the schedule's GEMMs on CUDA (tensor cores; cuSOLVER's
    eigh is far slower there), LAPACK's eigh on the CPU (3–5× faster than the 74·r³ FLOPs of
    GEMMs there, and exact)."""
    return "iterate" if x.is_cuda else "eigh"


def _small_iterate(a0: torch.Tensor, zero_rows: torch.Tensor, col_nz: torch.Tensor, m: int, n: int, dtype):
    """(W, ok, s̄ of X̃) by the schedule (module docstring): W = t·Y, ok = certified and the residual
    within RESID_SLACK·BOUND·√r (NaN fails)."""
    f64 = torch.float64
    rank = (~zero_rows).sum(-1).to(f64)
    y, tq, res, s = gram._iterate(a0, rank, COEFFS, "pap")  # a0 is Ã₀ after this
    # the certificate: λ_min(Ã₀) ≥ ELL² off the zero rows (their diagonal set to 1)
    a0.diagonal(dim1=-2, dim2=-1).add_(zero_rows.to(f64) - ELL * ELL)
    _, info = torch.linalg.cholesky_ex(a0)
    ok = (info == 0) & (res <= RESID_SLACK * BOUND * rank.sqrt())
    return y.mul_(tq[:, None, None]), ok, s * tq, res


def _small_eigh(a0: torch.Tensor, zero_rows: torch.Tensor, col_nz: torch.Tensor, m: int, n: int, dtype):
    """(W, ok, s̄ of X̃) by LAPACK's eigh (exact.eigh_polar: reference.py's rank cut, ok where eigh
    resolves every kept direction); the residual is 0 (no schedule)."""
    rank = torch.minimum((~zero_rows).sum(-1), col_nz)
    p, nuc, ok = exact.eigh_polar(a0, rank, m, n, dtype)
    keep = (~zero_rows).to(p.dtype)  # eigh leaves ~eps in the zero rows' lines: zero in, zero out
    p.mul_(keep[:, :, None]).mul_(keep[:, None, :])
    sbar = nuc / m
    ok = ok & torch.isfinite(sbar) & torch.isfinite(p).flatten(1).all(1)
    return p.mul_(sbar[:, None, None]), ok, sbar, torch.zeros_like(sbar)


def flatten_fast_gram_(
    x3: torch.Tensor, fallback, recorder, *, budget: int | None = None, small: str | None = None
) -> None:
    """In place Iso-C of a [B, m, n] batch on the Gram route (module docstring); all-or-nothing.

    A matrix the r×r part cannot certify (or resolve) gets gram.py's exact float64 schedule on the same
    A₀ (15 steps to κ ~1e7, residual- and rank-cut-checked) and is written by the same streaming pass:
    no copy of it. Only what that also misses (rank-deficient off its zero lines, κ beyond ~1e7) is
    copied aside and recomputed by `fallback`, an in-place flatten of a [b, m, n] compute-dtype batch
    (fast passes the SVD). recorder: the `Recorder` of the method ("fast"), which warns about every
    recomputed matrix before anything is written; small: "iterate" or "eigh" for the r×r part (default
    `small_side_for` the device). Non-finite input raises ValueError naming the matrix.
    """
    if x3.ndim != 3:
        raise ValueError(f"flatten_fast_gram_: expected [B, m, n], got shape {tuple(x3.shape)}")
    small = small_side_for(x3) if small is None else small
    if small not in SMALL_SIDES:
        raise ValueError(f"flatten_fast_gram_: small must be one of {SMALL_SIDES}, got {small!r}")
    nb, m0, n0 = x3.shape
    if x3.numel() == 0:
        return
    cd = compute_dtype(x3.dtype)
    x = x3.mT if m0 > n0 else x3
    _, m, n = x.shape
    sub_b, cols = gram._plan(nb, m, n, x3.element_size(), budget)
    f64 = torch.float64
    part = _small_iterate if small == "iterate" else _small_eigh

    amax = torch.zeros(nb, dtype=f64, device=x3.device)  # column block by block: no copy of the bucket
    for i in range(0, nb, sub_b):
        for sl in gram._chunks(n, cols):
            amax[i : i + sub_b] = torch.maximum(
                amax[i : i + sub_b], x[i : i + sub_b, :, sl].abs().amax((-2, -1)).to(f64)
            )
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(_describe_nonfinite(x3, "iso_flatten_ (fast)") + "; nothing was written")
    div = torch.where(amax > 0, amax, 1)[:, None, None]

    ws, resid, sbar_all, oks, exact_ok = [], [], [], [], []
    for i in range(0, nb, sub_b):
        j = min(nb, i + sub_b)
        a0 = torch.zeros(j - i, m, m, dtype=f64, device=x3.device)
        col_nz = torch.zeros(j - i, dtype=torch.int64, device=x3.device)
        for sl in gram._chunks(n, cols):
            ch = gram._chunk64(x[i:j, :, sl]).div_(div[i:j])
            a0.baddbmm_(ch, ch.mT)
            col_nz += (ch != 0).any(-2).sum(-1)
            del ch
        zero_rows = a0.diagonal(dim1=-2, dim2=-1) == 0
        keep = a0.clone()  # for what the r×r part cannot certify: gram.py's exact schedule on the same A₀
        w_i, ok_i, sbar_i, res_i = part(a0, zero_rows, col_nz, m, n, x3.dtype)
        del a0
        ex_i = ok_i.clone()
        bad = (~ok_i).nonzero().flatten()
        if bad.numel():
            rank = torch.minimum((~zero_rows[bad]).sum(-1), col_nz[bad]).to(f64)
            y, tq, res, sc = gram._iterate(keep[bad], rank, gram.COEFFS, "pap", tau=rank_tol(m, n, x3.dtype))
            good = res <= gram.CHECK_TOL  # NaN fails
            w_i[bad[good]] = y[good] * tq[good][:, None, None]
            sbar_i[bad[good]] = (sc * tq)[good]
            ex_i[bad[good]] = True
        del keep
        ws.append(w_i)
        oks.append(ok_i)
        exact_ok.append(ex_i)
        sbar_all.append(sbar_i)
        resid.append(res_i)
    w = torch.cat(ws) if len(ws) > 1 else ws[0]
    del ws
    resid = torch.cat(resid)
    recomputed = (~torch.cat(oks)).nonzero().flatten()  # missed the route's certificate or check
    flagged = (~torch.cat(exact_ok)).nonzero().flatten()  # missed gram.py's too: the SVD, aside
    sbar = amax * torch.cat(sbar_all)  # s̄ of X: every output entry is at most ~s̄ in size

    # Fit: |s̄·Q_ij| ≤ s̄·(1 + BOUND + rounding); where that bound reaches the dtype's limit, the
    # largest entry decides (computed chunk by chunk, nothing written).
    big = math.inf if x3.dtype == f64 else overflow_limit(x3.dtype)
    gram.check_fit(
        (~(sbar * 1.01 < big)).nonzero().flatten().tolist(),
        set(flagged.tolist()),
        lambda i: max(
            float(_apply(w[i : i + 1].to(cd), x[i : i + 1, :, sl].to(cd) / div[i].to(cd), cd).abs().max())
            for sl in gram._chunks(n, cols)
        ),
        amax,
        big,
        x3.dtype,
        "fast",
    )

    # The flagged matrices, recomputed aside (the fallback is all-or-nothing on its own copy).
    sub = None
    if flagged.numel():
        sub = x3[flagged].to(cd, copy=True)
        scale = sub.abs().amax((-2, -1), keepdim=True)
        scale = torch.where(scale > 0, scale, 1)
        sub.div_(scale)
        fallback(sub)
        sub = gram.check_aside(
            sub.mul_(scale),
            flagged,
            big,
            x3.dtype,
            lambda i, _: (
                f"iso_flatten_ (fast): matrix {i}: the recomputed Iso-C result does not fit {x3.dtype}; nothing was written"
            ),
        )

    recorder.finish(
        x3.shape,
        recomputed.tolist(),
        float(resid.max()),
        why="a singular value below the Gram route's certified floor: rank-deficient or condition number beyond ~2e4",
        by="by gram.py's float64 schedule (the SVD beyond it)",
        stacklevel=4,
    )

    # The write: t·Y·X̃·max|X|, chunk by chunk, straight into the bucket; the matrices gram.py's schedule
    # resolved in float64 (as gram.py writes them: their u·κ in float32 would be ~1e-2 at κ 1e6).
    wc = w.to(cd)
    in_f64 = set(recomputed.tolist()) - set(flagged.tolist())
    for sl in gram._chunks(n, cols):
        for i in range(0, nb, sub_b):
            j = min(nb, i + sub_b)
            ch = x[i:j, :, sl].to(cd, copy=True).div_(div[i:j].to(cd))
            out = _apply(wc[i:j], ch, cd).mul_(div[i:j].to(cd))
            for k in sorted(in_f64.intersection(range(i, j))):
                out[k - i] = (w[k] @ (x[k, :, sl].to(f64) / div[k])) * div[k]
            x[i:j, :, sl].copy_(out)
            del ch, out
    if sub is not None:
        x3[flagged] = sub
