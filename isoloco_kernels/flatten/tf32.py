"""3xTF32 GEMMs: float32 products on TF32 tensor cores at about float32 accuracy.

Each float32 operand is split into a TF32 head and a tail, x = hi + lo with hi = x rounded to
TF32 (10 explicit mantissa bits) and lo = x − hi (exact in float32); then

    x·y ≈ hi_x·hi_y + hi_x·lo_y + lo_x·hi_y

three TF32 GEMMs with float32 accumulation (the lo·lo term, ~2^-22 relative, is dropped). The
relative error of a product is ~2^-21 against float32's ~2^-24: close enough that the polar
iteration's float32 contract holds (tests/test_tf32.py), at up to 353 / 3 ≈ 118 TFLOP/s on an H200
against 50.8 for float32 without tensor cores (bench/results/2026-12-04-NVIDIA-H200.md).

On CUDA the three GEMMs run with TF32 switched on for their duration (`tf32_matmul`). On the CPU,
where torch has no TF32, the same numerics are emulated: every GEMM operand is rounded to TF32
first (`round_tf32`), so CPU tests see what the tensor cores compute (accumulation order aside).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["round_tf32", "mm_tf32x3", "mm_tf32", "tf32_matmul", "cuda_fp32_matmul", "Tf32x3Steps"]

_DROP = 13  # float32 has 23 explicit mantissa bits, TF32 10


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """x (float32) rounded to the nearest TF32 value (ties away from zero), kept as float32.

    Works on the bit pattern: add half of the dropped part's range, clear the 13 low mantissa
    bits. Finite values that would round past float32's largest TF32 value, and Inf/NaN, are
    left as they are (the callers check finiteness before)."""
    if x.dtype != torch.float32:
        raise TypeError(f"round_tf32: expected float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    rounded = (bits + (1 << (_DROP - 1))) & ~((1 << _DROP) - 1)
    exp_all_ones = (bits & 0x7F800000) == 0x7F800000
    overflow = (rounded & 0x7F800000) == 0x7F800000
    out = torch.where(exp_all_ones | overflow, bits, rounded)
    return out.view(torch.float32).view(x.shape)


def _fp32_precision_props():
    """The new-API (torch >= 2.9) per-backend matmul precision settings a legacy call also moves:
    cuBLAS's and oneDNN's; None on older torch."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        return None
    props = [matmul]
    mkldnn = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if mkldnn is not None and hasattr(mkldnn, "fp32_precision"):
        props.append(mkldnn)
    return props


@contextlib.contextmanager
def cuda_fp32_matmul(legacy_mode: str, cuda_mode: str):
    """CUDA float32 GEMMs in one precision inside, every setting restored after, whichever API
    the user set it with: the legacy `set_float32_matmul_precision(legacy_mode)` when the legacy
    state is readable, and on torch >= 2.9 `torch.backends.cuda.matmul.fp32_precision = cuda_mode`
    (the global `torch.backends.fp32_precision` makes the legacy getter raise: then only the new
    API describes the state). Process-global, as torch's setting is."""
    props = _fp32_precision_props()
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # new and legacy API disagree: only the new one describes the state
        legacy = None
    saved = [p.fp32_precision for p in props] if props is not None else None
    try:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy_mode)
        if props is not None:
            torch.backends.cuda.matmul.fp32_precision = cuda_mode
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        if saved is not None:  # after the legacy restore, which rewrites these
            for p, v in zip(props, saved):
                p.fp32_precision = v


@contextlib.contextmanager
def tf32_matmul(on: bool = True):
    """TF32 float32 GEMMs on CUDA inside (cuBLAS), every setting restored after; a no-op when
    `on` is false."""
    if not on:
        yield
        return
    with cuda_fp32_matmul("high", "tf32"):
        yield


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = round_tf32(x)
    return hi, x - hi


def _tf32_operand(x: torch.Tensor) -> torch.Tensor:
    """What a TF32 GEMM reads of x: on CUDA x itself (the tensor cores round it), on the CPU
    x rounded to TF32 (the emulation)."""
    return x if x.is_cuda else round_tf32(x)


def mm_tf32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with both operands read as TF32 (one GEMM): ~1e-3 relative error. For tests and the
    accuracy study; no flatten method runs its GEMMs this way."""
    with tf32_matmul(a.is_cuda):
        return torch.matmul(_tf32_operand(a), _tf32_operand(b))


def mm_tf32x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b (float32, batched as torch.matmul) through three TF32 GEMMs (module docstring)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"mm_tf32x3: expected float32 operands, got {a.dtype} and {b.dtype}")
    a_hi, a_lo = _split(a)
    b_hi, b_lo = _split(b)
    with tf32_matmul(a.is_cuda):
        out = torch.matmul(a_hi, b_hi)
        out += torch.matmul(a_hi, _tf32_operand(b_lo))
        out += torch.matmul(_tf32_operand(a_lo), b_hi)
    return out


def _symmetric(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """hi·hiᵀ + M + Mᵀ, M = hi·loᵀ: the 3xTF32 product of x = hi + lo with its transpose (for a
    symmetric A, A·A = A·Aᵀ), in two TF32 GEMMs instead of three."""
    with tf32_matmul(hi.is_cuda):
        out = torch.matmul(hi, hi.mT)
        m = torch.matmul(hi, _tf32_operand(lo).mT)
    return out.add_(m).add_(m.mT)


class Tf32x3Steps:
    """The polar iteration's step pieces (polar.TorchSteps' interface) on 3xTF32 GEMMs."""

    @staticmethod
    def gram(x: torch.Tensor) -> torch.Tensor:
        """X·Xᵀ: x split once, and hi·loᵀ + lo·hiᵀ = M + Mᵀ with M = hi·loᵀ (two GEMMs, not three)."""
        return _symmetric(*_split(x))

    @staticmethod
    def square(a: torch.Tensor) -> torch.Tensor:
        """A² of a symmetric A (the iteration's A = X·Xᵀ): two GEMMs as in `gram`."""
        return _symmetric(*_split(a))

    @staticmethod
    def step(x, a_mat, a2, a: float, b: float, c: float) -> torch.Tensor:
        """a·X + (b·A + c·A²)·X; A² is formed here unless given."""
        if a2 is None:  # A is symmetric: A² = A·Aᵀ in two GEMMs
            a2 = _symmetric(*_split(a_mat))
        bm = b * a_mat + c * a2
        return mm_tf32x3(bm, x).add_(x, alpha=a)
