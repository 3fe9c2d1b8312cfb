"""The Python API over the isoloco ops: `iso_merge_` (the batched, all-or-nothing flatten of
buckets), `iso_flatten` (out of place), `backends()` (what serves each op here), and
`iso_merge_unchecked_` for callers that checked their buckets already (`sharded_iso_merge_`).

They call the ops through `torch.ops.isoloco` (registered by ops.py, which the package imports
first and which re-exports these names) and read the dispatch tables (dispatch/table.py); nothing here
registers or dispatches.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    check_all_finite,
    check_matrix_tensor,
    check_writable,
    is_fake,
)
from .dispatch import _ext
from .dispatch import table as dispatch
from .flatten import registry as flatten
from .flatten.buckets import chunk_rows, flatten_chunked_
from .flatten.registry import check_method

__all__ = ["backends", "iso_flatten", "iso_merge_", "iso_merge_unchecked_"]


def iso_merge_(buckets: Sequence[torch.Tensor], *, method: str = "auto") -> list[torch.Tensor]:
    """Iso-C flatten every bucket in place; returns the buckets as a list.

    Each bucket is a [m, n] pseudo-gradient matrix or a [B, m, n] batch of same-shaped ones. All
    buckets are checked (type, dtype, rank, NaN/Inf; and as written tensors: no meta or inference
    tensor, no grad-requiring leaf with grad on, no expanded view, no two sharing memory) before
    any is touched: on bad input a TypeError/ValueError/RuntimeError names the bucket (and matrix)
    and every bucket stays bit-identical. Every finite input whose Iso-C result fits its dtype
    gets it (each matrix is scaled by a power of two first); a result that does not fit raises
    ResultOverflowError (a ValueError) naming bucket and matrix, with nothing written.
    All or nothing across buckets: all but the last slice of the largest bucket are flattened
    into scratch copies first, that slice in place, and the copies are written back only once
    every bucket succeeded. Memory beside the buckets: those copies (less than the buckets) and
    one slice's scratch, within `buckets.workspace_bytes()` (2 GiB by default; each method's
    scratch per matrix is modelled in `buckets.WORKSPACE_MODEL`) unless one matrix alone needs more.
    Zero-size buckets pass through; buckets may live on different devices. Fake tensors
    (FakeTensorMode, tracing) get the metadata checks and the op's fake impl.

    Raises:
        TypeError: a bucket is not a tensor, or of an unsupported dtype.
        ValueError: a bucket is not 2-D or 3-D, holds NaN/Inf, or method is unknown.
        RuntimeError: a bucket cannot be written in place (a grad-requiring leaf with grad on, an
            inference tensor outside inference mode, an expanded view, two buckets sharing memory).
        ResultOverflowError: a result does not fit its bucket's dtype (nothing written).

    Examples:
        >>> a, b = torch.randn(3, 16, 8), torch.randn(32, 32)
        >>> out = iso_merge_([a, b], method="auto")
        >>> out[0] is a and float(torch.linalg.svdvals(b).std()) < 1e-4
        True

    method: "svd" (exact, float64 torch.linalg.svd), "eigh" (float64 eigh of the short-side Gram
    matrix, svd where it cannot resolve the spectrum), "polar" (matmul-only Polar Express
    iteration, residual-checked, exact fallback), "polar_bf16" (bf16 GEMMs; well-conditioned
    inputs only), "gram" (the iteration in float64 on the short-side Gram matrix: two big GEMMs,
    exact to cond ~1e5) or "auto" ("gram" or "polar" per shape and device on CUDA, the faster exact
    method on the CPU, svd for float64 everywhere; see flatten.resolve_method).
    """
    buckets = list(buckets)
    check_method(method)
    names = [f"bucket {i}" for i in range(len(buckets))]
    for b, name in zip(buckets, names):
        check_matrix_tensor(b, name)
    if any(is_fake(b) for b in buckets):  # no data: shapes only
        for b in buckets:
            torch.ops.isoloco.iso_flatten_(b, method)
        return buckets
    check_writable(buckets, names)
    check_all_finite(buckets, names)
    todo = [i for i, b in enumerate(buckets) if b.numel()]
    last = max(todo, key=lambda i: buckets[i].numel(), default=None)
    aside = {i: buckets[i].clone() for i in todo if i != last}
    for i, c in aside.items():
        _flatten_bucket_(c, method, i)
    if last is not None:  # its last slice in place, the slices before it aside
        x3 = buckets[last] if buckets[last].ndim == 3 else buckets[last].unsqueeze(0)
        cut = (x3.shape[0] - 1) // chunk_rows(method, x3) * chunk_rows(method, x3)
        head = x3[:cut].clone()
        _flatten_bucket_(head, method, last)
        _flatten_bucket_(x3[cut:], method, last, offset=cut)
        x3[:cut].copy_(head)
    for i, c in aside.items():
        buckets[i].copy_(c)
    return buckets


def _flatten_bucket_(x: torch.Tensor, method: str, i: int, offset: int = 0) -> None:
    """Bucket i (checked) flattened in place in slices of bounded scratch (`buckets.flatten_chunked_`);
    a result that does not fit names bucket i and the matrix (offset: x's first matrix in the bucket)."""
    try:
        flatten_chunked_(x, method)
    except ResultOverflowError as e:
        j = None if e.matrix is None else e.matrix + offset
        raise ResultOverflowError(
            f"bucket {i}: {str(e).replace(f'matrix {e.matrix}', f'matrix {j}', 1)}", matrix=j, bucket=i
        ) from None


def iso_merge_unchecked_(buckets: Sequence[torch.Tensor], method: str, *, first: int = 0, index=None) -> None:
    """The flatten of every non-empty bucket, for callers that already checked all of them (the
    op's checks: type, rank, method, writable, finite), each in slices whose scratch stays within
    `buckets.workspace_bytes()` (`buckets.flatten_chunked_`, as `iso_merge_`). A result that does
    not fit its dtype raises ResultOverflowError naming the bucket (its position in `index`, or
    first + its position) and the matrix; that bucket's slices before the matrix's are already
    written, so callers pass scratch copies (`sharded_iso_merge_` does)."""
    for k, b in enumerate(buckets):
        if b.numel():
            try:
                flatten_chunked_(b, method)
            except ResultOverflowError as e:
                i = index[k] if index is not None else first + k
                raise ResultOverflowError(f"bucket {i}: {e}", matrix=e.matrix, bucket=i) from None


def iso_flatten(x: torch.Tensor, *, method: str = "auto") -> torch.Tensor:
    """Out-of-place Iso-C flatten of a [m, n] or [B, m, n] tensor: in each matrix every singular
    value becomes their mean, the singular vectors stay; zero in, zero out (methods: `iso_merge_`).

    Returns a new tensor of x's shape, dtype and device; x is not modified.

    Raises:
        TypeError: x is not a tensor, or not float16/bfloat16/float32/float64.
        ValueError: x is not 2-D or 3-D, holds NaN/Inf, or method is unknown.
        ResultOverflowError: the result does not fit x's dtype.
        RuntimeError: x requires grad while grad mode is on: Iso-C has no backward, and the result
            would silently leave the graph; pass x.detach() or call it under torch.no_grad().

    Examples:
        >>> x = torch.randn(64, 256)
        >>> s = torch.linalg.svdvals(iso_flatten(x))
        >>> bool(torch.allclose(s, torch.linalg.svdvals(x).mean().expand(64), rtol=1e-4))
        True
    """
    check_matrix_tensor(x, "iso_flatten: x")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "iso_flatten: x requires grad, but Iso-C has no backward (the result would not be part of "
            "the autograd graph); pass x.detach() or call it under torch.no_grad()"
        )
    y = x.detach().clone()
    torch.ops.isoloco.iso_flatten_(y, method)
    return y


def backends() -> dict[str, str]:
    """What serves each op here, from the dispatch tables (dispatch/table.py) that choose it: per op and
    device, the candidate `select` takes for a plain call, and why each one before it does not.

    Returns a dict of plain strings (also "cuda_extension", "cupy", "triton", "methods", "dtypes");
    raises nothing: an unavailable backend is a reason in the dict, not an exception.

    Examples:
        >>> info = backends()
        >>> "iso_scale_[cpu]" in info and "svd" in info["methods"]
        True
    """
    from . import triton as _tk

    out = {
        "cuda_extension": _ext.STATUS,
        "cupy": dispatch._cupy_available()[1] or "available",
        "triton": "available" if _tk.AVAILABLE else "not importable",
    }
    for op, device in dispatch.TABLES:
        chosen = dispatch.select(op, device).name
        skipped = [f"{name}: {why}" for name, ok, why in dispatch.report(op, device) if not ok]
        out[f"{op}[{device}]"] = chosen + (f" (not: {'; '.join(skipped)})" if skipped else "")
    from .compress import backend_for  # compressed exchange: one choice per tensor (compress/feedback.py)

    out["compress[cpu]"] = backend_for(torch.empty(0))[0]
    if _tk.AVAILABLE and not _tk.interpreted():
        out["compress[cuda]"] = "triton (float16, bfloat16, float32; float64: torch)"
    else:
        out["compress[cuda]"] = (
            "torch (" + ("the interpreter's kernels" if _tk.AVAILABLE else "triton not importable") + ")"
        )
    out["methods"] = ", ".join(m for m in flatten.METHODS if m != "auto")
    out["dtypes"] = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
    return out
