"""Error feedback and the two entry points the routes call: `compress` (Δ + residual → payload, new
residual) and `decompress_add_` (payload → added into an accumulator), each served by the Triton
kernels for CUDA tensors and by the torch path (codec.py, stat.py) everywhere else (`backend_for`).
Every format, the statistical ones included, goes through the same two calls.

    v = Δ + e            in the compute dtype (float32; float64 for float64 Δ)
    c = Q(v)             the dequantized payload (codec.py)
    e ← β·(v − c)        rounded once to the residual's dtype (spec.residual_dtype, or Δ's dtype)

With β = None there is no residual (e = 0, nothing kept). The residual is per worker and as large
as the parameter: numel × 4 bytes in float32, × 2 in bfloat16 / float16 (spec.residual_bytes).

Tracking (`track`, spec.feedback "ef21"): the worker keeps an estimate g of its Δ instead of a residual, in
the same dtype and memory, and sends the correction to it:

    v = Δ − β·g          in the compute dtype
    c = Q(v)             compressed without feedback
    g ← β·g + c          in the compute dtype, kept there (the owner's estimate of the mean is too)

All or nothing: the inputs are never written; the new residual is a new tensor the caller swaps
in. NaN or Inf in Δ or the residual (or a float32 overflow of their sum) raises ValueError naming
the tensor before the caller sees anything.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import triton as _tk
from .._validate import ResultOverflowError, compute_dtype
from .codec import Packed, _blocks, _check_packed, check_call, encode_blocks, pack_codes, stream_keys, unpack_add_
from .spec import Compression, format_of

__all__ = ["compress", "decompress_add_", "track", "backend_for", "residual_dtype_for"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def backend_for(x: torch.Tensor) -> tuple[str, str]:
    """("triton" | "torch", why) for compressing / decompressing tensors like x: the Triton kernels
    serve CUDA float16/bfloat16/float32 tensors when triton imports; the torch path everything else."""
    if not x.is_cuda:
        return "torch", "the torch path serves CPU tensors"
    if x.dtype == torch.float64:
        return "torch", "the Triton kernels compute in float32; float64 takes the torch path"
    if not _tk.AVAILABLE:
        return "torch", "triton is not importable"
    if _tk.interpreted():
        return "torch", "the Triton kernels were built for the interpreter (TRITON_INTERPRET=1)"
    return "triton", ""


def residual_dtype_for(spec: Compression, param_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The residual's dtype for a parameter of `param_dtype` (None when error feedback is off); under feedback
    "ef21" the estimate's, the compute dtype."""
    if spec.ef_beta is None:
        return None
    if spec.feedback == "ef21":
        return compute_dtype(param_dtype)
    return spec.residual_dtype or param_dtype


def _describe(delta, residual, v, name: str) -> str:
    for what, t in (("Δ", delta), ("the error-feedback residual", residual)):
        if t is not None and t.numel():
            bad = ~torch.isfinite(t.detach())
            if bool(bad.any()):
                kinds = "/".join(k for k, f in (("NaN", torch.isnan), ("Inf", torch.isinf)) if bool(f(t[bad]).any()))
                return f"compress: {name}: {what} contains {kinds} ({int(bad.sum())} of {t.numel()} entries)"
    return f"compress: {name}: Δ + residual overflows {v.dtype} (both finite)"


def _check_inputs(delta, residual, spec: Compression):
    if not isinstance(delta, torch.Tensor) or delta.dtype not in _FLOATS:
        got = delta.dtype if isinstance(delta, torch.Tensor) else type(delta).__name__
        raise TypeError(f"compress: Δ must be a float16, bfloat16, float32 or float64 tensor, got {got}")
    want = residual_dtype_for(spec, delta.dtype)
    if want is None:
        if residual is not None:
            raise ValueError("compress: got a residual but the spec's error feedback is off (ef_beta=None)")
        return
    if residual is None:
        return
    if not isinstance(residual, torch.Tensor) or residual.dtype != want:
        got = residual.dtype if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise TypeError(f"compress: the residual must be {want} (spec.residual_dtype or Δ's dtype), got {got}")
    if residual.shape != delta.shape or residual.device != delta.device:
        raise ValueError(
            f"compress: the residual ({tuple(residual.shape)} on {residual.device}) must match Δ "
            f"({tuple(delta.shape)} on {delta.device})"
        )


def compress(
    delta: torch.Tensor,
    residual: Optional[torch.Tensor],
    spec: Compression,
    *,
    step: int,
    tensor_id: int,
    first_block: int = 0,
    name: Optional[str] = None,
) -> tuple[Packed, Optional[torch.Tensor]]:
    """(payload, new residual) of one worker's Δ with error feedback: c = Q(Δ + e), e ← β·(Δ + e − c).

    residual: the previous residual (None = zeros: the first step); the new one has Δ's shape and
    the residual dtype, or is None when the spec's ef_beta is None. `step`, `tensor_id` (ints in
    [0, 2^32)) and `first_block` (Δ's first block in its whole tensor) seed stochastic rounding.
    Nothing given is modified. Raises ValueError naming the tensor (`name`, default "tensor
    <tensor_id>") on NaN/Inf, TypeError/ValueError on a residual of another dtype or shape.
    """
    check_call(spec, step, tensor_id, first_block)
    if spec.feedback == "ef21" and spec.ef_beta is not None:
        raise ValueError("compress: feedback 'ef21' keeps a tracked estimate, not a residual: call track(...)")
    _check_inputs(delta, residual, spec)
    name = name or f"tensor {tensor_id}"
    n = delta.numel()
    feedback = spec.ef_beta is not None
    rdt = residual_dtype_for(spec, delta.dtype)
    nbytes = (n * spec.bits + 7) // 8
    if n == 0:
        empty = Packed(
            torch.empty(0, dtype=torch.uint8, device=delta.device),
            torch.empty(0, device=delta.device),
            0,
            spec.format,
            spec.block,
        )
        return empty, (torch.empty(delta.shape, dtype=rdt, device=delta.device) if feedback else None)
    if backend_for(delta)[0] == "triton":
        return _compress_triton(delta, residual, spec, step, tensor_id, first_block, name, rdt)
    d = delta.detach()
    v = d.reshape(-1).to(compute_dtype(d.dtype))
    if residual is not None:
        v = v + residual.detach().reshape(-1).to(v.dtype)
    if not bool(torch.isfinite(v).all()):
        raise ValueError(_describe(delta, residual, v, name) + "; nothing was quantized or written")
    try:
        codes, scales, deq = encode_blocks(_blocks(v, spec.block), n, spec, step, tensor_id, first_block)
    except ValueError as e:
        raise ValueError(f"compress: {name}: {e}") from None
    packed = Packed(pack_codes(codes, spec.bits, nbytes), scales, n, spec.format, spec.block)
    if not feedback:
        return packed, None
    new = (spec.ef_beta * (v - deq[:n])).to(rdt)
    _check_residual(new, rdt, name)
    return packed, new.view(delta.shape)


def track(
    delta: torch.Tensor,
    estimate: Optional[torch.Tensor],
    spec: Compression,
    *,
    step: int,
    tensor_id: int,
    name: Optional[str] = None,
) -> tuple[Packed, torch.Tensor]:
    """(payload, new estimate) of one worker's Δ under tracking (module docstring; spec.feedback "ef21"):
    c = Q(Δ − β·g), g ← β·g + c. estimate: g (None = zeros: the first step), in the residual dtype
    (the compute dtype: float32, float64 for float64 Δ); the new one has Δ's shape and that dtype. Nothing given is modified. Raises
    ValueError naming the tensor on NaN/Inf in Δ or g, ResultOverflowError when the new g does not fit its dtype."""
    if not isinstance(spec, Compression) or spec.feedback != "ef21":
        raise ValueError(f"track: the spec's feedback must be 'ef21', got {getattr(spec, 'feedback', spec)!r}")
    _check_inputs(delta, estimate, spec)
    name = name or f"tensor {tensor_id}"
    cd, rdt = compute_dtype(delta.dtype), residual_dtype_for(spec, delta.dtype)
    v = delta.detach().reshape(-1).to(cd)
    prior = torch.zeros_like(v) if estimate is None else estimate.detach().reshape(-1).to(cd) * spec.ef_beta
    v = v - prior
    if not bool(torch.isfinite(v).all()):
        text = _describe(delta, estimate, v, name).replace("the error-feedback residual", "the tracked estimate")
        text = text.replace("compress:", "track:", 1)
        raise ValueError(text.replace("Δ + residual", "Δ − β·estimate") + "; nothing was quantized or written")
    plain = dataclasses.replace(spec, ef_beta=None, residual_dtype=None, feedback="workers")
    packed, _ = compress(v, None, plain, step=step, tensor_id=tensor_id, name=name)
    new = decompress_add_(prior, packed).to(rdt)
    if not bool(torch.isfinite(new).all()):
        raise ResultOverflowError(
            f"track: {name}: the tracked estimate β·g + c does not fit {rdt}; nothing was kept. Keep estimates in "
            "float32 (residual_dtype=None for float32 params) or send this tensor uncompressed"
        )
    return packed, new.view(delta.shape)


def _check_residual(new: Optional[torch.Tensor], rdt, name: str) -> None:
    """A residual kept for the next step must be finite: one that does not fit its dtype (a float16 residual of
    a large Δ, or Δ + e − c overflowing at the dtype's largest values) would be accepted now and refuse every
    later step. Raised here, before the caller keeps anything."""
    if new is not None and not bool(torch.isfinite(new).all()):
        raise ResultOverflowError(
            f"compress: {name}: the error-feedback residual β·(Δ + e − c) does not fit {rdt} (largest finite "
            f"entry of Δ + e is too large for it); nothing was kept. Keep residuals in float32 (residual_dtype=None "
            f"for float32 params) or send this tensor uncompressed"
        )


def _compress_triton(delta, residual, spec, step, tensor_id, first_block, name, rdt):
    from ..triton import quant

    fmt, n = spec.fmt, delta.numel()
    d = delta.detach().contiguous()
    r = None if residual is None else residual.detach().contiguous()
    codes = torch.empty((n * fmt.bits + 7) // 8, dtype=torch.uint8, device=d.device)
    scales = torch.empty(-(-n // spec.block) * spec.floats_per_block, dtype=torch.float32, device=d.device)
    new = torch.empty(d.shape, dtype=rdt, device=d.device) if rdt is not None else None
    if spec.is_stat:
        quant.stat_quantize_ef_pack(
            d, r, codes, scales, new, fmt=fmt, block=spec.block, sigmas=spec.sigmas, beta=spec.ef_beta
        )
    else:
        keys = stream_keys(spec.seed, step, tensor_id) if spec.rounding == "stochastic" else None
        quant.quantize_ef_pack(
            d, r, codes, scales, new, fmt=fmt, block=spec.block, first_block=first_block, keys=keys, beta=spec.ef_beta
        )
    if not bool(torch.isfinite(scales).all()):  # a non-finite block writes a NaN scale (or table): one sync
        v = d.reshape(-1).float() + (0 if r is None else r.reshape(-1).float())
        raise ValueError(_describe(delta, residual, v, name) + "; nothing was quantized or written")
    _check_residual(new, rdt, name)
    return Packed(codes, scales, n, spec.format, spec.block), new


def decompress_add_(acc: torch.Tensor, packed: Packed) -> torch.Tensor:
    """acc += the values `packed` stands for (level·s, one float32 product each), summed in float32
    (float64 for a float64 acc) and rounded once to acc's dtype; acc must be contiguous with
    packed.numel entries (any shape), on the payload's device. Returns acc. Raises ValueError on a
    size or device mismatch."""
    _check_packed(packed)
    if not isinstance(acc, torch.Tensor) or acc.dtype not in _FLOATS:
        raise TypeError(f"decompress_add_: acc must be a float tensor, got {getattr(acc, 'dtype', type(acc))}")
    if acc.numel() != packed.numel or not acc.is_contiguous():
        raise ValueError(
            f"decompress_add_: acc must be contiguous with {packed.numel} entries, got {tuple(acc.shape)} "
            f"(contiguous: {acc.is_contiguous()})"
        )
    if packed.codes.device != acc.device or packed.scales.device != acc.device:
        raise ValueError(f"decompress_add_: the payload is on {packed.codes.device}, acc on {acc.device}")
    if packed.numel == 0:
        return acc
    if backend_for(acc)[0] == "triton":
        from ..triton import quant

        fmt = format_of(packed.format)
        unpack = quant.stat_unpack_accumulate if hasattr(fmt, "bins") else quant.unpack_accumulate
        unpack(packed.codes, packed.scales, acc, fmt=fmt, block=packed.block)
        return acc
    return unpack_add_(acc, packed)
