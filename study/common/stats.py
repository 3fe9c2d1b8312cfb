"""The paired statistics the questions' gaps use: one seed is one pair (same init and data for both methods).

paired_bootstrap_ci, the percentile bootstrap of the mean paired difference; t_interval, its 95 % Student-t
interval; paired_t and paired_gap, a − b over the seeds both have with those intervals; mean_of, fmt and
interval_text, the mean and the number formats of the tables; markdown_table, a table from its header and rows.
"""

from __future__ import annotations

import statistics


def paired_bootstrap_ci(a, b, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of the paired differences a_i − b_i and its percentile-bootstrap
    interval at `level`. Pair i is one seed of both methods (same init and data), so the pairs are
    resampled together, with replacement, n_boot times, and the interval is the (1 − level)/2 and
    (1 + level)/2 quantiles of the resampled means. Deterministic for a given seed. With fewer than
    two pairs there is no interval: lo and hi are NaN. With few pairs (3 seeds) the percentile
    interval is too narrow (it cannot be wider than the pairs' range); read it with the pairs."""
    import random

    if len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError(f"level must be in (0, 1) and n_boot ≥ 1, got {level}, {n_boot}")
    d = [x - y for x, y in zip(a, b)]
    if not d:
        raise ValueError("no pairs")
    mean = statistics.fmean(d)
    if len(d) < 2:
        return mean, float("nan"), float("nan")
    rng, n = random.Random(seed), len(d)
    boots = sorted(statistics.fmean(rng.choices(d, k=n)) for _ in range(n_boot))
    q = lambda p: boots[min(n_boot - 1, max(0, round(p * (n_boot - 1))))]
    return mean, q((1 - level) / 2), q((1 + level) / 2)


def mean_of(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def paired_gap(a: dict | None, b: dict | None, paired_ci) -> dict | None:
    """a − b on the test split over the seeds both have, with its bootstrap interval."""
    if not a or not b:
        return None
    seeds = sorted(s for s in set(a["test"]) & set(b["test"]) if a["test"][s] is not None and b["test"][s] is not None)
    if not seeds:
        return None
    x, y = [a["test"][s] for s in seeds], [b["test"][s] for s in seeds]
    mean, lo, hi = paired_ci(x, y)
    d = [u - v for u, v in zip(x, y)]
    t_lo, t_hi = t_interval(d)
    return {"seeds": seeds, "per_seed": d, "mean": mean, "lo": lo, "hi": hi, "t_lo": t_lo, "t_hi": t_hi}


# Student's t, 0.975 quantile, by degrees of freedom (1 … 9)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def t_interval(d: list[float]) -> tuple[float, float]:
    """The 95 % Student-t interval of the mean of the paired differences d (NaN below two pairs). With
    3 seeds it is wide where the percentile bootstrap is too narrow: the two bracket what the pairs say."""
    n = len(d)
    if n < 2:
        return float("nan"), float("nan")
    half = _T975[min(n - 2, len(_T975) - 1)] * statistics.stdev(d) / n**0.5  # beyond 9 df: 9 df's, a bit wide
    m = statistics.fmean(d)
    return m - half, m + half


def paired_t(a: dict, b: dict) -> dict | None:
    """a − b over the seeds both map to a number (None and NaN skipped), with its 95 % t interval (None: no pair)."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b)) if a[s] is not None and b[s] is not None]
    d = [x for x in d if x == x]
    if not d:
        return None
    lo, hi = t_interval(d)
    return {"seeds": len(d), "mean": statistics.fmean(d), "t_lo": lo, "t_hi": hi, "per_seed": d}


def fmt(x, spec="+.3f"):
    return "—" if x is None or x != x else format(x, spec)


def interval_text(g: dict | None) -> str:
    """A paired_t gap as the tables write it: mean [95 % t] (seeds)."""
    if not g:
        return "—"
    return f"{fmt(g['mean'])} [{fmt(g['t_lo'])}, {fmt(g['t_hi'])}] ({g['seeds']} seeds)"


def markdown_table(header, rows) -> str:
    """A markdown table: the header's cells, then one line per row of cells (each written with str)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])
