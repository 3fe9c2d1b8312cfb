"""What the other optimizers need to know of a `ShardedIsoLoCo` checkpoint, and of its copies.

A rank's `ShardedIsoLoCo.state_dict()` holds the momentum of the params that rank owns, tagged with a
"sharding" entry (plan fingerprint, rank, world size), so it loads back only into the same rank of the
same plan; `ShardedIsoLoCo.consolidated_state_dict()` is the whole model's, for any world size, `IsoLoCo`
or `torch.optim.SGD` (docs/checkpoints.md). IsoLoCo and MergeLoCo refuse a per-rank state
(`refuse_rank_state`): loading one would silently drop every other rank's momentum. A copy (deepcopy,
pickle) of a `ShardedIsoLoCo` keeps everything but its process group, which it holds as `DROPPED`.
"""

from __future__ import annotations

__all__ = ["DROPPED", "refuse_rank_state"]

#: The process group of a copy until the user sets one (None is a real value: the default group).
DROPPED = "dropped by a copy"


def refuse_rank_state(state_dict, where: str) -> None:
    """ValueError for one rank's ShardedIsoLoCo state where a whole one is expected."""
    info = state_dict.get("sharding") if isinstance(state_dict, dict) else None
    if info is not None:
        rank, world = (info.get("rank"), info.get("world_size")) if isinstance(info, dict) else ("?", "?")
        raise ValueError(
            f"{where}: this is one rank's ShardedIsoLoCo state (rank {rank} of {world}: the momentum of the params "
            "that rank owns, not of the others); call ShardedIsoLoCo.consolidated_state_dict() on every rank and "
            "save that whole state to load it here (docs/checkpoints.md)"
        )
