"""`average_` (DiLoCo's chunked all-reduce-mean) and the DTensor step's padded all-gather and
owner all-to-alls of matrix shards (the gather and owner routes).

`average_` moves data in chunks of about `chunk_bytes` with at most two all-reduces in flight
(extra memory: a few chunks, never a copy of the model), sums in the compute dtype (`reduce_dtype`:
float32 for float16 and bfloat16) and rounds to the tensors' dtype once, after the division. Its
chunk machinery (`InFlight`, `CHUNK_BYTES`) and the sharded step's chunked, pipelined collectives
are pipeline.py, re-exported here. Every buffer handed to a collective here lives on the group's
`comm_device` (NCCL's rule: CUDA only) and comes from `pipeline.comm_buffer`, allocated before the
ranks agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional

import torch
import torch.distributed as dist

from .._validate import check_all_finite, check_writable
from . import pipeline
from .agree import Agreement, all_gather_single, comm_device, describe, fingerprint, group_info
from .pipeline import (
    CHUNK_BYTES,
    InFlight,
    _chunks,
    _copy_back,
    _offsets,
    _pack_chunk,
    flat_view,
    reduce_dtype,
)
from .plan import plan_shards

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["CHUNK_BYTES", "average_"]


def average_(
    tensors: Iterable[torch.Tensor],
    process_group: Optional[ProcessGroup] = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[torch.Tensor]:
    """All-reduce-mean a list of tensors in place over `process_group` (None: the default group), in
    chunks of about chunk_bytes: DiLoCo's pseudo-gradient average, after which the grads are
    "already averaged" (what `IsoLoCo(process_group=...)` and `sharded_iso_merge_` expect).

    Tensors are packed per (device, dtype) end to end into flat chunks (a tensor larger than a
    chunk is split), and up to two chunks' all-reduces are in flight at once, so extra memory is
    two chunks. Call it on every rank with the same shapes and dtypes in the same order (the
    DiLoCo pseudo-gradient average), with the same chunk_bytes. float16 and bfloat16 tensors
    are summed in float32 buffers and get the float32 mean rounded once to their dtype. Tensors off the group's
    communication device (`agree.comm_device`) travel through buffers on it. Returns the tensors
    as a list.

    Raises:
        DistributedStepError: on every rank, for bad input on any rank (type, dtype, NaN/Inf) or ranks
            passing different shapes, dtypes or chunk sizes; no tensor changes.
        RuntimeError: torch.distributed is not initialized.

    Examples:
        >>> # on every rank, after torch.distributed.init_process_group(...)
        >>> grads = [torch.ones(4, 3), torch.ones(5)]
        >>> [float(g.sum()) for g in average_(grads)]  # the same on every rank: the mean of the ranks'
        [12.0, 5.0]
    """
    group = process_group
    tensors = list(tensors)
    _, world = group_info(group)
    ag = Agreement("average_", group, alone=world == 1)
    ag.attempt(_check_average, tensors)
    if world == 1:
        return tensors
    # Every buffer before the ranks agree: a rank that cannot allocate one fails every rank there.
    kinds = ag.attempt(_average_buffers, tensors, chunk_bytes, comm_device(group))
    # Agree before the first all-reduce: a rank with bad input, or ranks passing different shapes,
    # dtypes or chunk sizes (gloo would abort the process on a size mismatch), fail on every rank.
    ag.settle(fingerprint(describe(tensors)), {"chunk_bytes": repr(chunk_bytes)})
    # From here the all-reduces run on every rank whatever happens locally; the local work between
    # them (packing, unpacking) runs under `attempt`, and a last agreement tells every rank if any
    # rank's failed (then the tensors may hold partly averaged values).
    for idx, flats, total, per, bufs in kinds:
        entries = ag.attempt(_offsets, tensors, idx) or []
        flight = InFlight(2, ag.attempt)
        for k, (a, b) in enumerate(_chunks(total, per)):
            buf = bufs[k % 3][: b - a]
            parts = ag.attempt(_pack_chunk, entries, flats, a, b, buf) or []

            def done(buf=buf, parts=parts):
                buf.div_(world)
                for i, ts, bs, n in parts:
                    flats[i][ts : ts + n].copy_(buf[bs : bs + n])

            flight.add(dist.all_reduce(buf, group=group, async_op=True), done)
        flight.drain()
        ag.attempt(_copy_back, tensors, flats, idx)
    ag.settle(written=True)
    return tensors


def _average_buffers(tensors, chunk_bytes: int, device) -> list[tuple]:
    """average_'s allocations, made before its agreement: per (device, dtype) of the non-empty
    tensors, (their indices, their flat views or copies, elements, elements per chunk, three chunk
    buffers in the reduce dtype on the communication device)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(i)
    out = []
    for (_, dtype), idx in by_kind.items():
        flats = {i: flat_view(tensors[i]) for i in idx}
        total = sum(tensors[i].numel() for i in idx)
        rdt = reduce_dtype(dtype)  # summed in float32 for 2-byte dtypes, rounded back once
        per = max(1, chunk_bytes // rdt.itemsize)
        out.append(
            (idx, flats, total, per, [pipeline.comm_buffer(min(per, total), rdt, device, False) for _ in range(3)])
        )
    return out


def _check_average(tensors) -> None:
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"average_: tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        if not t.is_floating_point():
            raise TypeError(f"average_: tensor {i} has dtype {t.dtype}; a mean needs a floating dtype")
    names = [f"average_: tensor {i}" for i in range(len(tensors))]
    check_writable(tensors, names)
    check_all_finite(tensors, names)  # NaN/Inf would spread to every rank


# -- DTensor matrices sharded on a 1-D mesh (`plan.ShardLayout`): the gather and owner routes'
#    collectives. Packing and unpacking run under the caller's `attempt` (agree.Agreement): a rank
#    whose local work failed sends zeros of the planned size and still joins, so none waits on it.
#    `shards`: this rank's local pieces; `devices`: where each whole matrix or result goes.


class GatherSegments:
    """Where each matrix's shards sit in one padded all-gather: per matrix, the offset of its
    piece in every rank's segment; the longest segment."""

    def __init__(self, layouts):
        self.layouts = list(layouts)
        self.world = self.layouts[0].world if self.layouts else 1
        seg = [0] * self.world
        self.offs = []
        for lay in self.layouts:
            self.offs.append(list(seg))
            for r in range(self.world):
                seg[r] += lay.numel(r)
        self.longest = max(seg)


def gather_buffers(group, dtype, segs: GatherSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """(send, recv) of `all_gather_shards`, on the group's communication device."""
    dev = comm_device(group)
    return pipeline.comm_buffer(segs.longest, dtype, dev, True), pipeline.comm_buffer(
        segs.world * segs.longest, dtype, dev, False
    )


def owner_buffers(group, dtype, send_split, recv_split) -> tuple[torch.Tensor, torch.Tensor]:
    """(send, recv) of one owner-route all-to-all, on the group's communication device."""
    dev = comm_device(group)
    return pipeline.comm_buffer(sum(send_split), dtype, dev, True), pipeline.comm_buffer(
        sum(recv_split), dtype, dev, False
    )


def all_gather_shards(group, segs: GatherSegments, shards, devices, attempt, buffers):
    """The whole matrices of `segs` on every rank (one padded all-gather on the group's
    communication device, into `buffers` = `gather_buffers(...)`, allocated before the ranks last
    agreed): (the list, or None once local work failed; elements received). The packing and the
    unpacking run under `attempt`; the all-gather runs on every rank whatever happened locally."""
    send, recv = buffers
    attempt(gather_pack, segs, shards, send)
    all_gather_single(recv, send, group=group)
    return attempt(gather_unpack, segs, recv, devices), recv.numel()


def gather_pack(segs: GatherSegments, shards, send: torch.Tensor) -> None:
    """This rank's shards into its segment of the all-gather."""
    for lay, o, loc in zip(segs.layouts, segs.offs, shards):
        send[o[lay.rank] : o[lay.rank] + loc.numel()].copy_(loc.reshape(-1))


def gather_unpack(segs: GatherSegments, recv: torch.Tensor, devices) -> list[torch.Tensor]:
    """Whole matrices from every rank's segment of the all-gather."""
    rows = recv.view(segs.world, segs.longest)
    out = []
    for lay, o, dev in zip(segs.layouts, segs.offs, devices):
        pieces = [rows[r, o[r] : o[r] + lay.numel(r)].view(lay.piece_shape(r)) for r in range(segs.world)]
        out.append(torch.cat(pieces, dim=lay.dim).to(dev))
    return out


class OwnerSplits:
    """The owner route's two all-to-alls for matrices of one dtype on one mesh: each matrix's owner
    (`plan_shards`: largest flatten cost first, to the least loaded rank) and the per-rank split
    sizes, out (shards to the owners) and back (results to every rank). `names`: the matrices'
    names in errors."""

    def __init__(self, layouts, names):
        self.layouts, self.names = list(layouts), list(names)
        world = self.layouts[0].world if self.layouts else 1
        me = self.layouts[0].rank if self.layouts else 0
        self.world, self.me = world, me
        self.owners = plan_shards([lay.shape for lay in self.layouts], world, solo_above=None).owners
        self.mine = [j for j, o in enumerate(self.owners) if o == me]
        self.out_send = [
            sum(lay.numel(me) for lay, o in zip(self.layouts, self.owners) if o == r) for r in range(world)
        ]
        self.out_recv = [sum(self.layouts[j].numel(r) for j in self.mine) for r in range(world)]


def owner_collect(splits: OwnerSplits, shards, send: torch.Tensor) -> None:
    """Out, local part: this rank's shard of each matrix into its owner's part of the outgoing
    all-to-all (`owner_exchange`, then `owner_unpack` on the owners)."""
    _owner_pack(splits, shards, send)


def owner_return(splits: OwnerSplits, results: dict, send: torch.Tensor) -> None:
    """Back, local part: each owner's results `results` ({j: whole matrix}) into the returning
    all-to-all, each rank's piece (`owner_exchange`, then `owner_receive` on every rank)."""
    _owner_pack_results(splits, results, send)


def owner_exchange(group, buffers, send_split, recv_split) -> int:
    """One all-to-all of the owner route from and into `buffers` (send, recv: `owner_buffers`,
    allocated before the ranks last agreed), and nothing else: it runs on every rank whatever its
    local work did. Returns the elements sent to other ranks."""
    send, recv = buffers
    dist.all_to_all_single(recv, send, recv_split, send_split, group=group)
    return send.numel() - send_split[dist.get_rank(group)]


def _owner_pack(splits: OwnerSplits, shards, send: torch.Tensor) -> None:
    """This rank's shard of each matrix into its owner's part of the outgoing all-to-all."""
    off = [sum(splits.out_send[:r]) for r in range(splits.world)]
    for loc, o in zip(shards, splits.owners):
        send[off[o] : off[o] + loc.numel()].copy_(loc.reshape(-1))
        off[o] += loc.numel()


def owner_unpack(splits: OwnerSplits, recv: torch.Tensor, devices) -> dict[int, torch.Tensor]:
    """{j: whole matrix} for the matrices this rank owns, from every rank's shard."""
    pieces: dict[int, list] = {j: [] for j in splits.mine}
    pos = 0
    for r in range(splits.world):
        for j in splits.mine:
            lay = splits.layouts[j]
            pieces[j].append(recv[pos : pos + lay.numel(r)].view(lay.piece_shape(r)))
            pos += lay.numel(r)
    return {j: torch.cat(pieces[j], dim=splits.layouts[j].dim).to(devices[j]) for j in splits.mine}


def _owner_pack_results(splits: OwnerSplits, results: dict, send: torch.Tensor) -> None:
    """The owner's results into the returning all-to-all: each rank's piece of each matrix this
    rank owns. Every result must be there."""
    pos = 0
    for r in range(splits.world):
        for j in splits.mine:
            lay, res = splits.layouts[j], results.get(j)
            if res is None:
                raise RuntimeError(f"IsoLoCo: {splits.names[j]}: the owner has no Iso-C result to return")
            send[pos : pos + lay.numel(r)].copy_(lay.piece(res, r).reshape(-1))
            pos += lay.numel(r)


def owner_receive(splits: OwnerSplits, recv: torch.Tensor, devices) -> dict[int, torch.Tensor]:
    """{j: this rank's piece of the result} for every matrix, from the owners' parts."""
    out, pos = {}, 0
    for r in range(splits.world):
        for j, o in enumerate(splits.owners):
            if o == r:
                lay = splits.layouts[j]
                n = lay.numel(lay.rank)
                out[j] = recv[pos : pos + n].view(lay.piece_shape(lay.rank)).to(devices[j])
                pos += n
    return out
