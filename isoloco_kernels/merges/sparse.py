"""TIES and DARE on one worker stack [K, *shape]: prune each delta, elect a sign, merge — one pass.

Definitions: merges/reference.py (`sparse_ref`). The pruning rule per worker is fixed first: TIES's
trim threshold (the k-th largest |entry|, or row/column 2-norm: one `torch.topk` per worker), DARE's
32-bit stream key. Then one pass over the K deltas prunes, elects and merges (the Triton kernel
`triton/sparse_merge.py` on CUDA for dim "all"; the torch loop here otherwise, the same arithmetic),
into a compute-dtype buffer the caller checks and stores. Memory beyond the input: the result and
a few entry-sized temporaries of one worker at a time (the torch loop), never K-sized.

Weighted (normalized weights ω, merges/options.py): the elected sign is that of Σ ω_k t_k, the
combination Σ ω_k t_k (DARE) or Σ_agree ω_k t_k / Σ_agree ω_k (TIES), in the torch loop on every device.

Each stack is divided by a power of two near its largest entry first (exact), so the K-term sums
cannot overflow; the result is scaled back (and by 1/(1 − p) where DARE rescales) at the end.
"""

from __future__ import annotations

import math

import torch

from .. import triton as tk
from .._validate import compute_dtype
from .reference import stream_key

__all__ = ["sparse_merge", "mix32_tensor"]

_M32 = 0xFFFFFFFF


def _mul32(v: torch.Tensor, c: int) -> torch.Tensor:
    """(v·c) mod 2³² for int64 v in [0, 2³²), in 16-bit halves of c (no int64 overflow)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (v * lo + (((v * hi) & 0xFFFF) << 16)) & _M32


def mix32_tensor(v: torch.Tensor) -> torch.Tensor:
    """reference.mix32 on an int64 tensor of values in [0, 2³²)."""
    v = v ^ (v >> 16)
    v = _mul32(v, 0x7FEB352D)
    v = v ^ (v >> 15)
    v = _mul32(v, 0x846CA68B)
    return v ^ (v >> 16)


def _scores(d: torch.Tensor, dim: str) -> torch.Tensor:
    """What TIES ranks: |entries| (dim "all") or the 2-norms of rows / columns, in the compute dtype."""
    if dim == "all":
        return d.abs().flatten()
    return torch.linalg.vector_norm(d, dim=-1 if dim == "row" else 0)


def _expand(keep: torch.Tensor, shape, dim: str) -> torch.Tensor:
    if dim == "all":
        return keep.reshape(shape)
    return keep[:, None] if dim == "row" else keep[None, :]


def cut_of(sparsity: float) -> int:
    """DARE keeps an entry when its 32-bit hash is ≥ this: ⌈p·2³²⌉ (exact in float64)."""
    return math.ceil(sparsity * 2.0**32)


def _thresholds(x: torch.Tensor, cd: torch.dtype, sparsity: float, dim: str) -> torch.Tensor:
    """TIES: per worker, the k-th largest score, k = max(1, ⌊(1 − p)·count⌋) (the reference's), as
    the (count − k + 1)-th smallest: one selection (kthvalue), ~5× faster than a topk of k ≈ 0.9·count."""
    out = []
    for d in x:
        s = _scores(d.to(cd), dim)
        k = max(1, int((1 - sparsity) * s.numel()))
        out.append(torch.kthvalue(s, s.numel() - k + 1).values)
    return torch.stack(out)


def _keep(d: torch.Tensor, k: int, opts: dict, thr, keys, cut: int) -> torch.Tensor:
    """Worker k's keep mask (broadcastable to d) under the stack's pruning rule."""
    dim = opts["dim"]
    if opts["prune"] == "magnitude":
        return _expand(_scores(d, dim) >= thr[k], d.shape, dim)
    count = d.numel() if dim == "all" else d.shape[0] if dim == "row" else d.shape[-1]
    idx = torch.arange(count, device=d.device, dtype=torch.int64)
    return _expand(mix32_tensor(idx ^ int(keys[k])) >= cut, d.shape, dim)


def _merge_torch(x, cd, opts, thr, keys, cut, inv_scale, post, weights=None) -> torch.Tensor:
    K = x.shape[0]

    def pruned(k: int) -> torch.Tensor:
        d = x[k].to(cd)  # the trim compares unscaled magnitudes, as the thresholds were taken
        return torch.where(_keep(d, k, opts, thr, keys, cut), d * inv_scale, 0)

    w = None if weights is None else weights.to(x.device, cd)
    out = _combine(pruned, K, w, opts["disjoint"])
    return out * (post / K) if w is None and not opts["disjoint"] else out * post


def _combine(pruned, K: int, w: torch.Tensor | None, disjoint: bool) -> torch.Tensor:
    """The combination of the K pruned deltas t_k with weights ω_k (normalized, every one > 0; w None: every
    ω_k = 1, nothing multiplied): Σ ω_k t_k, or with `disjoint` the elected sign sign(Σ ω_k t_k) and
    Σ_agree ω_k t_k / Σ_agree ω_k (none agree: 0)."""

    def term(k: int, t: torch.Tensor) -> torch.Tensor:
        return t if w is None else t * w[k]

    total = term(0, pruned(0))
    for k in range(1, K):
        total += term(k, pruned(k))
    if not disjoint:
        return total
    elect = torch.sign(total)
    acc = torch.zeros_like(total)
    mass = torch.zeros_like(total)
    for k in range(K):
        t = pruned(k)
        agree = (torch.sign(t) == elect) & (t != 0)
        acc += torch.where(agree, term(k, t), 0)
        mass += agree if w is None else torch.where(agree, w[k], 0)
    if w is None:
        return acc / mass.clamp_min(1)  # mass counts the agreeing workers
    return torch.where(mass > 0, acc / torch.where(mass > 0, mass, 1), 0)


def sparse_merge(
    x: torch.Tensor, opts: dict, stack: int, weights: torch.Tensor | None = None, workers=None
) -> torch.Tensor:
    """TIES / DARE of one checked, finite stack [K, *shape] (opts: options.resolve_options's);
    returns the merged [*shape] in the compute dtype (not yet checked against the output dtype).
    stack: the stack's index, part of DARE's stream keys. weights: the K rows' normalized weights
    (float64, every one > 0; None: equal), combined by the torch loop (the Triton kernel averages);
    workers: each row's worker index in DARE's stream (None: its position)."""
    cd = compute_dtype(x.dtype)
    K, shape = x.shape[0], x.shape[1:]
    p, dim = opts["sparsity"], opts["dim"] if x.ndim == 3 else "all"
    opts = {**opts, "dim": dim}
    amax = float(x.abs().amax()) if x.numel() else 0.0
    scale = 2.0 ** (math.frexp(amax)[1] - 1) if amax > 0 else 1.0
    post = scale / (1 - p) if (opts["rescale"] and p > 0) else scale
    if p == 0:
        thr, keys, cut, prune = None, None, 0, False
    elif opts["prune"] == "magnitude":
        thr, keys, cut, prune = _thresholds(x, cd, p, dim), None, 0, True
    else:
        ids = range(K) if workers is None else workers
        keys = torch.tensor([stream_key(opts["seed"], stack, k) for k in ids], dtype=torch.int64)
        thr, cut, prune = None, cut_of(p), True
    if not prune:  # nothing dropped: every entry kept (a threshold of 0 keeps all)
        thr, opts = torch.zeros(K, dtype=cd, device=x.device), {**opts, "prune": "magnitude"}
    flat = x.reshape(K, -1)
    if weights is None and tk.usable_for(x) and dim == "all" and flat.stride(-1) == 1 and x.numel():
        from ..triton.sparse_merge import sparse_merge_triton

        out = torch.empty(flat.shape[1], dtype=cd, device=x.device)
        sparse_merge_triton(
            flat,
            out,
            thresholds=thr.to(x.device) if thr is not None else None,
            keys=keys.to(x.device) if keys is not None and opts["prune"] == "random" else None,
            cut=cut,
            inv_scale=1.0 / scale,
            post=post,
            disjoint=opts["disjoint"],
        )
        return out.reshape(shape)
    return _merge_torch(x, cd, opts, thr, keys, cut, 1.0 / scale, post, weights)
