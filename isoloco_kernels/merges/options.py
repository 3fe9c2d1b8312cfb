"""The merges and their options: one table, one check (used by the reference and the batched ops).

    mean     —
    iso_c    —                      (the flatten's `method` is the op's own keyword)
    norm_mean —                     the mean's direction at the workers' mean Frobenius norm
    tsv      keep=None              components per worker; None: ⌊r/K⌋ (at least 1)
    iso_cts  common_fraction=0.8    share of the short side given to the mean's common space
    ties     sparsity=0.1, dim="all", rescale=False
    dare     sparsity=0.1, dim="all", seed=0, disjoint=False

sparsity: the share dropped (TIES: the smallest entries; DARE: at random); dim: "all" (entries),
"row" or "column" (whole rows / columns, by their 2-norm for TIES); seed: DARE's drops are a
function of (seed, stack, worker, index), so pass a new seed each outer step (the optimizers do).
The defaults are the official IsoLoCo code's sweep settings (docs/merges.md).

Every merge also takes per-worker weights (`resolve_weights`): a weight w_k ≥ 0 per worker (tokens
processed, say; 0 for a worker that did not deliver this round). Every merge is defined on the workers
with w_k > 0 only, K' of them, with normalized weights ω_k = w_k / Σ w (docs/merges.md,
merges/reference.py): a zero weight is that worker dropped, and K' is the worker count every
per-worker budget uses (TSV-M's ⌊r/K'⌋, Iso-CTS's task share). Where the workers left all have the
same weight, the merge is the unweighted one of those workers, on the unweighted code path: equal
weights are bit for bit the merge without weights.

And a norm clip (`resolve_clip`) applied to every worker's Δ before the merge: "median" (each worker's
Δ of a tensor shrunk to at most the median of the workers' norms of that tensor) or a positive number
(an absolute cap); merges/norm.py computes it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch

__all__ = ["MERGES", "Weights", "resolve_clip", "resolve_options", "resolve_weights"]

MERGES = {
    "mean": {},
    "iso_c": {},
    "norm_mean": {},
    "tsv": {"keep": None},
    "iso_cts": {"common_fraction": 0.8},
    "ties": {"sparsity": 0.1, "dim": "all", "rescale": False},
    "dare": {"sparsity": 0.1, "dim": "all", "seed": 0, "disjoint": False},
}
_FIXED = {
    "ties": {"prune": "magnitude", "disjoint": True},
    "dare": {"prune": "random", "rescale": True},
}
DIMS = ("all", "row", "column")


def _fraction(v, key: str, method: str, top_open: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TypeError(f"merge {method!r}: {key} must be a number, got {v!r}")
    if not (0 <= v < 1 if top_open else 0 <= v <= 1):
        raise ValueError(f"merge {method!r}: {key} must be in [0, {'1)' if top_open else '1]'}, got {v!r}")
    return float(v)


def resolve_options(method: str, options: dict) -> dict:
    """The method's full keyword set (defaults filled in, fixed ones added), every value checked:
    ValueError/TypeError naming the method and the option."""
    if method not in MERGES:
        raise ValueError(f"merge must be one of {tuple(MERGES)}, got {method!r}")
    unknown = sorted(set(options) - set(MERGES[method]))
    if unknown:
        allowed = ", ".join(MERGES[method]) or "none"
        raise TypeError(f"merge {method!r}: unknown option(s) {unknown}; it takes {allowed}")
    out = {**MERGES[method], **options}
    if "sparsity" in out:
        out["sparsity"] = _fraction(out["sparsity"], "sparsity", method, top_open=True)
        if out["dim"] not in DIMS:
            raise ValueError(f"merge {method!r}: dim must be one of {DIMS}, got {out['dim']!r}")
    if "common_fraction" in out:
        out["common_fraction"] = _fraction(out["common_fraction"], "common_fraction", method, top_open=False)
    for key in ("rescale", "disjoint"):
        if key in out and not isinstance(out[key], bool):
            raise TypeError(f"merge {method!r}: {key} must be a bool, got {out[key]!r}")
    if "seed" in out and (isinstance(out["seed"], bool) or not isinstance(out["seed"], int)):
        raise TypeError(f"merge {method!r}: seed must be an int, got {out['seed']!r}")
    keep = out.get("keep")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"merge {method!r}: keep must be None or an int >= 1, got {keep!r}")
    return {**out, **_FIXED.get(method, {})}


class Weights(NamedTuple):
    """A checked weight vector, reduced: `active` the workers with weight > 0 (None: all K), `omega` their
    normalized weights in float64 (sum 1), or None where they are all equal (the unweighted merge)."""

    active: Optional[list[int]]
    omega: Optional[torch.Tensor]


def _values(weights, where: str) -> list[float]:
    """The weights as Python floats, refused by name where they are not a 1-D sequence of real numbers."""
    what = f"{where}: weights must be a 1-D tensor or a sequence of non-negative numbers, one per worker"
    if isinstance(weights, torch.Tensor):
        if weights.ndim != 1:
            raise ValueError(f"{what}; got a tensor of shape {tuple(weights.shape)}")
        if weights.dtype == torch.bool or weights.is_complex():
            raise TypeError(f"{what}; got a tensor of dtype {weights.dtype}")
        return [float(v) for v in weights.detach().to("cpu", torch.float64).tolist()]
    if isinstance(weights, (str, bytes)) or not (isinstance(weights, Sequence) or hasattr(weights, "__array__")):
        raise TypeError(f"{what}; got {type(weights).__name__}")
    if not isinstance(weights, Sequence):  # an array-like (numpy): through a tensor, checked as one
        return _values(torch.as_tensor(weights), where)
    out = []
    for i, v in enumerate(weights):
        if isinstance(v, torch.Tensor) and v.ndim == 0 and v.dtype != torch.bool and not v.is_complex():
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{where}: weights[{i}] must be a real number (worker {i}'s weight), got {v!r}")
        out.append(float(v))
    return out


def resolve_weights(weights, workers: int, where: str = "merge") -> Weights:
    """`weights` (None, a 1-D tensor or a sequence of K numbers) checked against K = `workers` and reduced
    (class Weights). Raises TypeError / ValueError naming the weight and its value: not a sequence of real
    numbers, a length other than K, NaN or Inf, a negative weight, or every weight 0."""
    if weights is None:
        return Weights(None, None)
    w = _values(weights, where)
    if len(w) != workers:
        raise ValueError(f"{where}: {len(w)} weights for K = {workers} workers: give one weight per worker")
    for i, v in enumerate(w):
        if not math.isfinite(v):
            raise ValueError(f"{where}: weights[{i}] = {v!r} (worker {i}'s weight) must be finite")
        if v < 0:
            raise ValueError(f"{where}: weights[{i}] = {v!r} (worker {i}'s weight) is negative; weights must be ≥ 0")
    active = [i for i, v in enumerate(w) if v > 0]
    if not active:
        raise ValueError(
            f"{where}: every weight is 0 ({workers} workers): there is nothing to merge; skip this round's outer "
            "step, or give the workers that delivered a positive weight"
        )
    kept = [w[i] for i in active]
    top = max(kept)
    rel = torch.tensor([v / top for v in kept], dtype=torch.float64)  # largest 1: the sum cannot overflow
    omega = None if all(v == kept[0] for v in kept) else rel / rel.sum()
    return Weights(None if len(active) == workers else active, omega)


def resolve_clip(clip, where: str = "merge"):
    """`clip` checked: None (no clip), "median", or a positive number (float; inf: a cap nothing reaches).
    Raises TypeError / ValueError naming the value: another string, a bool, a number ≤ 0 or NaN."""
    if clip is None or (isinstance(clip, str) and clip == "median"):
        return clip
    what = f"{where}: clip must be 'median' or a positive number (the largest Frobenius norm a worker's Δ keeps)"
    if isinstance(clip, torch.Tensor) and clip.ndim == 0 and clip.dtype != torch.bool and not clip.is_complex():
        clip = clip.item()
    if isinstance(clip, bool) or not isinstance(clip, numbers.Real):
        raise TypeError(f"{what}, got {clip!r}")
    v = float(clip)
    if math.isnan(v) or v <= 0:
        raise ValueError(f"{what}, got {clip!r}")
    return v
