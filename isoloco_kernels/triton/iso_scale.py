"""The Iso-C epilogue in Triton: s̄ = ⟨Δ, Q⟩ / min(m, n) per matrix, then Δ ← s̄·Q, in place.

Q = U_r V_rᵀ is the polar factor of Δ, so ⟨Δ, Q⟩ = Σσ (the nuclear norm) and s̄·Q is the Iso-C
merge iso(Δ) (Marczak et al., 2025; the identity is what makes a matmul-only flatten possible).

    _iso_dot_kernel:   program (b, s) sums Δ·Q over the chunks s, s + S, s + 2S, … of matrix b
                       into partial[b, s] (fixed order: deterministic, no atomics).
    _iso_write_kernel: program (b, s) adds matrix b's S partials (S ≤ 1024, one vector load),
                       divides by r0 = min(m, n) in the accumulator dtype, writes s̄·Q over the same chunks; program 0 stores s̄.

S grows up to 1024 for batches of few matrices (`splits_for`), so one huge matrix still spreads
over the whole GPU.

Δ is read in full by the first kernel before the second writes it, so the op never mixes old and
new values. Accumulation in float64 for float64 Δ (ACC_F64), else float32, as iso_scale_ specifies.
Any strides: the flat index inside a matrix is split into (row, column), in 64 bits, so one
matrix may exceed 2^31 elements; row-major pairs (FLAT) use the flat index itself. Loop bounds and
offsets are 64-bit (a 32-bit chunk counter would wrap just below 2^31 elements). The batch runs on grid axis 0 (2^31 − 1 blocks, not 65535).
r0 is passed as an integer: a Python float argument would be typed fp32 and put ~1e-8 relative
error into a float64 s̄.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device


@triton.jit
def _offsets(idx, N, sb, sm, sn, bid, FLAT: tl.constexpr):
    """Element offsets of flat in-matrix indices idx (int64) of matrix bid: idx itself when the
    matrix is row-major contiguous (FLAT), else row·sm + col·sn."""
    if FLAT:
        return bid * sb + idx
    else:
        return bid * sb + (idx // N) * sm + (idx % N) * sn


@triton.jit
def _iso_dot_kernel(
    x_ptr,
    q_ptr,
    part_ptr,
    N,
    NUMEL,
    S,
    sxb,
    sxm,
    sxn,
    sqb,
    sqm,
    sqn,
    BLOCK: tl.constexpr,
    ACC_F64: tl.constexpr,
    FLAT: tl.constexpr,
):
    bid = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    acc_t = tl.float64 if ACC_F64 else tl.float32
    acc = tl.zeros((BLOCK,), dtype=acc_t)
    # 64-bit loop bounds: a 32-bit counter would wrap for NUMEL within S·BLOCK of 2^31. tl.cast,
    # not .to: Triton passes an integer argument equal to 1 as a constexpr (a Python int).
    for start in range(tl.cast(pid, tl.int64) * BLOCK, tl.cast(NUMEL, tl.int64), tl.cast(S, tl.int64) * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < NUMEL
        xv = tl.load(x_ptr + _offsets(idx, N, sxb, sxm, sxn, bid, FLAT), mask=ok, other=0.0)
        qv = tl.load(q_ptr + _offsets(idx, N, sqb, sqm, sqn, bid, FLAT), mask=ok, other=0.0)
        acc += xv.to(acc_t) * qv.to(acc_t)
    tl.store(part_ptr + bid * S + pid, tl.sum(acc, axis=0))


@triton.jit
def _iso_write_kernel(
    x_ptr,
    q_ptr,
    part_ptr,
    sbar_ptr,
    N,
    NUMEL,
    S,
    R0,
    sxb,
    sxm,
    sxn,
    sqb,
    sqm,
    sqn,
    BLOCK: tl.constexpr,
    S_POW2: tl.constexpr,
    FLAT: tl.constexpr,
):
    bid = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    rs = tl.arange(0, S_POW2)
    parts = tl.load(part_ptr + bid * S + rs, mask=rs < S, other=0.0)
    total = tl.sum(parts, axis=0)
    sbar = total / tl.cast(R0, total.dtype)  # in the accumulator dtype (float64 for float64 x)
    if pid == 0:
        tl.store(sbar_ptr + bid, sbar)
    for start in range(tl.cast(pid, tl.int64) * BLOCK, tl.cast(NUMEL, tl.int64), tl.cast(S, tl.int64) * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < NUMEL
        qv = tl.load(q_ptr + _offsets(idx, N, sqb, sqm, sqn, bid, FLAT), mask=ok, other=0.0)
        out = (sbar * qv.to(sbar.dtype)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + _offsets(idx, N, sxb, sxm, sxn, bid, FLAT), out, mask=ok)


#: Programs per matrix: at most MAX_SPLITS (one vector load of the partials), and enough that a
#: batch of one or two huge matrices (embedding, head) still fills a GPU: about TARGET_PROGRAMS in
#: all, never fewer than 256 per matrix.
MAX_SPLITS = 1024
TARGET_PROGRAMS = 4096


def splits_for(nb: int, numel: int, block: int, max_splits: int = MAX_SPLITS) -> int:
    """Programs per matrix for a batch of nb matrices of numel elements (one per BLOCK at most)."""
    want = max(256, triton.cdiv(TARGET_PROGRAMS, max(nb, 1)))
    return max(1, min(max_splits, MAX_SPLITS, want, triton.cdiv(numel, block)))


def _row_major(t: torch.Tensor) -> bool:
    m, n = t.shape[-2:]
    return (n == 1 or t.stride(-1) == 1) and (m == 1 or t.stride(-2) == n)


def iso_scale_triton(
    x: torch.Tensor, q: torch.Tensor, *, block: int = 1024, max_splits: int = MAX_SPLITS
) -> torch.Tensor:
    """x ← s̄·q in place for [m, n] / [B, m, n] x and q of the same shape; returns s̄ [B] (or [])
    in float32 (float64 for float64 x). Arguments are checked by the op (ops.py)."""
    m, n = x.shape[-2:]
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    q3 = q if q.ndim == 3 else q.unsqueeze(0)
    nb = x3.shape[0]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    sbar = torch.empty(nb, device=x.device, dtype=acc)
    numel = m * n
    if nb == 0 or numel == 0:
        sbar.zero_()
        return sbar.reshape(x.shape[:-2])
    splits = splits_for(nb, numel, block, max_splits)
    part = torch.empty(nb, splits, device=x.device, dtype=acc)
    grid = (nb, splits)  # the batch on axis 0: no 65535 cap
    # Row-major matrices (the polar path's): flat offsets, no 64-bit div/mod per element.
    flat = _row_major(x3) and _row_major(q3)
    with on_device(x3):
        _iso_dot_kernel[grid](
            x3,
            q3,
            part,
            n,
            numel,
            splits,
            *x3.stride(),
            *q3.stride(),
            BLOCK=block,
            ACC_F64=acc == torch.float64,
            FLAT=flat,
        )
        _iso_write_kernel[grid](
            x3,
            q3,
            part,
            sbar,
            n,
            numel,
            splits,
            min(m, n),
            *x3.stride(),
            *q3.stride(),
            BLOCK=block,
            S_POW2=triton.next_power_of_2(splits),
            FLAT=flat,
        )
    return sbar.reshape(x.shape[:-2])
