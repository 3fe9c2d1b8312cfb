"""Chunked, pipelined collectives for the sharded outer step and `average_`.

Every helper moves data in chunks of about `bucket_bytes` with at most two asynchronous
collectives in flight (`InFlight`), so extra memory is a few chunks, never a copy of the model.
Every buffer handed to a collective lives on the group's `comm_device` (NCCL's rule: CUDA only);
tensors handed over in place (params broadcast into) were checked to live there by the caller.
Means are summed in the compute dtype (`reduce_dtype`: float32 for float16 and bfloat16) and
rounded to the tensors' dtype once, after the division: a float16 sum that overflows where the
mean fits gives the mean, and a bfloat16 mean over many ranks is rounded once, not per addition.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from .._validate import check_all_finite, check_writable, compute_dtype
from .agree import agree, comm_device, describe, error_text, fingerprint, group_info
from .plan import ShardPlan, owned_views

__all__ = ["BUCKET_BYTES", "average_"]

#: Default size of one communication chunk (all ranks' pieces together), as DDP's 25 MB buckets.
BUCKET_BYTES = 25 * 1024 * 1024

# torch 2.14 renamed the single-tensor collectives; older releases only have the old names.
# (Builds without torch.distributed have neither: importing stays fine, calling raises in group_info.)
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


def reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums over ranks are taken in: float32 for float16 and bfloat16, else `dtype`."""
    return compute_dtype(dtype) if dtype in (torch.float16, torch.bfloat16) else dtype


def _pieces(entries: Sequence[tuple[int, int]], numel_of, a: int, b: int):
    """Parts of [a, b) of a flat segment made of entries (tensor index, offset), in order:
    yields (tensor index, start inside the tensor, start inside [a, b), length)."""
    for i, off in entries:
        n = numel_of(i)
        lo, hi = max(a, off), min(b, off + n)
        if lo < hi:
            yield i, lo - off, lo - a, hi - lo


def _chunks(total: int, per_chunk: int):
    for a in range(0, total, per_chunk):
        yield a, min(total, a + per_chunk)


class InFlight:
    """At most `depth` async collectives in flight; each finishes with its callback, in order."""

    def __init__(self, depth: int = 2):
        self.depth, self.queue = depth, []

    def add(self, work, done) -> None:
        self.queue.append((work, done))
        if len(self.queue) > self.depth:
            self.pop()

    def pop(self) -> None:
        work, done = self.queue.pop(0)
        work.wait()
        done()

    def drain(self) -> None:
        while self.queue:
            self.pop()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of t (contiguous t), else a flat copy."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def average_(
    tensors: Iterable[torch.Tensor], group=None, *, bucket_bytes: int = BUCKET_BYTES
) -> list[torch.Tensor]:
    """All-reduce-mean a list of tensors in place over `group`, in buckets of about bucket_bytes.

    Tensors are packed per (device, dtype) end to end into flat buckets (a tensor larger than a
    bucket is split), and up to two buckets' all-reduces are in flight at once, so extra memory is
    two buckets. Call it on every rank with the same shapes and dtypes in the same order (the
    DiLoCo pseudo-gradient average), with the same bucket_bytes. float16 and bfloat16 tensors
    are summed in float32 buffers and get the float32 mean rounded once to their dtype. Tensors off the group's
    communication device (`agree.comm_device`) travel through buffers on it. Returns the tensors
    as a list.
    """
    tensors = list(tensors)
    _, world = group_info(group)
    error = None
    try:
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"average_: tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            if not t.is_floating_point():
                raise TypeError(f"average_: tensor {i} has dtype {t.dtype}; a mean needs a floating dtype")
        names = [f"average_: tensor {i}" for i in range(len(tensors))]
        check_writable(tensors, names)
        check_all_finite(tensors, names)  # NaN/Inf would spread to every rank
    except Exception as e:  # noqa: BLE001
        if world == 1:
            raise
        error = error_text(e)
    if world == 1:
        return tensors
    # Agree before the first all-reduce: a rank with bad input, or ranks passing different shapes,
    # dtypes or chunk sizes (gloo would abort the process on a size mismatch), fail on every rank.
    agree(error, group, "average_", fp=fingerprint(describe(tensors)), settings={"bucket_bytes": repr(bucket_bytes)})
    device = comm_device(group)
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), idx in by_kind.items():
        flats = {i: flat_view(tensors[i]) for i in idx}
        entries, total = [], 0
        for i in idx:
            entries.append((i, total))
            total += tensors[i].numel()
        rdt = reduce_dtype(dtype)  # summed in float32 for 2-byte dtypes, rounded back once
        per = max(1, bucket_bytes // rdt.itemsize)
        bufs = [torch.empty(min(per, total), dtype=rdt, device=device) for _ in range(3)]
        flight = InFlight(2)
        for k, (a, b) in enumerate(_chunks(total, per)):
            buf = bufs[k % 3][: b - a]
            parts = list(_pieces(entries, lambda i: flats[i].numel(), a, b))
            for i, ts, bs, n in parts:
                buf[bs : bs + n].copy_(flats[i][ts : ts + n])

            def done(buf=buf, parts=parts):
                buf.div_(world)
                for i, ts, bs, n in parts:
                    flats[i][ts : ts + n].copy_(buf[bs : bs + n])

            flight.add(dist.all_reduce(buf, group=group, async_op=True), done)
        flight.drain()
        for i in idx:
            if not tensors[i].is_contiguous():
                tensors[i].copy_(flats[i].view(tensors[i].shape))
    return tensors


def reduce_scatter_mean(plan: ShardPlan, dtype, src, rank, group, bucket_bytes) -> torch.Tensor:
    """This rank's segment of the mean over ranks of the sharded tensors of one dtype.

    src(i) is tensor i's flat local pseudo-gradient, or None (sent as zeros). Chunk k covers
    elements [a, b) of every rank's segment: send holds world pieces of b − a elements. The sums
    are taken in `reduce_dtype(dtype)` and the mean rounded to `dtype` once. The segment and the
    buffers live on the group's communication device.
    """
    per_rank, seg = plan.layout(dtype)
    world = plan.world_size
    device = comm_device(group)
    own = torch.empty(seg, dtype=dtype, device=device)
    if seg == 0:
        return own
    rdt = reduce_dtype(dtype)
    wide = rdt != dtype  # reduce into float32 chunks, then round each chunk's mean into `own`
    per = max(1, bucket_bytes // (world * rdt.itemsize))
    sends = [torch.empty(world * min(per, seg), dtype=rdt, device=device) for _ in range(3)]
    outs = [torch.empty(min(per, seg), dtype=rdt, device=device) for _ in range(3)] if wide else None
    flight = InFlight(2)
    for k, (a, b) in enumerate(_chunks(seg, per)):
        w = b - a
        send = sends[k % 3][: world * w]
        send.zero_()
        for r in range(world):
            for i, ts, bs, n in _pieces(per_rank[r], plan.numel, a, b):
                g = src(i)
                if g is not None:
                    send[r * w + bs : r * w + bs + n].copy_(g[ts : ts + n])
        out = outs[k % 3][:w] if wide else own[a:b]

        def done(out=out, a=a, b=b):
            if wide:
                own[a:b].copy_(out.div_(world))

        flight.add(reduce_scatter_single(out, send, group=group, async_op=True), done)
    flight.drain()
    return own if wide else own.div_(world)


def all_gather_segments(plan: ShardPlan, dtype, own, dst, rank, group, bucket_bytes) -> None:
    """Every rank's segment of one dtype, scattered into dst(i) (tensor i's flat destination)."""
    per_rank, seg = plan.layout(dtype)
    world = plan.world_size
    if seg == 0:
        return
    per = max(1, bucket_bytes // (world * own.element_size()))
    bufs = [torch.empty(world * min(per, seg), dtype=dtype, device=comm_device(group)) for _ in range(3)]
    flight = InFlight(2)
    for k, (a, b) in enumerate(_chunks(seg, per)):
        w = b - a
        buf = bufs[k % 3][: world * w]

        def done(buf=buf, a=a, b=b, w=w):
            for r in range(world):
                for i, ts, bs, n in _pieces(per_rank[r], plan.numel, a, b):
                    dst(i)[ts : ts + n].copy_(buf[r * w + bs : r * w + bs + n])

        flight.add(all_gather_single(buf, own[a:b], group=group, async_op=True), done)
    flight.drain()


def reduce_to_owner(src, numel, dtype, owner, rank, group, bucket_bytes) -> Optional[torch.Tensor]:
    """Mean over ranks of one flat tensor, delivered to `owner` only (returned there, else None).

    src: this rank's flat values, or None (sent as zeros). Sent in chunks through a scratch buffer
    (a reduce may use a non-root's input as scratch, so grads are never handed to it directly),
    on the group's communication device; summed in `reduce_dtype(dtype)`, the mean rounded to
    `dtype` once.
    """
    world = dist.get_world_size(group)
    device = comm_device(group)
    dst = dist.get_global_rank(group, owner) if group is not None else owner
    rdt = reduce_dtype(dtype)
    wide = rdt != dtype
    per = max(1, bucket_bytes // rdt.itemsize)
    out = torch.empty(numel, dtype=dtype, device=device) if rank == owner else None
    scratch = rank != owner or wide  # the owner reduces straight into `out` when no rounding follows
    bufs = [torch.empty(min(per, numel), dtype=rdt, device=device) for _ in range(3)] if scratch else None
    flight = InFlight(2)
    for k, (a, b) in enumerate(_chunks(numel, per)):
        buf = bufs[k % 3][: b - a] if scratch else out[a:b]
        if src is None:
            buf.zero_()
        else:
            buf.copy_(src[a:b])

        def done(buf=buf, a=a, b=b):
            if out is not None and wide:
                out[a:b].copy_(buf.div_(world))

        flight.add(dist.reduce(buf, dst=dst, group=group, async_op=True), done)
    flight.drain()
    if out is None:
        return None
    return out if wide else out.div_(world)


def broadcast_from_owner(flat: torch.Tensor, owner: int, group, bucket_bytes) -> None:
    """flat (contiguous) ← the owner's flat, in chunks, in place on every rank."""
    src = dist.get_global_rank(group, owner) if group is not None else owner
    per = max(1, bucket_bytes // flat.element_size())
    flight = InFlight(2)
    for a, b in _chunks(flat.numel(), per):
        flight.add(dist.broadcast(flat[a:b], src=src, group=group, async_op=True), lambda: None)
    flight.drain()


def broadcast_into(t: torch.Tensor, owner: int, group, bucket_bytes) -> None:
    """t ← the owner's t (t on the group's communication device; non-contiguous t through a
    flat copy there)."""
    if t.is_contiguous():
        broadcast_from_owner(t.view(-1), owner, group, bucket_bytes)
        return
    flat = torch.empty(t.numel(), dtype=t.dtype, device=comm_device(group))
    flat.copy_(t.reshape(-1))
    broadcast_from_owner(flat, owner, group, bucket_bytes)
    t.copy_(flat.view(t.shape))


def scatter_into(plan, dtype, own, tensors, rank, group, bucket_bytes) -> None:
    """All-gather every rank's segment of one dtype into `tensors` (non-contiguous ones via a copy)."""
    flats = {}

    def dst(i):
        if i not in flats:
            flats[i] = flat_view(tensors[i])
        return flats[i]

    if plan.world_size == 1:
        for i, v in owned_views(plan, dtype, own, rank).items():
            tensors[i].copy_(v)
        return
    all_gather_segments(plan, dtype, own, dst, rank, group, bucket_bytes)
    for i, f in flats.items():
        if not tensors[i].is_contiguous():
            tensors[i].copy_(f.view(tensors[i].shape))
