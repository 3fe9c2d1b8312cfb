"""`sharded_iso_merge_`: `iso_merge_` for buckets already equal on every rank, the work split.

For codebases that all-reduce pseudo-gradients themselves (torchft, OpenDiLoCo): each rank
Iso-C-flattens the matrices `plan_shards` gives it and the results are all-gathered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from .._validate import check_all_finite, check_matrix_tensor, check_writable
from ..flatten import check_method
from ..ops import iso_merge_unchecked_
from .agree import Agreement, check_on_comm_device, comm_device, group_info, renamed_keyword
from .collectives import CHUNK_BYTES, broadcast_into, check_chunk_bytes, scatter_into
from .plan import plan_shards

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["sharded_iso_merge_"]

PLAN_MISMATCH = "the ranks built different shard plans"


def sharded_iso_merge_(
    buckets: Iterable[torch.Tensor],
    process_group: Optional[ProcessGroup] = None,
    *,
    method: str = "auto",
    chunk_bytes: int = CHUNK_BYTES,
    solo_above: Optional[float] = 1.0,
    **old: Any,
) -> list[torch.Tensor]:
    """`iso_merge_` for buckets that are already averaged (equal on every rank), with the work split.

    The unit of work is one matrix (a [B, m, n] bucket is B units), so a few large buckets still
    spread over many ranks. Each rank flattens the matrices `plan_shards` gives it, batched per
    bucket; the results are all-gathered into every rank's buckets (solo matrices: broadcast from
    their owner), in communication chunks of about `chunk_bytes`. The result equals
    `iso_merge_(buckets, method=method)` on every rank.
    All-or-nothing across the group: bad input on any rank (method, type, dtype, shape, NaN/Inf,
    buckets off the group's communication device) or ranks passing different shapes, method,
    chunk_bytes or solo_above raise DistributedStepError on every rank (naming the ranks and what
    differs) and no bucket changes. `process_group`: the group (None: the default group); `group=`
    is its old name and `bucket_bytes=` the old name of chunk_bytes (both still accepted, with a
    DeprecationWarning).
    """
    where = "sharded_iso_merge_"
    group = renamed_keyword(
        {k: v for k, v in old.items() if k != "bucket_bytes"}, "group", "process_group", process_group, None, where
    )
    old_chunk = {k: v for k, v in old.items() if k == "bucket_bytes"}
    chunk_bytes = renamed_keyword(old_chunk, "bucket_bytes", "chunk_bytes", chunk_bytes, CHUNK_BYTES, where)
    buckets = list(buckets)
    rank, world = group_info(group)
    ag = Agreement("sharded_iso_merge_", group, mismatch=PLAN_MISMATCH)
    # every check inside: a rank that refuses its arguments must still reach the agreement
    units, plan = ag.attempt(_plan, buckets, rank, world, group, method, chunk_bytes, solo_above) or ([], None)
    # the settings that change which collectives run (plan, chunk size) or what is written (method)
    ag.settle(
        settings=None
        if plan is None
        else {
            "method": repr(method),
            "chunk_bytes": repr(chunk_bytes),
            "solo_above": repr(solo_above),
            "shard plan (bucket shapes and dtypes)": f"{plan.fingerprint:#x}",
        }
    )
    device = comm_device(group)

    def unit(u: int) -> torch.Tensor:
        k, j = units[u]
        return buckets[k] if j is None else buckets[k][j]

    # My matrices, copied aside and flattened before anyone writes: the segment ones inside my
    # flat segment (a bucket's share is one [b, m, n] block there), solo ones in fresh batches.
    owns, batches = {}, []
    for dt in plan.sharded_dtypes:
        per_rank, seg = plan.layout(dt)
        own = torch.empty(seg, dtype=dt, device=device)
        by_bucket: dict[int, list[tuple[int, int]]] = {}
        for u, off in per_rank[rank]:
            by_bucket.setdefault(units[u][0], []).append((u, off))
        for k, members in by_bucket.items():
            m, n = buckets[k].shape[-2:]
            block = own[members[0][1] : members[0][1] + len(members) * m * n].view(len(members), m, n)
            torch._foreach_copy_(list(block.unbind(0)), [unit(u) for u, _ in members])
            batches.append((block, None))
        owns[dt] = own
    solo_mine: dict[int, list[int]] = {}
    for u in sorted(plan.solo):
        if plan.owners[u] == rank:
            solo_mine.setdefault(units[u][0], []).append(u)
    for us in solo_mine.values():
        batches.append((torch.stack([unit(u) for u in us]), us))
    ag.attempt(iso_merge_unchecked_, [blk for blk, _ in batches], method)  # checked above
    ag.settle()  # any failure reaches the other ranks before they write

    for blk, us in batches:
        if us is not None:
            for u, r in zip(us, blk.unbind(0)):
                unit(u).copy_(r)
    flat_units = [unit(u) for u in range(len(units))]
    for dt, own in owns.items():
        scatter_into(plan, dt, own, flat_units, rank, group, chunk_bytes)
    for u in sorted(plan.solo):
        broadcast_into(flat_units[u], plan.owners[u], group, chunk_bytes)
    return buckets


def _plan(buckets, rank, world, group, method, chunk_bytes, solo_above):
    """Every check of sharded_iso_merge_'s arguments; (the units: (bucket, matrix or None), the plan)."""
    check_method(method)
    check_chunk_bytes(chunk_bytes, "sharded_iso_merge_: chunk_bytes")
    names = [f"bucket {i}" for i in range(len(buckets))]
    for b, name in zip(buckets, names):
        check_matrix_tensor(b, name)
    if world > 1:
        check_on_comm_device(buckets, [f"sharded_iso_merge_: {n}" for n in names], group)
    units = [(k, j) for k, b in enumerate(buckets) for j in (range(b.shape[0]) if b.ndim == 3 else (None,))]
    plan = plan_shards(
        [buckets[k].shape[-2:] for k, _ in units],
        world,
        dtypes=[buckets[k].dtype for k, _ in units],
        solo_above=solo_above,
    )
    check_writable(buckets, names)
    mine = sorted({units[u][0] for u in plan.owned(rank)})
    check_all_finite([buckets[k] for k in mine], [names[k] for k in mine])
    return units, plan
