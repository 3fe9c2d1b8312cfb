"""The error every rank of a collective outer step raises together."""

from __future__ import annotations

__all__ = ["DistributedStepError"]


class DistributedStepError(RuntimeError):
    """A collective outer step failed on at least one rank; no rank changed any tensor.

    Raised on every rank of the group together, by `ShardedIsoLoCo`, `IsoLoCo(process_group=...)`,
    `sharded_iso_merge_` and `average_`; the message names the failing ranks and what differed or went
    wrong there (the failing rank raises its own error). A `RuntimeError`.

    Examples:
        >>> issubclass(DistributedStepError, RuntimeError)
        True
    """
