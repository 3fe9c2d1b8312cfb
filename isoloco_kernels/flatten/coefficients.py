"""Offline derivation of Polar Express schedules (not imported at run time; polar.py ships a table).

Step t of the iteration maps every singular value through an odd quintic p(x) = ax + bx³ + cx⁵,
the minimax approximation of 1 on the interval [ℓ_t, u_t] the previous steps left them in
(N. Amsel, D. Persson, C. Musco, R. M. Gower, "The Polar Express", arXiv:2505.16932, §4).

Two ways to get that quintic, chosen by how well float64 can resolve it:
- Remez exchange (`remez_odd_quintic`) while its 4×4 system is well conditioned: its answer moves
  by about cond·eps64 across BLAS builds, so it is used only while cond·eps64 ≤ `REMEZ_MAX_ERR`.
- Beyond that (an interval [1 − δ, 1 + δ] narrower than ~2·10⁻³: cond ≈ 2.8/δ²), the closed form
  `near_one_quintic`: p(1) = 1, p''(1) = 0 and p'(1) = −(3/4)·(p'''(1)/6)·δ², so that p − 1 is
  the scaled Chebyshev cubic (p'''(1)/6)·(δ³/4)·T₃((x − 1)/δ) to leading order: the minimax up to
  O(δ⁴) (≤ 1e-11 here), which is below the Remez answer's own noise at that width.

`python -m isoloco_kernels.flatten.coefficients [ell steps]` prints a table in the form polar.py keeps it.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np

__all__ = [
    "CUSHION",
    "SAFETY",
    "REMEZ_MAX_ERR",
    "Schedule",
    "remez_odd_quintic",
    "near_one_quintic",
    "remez_condition",
    "schedule",
    "polar_express_coefficients",
]

CUSHION = 0.024  # never design a step for an interval narrower than [CUSHION·u, u] (the paper's
# cushioning, value ≈ its 0.02407): keeps the early quintics monotone and tame
SAFETY = 0.01  # steps but the last use p(x / 1.01): slack for round-off pushing σ above u
REMEZ_MAX_ERR = 1e-10  # Remez only while cond(system)·eps64 stays below this

_EPS64 = float(np.finfo(np.float64).eps)
_SIGN = np.array([-1.0, 1.0, -1.0, 1.0])


def _nodes(lo: float, hi: float) -> np.ndarray:
    """Chebyshev-like start points lo < x₁ < x₂ < hi."""
    return lo + (hi - lo) * (1 - np.cos(np.pi * np.arange(4) / 3)) / 2


def _system(x: np.ndarray) -> np.ndarray:
    return np.stack([x, x**3, x**5, -_SIGN], 1)


def remez_condition(lo: float, hi: float) -> float:
    """2-norm condition number of the Remez system at its start points (≈ 2.8/δ² near 1)."""
    return float(np.linalg.cond(_system(_nodes(lo, hi))))


def remez_odd_quintic(lo: float, hi: float, iters: int = 100) -> tuple[float, float, float, float]:
    """(a, b, c, E): the odd quintic p(x) = ax + bx³ + cx⁵ minimising max |1 − p| on [lo, hi].

    Remez exchange in float64: p − 1 equioscillates at 4 points lo < x₁ < x₂ < hi
    (p = 1 − E, 1 + E, 1 − E, 1 + E); solve for (a, b, c, E) on the current points, move x₁, x₂ to
    the roots of p'(x) = a + 3bx² + 5cx⁴, repeat until the points stop moving. Meant for intervals
    where `remez_condition` · eps64 is small; narrower ones raise RuntimeError when the exchange
    cannot find two interior extrema.
    """
    if not 0 < lo < hi:
        raise ValueError(f"remez_odd_quintic: need 0 < lo < hi, got lo={lo}, hi={hi}")
    x = _nodes(lo, hi)
    for _ in range(iters):
        a, b, c, e = np.linalg.solve(_system(x), np.ones(4))
        y = np.roots([5 * c, 3 * b, a])  # p'(x) = 0 with y = x²
        y = np.sort(y[np.isreal(y)].real)
        y = y[(y > lo * lo) & (y < hi * hi)]
        if len(y) != 2:
            raise RuntimeError(f"remez_odd_quintic: {len(y)} interior extrema on [{lo}, {hi}]")
        new = np.array([lo, math.sqrt(y[0]), math.sqrt(y[1]), hi])
        done = np.max(np.abs(new - x)) <= 1e-15 * hi
        x = new
        if done:
            break
    return float(a), float(b), float(c), float(abs(e))


def near_one_quintic(lo: float, hi: float) -> tuple[float, float, float]:
    """(a, b, c) of the leading-order minimax odd quintic on a narrow [lo, hi] (closed form).

    On [1 − δ, 1 + δ]: with p(1) = 1, p''(1) = 0, p'(1) = −5cδ² (the Chebyshev condition above,
    p'''(1) = 40c), the linear conditions give c = 3 / (8 − 15δ²), b = −10c/3, a = 1 + 7c/3; δ → 0
    gives the limit (15, −10, 3)/8. Another centre m is the same problem in x/m.
    """
    if not 0 < lo < hi:
        raise ValueError(f"near_one_quintic: need 0 < lo < hi, got lo={lo}, hi={hi}")
    m = (lo + hi) / 2
    d = (hi - lo) / (2 * m)
    c = 3.0 / (8.0 - 15.0 * d * d)
    b = -10.0 * c / 3.0
    a = 1.0 + 7.0 * c / 3.0
    return a / m, b / m**3, c / m**5


def _range_on(a: float, b: float, c: float, lo: float, hi: float) -> tuple[float, float]:
    """(min, max) of p(x) = ax + bx³ + cx⁵ over [lo, hi]: the ends and the real critical points."""
    pts = [lo, hi]
    if c != 0 or b != 0:
        for y in np.roots([5 * c, 3 * b, a]):
            if abs(y.imag) <= 1e-12 * abs(y) and lo * lo < y.real < hi * hi:
                pts.append(math.sqrt(y.real))
    vals = [a * x + b * x**3 + c * x**5 for x in pts]
    return min(vals), max(vals)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A schedule and what it promises.

    coeffs[t] = (a, b, c) of step t; bounds[t] = e_t such that after steps 0..t every σ that
    started in [ell, 1] lies in [1 − e_t, 1 + e_t] (exact arithmetic; float64 adds round-off);
    conds[t] = condition number of step t's Remez system (0 for closed-form steps).
    """

    ell: float
    coeffs: tuple[tuple[float, float, float], ...]
    bounds: tuple[float, ...]
    conds: tuple[float, ...]


def schedule(ell: float, steps: int, cushion: float = CUSHION, safety: float = SAFETY) -> Schedule:
    """The per-step quintics that take singular values from [ell, 1] to 1 (arXiv:2505.16932, §4).

    Step t: p = minimax quintic on [max(ℓ, cushion·u), u] (Remez or the closed form, see the
    module docstring); rescaled so that it is centred on 1 over the true interval,
    1 − p(ℓ) = p(u) − 1; unless it is the last step, p(x / (1 + safety)). The next interval is
    [1 − e, 1 + e] with e the largest |1 − p| over [ℓ, u] (ends and critical points).
    Defined for every 0 < ell < 1 and steps ≥ 1; never falls back to raising.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"schedule: steps must be an int ≥ 1, got {steps!r}")
    if not 0.0 < ell < 1.0:
        raise ValueError(f"schedule: need 0 < ell < 1, got {ell!r}")
    lo, hi = float(ell), 1.0
    coeffs, bounds, conds = [], [], []
    for t in range(steps):
        rlo = max(lo, cushion * hi)
        cond = remez_condition(rlo, hi)
        if cond * _EPS64 <= REMEZ_MAX_ERR:
            a, b, c, _ = remez_odd_quintic(rlo, hi)
        else:
            a, b, c = near_one_quintic(rlo, hi)
            cond = 0.0
        r = 2.0 / (a * lo + b * lo**3 + c * lo**5 + a * hi + b * hi**3 + c * hi**5)
        a, b, c = a * r, b * r, c * r
        if t < steps - 1:
            a, b, c = a / (1 + safety), b / (1 + safety) ** 3, c / (1 + safety) ** 5
        pmin, pmax = _range_on(a, b, c, lo, hi)
        lo = min(pmin, 2.0 - pmax, 1.0)  # kept as is: 1 − (1 − lo) would round a small lo
        hi = 2.0 - lo
        coeffs.append((a, b, c))
        bounds.append(1.0 - lo)
        conds.append(cond)
        if lo <= 0:  # cannot happen with the cushion; guard the next step's interval anyway
            raise RuntimeError(f"schedule: step {t} left the interval [{lo}, {hi}]")
    return Schedule(float(ell), tuple(coeffs), tuple(bounds), tuple(conds))


def polar_express_coefficients(
    ell: float, steps: int, cushion: float = CUSHION, safety: float = SAFETY
) -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) per step of `schedule(ell, steps, cushion, safety)`."""
    return schedule(ell, steps, cushion, safety).coeffs


def _main(argv: list[str]) -> None:
    from . import polar  # noqa: PLC0415 (the defaults of the shipped table)

    ell = float(argv[0]) if argv else polar.ELL
    steps = int(argv[1]) if len(argv) > 1 else polar.STEPS
    s = schedule(ell, steps)
    for abc, e in zip(s.coeffs, s.bounds):
        print("    (" + ", ".join(repr(v) for v in abc) + f"),  # |1 − σ| ≤ {e:.1e}")


if __name__ == "__main__":
    _main(sys.argv[1:])
