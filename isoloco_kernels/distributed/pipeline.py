"""Chunked, pipelined collectives: `sharded_iso_merge_`'s all-gather of segments and broadcast from an
owner, the chunk machinery `average_` (collectives.py) shares with it, and the pieces every chunked
collective of the package uses (`comm_buffer`, `reduce_dtype`, the collectives' names, `CHUNK_BYTES`);
`ShardedIsoLoCo`'s exchanges (sharded.py) run their own chunk loops on these.

Every helper moves data in chunks of about `chunk_bytes` with at most two asynchronous
collectives in flight (`InFlight`), so extra memory is a few chunks, never a copy of the model.
Every buffer handed to a collective lives on the group's `comm_device` (NCCL's rule: CUDA only) and
comes from `comm_buffer`, allocated before the ranks agree; tensors handed over in place (params
broadcast into) were checked to live there by the caller. Means are summed in the compute dtype
(`reduce_dtype`: float32 for float16 and bfloat16) and rounded to the tensors' dtype once, after
the division: a float16 sum that overflows where the mean fits gives the mean, and a bfloat16 mean
over many ranks is rounded once, not per addition. The local work between two collectives runs
under the caller's `attempt` (`Agreement.attempt`).
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .._validate import compute_dtype
from .agree import all_gather_single, comm_device
from .plan import ShardPlan, owned_views

#: Default size of one communication chunk (all ranks' pieces together), as DDP's 25 MB buckets.
CHUNK_BYTES = 25 * 1024 * 1024

# torch 2.14 renamed the single-tensor reduce-scatter; older releases only have the old name.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


def check_chunk_bytes(value, where: str) -> None:
    """A communication chunk size must be a positive int (`where`: e.g. "average_: chunk_bytes")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{where} must be a positive int, got {value!r}")


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


def run_here(fn, *args):
    """fn(*args): the `attempt` of a caller with no agreement to report a failure to."""
    return fn(*args)


class InFlight:
    """At most `depth` async collectives in flight; each finishes with its callback, in order, run
    under `attempt` (the caller's `Agreement.attempt`: a callback that fails is kept for the
    caller's next agreement, and the collectives after it still run)."""

    def __init__(self, depth: int = 2, attempt=run_here):
        self.depth, self.queue, self.attempt = depth, [], attempt

    def add(self, work, done) -> None:
        self.queue.append((work, done))
        if len(self.queue) > self.depth:
            self.pop()

    def pop(self) -> None:
        work, done = self.queue.pop(0)
        work.wait()
        self.attempt(done)

    def drain(self) -> None:
        while self.queue:
            self.pop()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view of t (contiguous t), else a flat copy."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def _offsets(tensors, idx) -> list[tuple[int, int]]:
    """(tensor index, offset) of each tensor of one kind, end to end."""
    entries, off = [], 0
    for i in idx:
        entries.append((i, off))
        off += tensors[i].numel()
    return entries


def _pack_chunk(entries, flats, a: int, b: int, buf: torch.Tensor) -> list:
    """Elements [a, b) of the tensors laid end to end into `buf`; returns their pieces."""
    parts = list(_pieces(entries, lambda i: flats[i].numel(), a, b))
    for i, ts, bs, n in parts:
        buf[bs : bs + n].copy_(flats[i][ts : ts + n])
    return parts


def _copy_back(tensors, flats, idx) -> None:
    """Non-contiguous tensors from the flat copies they were averaged in."""
    for i in idx:
        if not tensors[i].is_contiguous():
            tensors[i].copy_(flats[i].view(tensors[i].shape))


def gather_segment_buffers(plan: ShardPlan, dtype, group, chunk_bytes) -> list[torch.Tensor]:
    """The three chunk buffers of `all_gather_segments`, on the group's communication device."""
    _, seg = plan.layout(dtype)
    if seg == 0:
        return []
    per = max(1, chunk_bytes // (plan.world_size * dtype.itemsize))
    return [comm_buffer(plan.world_size * min(per, seg), dtype, comm_device(group), False) for _ in range(3)]


def all_gather_segments(
    plan: ShardPlan, dtype, own, dst, rank, group, chunk_bytes, buffers=None, attempt=run_here
) -> None:
    """Every rank's segment of one dtype, scattered into dst(i) (tensor i's flat destination),
    through `buffers` (`gather_segment_buffers`, made before the ranks agreed; None: made here)."""
    per_rank, seg = plan.layout(dtype)
    world = plan.world_size
    if seg == 0:
        return
    per = max(1, chunk_bytes // (world * own.element_size()))
    bufs = buffers if buffers is not None else gather_segment_buffers(plan, dtype, group, chunk_bytes)
    flight = InFlight(2, attempt)
    for k, (a, b) in enumerate(_chunks(seg, per)):
        w = b - a
        buf = bufs[k % 3][: world * w]

        def done(buf=buf, a=a, b=b, w=w):
            for r in range(world):
                for i, ts, bs, n in _pieces(per_rank[r], plan.numel, a, b):
                    dst(i)[ts : ts + n].copy_(buf[r * w + bs : r * w + bs + n])

        flight.add(all_gather_single(buf, own[a:b], group=group, async_op=True), done)
    flight.drain()


def broadcast_from_owner(flat: torch.Tensor, owner: int, group, chunk_bytes) -> None:
    """flat (contiguous) ← the owner's flat, in chunks, in place on every rank."""
    src = dist.get_global_rank(group, owner) if group is not None else owner
    per = max(1, chunk_bytes // flat.element_size())
    flight = InFlight(2)
    for a, b in _chunks(flat.numel(), per):
        flight.add(dist.broadcast(flat[a:b], src=src, group=group, async_op=True), lambda: None)
    flight.drain()


def broadcast_into(
    t: torch.Tensor, owner: int, group, chunk_bytes, flat: Optional[torch.Tensor] = None, attempt=run_here
) -> None:
    """t ← the owner's t (t on the group's communication device; non-contiguous t through a
    flat copy there: `flat`, made before the ranks agreed, or made here). The copies run under
    `attempt`."""
    if t.is_contiguous():
        broadcast_from_owner(t.view(-1), owner, group, chunk_bytes)
        return
    if flat is None:
        flat = comm_buffer(t.numel(), t.dtype, comm_device(group), False)
    attempt(flat.copy_, t.reshape(-1))
    broadcast_from_owner(flat, owner, group, chunk_bytes)
    attempt(t.copy_, flat.view(t.shape))


def scatter_into(plan, dtype, own, tensors, rank, group, chunk_bytes, buffers=None, attempt=run_here) -> None:
    """All-gather every rank's segment of one dtype into `tensors` (non-contiguous ones via a copy;
    `buffers`: `gather_segment_buffers(...)`, or None to make them here); local work under `attempt`."""
    flats = {}

    def dst(i):
        if i not in flats:
            flats[i] = flat_view(tensors[i])
        return flats[i]

    if plan.world_size == 1:
        for i, v in owned_views(plan, dtype, own, rank).items():
            tensors[i].copy_(v)
        return
    all_gather_segments(plan, dtype, own, dst, rank, group, chunk_bytes, buffers, attempt)
    attempt(_copy_back, tensors, flats, list(flats))


def comm_buffer(numel: int, dtype: torch.dtype, device, zero: bool) -> torch.Tensor:
    """A buffer a collective of this package sends from (`zero`: padding and a failed rank's part
    stay zeros) or receives into. Every such buffer comes from here (the sharded step's, `average_`'s,
    `sharded_iso_merge_`'s, the DTensor routes': `collectives.gather_buffers`, `owner_buffers`,
    `gram_route`), allocated before the ranks agree that every one of them has its buffers: a rank
    that cannot allocate one must not be the only rank missing from the collective. Callers in other
    modules call it through this module, so a test can make it fail in one place."""
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
