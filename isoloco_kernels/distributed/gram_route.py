"""The DTensor step's Gram route: matrices sharded along their long side on a 1-D mesh.

Each rank holds rows Yᵢ of Xᵀ (the long side down). One float64 all-reduce per mesh sums the
short-side Gram matrices of all its matrices, A₀ = Σᵢ YᵢᵀYᵢ; then every rank, holding the same A₀,
runs gram.py's iteration on it (method "gram", or "auto" resolving to it) or float64 eigh
(`exact.eigh_polar`, reference.py's rank cut), and writes its own rows s̄·Yᵢ·P. A matrix its A₀
cannot resolve (the iteration's checks or eigh's resolution fail) is left to the exact path
(routes.py); the ranks agree on which by one small all-reduce of flags (`agree_exact`). A₀'s
buffer and the flags are allocated, and the ranks agree that each has them, before A₀'s all-reduce.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._validate import check_all_finite, compute_dtype, local
from . import pipeline
from .agree import comm_device

__all__ = ["agree_exact", "gram_route"]


def gram_route(mesh, ks: list[int], ds: list[int], entries, layouts, method: str, attempt, stats):
    """(this rank's piece of s̄·Q for the Gram-route matrices `ks` (short sides `ds`) of one mesh that
    their all-reduced A₀ serves, as {entry index: tensor}, or None once local work failed; the
    zeroed flags for `agree_exact`).

    `attempt`: the step's `Agreement.attempt`. A₀'s buffer and the exact path's flags are allocated
    under it and the ranks agree (that Agreement's `settle`) before the all-reduce: a rank that
    cannot allocate them (out of memory) fails every rank there, with nothing changed, instead of
    leaving the others in a collective. After that the all-reduce runs whatever happens locally (a
    rank that failed adds zeros)."""
    group = mesh.get_group(0)
    dev = comm_device(group)
    bufs = attempt(_gram_buffers, sum(d * d for d in ds), len(ks), dev)
    attempt.__self__.settle()  # every rank has its buffers, or every rank raises here
    buf, flags = bufs
    ys, off = {}, 0
    for k, d in zip(ks, ds):
        ys[k] = attempt(_gram_into, entries[k], layouts[k], buf[off : off + d * d].view(d, d))
        off += d * d
    dist.all_reduce(buf, group=group)
    stats.gram_elements += buf.numel()
    return attempt(_gram_results, entries, layouts, ks, ds, ys, buf, method, stats), flags


def _gram_buffers(a0_numel: int, n_flags: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(A₀'s float64 buffer, the exact path's int64 flags), zeroed, on the communication device."""
    return (
        pipeline.comm_buffer(a0_numel, torch.float64, device, True),
        pipeline.comm_buffer(n_flags, torch.int64, device, True),
    )


def agree_exact(mesh, ks: list[int], served: Optional[dict], flags: torch.Tensor) -> list[int]:
    """The Gram-route matrices of `ks` that no A₀ served (`served`: this rank's results, None once
    its local work failed), as every rank of the mesh sees them: every rank holds the same A₀ and
    decides alike, and one small all-reduce (max) of the flags makes that exact even where LAPACK
    differs between ranks in its last bits; a failed rank flags nothing, so it joins the others.
    `flags`: len(ks) zeros on the communication device (`gram_route`'s, allocated before its agreement)."""
    group = mesh.get_group(0)
    if served is not None:
        flags.copy_(torch.tensor([int(k not in served) for k in ks], dtype=torch.int64))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [k for k, f in zip(ks, flags.tolist()) if f]


def _gram_into(entry, layout, slot: torch.Tensor) -> torch.Tensor:
    """slot ← YᵀY for this rank's shard Y (long side down, float64); returns Y."""
    x = local(entry.g).to(torch.float64)
    y = x if layout.dim == 0 else x.mT
    slot.copy_(y.mT @ y)
    return y


def _gram_results(entries, layouts, ks, ds, ys, buf: torch.Tensor, method: str, stats) -> dict[int, torch.Tensor]:
    """This rank's piece of s̄·Q for the matrices `ks` that their A₀ (in the flat buffer) serves,
    batched per (d, long side, dtype, how) as the single-process methods decide: gram.py's
    iteration on A₀ (`gram.gram_from_a0`, with its residual and rank-cut checks) where the method
    asks for it, else float64 eigh where it resolves the spectrum. A matrix either misses is left
    out: it needs the exact path, as in `flatten_gram_` and `flatten_eigh_`."""
    by: dict[tuple, list] = {}
    off = 0
    for k, d in zip(ks, ds):
        a0 = buf[off : off + d * d].view(d, d).to(ys[k].device)
        off += d * d
        g, n = entries[k].g, max(layouts[k].shape)
        how = _gram_method(method, d, n, local(g).device, g.dtype)
        by.setdefault((d, n, g.dtype, how), []).append((k, ys[k], a0))
    out = {}
    for (_, n, dtype, how), its in by.items():
        a = torch.stack([a0 for _, _, a0 in its])
        check_all_finite([a], ["Gram matrix"])
        served = _gram_iterate(its, a, n, dtype, stats) if how == "gram" else _gram_eigh(its, a, n, dtype)
        for k, q in served.items():
            out[k] = (q if layouts[k].dim == 0 else q.mT).to(compute_dtype(dtype))
    return out


def _gram_method(method: str, d: int, n: int, device, dtype) -> str:
    """ "gram" when the optimizer's method runs the Gram-space iteration on a d×n matrix (method
    "gram", or "auto" resolving to it for this shape and device), else "eigh"."""
    if method == "gram":
        return "gram"
    if method == "auto":
        from ..flatten.registry import resolve_method

        probe = torch.empty((), dtype=dtype, device=device).expand(1, d, n)  # no allocation
        return "gram" if resolve_method("auto", probe) == "gram" else "eigh"
    return "eigh"


def _gram_iterate(its, a: torch.Tensor, n: int, dtype, stats) -> dict[int, torch.Tensor]:
    """{entry index: s̄·Qᵀ's rows on this rank} by gram.py's iteration on the stacked A₀ `a`, for
    the matrices that pass its checks; the others are left out."""
    from ..flatten.gram import gram_from_a0

    yg, sbar, _, ok = gram_from_a0(a, long_side=n, dtype=dtype)
    w = yg * sbar[:, None, None]  # s̄·Qᵀ = Xᵀ·Wᵀ; y: this rank's rows of Xᵀ (long side down)
    served = {k: y @ ww.mT for (k, y, _), ww, good in zip(its, w, ok.tolist()) if good}
    stats.gram_iterated += len(served)
    stats.gram_fallbacks += len(its) - len(served)
    return served


def _gram_eigh(its, a: torch.Tensor, n: int, dtype) -> dict[int, torch.Tensor]:
    """{entry index: s̄·Qᵀ's rows on this rank} by float64 eigh of the stacked A₀ `a` for the
    matrices it resolves (`exact.eigh_polar`: the rank bound is A₀'s nonzero diagonal, the cut
    reference.py's); the others are left out."""
    from ..flatten.exact import eigh_polar

    d = a.shape[-1]
    nzd = a.diagonal(dim1=-2, dim2=-1) != 0  # X's nonzero short-side lines
    pm, nuc, ok = eigh_polar(a, nzd.sum(-1), d, n, dtype)
    out = {}
    for (k, y, _), pp, s, good, cols in zip(its, pm, nuc, ok.tolist(), nzd):
        if good:
            # Qᵀ = Xᵀ·P on this rank's rows; zero columns of Q stay exactly zero
            out[k] = ((y @ pp) * (s / d)) * cols.to(y.dtype)
    return out
