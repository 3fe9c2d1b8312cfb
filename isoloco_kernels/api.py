"""The Python API over the isoloco ops: `iso_merge_` (the batched, all-or-nothing flatten of
buckets), `iso_flatten` (out of place) and `backends()` (what serves each op here).

They call the ops through `torch.ops.isoloco` (registered by ops.py, imported here) and read the
dispatch tables (dispatch/table.py); nothing here registers, checks data or dispatches.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import ops  # noqa: F401  (registers the isoloco ops this module calls)
from ._validate import SUPPORTED_DTYPES, check_matrix_tensor
from .dispatch import _ext
from .dispatch import table as dispatch
from .flatten import registry as flatten
from .flatten.registry import check_method

__all__ = ["backends", "iso_flatten", "iso_merge_"]


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
    one slice's scratch, within `flatten.registry.workspace_bytes()` (2 GiB by default; each method's
    scratch per matrix is modelled in `flatten.registry.WORKSPACE_MODEL`) unless one matrix alone needs more.
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
    check_method(method)  # the op's schema would refuse these, less clearly
    for i, b in enumerate(buckets):
        check_matrix_tensor(b, f"bucket {i}")
    torch.ops.isoloco.iso_merge_(buckets, method)
    return buckets


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
