"""`sharded_iso_merge_`: `iso_merge_` for buckets already equal on every rank, the work split.

For codebases that all-reduce pseudo-gradients themselves (torchft, OpenDiLoCo): each rank
Iso-C-flattens the matrices `plan_shards` gives it and the results are all-gathered.
"""
from __future__ import annotations

import numbers
from typing import Iterable, Optional

import torch

from .._validate import check_all_finite, check_matrix_tensor, check_writable
from ..flatten import check_method
from ..ops import iso_merge_unchecked_
from .agree import agree, check_on_comm_device, comm_device, error_text, group_info
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
    All-or-nothing across the group: bad input on any rank (method, type, dtype, shape, NaN/Inf,
    buckets off the group's communication device) or ranks passing different shapes, method,
    bucket_bytes or solo_above raise DistributedStepError on every rank (naming the ranks and what
    differs) and no bucket changes.
    """
    buckets = list(buckets)
    rank, world = group_info(group)
    error, plan, units = None, None, []
    try:  # every check inside: a rank that refuses its arguments must still reach the agreement
        check_method(method)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or bucket_bytes < 1:
            raise ValueError(f"sharded_iso_merge_: bucket_bytes must be a positive int, got {bucket_bytes!r}")
        names = [f"bucket {i}" for i in range(len(buckets))]
        for b, name in zip(buckets, names):
            check_matrix_tensor(b, name)
        if world > 1:
            check_on_comm_device(buckets, [f"sharded_iso_merge_: {n}" for n in names], group)
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
    # the settings that change which collectives run (plan, chunk size) or what is written (method)
    settings = None if error else {"method": repr(method), "bucket_bytes": repr(bucket_bytes),
                                   "solo_above": repr(solo_above),
                                   "shard plan (bucket shapes and dtypes)": f"{plan.fingerprint:#x}"}
    agree(error, group, "sharded_iso_merge_", mismatch=PLAN_MISMATCH, settings=settings)
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
    try:
        iso_merge_unchecked_([blk for blk, _ in batches], method)  # checked above
    except Exception as e:  # any failure must reach the other ranks before they write
        error = error_text(e)
    agree(error, group, "sharded_iso_merge_")

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
