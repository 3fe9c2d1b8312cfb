"""What the residual-checked iterations (polar.py, gram.py) did: counts, fallbacks, the warnings."""
from __future__ import annotations

import dataclasses

__all__ = ["PolarFallbackWarning", "PolarStats", "Recorder"]


class PolarFallbackWarning(RuntimeWarning):
    """Some matrices missed the polar iteration's accuracy check and were recomputed exactly."""


@dataclasses.dataclass
class PolarStats:
    """What a flatten did. `last_*` describe the latest call, the rest are running totals."""

    calls: int = 0
    matrices: int = 0
    recomputed: int = 0
    last_matrices: int = 0
    last_recomputed: tuple[int, ...] = ()
    last_max_residual: float = 0.0  # max over the batch of |r − ‖X‖_F²| / √r (before fallback)

    def after(self, nb: int, recomputed: tuple[int, ...], max_residual: float) -> "PolarStats":
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
    """The running statistics of one flatten method."""

    def __init__(self) -> None:
        self._stats = PolarStats()

    def last(self) -> PolarStats:
        """A copy of the running statistics."""
        return dataclasses.replace(self._stats)

    def reset(self) -> None:
        self._stats = PolarStats()

    def record(self, nb: int, recomputed: tuple[int, ...], max_residual: float) -> None:
        self._stats = self._stats.after(nb, recomputed, max_residual)
