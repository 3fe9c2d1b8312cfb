"""The pieces of one polar step X ← a·X + (b·A + c·A²)·X, A = X Xᵀ, fused around the GEMMs.

    _poly_kernel: B = b·A + c·A·A for a symmetric A [B, m, m]. A·A is symmetric too, so only the
                  lower triangle of tiles is computed and mirrored (as in triton_gram.py); the b·A term is
                  added in the epilogue (HAS_LINEAR=False compiles it out, giving A² alone).
    _step_kernel: X' = a·X + B·X [B, m, n]: the axpy is fused into the GEMM's epilogue, so X' costs
                  one pass and no temporary for B·X.

Coefficients (a, b, c) per step come from polar.COEFFS (Polar Express, N. Amsel, D. Persson,
C. Musco, R. M. Gower, arXiv:2505.16932). Accumulation is float32. `gram`, `square` and `step`
have the interface of polar.TorchSteps, so polar.polar_factor can use either.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton import batch_chunks, needs_int64, on_device
from .triton_gram import _lower_tile, gram as _gram, num_lower_tiles

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _poly_kernel(
    a_ptr, out_ptr, M, coef_b, coef_c,
    sab, sam, san, sob, som, son,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_LINEAR: tl.constexpr, PRECISION: tl.constexpr,
    INT64: tl.constexpr = False,
):
    """out[b, I, J] = coef_b·A[I, J] + coef_c·Σ_k A[I, k]·A[k, J] on lower tiles, mirrored."""
    ti, tj = _lower_tile(tl.program_id(0))
    bid = tl.program_id(1).to(tl.int64)
    rm = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tj * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    if INT64:  # one matrix reaching 2^31 elements: 64-bit in-matrix offsets
        rm, rn, rk = rm.to(tl.int64), rn.to(tl.int64), rk.to(tl.int64)
    a = a_ptr + bid * sab
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + rk
        ai = tl.load(a + rm[:, None] * sam + kk[None, :] * san, mask=(rm[:, None] < M) & (kk[None, :] < M), other=0.0)
        aj = tl.load(a + kk[:, None] * sam + rn[None, :] * san, mask=(kk[:, None] < M) & (rn[None, :] < M), other=0.0)
        acc = tl.dot(ai, aj, acc, input_precision=PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < M)
    acc = acc * coef_c
    if HAS_LINEAR:
        lin = tl.load(a + rm[:, None] * sam + rn[None, :] * san, mask=mask, other=0.0)
        acc += coef_b * lin.to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    o = out_ptr + bid * sob
    tl.store(o + rm[:, None] * som + rn[None, :] * son, out, mask=mask)
    if ti != tj:
        tl.store(o + rn[None, :] * som + rm[:, None] * son, out, mask=mask)


@triton.jit
def _step_kernel(
    x_ptr, b_ptr, out_ptr, M, N, coef_a,
    sxb, sxm, sxn, sbb, sbm, sbn, sob, som, son,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    INT64: tl.constexpr = False,
):
    """out[b, I, J] = coef_a·X[I, J] + Σ_k B[I, k]·X[k, J]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bid = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if INT64:  # one matrix reaching 2^31 elements: 64-bit in-matrix offsets
        rm, rn, rk = rm.to(tl.int64), rn.to(tl.int64), rk.to(tl.int64)
    x = x_ptr + bid * sxb
    bm = b_ptr + bid * sbb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, M, BLOCK_K):
        kk = k0 + rk
        bt = tl.load(bm + rm[:, None] * sbm + kk[None, :] * sbn, mask=(rm[:, None] < M) & (kk[None, :] < M), other=0.0)
        xt = tl.load(x + kk[:, None] * sxm + rn[None, :] * sxn, mask=(kk[:, None] < M) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(bt, xt, acc, input_precision=PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    xo = tl.load(x + rm[:, None] * sxm + rn[None, :] * sxn, mask=mask, other=0.0)
    acc += coef_a * xo.to(tl.float32)
    tl.store(out_ptr + bid * sob + rm[:, None] * som + rn[None, :] * son, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(t: torch.Tensor, what: str, square: bool = False) -> None:
    if t.ndim != 3 or t.dtype not in _DTYPES or (square and t.shape[-1] != t.shape[-2]):
        raise ValueError(f"{what}: need a [B, m, {'m' if square else 'n'}] float32/float16/bfloat16 tensor, got {tuple(t.shape)} {t.dtype}")


def poly(a: torch.Tensor, coef_b: float, coef_c: float, *, block_m: int = 64, block_k: int = 32, tf32: bool = False) -> torch.Tensor:
    """coef_b·A + coef_c·A·A for a batch of symmetric [B, m, m] matrices (A·A computed once per
    lower tile and mirrored; coef_b == 0 compiles the linear term out)."""
    _check(a, "poly: a", square=True)
    nb, m, _ = a.shape
    out = torch.empty(a.shape, device=a.device, dtype=a.dtype)
    if out.numel() == 0:
        return out
    big = needs_int64(a, out)
    with on_device(a):
        for b0, b1 in batch_chunks(nb):  # the batch rides grid axis 1 (at most 65535)
            ai, oi = a[b0:b1], out[b0:b1]
            _poly_kernel[(num_lower_tiles(m, block_m), b1 - b0)](
                ai, oi, m, float(coef_b), float(coef_c), *ai.stride(), *oi.stride(),
                BLOCK_M=block_m, BLOCK_K=block_k, HAS_LINEAR=coef_b != 0, PRECISION="tf32" if tf32 else "ieee",
                INT64=big,
            )
    return out


def axpy_matmul(x: torch.Tensor, b: torch.Tensor, coef_a: float, *, block_m: int = 64, block_n: int = 64,
                block_k: int = 32, tf32: bool = False) -> torch.Tensor:
    """coef_a·X + B·X for X [B, m, n], B [B, m, m], in one GEMM with the axpy in its epilogue."""
    _check(x, "axpy_matmul: x")
    _check(b, "axpy_matmul: b", square=True)
    nb, m, n = x.shape
    if b.shape != (nb, m, m):
        raise ValueError(f"axpy_matmul: b must be [{nb}, {m}, {m}], got {tuple(b.shape)}")
    out = torch.empty(nb, m, n, device=x.device, dtype=x.dtype)
    if out.numel() == 0:
        return out
    big = needs_int64(x, b, out)
    with on_device(x):
        for b0, b1 in batch_chunks(nb):  # the batch rides grid axis 2 (at most 65535)
            xi, bi, oi = x[b0:b1], b[b0:b1], out[b0:b1]
            grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), b1 - b0)
            _step_kernel[grid](
                xi, bi, oi, m, n, float(coef_a), *xi.stride(), *bi.stride(), *oi.stride(),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32" if tf32 else "ieee",
                INT64=big,
            )
    return out


# The interface polar.polar_factor calls (float64 goes through torch: tl.dot is for ≤ 32 bits).


def gram(x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, x.mT) if x.dtype == torch.float64 else _gram(x)


def square(a: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, a) if a.dtype == torch.float64 else poly(a, 0.0, 1.0)


def step(x: torch.Tensor, a_mat: torch.Tensor, a2, a: float, b: float, c: float) -> torch.Tensor:
    """a·X + (b·A + c·A²)·X; A² is formed here (fused with b·A) unless given."""
    if x.dtype == torch.float64:
        bm = b * a_mat + c * (a2 if a2 is not None else a_mat @ a_mat)
        return torch.baddbmm(x, bm, x, beta=a)
    bm = poly(a_mat, b, c) if a2 is None else (b * a_mat.float() + c * a2.float()).to(a_mat.dtype)
    return axpy_matmul(x, bm, a)
