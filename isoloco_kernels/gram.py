"""The Gram-space Iso-C flatten: the Polar Express iteration run on the small Gram matrix, in float64.

For X (m×n, m ≤ n; tall inputs are transposed) every iterate of X ← p(X Xᵀ)·X is X_t = Y_t·X with
Y_t a polynomial in A₀ = X Xᵀ (p(X Xᵀ)·X moves singular values only). So the whole iteration runs
on m×m matrices, and only two GEMMs touch the big matrix:

    A₀ = X Xᵀ              float64, m²n (column chunks: no float64 copy of the bucket)
    Y ← p_t(A_t)·Y,  A_{t+1} = p_t·A_t·p_t (= Y·A₀·Yᵀ)      T steps, m×m only
    Q = Y·X,  ⟨Δ, Q⟩ = tr(Y·A₀),  ‖Q‖_F² = tr(Y·A₀·Yᵀ)      one m²n GEMM, the rest m×m

A₀ has condition number κ², so it is formed and iterated in float64 (good to κ ≈ 1e7); the result
is written back in the input dtype. On A100/H100/H200 float64 GEMMs run on tensor cores at the
non-TF32 float32 rate, so this costs 4m²n + (8T + 2)·m³ float64 FLOPs (`gram_flops`) against
T'(4m²n + 2m³) float32 for polar.py's direct iteration — less for matrices ≳ 3× wider than tall —
and is exact to κ ~ 1e5 for float32 input (design notes, "Gram space").

Scaling (no overflow for any finite input). X̃ = X / amax|X| (entries ≤ 1, A₀ entries ≤ n); then
with B = A₀ / tr(A₀) (eigenvalues λ_i ≥ 0 summing to 1), λ_max(B) ≤ ‖B⁴‖_F^{1/4} ≤ r^{1/8}·λ_max(B)
(‖B⁴‖_F² = Σλ⁸), so s² = tr(A₀)·‖B⁴‖_F^{1/4} ≥ σ_max(X̃)² and X̃ / s has σ_max ≤ 1 while losing at
most r^{1/16} (≤ 2 for r ≤ 65536, ≤ 4 for r ≤ 2³²) at the small end. Two m³ products buy that
bound (polar.py's one product gives r^{1/8}).

Schedule. `COEFFS` is `coefficients.schedule(ELL, STEPS).coeffs` (tests regenerate and compare):
- ELL = 2.5e-8 = 1e-7 / 4: every direction with σ ≥ 1e-7·σ_max — κ ≤ 1e7, where float64 A₀ stops
  resolving directions, and at least the float32 rank cut sqrt(max(m, n))·eps32 ≥ 1.19e-7 — lies in
  [ELL, 1] after the σ_max bound (which loses at most r^{1/16} ≤ 4).
- STEPS = 15: the fewest for which the composed schedule maps all of [ELL, 1] to within float64
  round-off of 1 (3e-13); 14 steps leave 1.5e-5.

Updating A. A_{t+1} = p_t·A_t·p_t (p_t = p_t(A_t) is symmetric and bounded, |p| ≤ ~8), not
recomputed as Y_{t+1}·A₀·Y_{t+1}ᵀ: both cost two m×m products per step, but Y grows to ~1/σ_min, so the recomputed
product carries an absolute rounding error of ~eps64·κ² in A (2e-6 at κ 1e5) while p·A·p keeps
~eps64 per step. Measured against reference.py, float64 input, 128×128 to 64×2048: p·A·p is 2–8×
more accurate — flat-tail spectra 2.5e-9 vs 2.1e-8 at κ 1e4, 2.5e-7 vs 1.0e-6 at κ 1e5; geometric
1.5e-8 vs 4.7e-8 at κ 1e5 (tests/test_gram.py: `test_pap_update_beats_recomputing_a`). (Recomputing
A needs Y·A₀·Yᵀ with the transpose: Y·A₀·Y feeds Y's rounding asymmetry back and diverges.) The
residual check does not trust the tracked A: it uses ‖Q‖_F² = tr(Y·A₀·Yᵀ) of the Y that is returned.

Zeros. A zero row i of X is a zero row and column of A₀; then p(A)_ik = a·δ_ik exactly, Y keeps
Y_ik = 0 for k ≠ i, and row i of Q = Y·X is an exact sum of zeros. A zero column of X is a zero column
of Q. So zero rows, columns and matrices come out exactly zero.

The residual check (as polar.py's): f_i the final singular values of Q (ideally 1 on the rank r),
D = r − ‖Q‖_F² = r − tr(Y·A₀·Yᵀ) with r = min(nonzero rows, nonzero columns); the relative error of
Q is at most |D|/√r while 0 ≤ f_i ≤ 1. A matrix with |D| > CHECK_TOL·√r (κ ≫ 1e7, or rank deficient
beyond exact zero rows/columns) is recomputed with the exact SVD (`exact.flatten_svd_`), with a
`GramFallbackWarning`; `last_stats()` counts them.

All-or-nothing. Everything that can fail — non-finite input, a result that does not fit the output
dtype — is decided before the first write; the result is then written column chunk by column chunk
straight into the input (chunk j of Q needs only chunk j of X) with `copy_`.

Memory. Besides the bucket: the B·m² float64 Y matrices kept until the write, a workspace of about
6 m×m float64 matrices per matrix of a sub-batch, and float64 column chunks; sub-batches and chunks
are sized to half the bucket (at least one matrix, at least 128 columns). So the peak extra memory
stays below the bucket's own size for wide buckets (m×m float64 small against m×n), but not for
near-square float32 ones, where one matrix's m×m float64 workspace alone is 12× its float32 size.
Measured (peak RSS of a fresh process, float32, one thread; bench/results/gram.md), in units of the
bucket: 2×32000×256 0.40 (polar 5.4, eigh 8.6), 4×4096×256 0.81, 3×2688×1024 2.6, 4×1024×1024 4.4
(polar 11.3).
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch

from . import exact
from ._validate import ResultOverflowError, _describe_nonfinite, overflow_limit
from .polar import PolarFallbackWarning, PolarStats

__all__ = [
    "ELL", "STEPS", "CHECK_TOL", "COEFFS", "gram_factor", "gram_from_a0", "flatten_gram_",
    "GramFallbackWarning", "last_stats", "reset_stats",
]

ELL = 2.5e-8     # 1e-7 (κ 1e7, float64 Gram limit; ≥ float32 rank cut) / 4 (σ_max bound's loss)
STEPS = 15       # fewest steps taking [ELL, 1] to float64 round-off of 1 (14 leave 1.5e-5)
CHECK_TOL = 1e-5  # flag a matrix when |r − ‖Q‖_F²| > CHECK_TOL·√r (bounds Q's relative error)
MIN_CHUNK_COLS = 128

# Generated by coefficients.schedule(ELL, STEPS) (tests/test_polar.py regenerates and
# compares). Print it with `python -m isoloco_kernels.coefficients 2.5e-8 15`.
COEFFS = (
    (8.239883501496415, -23.001837819539652, 16.533175835081476),
    (4.1199408379159115, -2.8752296826829054, 0.5166618432340994),
    (4.119936652758565, -2.8752286098454993, 0.5166619825095137),
    (4.119919410270709, -2.8752241898665627, 0.5166625563234806),
    (4.1198483742277325, -2.8752059806430688, 0.5166649205279773),
    (4.119555743953052, -2.8751309738534485, 0.5166746630208292),
    (4.1183507029811866, -2.8748221904658773, 0.5167148372887834),
    (4.113395813281833, -2.8735540936415176, 0.5168809596929765),
    (4.093147364394232, -2.8683983876318315, 0.5175756554895948),
    (4.012458114856163, -2.8483006321232387, 0.5206110990006511),
    (3.686443634383366, -2.7025105444119926, 0.5172672793113378),
    (2.7775945777972937, -2.032088444305945, 0.44299587560593967),
    (1.986573671242047, -1.3485196121968093, 0.3702994341837175),
    (1.8572913421151878, -1.2141694019479456, 0.35689098104304073),
    (1.8750000103783444, -1.2500000148262065, 0.375000004447862),
)


class GramFallbackWarning(PolarFallbackWarning):
    """Some matrices missed the Gram iteration's accuracy check and were recomputed by SVD."""


_STATS = PolarStats()


def last_stats() -> PolarStats:
    """A copy of the running statistics of the Gram flatten (fields as polar.PolarStats)."""
    return dataclasses.replace(_STATS)


def reset_stats() -> None:
    global _STATS
    _STATS = PolarStats()


# ----------------------------------------------------------------------------------------------
# Sizes and work


def gram_flops(k: int, r: int, steps: int = STEPS) -> float:
    """float64 FLOPs of one r×k matrix (r ≤ k): A₀ = X·Xᵀ and Q = Y·X (2kr² each), the σ_max
    bound (two r³ products), every step but the last A², p·Y, p·A and (p·A)·p (four), the last
    A² and p·Y (two), and Y·Ã₀ for the scale and the check (one); 2r³ FLOPs per product."""
    return 4.0 * k * r * r + (8.0 * steps + 2.0) * r**3



def _plan(b: int, m: int, n: int, itemsize: int, budget: int | None) -> tuple[int, int]:
    """(matrices per sub-batch, columns per chunk) for a [b, m, n] (m ≤ n) bucket: workspace of
    ~6 m×m float64 per matrix, and the float64 [sub, m, cols] buffers of the passes over X (at most
    two live: a chunk and its product; four counted, for the allocator's slack), each within the
    budget (default: half the bucket's bytes; at least one matrix and MIN_CHUNK_COLS columns)."""
    if budget is None:
        budget = b * m * n * itemsize // 2
    sub = max(1, min(b, budget // max(6 * m * m * 8, 1)))
    cols = max(min(n, MIN_CHUNK_COLS), min(n, budget // max(4 * sub * m * 8, 1)))
    return sub, cols


def _chunks(n: int, cols: int):
    for j in range(0, n, cols):
        yield slice(j, min(n, j + cols))


def _chunk64(x: torch.Tensor) -> torch.Tensor:
    """A contiguous float64 copy of a column chunk (one buffer; never a view of the input)."""
    out = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    return out.copy_(x)


# ----------------------------------------------------------------------------------------------
# The iteration


def _eye_like(a: torch.Tensor) -> torch.Tensor:
    return torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)


def gram_factor(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    coeffs=COEFFS,
    cols: int | None = None,
    update: str = "pap",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Y, t, resid, rank, s) for a [b, m, n] view with m ≤ n (any dtype, read in float64 chunks).

    amax: [b] max |x| per matrix (finite; 0 for a zero matrix). Returns, per matrix, in float64:
    Y [b, m, m] with Q = Y·(X / c) ≈ U_r V_rᵀ (c = amax·s, the σ_max bound), t = tr(Y·Ã₀) / min(m, n)
    = s̄ / c ≤ 1 (so the result is s̄·Q = t·Y·X), resid = |r − ‖Q‖_F²| / √r, the exact rank bound r
    and s.
    update: "pap" (A ← p·A·p, the default) or "recompute" (A = Y·A₀·Yᵀ), for the stability test.
    """
    if update not in ("recompute", "pap"):
        raise ValueError(f"gram_factor: update must be 'recompute' or 'pap', got {update!r}")
    b, m, n = x.shape
    f64 = torch.float64
    dev = x.device
    cols = n if cols is None else cols
    inv = 1.0 / torch.where(amax > 0, amax, 1).to(f64)[:, None, None]

    # A₀ = X̃ X̃ᵀ and the exact rank bound, one pass over column chunks.
    a0 = torch.zeros(b, m, m, dtype=f64, device=dev)
    row_nz = torch.zeros(b, m, dtype=torch.bool, device=dev)
    col_nz = torch.zeros(b, dtype=torch.int64, device=dev)
    for sl in _chunks(n, cols):
        ch = _chunk64(x[:, :, sl]).mul_(inv)
        a0.baddbmm_(ch, ch.mT)
        nz = ch != 0
        row_nz |= nz.any(-1)
        col_nz += nz.any(-2).sum(-1)
        del ch, nz
    rank = torch.minimum(row_nz.sum(-1), col_nz).to(f64)
    y, tq, resid, s = _iterate(a0, rank, coeffs, update)
    return y, tq, resid, rank, s


def _iterate(a0: torch.Tensor, rank: torch.Tensor, coeffs, update: str):
    """The m×m part of `gram_factor` on A₀ [b, m, m] (float64, overwritten by Ã₀): the σ_max
    bound, the schedule and the residual check. Returns (Y, t, resid, s) as `gram_factor`."""
    # σ_max bound: B = A₀ / tr(A₀), λ_max(B) ≤ ‖B⁴‖_F^{1/4} ≤ r^{1/4} λ_max(B).
    tr = a0.diagonal(dim1=-2, dim2=-1).sum(-1)
    tr = torch.where(tr > 0, tr, 1)[:, None, None]
    bm = a0 / tr
    b2 = bm @ bm
    b4n = torch.linalg.vector_norm(b2 @ b2, dim=(-2, -1), keepdim=True)
    lam = torch.where(b4n > 0, b4n, 1) ** 0.25
    a0.div_(tr * lam)  # Ã₀: the Gram matrix of X̃ / s, σ_max ≤ 1
    s = (tr * lam).sqrt().flatten()
    del bm, b2, b4n

    eye = _eye_like(a0)
    y = eye.clone()
    a_mat = a0
    for t, (ca, cb, cc) in enumerate(coeffs):
        p = torch.baddbmm(a_mat, a_mat, a_mat, beta=cb, alpha=cc)  # bA + cA²
        p.add_(eye, alpha=ca)
        y = p @ y
        if t == len(coeffs) - 1:
            break
        if update == "recompute":
            a_mat = y @ (a0 @ y.mT)
        else:
            a_mat = p @ a_mat @ p
        del p
    z = y @ a0  # Y·Ã₀ (symmetric in exact arithmetic)
    r0 = a0.shape[-1]  # m ≤ n
    tq = z.diagonal(dim1=-2, dim2=-1).sum(-1) / r0  # s̄ / c
    fro2 = (z * y).sum((-2, -1))  # tr(Y Ã₀ Yᵀ) = ‖Q‖_F²
    resid = (rank - fro2).abs() / rank.clamp_min(1).sqrt()
    del z
    return y, tq, resid, s


# ----------------------------------------------------------------------------------------------
# The in-place flatten


def _svd_fallback(sub: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The exact SVD path (exact.flatten_svd_) on a copy of `sub`; far from 1 the copy is first
    scaled by a power of two (exact) so that LAPACK neither overflows nor underflows."""
    sub = sub.clone()
    k = torch.zeros_like(amax, dtype=torch.float64)
    big = (amax > 2.0**60) | ((amax > 0) & (amax < 2.0**-60))
    if bool(big.any()):
        k = torch.where(big, torch.floor(torch.log2(torch.where(amax > 0, amax, 1).double())), 0)
        sub.mul_(torch.exp2(-k).to(sub.dtype)[:, None, None])
    exact.flatten_svd_(sub)
    if bool(big.any()):
        cd = torch.float64 if sub.dtype == torch.float64 else torch.float32
        sub = (sub.to(cd) * torch.exp2(k).to(cd)[:, None, None])
    return sub


def flatten_gram_(x3: torch.Tensor, *, budget: int | None = None, update: str = "pap") -> None:
    """In place Iso-C of a [B, m, n] batch through the Gram-space iteration; all-or-nothing.

    budget: bytes of workspace per phase (default: half the bucket; see the module docstring).
    Non-finite input, or a result that does not fit the input dtype, raises ValueError naming the
    matrix; x3 is then untouched. Matrices that miss the residual check are recomputed by SVD with a
    GramFallbackWarning.
    """
    global _STATS
    if x3.ndim != 3:
        raise ValueError(f"flatten_gram_: expected [B, m, n], got shape {tuple(x3.shape)}")
    nb, m0, n0 = x3.shape
    if x3.numel() == 0:
        return
    tall = m0 > n0
    x = x3.mT if tall else x3
    _, m, n = x.shape
    sub_b, cols = _plan(nb, m, n, x3.element_size(), budget)

    # Pass 1: amax per matrix (also the finite check: NaN/Inf make it non-finite).
    amax = torch.zeros(nb, dtype=torch.float64, device=x3.device)
    for i in range(0, nb, sub_b):
        j = min(nb, i + sub_b)
        for sl in _chunks(n, cols):
            part = x[i:j, :, sl].abs().amax((-2, -1)).to(torch.float64)
            amax[i:j] = torch.maximum(amax[i:j], part)
    bad = (~torch.isfinite(amax)).nonzero().flatten()
    if bad.numel():
        raise ValueError(_describe_nonfinite(x3, "iso_flatten_ (gram)") + "; nothing was written")

    # Pass 2: the m×m iteration, sub-batch by sub-batch; only W = t·Y is kept.
    ws, resid, sbar_over_c, scale = [], [], [], []
    for i in range(0, nb, sub_b):
        j = min(nb, i + sub_b)
        y, tq, res, _, s = gram_factor(x[i:j], amax[i:j], cols=cols, update=update)
        ws.append(y.mul_(tq[:, None, None]))
        resid.append(res)
        sbar_over_c.append(tq)
        scale.append(s)
    w = torch.cat(ws) if len(ws) > 1 else ws[0]
    del ws
    resid = torch.cat(resid)
    tq = torch.cat(sbar_over_c)
    c = amax * torch.cat(scale)  # X = c·X̃ (may be inf for float64 input near its max: see below)

    # Fit check: |s̄·Q_ij| ≤ s̄·(1 + δ) = c·t·(1 + δ). Where that bound exceeds the dtype's max, the
    # actual largest entry decides (computed chunk by chunk, nothing written).
    # The smallest magnitude that rounds to Inf (float64: any finite value fits).
    big = math.inf if x3.dtype == torch.float64 else overflow_limit(x3.dtype)
    flagged = (~(resid <= CHECK_TOL)).nonzero().flatten()
    flag_set = set(flagged.tolist())
    suspects = (~((c * tq) * 1.001 < big)).nonzero().flatten().tolist()
    for i in suspects:
        if i in flag_set:
            continue
        top = 0.0
        for sl in _chunks(n, cols):
            ch = _chunk64(x[i, :, sl]).div_(amax[i])
            top = max(top, float((w[i] @ ch).abs().max()))
        if not top * float(amax[i]) < big:
            raise ResultOverflowError(
                f"iso_flatten_ (gram): matrix {i}: the Iso-C result does not fit {x3.dtype} (largest "
                f"entry {top * float(amax[i]):.4g}, the input is finite); nothing was written",
                matrix=i,
            )

    # The exact fallback for flagged matrices, computed aside; it must fit too.
    fallback = None
    if flagged.numel():
        fallback = _svd_fallback(x3[flagged], amax[flagged])
        top = fallback.abs().flatten(1).amax(-1)
        ok = torch.isfinite(top) & (top < big)
        if not bool(ok.all()):
            k = int((~ok).nonzero()[0, 0])
            i = int(flagged[k])
            raise ResultOverflowError(
                f"iso_flatten_ (gram): matrix {i}: the Iso-C result (recomputed by SVD) does not fit "
                f"{x3.dtype} (largest entry {float(top[k]):.4g}, the input is finite); nothing was "
                f"written",
                matrix=i,
            )
        fallback = fallback.to(x3.dtype)

    # The write: out = s̄·Y·X̃ = t·Y·(X / amax)·amax, chunk by chunk, straight into the bucket.
    amax_b = torch.where(amax > 0, amax, 1)[:, None, None]
    for sl in _chunks(n, cols):
        for i in range(0, nb, sub_b):
            j = min(nb, i + sub_b)
            ch = _chunk64(x[i:j, :, sl]).div_(amax_b[i:j])
            out = torch.bmm(w[i:j], ch).mul_(amax_b[i:j])
            x[i:j, :, sl].copy_(out)
            del ch, out
    if fallback is not None:
        x3[flagged] = fallback

    idx = tuple(int(i) for i in flagged.tolist())
    _STATS = _STATS.after(nb, idx, float(resid.max()))
    if idx:
        shown = f"{list(idx[:8])}{'…' if len(idx) > 8 else ''}"
        warnings.warn(
            f"isoloco gram flatten: {len(idx)} of {nb} matrices of shape {tuple(x3.shape[1:])} "
            f"missed the accuracy check (condition number beyond ~1e7 or rank-deficient) and were "
            f"recomputed by SVD: matrices {shown}",
            GramFallbackWarning,
            stacklevel=3,
        )


def gram_from_a0(a0: torch.Tensor, *, coeffs=COEFFS, update: str = "pap"):
    """(Y, s̄, resid, ok) from the short-side Gram matrices alone: a0 [b, d, d] float64, A₀ = X Xᵀ of a
    wide d×n X (or XᵀX of a tall n×d one), e.g. summed over the row shards of a sharded matrix.

    The same scaling, schedule and residual check as `flatten_gram_`; a0 is not modified. Y [b, d, d]
    (float64) gives Q = Y·X (wide) or Q = X·Yᵀ (tall), and the Iso-C result is s̄·Q with s̄ [b] the
    mean singular value. The rank bound comes from A₀'s nonzero diagonal (X's nonzero short-side
    lines); a matrix with fewer nonzero long-side lines than that fails the check. resid [b] and
    ok = resid ≤ CHECK_TOL: a matrix that fails it needs an exact method. Deterministic: the same
    A₀ gives the same Y and decision (so ranks holding one all-reduced A₀ agree). Non-finite a0
    raises ValueError."""
    if a0.ndim != 3 or a0.shape[-1] != a0.shape[-2] or a0.dtype != torch.float64:
        raise ValueError(f"gram_from_a0: expected float64 [B, d, d], got {a0.dtype} {tuple(a0.shape)}")
    if not bool(torch.isfinite(a0).all()):
        raise ValueError("gram_from_a0: the Gram matrix has NaN/Inf entries")
    rank = (a0.diagonal(dim1=-2, dim2=-1) != 0).sum(-1).to(torch.float64)
    y, tq, resid, s = _iterate(a0.clone(), rank, coeffs, update)
    sc = torch.where(s > 0, s, 1)
    return y / sc[:, None, None], tq * s, resid, resid <= CHECK_TOL
