"""`sharded_iso_merge_`: `iso_merge_` for buckets already equal on every rank, the work split.

For codebases that all-reduce pseudo-gradients themselves (torchft, OpenDiLoCo): each rank
Iso-C-flattens the matrices `plan_shards` gives it and the results are all-gathered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch

from .._validate import check_all_finite, check_matrix_tensor, check_writable
from ..flatten.registry import check_method
from . import pipeline
from .agree import Agreement, check_on_comm_device, comm_device, group_info
from .pipeline import CHUNK_BYTES, broadcast_into, check_chunk_bytes, scatter_into
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
    agreement: Optional[Agreement] = None,
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
    differs) and no bucket changes; so does a buffer one rank cannot allocate (every buffer is made
    before the ranks first agree). Each rank's share is flattened in slices whose scratch stays
    within `flatten.registry.workspace_bytes()`, as in `iso_merge_`. `process_group`: the group (None: the
    default group). `agreement`: an outer step's `agree.Agreement`
    over the same group, to run inside (a failure of that step's local work before this call is
    reported at this call's first agreement, and the step agrees again after it); None: this call
    agrees on its own, and once more at its end (a failure while writing reaches every rank).

    Raises:
        DistributedStepError: on every rank, as above; no bucket changes.
        RuntimeError: torch.distributed is not initialized.

    Examples:
        >>> # on every rank, after torch.distributed.init_process_group(...), buckets already averaged
        >>> b = torch.randn(4, 16, 8)
        >>> ref = iso_merge_([b.clone()])[0]
        >>> bool(torch.allclose(sharded_iso_merge_([b])[0], ref, atol=1e-6))
        True
    """
    group = process_group
    buckets = list(buckets)
    rank, world = group_info(group)
    ag = agreement if agreement is not None else Agreement("sharded_iso_merge_", group, mismatch=PLAN_MISMATCH)
    # every check inside: a rank that refuses its arguments must still reach the agreement
    units, plan = ag.attempt(_plan, buckets, rank, world, group, method, chunk_bytes, solo_above) or ([], None)
    # every buffer of the call (the copies flattened aside, the collectives' buffers) before the
    # ranks agree: a rank that cannot allocate one fails every rank there, with nothing changed
    bufs = ag.attempt(_buffers, buckets, units, plan, rank, group, chunk_bytes)
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

    def unit(u: int) -> torch.Tensor:
        k, j = units[u]
        return buckets[k] if j is None else buckets[k][j]

    # My matrices, copied aside and flattened before anyone writes (the flatten takes each batch in
    # slices of bounded scratch; checked above: only these copies are written).
    ag.attempt(_copy_aside, bufs, unit)
    ag.attempt(torch.ops.isoloco.iso_merge_, [blk for blk, _ in bufs.batches], method, True)
    ag.settle()  # any failure reaches the other ranks before they write

    # From here the collectives run on every rank whatever happens locally; the local work between
    # them runs under `ag.attempt`, and the last agreement tells every rank whether any failed.
    ag.attempt(_write_solo, bufs, unit)
    # the all-gather writes contiguous units in place, the others through their stand-ins
    flat_units = [bufs.standins[u] if u in bufs.standins else unit(u) for u in range(len(units))]
    for dt, own in bufs.owns.items():
        scatter_into(plan, dt, own, flat_units, rank, group, chunk_bytes, bufs.gather.get(dt), ag.attempt)
    ag.attempt(_write_standins, bufs, unit)
    for u in sorted(plan.solo):
        broadcast_into(flat_units[u], plan.owners[u], group, chunk_bytes, bufs.flats.get(u), ag.attempt)
    if agreement is None and world > 1:
        ag.settle(written=True)
    return buckets


def _write_solo(bufs, unit) -> None:
    """The solo matrices I flattened aside into their buckets."""
    for blk, us in bufs.batches:
        if us is not None:
            for u, r in zip(us, blk.unbind(0)):
                unit(u).copy_(r)


def _write_standins(bufs, unit) -> None:
    """Non-contiguous units from the contiguous stand-ins the all-gather filled."""
    for u, s in bufs.standins.items():
        unit(u).copy_(s)


class _Buffers:
    """Every buffer `sharded_iso_merge_` makes, all from `pipeline.comm_buffer`, before its
    ranks first agree.

    owns: my flat segment per sharded dtype (on the group's communication device: the all-gather
    sends from it), into which my share of each bucket is copied and flattened; batches: (block,
    None) for those shares (views of `owns`) and (copy, unit indices) for the solo matrices I own,
    per bucket; gather: the all-gather's chunk buffers per dtype; standins: a contiguous buffer
    shaped like each non-contiguous sharded unit, which the all-gather fills (copied into the
    unit after it); flats: a flat copy for each non-contiguous solo unit, which the broadcast
    goes through."""

    def __init__(self):
        self.owns: dict[torch.dtype, torch.Tensor] = {}
        self.batches: list[tuple[torch.Tensor, Optional[list[int]]]] = []
        self.members: list[list[int]] = []  # the units copied into each batch, in order
        self.gather: dict[torch.dtype, list[torch.Tensor]] = {}
        self.standins: dict[int, torch.Tensor] = {}
        self.flats: dict[int, torch.Tensor] = {}


def _buffers(buckets, units, plan, rank, group, chunk_bytes) -> _Buffers:
    """The buffers of one `sharded_iso_merge_` call (`_Buffers`), sized by this rank's plan."""
    device, world = comm_device(group), plan.world_size
    out = _Buffers()

    def shape(u: int) -> torch.Size:
        k, j = units[u]
        return buckets[k].shape if j is None else buckets[k].shape[1:]

    def contiguous(u: int) -> bool:
        k, j = units[u]
        return (buckets[k] if j is None else buckets[k][j]).is_contiguous()

    for dt in plan.sharded_dtypes:
        per_rank, seg = plan.layout(dt)
        own = pipeline.comm_buffer(seg, dt, device, False)
        by_bucket: dict[int, list[tuple[int, int]]] = {}
        for u, off in per_rank[rank]:
            by_bucket.setdefault(units[u][0], []).append((u, off))
        for k, members in by_bucket.items():
            m, n = buckets[k].shape[-2:]
            block = own[members[0][1] : members[0][1] + len(members) * m * n].view(len(members), m, n)
            out.batches.append((block, None))
            out.members.append([u for u, _ in members])
        out.owns[dt] = own
        if world > 1:
            out.gather[dt] = pipeline.gather_segment_buffers(plan, dt, group, chunk_bytes)
    solo_mine: dict[int, list[int]] = {}
    for u in sorted(plan.solo):
        if plan.owners[u] == rank:
            solo_mine.setdefault(units[u][0], []).append(u)
    for k, us in solo_mine.items():
        m, n = buckets[k].shape[-2:]
        batch = pipeline.comm_buffer(len(us) * m * n, buckets[k].dtype, buckets[k].device, False)
        out.batches.append((batch.view(len(us), m, n), us))
        out.members.append(us)
    for u in range(len(units)):
        if contiguous(u):
            continue
        dt = buckets[units[u][0]].dtype
        if u in plan.solo:
            out.flats[u] = pipeline.comm_buffer(shape(u).numel(), dt, device, False)
        elif world > 1:
            out.standins[u] = pipeline.comm_buffer(shape(u).numel(), dt, device, False).view(shape(u))
    return out


def _copy_aside(bufs: _Buffers, unit) -> None:
    """My matrices into their batches (`_Buffers.batches`), to be flattened there."""
    for (blk, _), us in zip(bufs.batches, bufs.members):
        torch._foreach_copy_(list(blk.unbind(0)), [unit(u) for u in us])


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
