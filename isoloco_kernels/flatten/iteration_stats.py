"""What the residual-checked flatten methods (polar.py, gram.py) did: counts, fallbacks, the warning.

Each such method keeps one `Recorder`; `Recorder.finish` records a call and, when matrices missed
the method's accuracy check and were recomputed by another method, warns with the method's
`FlattenFallbackWarning` class.
"""

from __future__ import annotations

import dataclasses
import warnings

__all__ = ["FlattenFallbackWarning", "FlattenStats", "Recorder"]


class FlattenFallbackWarning(RuntimeWarning):
    """Some matrices missed a flatten method's accuracy check and were recomputed by another method.

    The result still meets the requested method's contract (the recomputing method is more exact);
    only time was lost. Raised as a warning before anything is written, so turning it into an error
    (`warnings.simplefilter("error", FlattenFallbackWarning)`) leaves the input untouched.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore", FlattenFallbackWarning)  # fallbacks expected here
        ...     y = iso_flatten(torch.zeros(4, 4), method="polar")
        >>> bool(y.abs().max() == 0)
        True
    """


@dataclasses.dataclass
class FlattenStats:
    """What a flatten did. `last_*` describe the latest call, the rest are running totals."""

    calls: int = 0
    matrices: int = 0
    recomputed: int = 0
    last_matrices: int = 0
    last_recomputed: tuple[int, ...] = ()
    last_max_residual: float = 0.0  # max over the batch of |r − ‖X‖_F²| / √r (before fallback)

    def after(self, nb: int, recomputed: tuple[int, ...], max_residual: float) -> "FlattenStats":
        """These statistics updated with one call over `nb` matrices."""
        return dataclasses.replace(
            self,
            calls=self.calls + 1,
            matrices=self.matrices + nb,
            recomputed=self.recomputed + len(recomputed),
            last_matrices=nb,
            last_recomputed=recomputed,
            last_max_residual=max_residual,
        )


class Recorder:
    """The running statistics of one flatten method, and its fallback warning."""

    def __init__(self, name: str = "", warning: type[Warning] = FlattenFallbackWarning) -> None:
        self.name = name
        self.warning = warning
        self._stats = FlattenStats()

    def last(self) -> FlattenStats:
        """A copy of the running statistics."""
        return dataclasses.replace(self._stats)

    def reset(self) -> None:
        self._stats = FlattenStats()

    def record(self, nb: int, recomputed: tuple[int, ...], max_residual: float) -> None:
        self._stats = self._stats.after(nb, recomputed, max_residual)

    def finish(self, shape, recomputed, max_residual: float, *, why: str, by: str, stacklevel: int = 3) -> None:
        """Record one call over a [B, m, n] batch of `shape` and warn when matrices were recomputed:
        `why` says what they missed, `by` what recomputed them. `stacklevel` counts from the
        method's function (as if it called warnings.warn itself)."""
        nb = int(shape[0])
        idx = tuple(int(i) for i in recomputed)
        self.record(nb, idx, max_residual)
        if idx:
            shown = f"{list(idx[:8])}{'…' if len(idx) > 8 else ''}"
            warnings.warn(
                f"isoloco {self.name} flatten: {len(idx)} of {nb} matrices of shape {tuple(shape[1:])} "
                f"missed the accuracy check ({why}) and were recomputed {by}: matrices {shown}",
                self.warning,
                stacklevel=stacklevel + 1,
            )
