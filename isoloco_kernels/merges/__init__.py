"""The paper's five merges of K workers' pseudo-gradients and a norm-preserving mean, batched:
`merge` / `merge_`.

IsoLoCo's paper casts DiLoCo's outer step as model merging of the workers' task vectors Δ_1..Δ_K
and compares five merges; this module runs all of them on the library's kernels:

    mean     DiLoCo's average
    iso_c    Iso-C of the mean (the library's flatten; what `IsoLoCo` does)
    norm_mean  the mean's direction at the workers' mean Frobenius norm (the step-size control)
    tsv      TSV-M: each worker's top ⌊r/K⌋ singular triplets, decorrelated by polar factors
    iso_cts  Iso-CTS: the mean's common space + each worker's own directions, isotropic
    ties     TIES: trim the smallest entries, elect a sign by mass, mean of the agreeing ones
    dare     DARE: drop entries at random, rescale by 1/(1 − p), mean

Definitions and their departures from the official code: merges/reference.py, docs/merges.md.
Per-worker weights (`weights=`, merges/options.py): each merge's weighted form over the workers with
weight > 0; equal weights are the unweighted merge bit for bit. A norm clip (`clip=`, merges/norm.py):
each worker's Δ of a tensor shrunk to at most the workers' median norm or a given cap, before the merge.
Options per merge: merges/options.py. Tensors that are not 2-D get the mean under iso_c, norm_mean,
tsv and iso_cts, and are pruned like any tensor under ties and dare (as in the official code). One
worker (K = 1) is each merge's value for its delta: the delta (mean; norm_mean, bit for bit: its two
norms are then one; tsv up to rounding: ⌊r/1⌋ = r triplets),
its Iso-C (iso_c; iso_cts, whose common and own spaces then span all of the delta's directions), its
trimmed entries (ties), its DARE drops rescaled (dare).
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import torch

from .._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    check_all_finite,
    check_writable,
    compute_dtype,
    overflow_limit,
)
from ..api import iso_flatten
from .norm import Clipped, clip_stacks, norm_mean_merge, worker_norms
from .options import MERGES, resolve_clip, resolve_options, resolve_weights
from .sparse import sparse_merge
from .spectral import iso_cts_merge, tsv_merge

__all__ = ["MERGES", "Clipped", "merge", "merge_", "merge_groups", "check_stacks", "clip_stacks", "worker_norms"]


def check_stacks(stacks: Sequence[torch.Tensor], where: str = "merge", ids: Optional[Sequence[int]] = None) -> int:
    """Type, dtype, rank and worker count of every stack [K, *shape]; returns K (0 for no stacks).
    Refuses K = 0 and stacks whose K differ, naming the stack (by its position, or by `ids[position]`: the caller's
    own numbering, e.g. MergeLoCo's param index). K = 1 is a merge of one worker."""
    K = None
    name = (lambda j: j) if ids is None else (lambda j: ids[j])
    for j, s in enumerate(stacks):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{where}: stack {name(j)}: expected a torch.Tensor, got {type(s).__name__}")
        if s.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{where}: stack {name(j)}: dtype {s.dtype} is not supported; use float16, bfloat16, float32 or float64"
            )
        if s.ndim < 1:
            raise ValueError(
                f"{where}: stack {name(j)}: expected [K, *shape] (the workers' deltas stacked on dim 0), got shape {tuple(s.shape)}"
            )
        if K is None:
            K = s.shape[0]
        elif s.shape[0] != K:
            raise ValueError(
                f"{where}: stack {name(j)} has {s.shape[0]} workers, stack {name(0)} has {K}: every stack needs the same K"
            )
    if K == 0:
        raise ValueError(
            f"{where}: stack {name(0)} has K = 0 workers (shape {tuple(stacks[0].shape)}): a merge needs at least one delta"
        )
    return K or 0


def _stack_ids(stack_ids, count: int, where: str) -> list[int]:
    """The stacks' ids in DARE's stream (default: their positions): ints only, one per stack."""
    if stack_ids is None:
        return list(range(count))
    try:
        listed = None if isinstance(stack_ids, (str, bytes)) else list(stack_ids)
    except TypeError:  # not iterable (a number, a 0-d tensor)
        listed = None
    if listed is None:
        raise TypeError(f"{where}: stack_ids must be a sequence of ints, one per stack, got {stack_ids!r}")
    ids = []
    for i, v in enumerate(listed):
        try:
            if isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
                raise TypeError
            ids.append(operator.index(v))
        except TypeError:
            raise TypeError(
                f"{where}: stack_ids[{i}] must be an int (stack {i}'s id in DARE's stream), got {v!r}"
            ) from None
    if len(ids) != count:
        raise ValueError(f"{where}: {len(ids)} stack_ids for {count} stacks")
    return ids


def _check_finite(stacks: Sequence[torch.Tensor], where: str) -> None:
    views, names = [], []
    for j, s in enumerate(stacks):
        for k in range(s.shape[0]):
            views.append(s[k])
            names.append(f"{where}: stack {j} (shape {tuple(s.shape)}), worker {k}")
    check_all_finite(views, names)


def _mean(s: torch.Tensor, cd: torch.dtype, omega: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean over dim 0 in the compute dtype: torch's mean (bit for bit), except where its K-term
    sum overflowed although every input is finite; those entries again in float64, each term
    divided by K first (the mean of finite values fits: it is at most their largest magnitude).
    omega: normalized weights [K] (float64): the weighted mean Σ ω_k s_k instead, by the same rule."""
    x = s.to(cd)
    out = x.mean(0) if omega is None else torch.tensordot(omega.to(x.device, cd), x, dims=1)
    bad = ~torch.isfinite(out).reshape(-1)
    if bool(bad.any()):
        terms = x.reshape(x.shape[0], -1)[:, bad].to(torch.float64)
        if omega is None:  # each term divided by K first
            fix = (terms / x.shape[0]).sum(0)
        else:  # each term times its weight first
            fix = (terms * omega.to(x.device)[:, None]).sum(0)
        out.view(-1)[bad] = fix.to(cd)
    return out


def _spectral(
    method: str, bucket: list[torch.Tensor], opts: dict, flatten_method: str, omega: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """One batched merge (iso_c, norm_mean, tsv, iso_cts) of same-shaped 2-D stacks; [B, m, n] in the
    compute dtype."""
    dtype = bucket[0].dtype
    cd = compute_dtype(dtype)
    x = torch.stack([s.to(cd) for s in bucket])  # [B, K, m, n]
    amax = x.abs().amax((1, 2, 3))
    _, e = torch.frexp(amax)
    scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e - 1), torch.ones_like(amax))
    x = x / scale[:, None, None, None]
    w = None if omega is None else omega.to(x.device, cd)
    if method == "iso_c":
        out = iso_flatten(x.mean(1) if w is None else torch.tensordot(x, w, dims=([1], [0])), method=flatten_method)
    elif method == "norm_mean":
        out = norm_mean_merge(x, w)
    elif method == "tsv":
        out = tsv_merge(x, dtype, keep=opts["keep"], method=flatten_method, weights=w)
    else:
        out = iso_cts_merge(x, dtype, common_fraction=opts["common_fraction"], method=flatten_method, weights=w)
    return out * scale[:, None, None]


def _compute(
    stacks, method: str, opts: dict, flatten_method: str, stack_ids, omega=None, workers=None
) -> list[torch.Tensor]:
    """Every stack's merge in its compute dtype. omega: the workers' normalized weights (None: equal);
    workers: each stack row's worker index in DARE's stream (None: its position)."""
    results: list[Optional[torch.Tensor]] = [None] * len(stacks)
    buckets: dict[tuple, list[int]] = {}
    for j, s in enumerate(stacks):
        cd = compute_dtype(s.dtype)
        if s.numel() == 0:
            results[j] = torch.zeros(s.shape[1:], dtype=cd, device=s.device)
        elif method in ("ties", "dare"):
            results[j] = sparse_merge(s, opts, stack_ids[j], weights=omega, workers=workers)
        elif method == "mean" or s.ndim != 3:
            results[j] = _mean(s, cd, omega)
        else:
            buckets.setdefault((tuple(s.shape), s.dtype, s.device), []).append(j)
    for idx in buckets.values():
        out = _spectral(method, [stacks[j] for j in idx], opts, flatten_method, omega)
        for j, o in zip(idx, out):
            results[j] = o
    return results


_NAMES = {
    "mean": "mean",
    "iso_c": "Iso-C",
    "norm_mean": "norm-mean",
    "tsv": "TSV-M",
    "iso_cts": "Iso-CTS",
    "ties": "TIES",
    "dare": "DARE",
}


def _check_fits(r: torch.Tensor, s: torch.Tensor, method: str, j: int) -> None:
    """Raise ResultOverflowError naming the merge and the stack when result r (compute dtype) does
    not fit stack s's dtype; `method`'s own name, or the mean for a tensor it averages (not 2-D)."""
    if not r.numel():
        return
    amax = float(r.abs().amax())
    wider = r.dtype != s.dtype and torch.finfo(r.dtype).max > torch.finfo(s.dtype).max
    if amax < (overflow_limit(s.dtype) if wider else math.inf):
        return
    name = _NAMES[method] if method in ("ties", "dare") or s.ndim == 3 else "mean"
    raise ResultOverflowError(
        f"merge {method!r}: stack {j}: the {name} result does not fit {s.dtype} (largest entry {amax:.4g}, "
        "the input is finite); nothing was written"
    )


def merge(
    stacks: Sequence[torch.Tensor],
    method: str = "iso_c",
    *,
    flatten_method: str = "auto",
    stack_ids: Optional[Sequence[int]] = None,
    weights=None,
    clip=None,
    **options,
) -> list[torch.Tensor]:
    """The merge `method` of every worker stack [K, *shape], out of place: a list of [*shape]
    tensors in each stack's dtype. Nothing is written.

    stacks: one tensor per parameter, its K workers' pseudo-gradients (global − local) on dim 0;
        every stack must have the same K ≥ 1, a supported float dtype, finite values.
    method: one of MERGES ("mean", "iso_c", "norm_mean", "tsv", "iso_cts", "ties", "dare"); options: that
        merge's (merges/options.py), e.g. `merge(stacks, "ties", sparsity=0.8)`.
    flatten_method: the Iso-C flatten behind iso_c and every orthogonal polar factor (tsv, iso_cts).
    stack_ids: each stack's identity in DARE's random stream (ints; default: its position), so a
        subset of stacks merged elsewhere draws the same drops.
    weights: one non-negative weight per worker (a sequence of K numbers or a 1-D tensor; e.g. the
        tokens each processed, 0 for a worker that did not deliver), the same for every stack; None:
        equal. The merge of the workers with weight > 0 under their normalized weights (each merge's
        weighted form: merges/options.py, docs/merges.md); equal weights are the unweighted merge bit
        for bit, a zero weight is that worker dropped (DARE: the others keep their stream indices).
        Every worker's Δ must still be finite, a zero-weight one's too.
    clip: None, "median" or a positive number: before the merge, each worker's Δ of each stack is scaled
        to at most the cap (its 2-norm over the whole tensor; "median": the median of the workers' norms
        of that stack, over the workers with weight > 0; a number: that cap), never grown, and rounded to
        the stack's dtype (merges/norm.py). `clip_stacks` returns the norms it saw.

    Raises:
        TypeError, ValueError: naming the stack, worker, weight or option (a stack that is not a tensor
            of a supported float dtype, K = 0 or K differing between stacks, NaN/Inf, an unknown merge
            or option, a stack id that is not an int, weights that are not K finite numbers ≥ 0 with
            one > 0, a clip that is not "median" or a number > 0); nothing is computed.
        ResultOverflowError: a result does not fit its dtype (DARE's rescale can push one past it),
            naming the merge and the stack. The mean of finite stacks always fits.

    Examples:
        >>> deltas = torch.randn(4, 64, 32)             # K = 4 workers' deltas of one matrix
        >>> merged = merge([deltas], "tsv")[0]
        >>> tuple(merged.shape)
        (64, 32)
        >>> s = torch.linalg.svdvals(merge([deltas], "iso_cts")[0])
        >>> bool(torch.allclose(s, s.mean().expand(32), rtol=1e-4))   # Iso-CTS: one singular value
        True
    """
    stacks = list(stacks)
    opts = resolve_options(method, options)
    K = check_stacks(stacks)
    stack_ids = _stack_ids(stack_ids, len(stacks), "merge")
    w = resolve_weights(weights, K, "merge") if stacks else resolve_weights(None, 0)
    clip = resolve_clip(clip, "merge")
    _check_finite(stacks, "merge")
    inputs = stacks if clip is None else clip_stacks(stacks, clip, w.active).stacks
    if w.active is not None:  # zero weights: those workers dropped (each row keeps its worker index for DARE)
        inputs = [s[w.active] for s in inputs]
    results = _compute(inputs, method, opts, flatten_method, stack_ids, w.omega, w.active)
    for j, (s, r) in enumerate(zip(stacks, results)):
        _check_fits(r, s, method, j)
    return [r.to(s.dtype) for s, r in zip(stacks, results)]


def merge_(stacks: Sequence[torch.Tensor], method: str = "iso_c", **kwargs) -> list[torch.Tensor]:
    """`merge`, written in place into each stack's first worker slot (stack[0]); returns those views.
    All or nothing: every stack is checked and merged aside before the first write.

    Raises:
        TypeError, ValueError, ResultOverflowError: as `merge`; nothing is written.
        RuntimeError: a slot that cannot be written (a stack that requires grad while grad mode
            is on, an inference tensor, an expanded view, two slots sharing memory), named; nothing
            is written.

    Examples:
        >>> stack = torch.randn(4, 16, 8)
        >>> want = merge([stack], "ties", sparsity=0.5)[0]
        >>> slot = merge_([stack], "ties", sparsity=0.5)[0]
        >>> bool(torch.equal(slot, want)) and slot.data_ptr() == stack.data_ptr()
        True
    """
    stacks = list(stacks)
    check_stacks(stacks, "merge_")
    for j, s in enumerate(stacks):
        if s.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                f"merge_: stack {j} requires grad, but the merges have no backward (its worker-0 slot cannot be "
                "written under autograd); pass .detach() or call merge_ under torch.no_grad(); nothing was written"
            )
    slots = [s[0] for s in stacks]
    check_writable(slots, [f"merge_: stack {j} (its worker-0 slot)" for j in range(len(stacks))])
    merged = merge(stacks, method, **kwargs)
    for slot, m in zip(slots, merged):
        slot.copy_(m)
    return slots


def merge_groups(
    stacks: dict,
    merged: set,
    method: str,
    options: dict,
    step: int,
    flatten_method: str = "auto",
    weights=None,
    clip=None,
) -> dict:
    """The outer optimizers' merge of their params' stacks ({param index: [K, *shape]}): `method` for
    the indices in `merged`, the mean for the others (param groups with iso=False); the param index is
    each stack's id in DARE's stream and DARE's seed is offset by `step`, so one process (`MergeLoCo`)
    and a sharded step (`ShardedIsoLoCo(merge=...)`) draw the same drops. weights, clip: as `merge`'s, for
    both. Returns {index: result}."""
    opts = dict(options)
    if method == "dare":
        opts["seed"] = opts.get("seed", 0) + step
    idx = sorted(stacks)
    chosen = [i for i in idx if i in merged] if method not in ("iso_c", "mean") else []
    plain = [i for i in idx if i not in set(chosen)]
    out = {}
    if chosen:
        got = merge(
            [stacks[i] for i in chosen],
            method,
            flatten_method=flatten_method,
            stack_ids=chosen,
            weights=weights,
            clip=clip,
            **opts,
        )
        out.update(zip(chosen, got))
    if plain:
        out.update(zip(plain, merge([stacks[i] for i in plain], "mean", weights=weights, clip=clip)))
    return out
