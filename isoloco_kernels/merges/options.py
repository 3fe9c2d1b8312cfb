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
"""

from __future__ import annotations

import math

__all__ = ["MERGES", "resolve_options"]

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
