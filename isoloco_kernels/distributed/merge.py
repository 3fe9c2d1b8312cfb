"""`sharded_iso_merge_`: `iso_merge_` for buckets already equal on every rank, the work split.

For codebases that all-reduce pseudo-gradients themselves (torchft, OpenDiLoCo): each rank
Iso-C-flattens the matrices `plan_shards` gives it and the results are all-gathered.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from .._validate import check_all_finite, check_matrix_tensor, check_writable
from ..flatten import check_method
from ..ops import iso_merge_unchecked_
from .agree import agree, comm_device, error_text, group_info
from .collectives import BUCKET_BYTES, broadcast_into, scatter_into
from .plan import plan_shards

__all__ = ["sharded_iso_merge_"]

PLAN_MISMATCH = "the ranks built different shard plans"


def sharded_iso_merge_(
    buckets: Iterable[torch.Tensor],
    group=None,
    *,
    method: str = "auto",
    bucket_bytes: int = BUCKET_BYTES,
    solo_above: Optional[float] = 1.0,
) -> list[torch.Tensor]:
    """`iso_merge_` for buckets that are already equal on every rank, with the work split.

    The unit of work is one matrix (a [B, m, n] bucket is B units), so a few large buckets still
    spread over many ranks. Each rank flattens the matrices `plan_shards` gives it, batched per
    bucket; the results are all-gathered into every rank's buckets (solo matrices: broadcast from
    their owner). The result equals `iso_merge_(buckets, method=method)` on every rank.
    All-or-nothing across the group: bad input on any rank (type, dtype, shape, NaN/Inf, ranks
    passing different shapes) raises DistributedStepError on every rank and no bucket changes.
    """
    buckets = list(buckets)
    rank, world = group_info(group)
    check_method(method)
    device = comm_device(group, next((b.device for b in buckets if isinstance(b, torch.Tensor)), None))
    error, plan, units = None, None, []
    try:
        names = [f"bucket {i}" for i in range(len(buckets))]
        for b, name in zip(buckets, names):
            check_matrix_tensor(b, name)
        units = [(k, j) for k, b in enumerate(buckets) for j in (range(b.shape[0]) if b.ndim == 3 else (None,))]
        plan = plan_shards(
            [buckets[k].shape[-2:] for k, _ in units], world, dtypes=[buckets[k].dtype for k, _ in units],
            solo_above=solo_above,
        )
        check_writable(buckets, names)
        mine = sorted({units[u][0] for u in plan.owned(rank)})
        check_all_finite([buckets[k] for k in mine], [names[k] for k in mine])
    except Exception as e:  # noqa: BLE001 — any failure must reach the other ranks
        error = error_text(e)
    agree(error, group, device, "sharded_iso_merge_", plan.fingerprint if plan else None, PLAN_MISMATCH)

    def unit(u: int) -> torch.Tensor:
        k, j = units[u]
        return buckets[k] if j is None else buckets[k][j]

    # My matrices, copied aside and flattened before anyone writes: the segment ones inside my
    # flat segment (a bucket's share is one [b, m, n] block there), solo ones in fresh batches.
    owns, batches = {}, []
    for dt in plan.sharded_dtypes:
        per_rank, seg = plan.layout(dt)
        own = torch.empty(seg, dtype=dt, device=unit(per_rank[rank][0][0]).device if per_rank[rank] else device)
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
    try:
        iso_merge_unchecked_([blk for blk, _ in batches], method)  # checked above
    except Exception as e:  # any failure must reach the other ranks before they write
        error = error_text(e)
    agree(error, group, device, "sharded_iso_merge_")

    for blk, us in batches:
        if us is not None:
            for u, r in zip(us, blk.unbind(0)):
                unit(u).copy_(r)
    flat_units = [unit(u) for u in range(len(units))]
    for dt, own in owns.items():
        scatter_into(plan, dt, own, flat_units, rank, group, bucket_bytes)
    for u in sorted(plan.solo):
        broadcast_into(flat_units[u], plan.owners[u], group, bucket_bytes)
    return buckets
