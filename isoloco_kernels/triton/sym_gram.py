"""Triton symmetric products computed one triangle at a time: C = α·X·Xᵀ + β·B + γ·I.

For a batch X [nb, r, k] (B [nb, r, r] symmetric, or none), program (i, j, b) with j ≤ i computes the
BLOCK×BLOCK tile C[i, j] (a K loop of tl.dot, float32 accumulation) and stores it twice: as itself
where row ≥ column and transposed where row < column, so C is exactly symmetric and the tiles above
the diagonal cost nothing but their launch (an early return): about half the FLOPs of a full GEMM
for r ≫ BLOCK. The polar iteration's symmetric products are all of this form:

    A = X·Xᵀ                 α = 1
    A² = A·Aᵀ                (A symmetric)
    p(A) = c·A² + b·A        α = c, B = A, β = b (γ = a gives a·I + b·A + c·A², one kernel)

Operands float32 (tl.dot at `precision`: "ieee", "tf32" or "tf32x3" on GPUs; the interpreter
computes in float32), bfloat16 or float16 (tensor cores); the result is float32. Works under
TRITON_INTERPRET=1 on CPU tensors. No package-relative imports (a test may load a second copy with
the interpreter on).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64
BLOCK_K = 32
PRECISIONS = ("ieee", "tf32", "tf32x3")


@triton.jit
def _sym_kernel(
    x_ptr,
    b_ptr,
    c_ptr,
    r,
    k,
    sxb,
    sxr,
    sxk,
    sbb,
    sbr,
    sbc,
    scb,
    scr,
    scc,
    alpha,
    beta,
    gamma,
    HAS_B: tl.constexpr,
    IS_F32: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_i = tl.program_id(0)
    pid_j = tl.program_id(1)
    if pid_j > pid_i:  # above the diagonal: the tile (j, i) writes it
        return
    bat = tl.program_id(2).to(tl.int64)
    ri = pid_i * BLOCK + tl.arange(0, BLOCK)
    rj = pid_j * BLOCK + tl.arange(0, BLOCK)
    offk = tl.arange(0, BLOCK_K)
    xb = x_ptr + bat * sxb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + offk
        a = tl.load(xb + ri[:, None] * sxr + kk[None, :] * sxk, mask=(ri[:, None] < r) & (kk[None, :] < k), other=0.0)
        bt = tl.load(xb + rj[None, :] * sxr + kk[:, None] * sxk, mask=(rj[None, :] < r) & (kk[:, None] < k), other=0.0)
        if IS_F32:
            acc += tl.dot(a, bt, input_precision=PRECISION)
        elif UPCAST:  # the interpreter's dot takes no bfloat16: the same products, exact in float32
            acc += tl.dot(a.to(tl.float32), bt.to(tl.float32), input_precision="ieee")
        else:  # bfloat16 / float16 operands: tensor cores, float32 accumulation
            acc += tl.dot(a, bt)
    val = acc * alpha
    if HAS_B:
        bm = tl.load(
            b_ptr + bat * sbb + ri[:, None] * sbr + rj[None, :] * sbc,
            mask=(ri[:, None] < r) & (rj[None, :] < r),
            other=0.0,
        )
        val += beta * bm.to(tl.float32)
    val = tl.where(ri[:, None] == rj[None, :], val + gamma, val)
    inside = (ri[:, None] < r) & (rj[None, :] < r)
    cb = c_ptr + bat * scb
    tl.store(cb + ri[:, None] * scr + rj[None, :] * scc, val, mask=inside & (ri[:, None] >= rj[None, :]))
    # the mirror: C[rj, ri] = val[ri, rj] where rj < ri (the diagonal tile's upper part from its lower)
    tl.store(cb + rj[None, :] * scr + ri[:, None] * scc, val, mask=inside & (rj[None, :] < ri[:, None]))


def sym_gram(
    x: torch.Tensor,
    *,
    alpha: float = 1.0,
    b: torch.Tensor | None = None,
    beta: float = 0.0,
    gamma: float = 0.0,
    precision: str = "ieee",
) -> torch.Tensor:
    """α·X·Xᵀ + β·B + γ·I (float32, exactly symmetric) for X [nb, r, k] (any strides; float32,
    bfloat16 or float16) and B [nb, r, r] symmetric or None (module docstring)."""
    if x.ndim != 3:
        raise ValueError(f"sym_gram: expected X [nb, r, k], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"sym_gram: X must be float32, bfloat16 or float16, got {x.dtype}")
    if precision not in PRECISIONS:
        raise ValueError(f"sym_gram: precision must be one of {PRECISIONS}, got {precision!r}")
    nb, r, k = x.shape
    if b is not None and (b.shape != (nb, r, r) or b.device != x.device):
        raise ValueError(f"sym_gram: B must be [{nb}, {r}, {r}] on {x.device}, got {tuple(b.shape)} on {b.device}")
    out = torch.empty(nb, r, r, dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        out.zero_()
        if b is not None:
            out.add_(b.to(torch.float32), alpha=beta)
        out.diagonal(dim1=-2, dim2=-1).add_(gamma)
        return out
    bb = b if b is not None else out  # unread when HAS_B is off
    tiles = triton.cdiv(r, BLOCK)
    for b0 in range(0, nb, 65535):
        b1 = min(nb, b0 + 65535)
        ctx = torch.cuda.device(x.device) if x.is_cuda else _null()
        with ctx:
            _sym_kernel[(tiles, tiles, b1 - b0)](
                x[b0:b1],
                bb[b0:b1],
                out[b0:b1],
                r,
                k,
                *x.stride(),
                *bb.stride(),
                *out.stride(),
                float(alpha),
                float(beta),
                float(gamma),
                HAS_B=b is not None,
                IS_F32=x.dtype == torch.float32,
                UPCAST=not x.is_cuda,
                BLOCK=BLOCK,
                BLOCK_K=BLOCK_K,
                PRECISION=precision,
            )
    return out


def _null():
    import contextlib

    return contextlib.nullcontext()


class SymSteps:
    """The polar iteration's step pieces (polar.TorchSteps' interface) with every symmetric product
    from `sym_gram` (half the FLOPs of a GEMM) and the product with X from torch.baddbmm. Results in
    the operands' dtype, as TorchSteps gives them; float64 operands (which sym_gram does not take)
    go to full torch GEMMs."""

    precision = "ieee"

    @classmethod
    def gram(cls, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float64:
            return torch.matmul(x, x.mT)
        return sym_gram(x, precision=cls.precision).to(x.dtype)

    @classmethod
    def square(cls, a: torch.Tensor) -> torch.Tensor:
        return cls.gram(a)  # A symmetric: A² = A·Aᵀ

    @classmethod
    def step(cls, x, a_mat, a2, a: float, b: float, c: float) -> torch.Tensor:
        """a·X + (b·A + c·A²)·X; the polynomial in one sym_gram call unless A² is given."""
        if a2 is None and a_mat.dtype == torch.float64:
            a2 = torch.matmul(a_mat, a_mat)
        if a2 is None:
            bm = sym_gram(a_mat, alpha=c, b=a_mat, beta=b, precision=cls.precision).to(x.dtype)
        else:
            bm = b * a_mat + c * a2
        return torch.baddbmm(x, bm, x, beta=a)
