"""The isoloco torch ops: every schema, its fake (meta) impl, and which backend serves each device.

    isoloco::iso_flatten_(Tensor(a!) x, str method) -> ()
        Iso-C flatten of a [m, n] or [B, m, n] tensor in place (see reference.py for the math).
    isoloco::iso_scale_(Tensor(a!) x, Tensor q) -> Tensor
        The Iso-C epilogue: s̄ = ⟨x, q⟩ / min(m, n) per matrix, x ← s̄·q; returns s̄ (float32, or
        float64 for float64 x), shape x.shape[:-2].
    isoloco::nesterov_outer_(Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor[] updates,
                             float lr, float momentum, Tensor? scales) -> ()
        buf ← μ·buf + s·u ; p ← p − lr·(s·u + μ·buf), s = scales[i] (1 when scales is None).

Every implementation registered here checks its arguments (one check per op, the same on every
device) and then runs what `dispatch.select` picks: on CUDA the compiled extension's kernels
(csrc/, registered as the private ops csrc_iso_scale_ / csrc_nesterov_outer_), the same kernels
through CuPy, Triton or torch; torch on the CPU.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from . import _ext, dispatch, flatten
from ._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    check_all_finite,
    check_matrix_tensor,
    check_writable,
    compute_dtype,
)
from .flatten import check_method, iso_flatten_impl

_lib = torch.library.Library("isoloco", "DEF")  # noqa: TOR901 (owned by this module)

# Not capturable in a CUDA graph: the flatten syncs with the host (method choice, fallbacks), the
# Nesterov kernels launch from a pointer table built on the host each call. torch.compile's CUDA
# graphs skip graphs holding these ops (torch >= 2.8 has the tag; older torch: none).
_HOST_BOUND = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)

# One flatten for every device: the method choice and the backend live in flatten.py.
_lib.define("iso_flatten_(Tensor(a!) x, str method) -> ()", tags=_HOST_BOUND)
# Iso-C epilogue; CUDA kernel in csrc/iso_scale.cu.
_lib.define("iso_scale_(Tensor(a!) x, Tensor q) -> Tensor")
# Multi-tensor Nesterov outer update; CUDA kernel in csrc/nesterov.cu.
_lib.define(
    "nesterov_outer_(Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor[] updates, "
    "float lr, float momentum, Tensor? scales) -> ()", tags=_HOST_BOUND
)

# The compiled extension's kernels, behind the checks of the public ops (called by dispatch.py only).
_lib.define("csrc_iso_scale_(Tensor(a!) x, Tensor q) -> Tensor")
_lib.define(
    "csrc_nesterov_outer_(Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor[] updates, "
    "float lr, float momentum, Tensor? scales) -> ()", tags=_HOST_BOUND
)

_ext.load()  # registers the csrc_* CUDA kernels, if the extension was built


@torch.library.impl(_lib, "iso_flatten_", "CompositeExplicitAutograd")
def _iso_flatten_(x: torch.Tensor, method: str) -> None:
    iso_flatten_impl(x, method)


@torch.library.register_fake("isoloco::iso_flatten_", lib=_lib)
def _iso_flatten_fake(x: torch.Tensor, method: str) -> None:
    check_matrix_tensor(x, "iso_flatten_: x")
    check_method(method)


def _check_scale_args(x: torch.Tensor, q: torch.Tensor) -> None:
    check_matrix_tensor(x, "iso_scale_: x")
    check_matrix_tensor(q, "iso_scale_: q")
    if x.shape != q.shape or x.device != q.device:
        raise ValueError(
            f"iso_scale_: q must match x in shape and device, got x {tuple(x.shape)} on {x.device}"
            f" and q {tuple(q.shape)} on {q.device}"
        )


@torch.library.impl(_lib, "iso_scale_", "CPU")
@torch.library.impl(_lib, "iso_scale_", "CUDA")
def _iso_scale_impl(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    _check_scale_args(x, q)
    return dispatch.select("iso_scale_", x.device, x, q).run(x, q)


@torch.library.register_fake("isoloco::iso_scale_", lib=_lib)
def _iso_scale_fake(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    _check_scale_args(x, q)
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.new_empty(x.shape[:-2], dtype=dt)


def check_nesterov_args(params, bufs, updates, lr, momentum, scales) -> None:
    """Lengths, shapes, devices and dtypes of a nesterov_outer_ call; cheap, no device sync."""
    if not (len(params) == len(bufs) == len(updates)):
        raise ValueError(
            f"nesterov_outer_: params, bufs and updates must have one entry each per tensor, got "
            f"{len(params)}, {len(bufs)} and {len(updates)}"
        )
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        for name, t in (("param", p), ("buf", b), ("update", u)):
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"nesterov_outer_: {name} {i} has unsupported dtype {t.dtype}")
        if not (p.shape == b.shape == u.shape):
            raise ValueError(
                f"nesterov_outer_: tensor {i}: param {tuple(p.shape)}, buf {tuple(b.shape)} and "
                f"update {tuple(u.shape)} must have the same shape"
            )
        if not (p.device == b.device == u.device == params[0].device):
            raise ValueError(f"nesterov_outer_: tensor {i}: param, buf and update must all be on param 0's "
                             f"device {params[0].device}, got {p.device}, {b.device}, {u.device}")
        if b.dtype not in (torch.float32, p.dtype):  # the kernels hold momentum in float32 or the param dtype
            raise TypeError(f"nesterov_outer_: buf {i} is {b.dtype}; it must be float32 or the param's dtype ({p.dtype})")
    if scales is not None:
        if scales.ndim != 1 or scales.numel() != len(params):
            raise ValueError(
                f"nesterov_outer_: scales must be 1-D with one entry per tensor ({len(params)}), "
                f"got shape {tuple(scales.shape)}"
            )
        if params and scales.device != params[0].device:
            raise ValueError("nesterov_outer_: scales must be on the params' device")
        if not scales.is_floating_point():
            raise TypeError(f"nesterov_outer_: scales must be floating point, got {scales.dtype}")
    if not (math.isfinite(lr) and math.isfinite(momentum)):  # NaN or ±Inf: every param would be NaN/Inf
        raise ValueError(
            f"nesterov_outer_: lr and momentum must be finite numbers, got lr={lr}, momentum={momentum}"
        )


def check_nesterov_written(params, bufs) -> None:
    """The tensors nesterov_outer_ writes (params and bufs), checked all together before any is
    written: no meta/inference tensor, no grad-requiring leaf with grad mode on, no internal
    overlap, no two sharing memory (every CPU/CUDA backend runs this; fake tensors skip it)."""
    check_writable(
        [*params, *bufs], [f"nesterov_outer_: param {i}" for i in range(len(params))]
        + [f"nesterov_outer_: buf {i}" for i in range(len(bufs))],
    )


@torch.library.impl(_lib, "nesterov_outer_", "CPU")
@torch.library.impl(_lib, "nesterov_outer_", "CUDA")
def _nesterov_outer_impl(params, bufs, updates, lr, momentum, scales) -> None:
    check_nesterov_args(params, bufs, updates, lr, momentum, scales)
    check_nesterov_written(params, bufs)
    if params:
        args = (params, bufs, updates, lr, momentum, scales)
        dispatch.select("nesterov_outer_", params[0].device, *args).run(*args)


@torch.library.register_fake("isoloco::nesterov_outer_", lib=_lib)
def _nesterov_outer_fake(params, bufs, updates, lr, momentum, scales) -> None:
    check_nesterov_args(params, bufs, updates, lr, momentum, scales)


# ----------------------------------------------------------------------------------------------
# Python API


def iso_merge_(buckets: Sequence[torch.Tensor], *, method: str = "auto") -> list[torch.Tensor]:
    """Iso-C flatten every bucket in place; returns the buckets as a list.

    Each bucket is a [m, n] pseudo-gradient matrix or a [B, m, n] batch of same-shaped ones. All
    buckets are checked (type, dtype, rank, NaN/Inf; and as written tensors: no meta or inference
    tensor, no grad-requiring leaf with grad on, no expanded view, no two sharing memory) before
    any is touched: on bad input a TypeError/ValueError/RuntimeError names the bucket (and matrix)
    and every bucket stays bit-identical. Every finite input whose Iso-C result fits its dtype
    gets it (each matrix is scaled by a power of two first); a result that does not fit raises
    ResultOverflowError (a ValueError) naming bucket and matrix, with nothing written.
    Zero-size buckets pass through; buckets may live on different devices.

    method: "svd" (exact, torch.linalg.svd), "eigh" (float64 eigh of the short-side Gram
    matrix), "polar" (matmul-only Polar Express iteration, residual-checked, exact fallback),
    "polar_bf16" (bf16 GEMMs; well-conditioned inputs only), "gram" (the iteration in float64 on
    the short-side Gram matrix: two big GEMMs, exact to cond ~1e5) or "auto" ("gram" or "polar"
    per shape and device on CUDA, the faster exact method on the CPU; see flatten.resolve_method).
    """
    buckets = list(buckets)
    check_method(method)
    names = [f"bucket {i}" for i in range(len(buckets))]
    for b, name in zip(buckets, names):
        check_matrix_tensor(b, name)
    check_writable(buckets, names)
    check_all_finite(buckets, names)
    # All or nothing across buckets: those whose result might not fit their dtype (a bound from
    # the Frobenius norm) are flattened aside first; only when all of them fit is anything written.
    risky = [i for i, b in enumerate(buckets) if b.numel() and _may_not_fit(b)]
    done = {}
    for i in risky:
        done[i] = buckets[i].clone()
        iso_merge_unchecked_([done[i]], method, first=i)
    iso_merge_unchecked_([b for i, b in enumerate(buckets) if i not in done], method,
                         index=[i for i in range(len(buckets)) if i not in done])
    for i, r in done.items():
        buckets[i].copy_(r)
    return buckets


def _may_not_fit(b: torch.Tensor) -> bool:
    """Whether an Iso-C result of bucket b could exceed half its dtype's range: every entry of
    iso(Δ) is at most s̄ ≤ ‖Δ‖_F / √r0 (r0 = min(m, n)), bounded here by the whole bucket's norm."""
    r0 = min(b.shape[-2:])
    norm = float(torch.linalg.vector_norm(b, dtype=compute_dtype(b.dtype)))
    return not norm / math.sqrt(r0) < torch.finfo(b.dtype).max / 2


def iso_merge_unchecked_(buckets: Sequence[torch.Tensor], method: str, *, first: int = 0, index=None) -> None:
    """The op over every non-empty bucket, for callers that already checked all of them.
    A result that does not fit its dtype raises ResultOverflowError naming the bucket (its
    position in `index`, or first + its position) and the matrix; that bucket is untouched."""
    for k, b in enumerate(buckets):
        if b.numel():
            try:
                torch.ops.isoloco.iso_flatten_(b, method)
            except ResultOverflowError as e:
                i = index[k] if index is not None else first + k
                raise ResultOverflowError(f"bucket {i}: {e}", matrix=e.matrix, bucket=i) from None


def iso_flatten(x: torch.Tensor, *, method: str = "auto") -> torch.Tensor:
    """Out-of-place Iso-C flatten of a [m, n] or [B, m, n] tensor (see `iso_merge_`)."""
    check_matrix_tensor(x, "iso_flatten: x")
    y = x.detach().clone()
    torch.ops.isoloco.iso_flatten_(y, method)
    return y


def backends() -> dict[str, str]:
    """What serves each op here, from the dispatch tables (dispatch.py) that choose it: per op and
    device, the candidate `select` takes for a plain call, and why each one before it does not."""
    from . import triton as _tk

    out = {"cuda_extension": _ext.STATUS, "cupy": dispatch._cupy_available()[1] or "available",
           "triton": "available" if _tk.AVAILABLE else "not importable"}
    for (op, device), cands in dispatch.TABLES.items():
        chosen = dispatch.select(op, device).name
        skipped = [f"{name}: {why}" for name, ok, why in dispatch.report(op, device) if not ok]
        out[f"{op}[{device}]"] = chosen + (f" (not: {'; '.join(skipped)})" if skipped else "")
    out["methods"] = ", ".join(m for m in flatten.METHODS if m != "auto")
    out["dtypes"] = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
    return out
