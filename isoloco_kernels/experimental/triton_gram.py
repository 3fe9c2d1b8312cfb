"""Batched symmetric Gram matrix A = X Xᵀ, [B, m, k] → [B, m, m], one triangle of tiles only.

A is symmetric, so only the tiles (i, j) with j ≤ i are computed (T(T+1)/2 of T² tiles for
T = ⌈m / BLOCK⌉, about half the work); each off-diagonal tile is also stored transposed at (j, i).
This is the idea of flash-muon's symmetric matmul for the Newton–Schulz/Muon iteration, used here
for the polar iteration X ← a·X + (b·A + c·A²)·X, A = X Xᵀ (Polar Express, arXiv:2505.16932).
Accumulation is float32; fp32 operands use IEEE products unless TF32 is asked for.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton import batch_chunks, needs_int64, on_device


@triton.jit
def _lower_tile(pid):
    """Tile pid of the lower triangle, enumerated row by row: (0,0), (1,0), (1,1), (2,0), …"""
    i = ((tl.sqrt(8.0 * pid + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)  # float rounding either way
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _gram_kernel(
    x_ptr, a_ptr, M, K,
    sxb, sxm, sxk, sab, sam, san,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, INT64: tl.constexpr = False,
):
    """a[b, I, J] = Σ_k x[b, I, k]·x[b, J, k] for tile (I, J) below the diagonal, mirrored.
    INT64: in-matrix offsets in 64 bits (one matrix reaching 2^31 elements)."""
    ti, tj = _lower_tile(tl.program_id(0))
    bid = tl.program_id(1).to(tl.int64)
    rm = ti * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tj * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    if INT64:
        rm, rn, rk = rm.to(tl.int64), rn.to(tl.int64), rk.to(tl.int64)
    x = x_ptr + bid * sxb
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        xi = tl.load(x + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        xj = tl.load(x + rn[:, None] * sxm + kk[None, :] * sxk, mask=(rn[:, None] < M) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(xi, tl.trans(xj), acc, input_precision=PRECISION)
    out = acc.to(a_ptr.dtype.element_ty)
    a = a_ptr + bid * sab
    mask = (rm[:, None] < M) & (rn[None, :] < M)
    tl.store(a + rm[:, None] * sam + rn[None, :] * san, out, mask=mask)
    if ti != tj:
        tl.store(a + rn[None, :] * sam + rm[:, None] * san, out, mask=mask)


def num_lower_tiles(m: int, block: int) -> int:
    t = triton.cdiv(m, block)
    return t * (t + 1) // 2


def gram(x: torch.Tensor, *, block_m: int = 64, block_k: int = 32, tf32: bool = False) -> torch.Tensor:
    """X Xᵀ of a [B, m, k] float32/float16/bfloat16 tensor (any strides), in x's dtype."""
    if x.ndim != 3 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"gram: need a [B, m, k] float32/float16/bfloat16 tensor, got {tuple(x.shape)} {x.dtype}")
    nb, m, k = x.shape
    a = torch.empty(nb, m, m, device=x.device, dtype=x.dtype)
    if a.numel() == 0:
        return a
    big = needs_int64(x, a)
    with on_device(x):
        for b0, b1 in batch_chunks(nb):  # the batch rides grid axis 1 (at most 65535)
            xs, as_ = x[b0:b1], a[b0:b1]
            _gram_kernel[(num_lower_tiles(m, block_m), b1 - b0)](
                xs, as_, m, k, *xs.stride(), *as_.stride(),
                BLOCK_M=block_m, BLOCK_K=block_k, PRECISION="tf32" if tf32 else "ieee", INT64=big,
            )
    return a
