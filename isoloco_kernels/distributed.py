"""The IsoLoCo outer step over torch.distributed, with the Iso-C work sharded across ranks.

In DiLoCo every rank (worker) ends a round holding the same global weights θ and its own
pseudo-gradient Δ_k = θ − θ_k. Replicated, the outer step is: all-reduce the Δ_k to their mean, then
every rank runs the whole outer optimizer. For IsoLoCo that means every rank repeats every Iso-C
flatten. Sharded (`ShardedIsoLoCo`), each matrix has one owner:

    reduce-scatter Δ_k → each rank receives mean(Δ) of the tensors it owns
    owner:  M = iso(mean Δ) (2-D, iso on) or mean Δ;  buf ← μ·buf + M;  θ ← θ − lr·(M + μ·buf)
    all-gather θ        → every rank holds the whole updated θ

A reduce-scatter plus an all-gather move the same bytes as one all-reduce, each flatten runs once
in the group instead of once per rank, and the momentum of a tensor lives only on its owner.

Ownership (`plan_shards`): whole tensors, greedy largest-first by flatten cost m·n·min(m, n) (numel
for 1-D tensors and for matrices with iso off), ties to the lowest rank, so every rank derives the
same plan from the shapes alone. Tensors ride the reduce-scatter/all-gather in per-rank flat
segments padded to the longest one, so one tensor larger than a fair share of the elements
(`solo_above` · total / world; a vocabulary embedding on many ranks) would pad every segment up to
its size. Such "solo" tensors travel on their own instead: reduce to the owner, broadcast back —
again an all-reduce's bytes, no padding — and the owner alone flattens and steps them.

Failure handling: before any tensor is written, every rank reports ok/failed in one small
all-gather (checks, reductions and flattens all run before it). If any rank failed, every rank
raises `DistributedStepError` naming the ranks and their errors, and nothing changed anywhere. A rank
that dies or stalls outside the step is caught by the process group timeout.

`sharded_iso_merge_` is the same idea for code that has already all-reduced its pseudo-gradients
(torchft, OpenDiLoCo): each rank flattens the matrices it owns and all-gathers the results.
`average_` is the bucketed all-reduce-mean a replicated (DiLoCo) loop needs.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from ._agree import DistributedStepError, agree, comm_device as _comm_device, describe, error_text as _error_text
from ._agree import fingerprint as _fingerprint, group_info as _group_info
from ._validate import SUPPORTED_DTYPES, check_all_finite, check_matrix_tensor, check_writable, compute_dtype
from .buckets import BucketPlan
from .flatten import check_method
from .nesterov import prepare_outer_update
from .ops import iso_merge_unchecked_
from .optim import _SGD_KEYS, _check_group, check_state_dict

__all__ = [
    "DistributedStepError",
    "ShardPlan",
    "ShardedIsoLoCo",
    "average_",
    "plan_shards",
    "sharded_iso_merge_",
]

#: Default size of one communication chunk (all ranks' pieces together), as DDP's 25 MB buckets.
BUCKET_BYTES = 25 * 1024 * 1024


# torch 2.14 renamed the single-tensor collectives; older releases only have the old names.
# (Builds without torch.distributed have neither: importing stays fine, calling raises in _group_info.)
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_single = (
    getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
)


# ----------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class ShardPlan:
    """Who owns which tensor, and how it travels.

    owners[i] is the rank that flattens and steps tensor i. Tensors in `solo` are reduced to their
    owner and broadcast back one by one. The others, per dtype, are laid end to end (in tensor
    order) in each owner's flat segment; segments are zero-padded to the longest (`layout`).
    """

    world_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    costs: tuple[int, ...]
    owners: tuple[int, ...]
    solo: frozenset[int] = frozenset()

    def owned(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owners) if o == rank]

    def numel(self, i: int) -> int:
        n = 1
        for s in self.shapes[i]:
            n *= s
        return n

    def layout(self, dtype: torch.dtype) -> tuple[list[list[tuple[int, int]]], int]:
        """([per rank: [(tensor index, offset)]], padded segment length) for one dtype."""
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.world_size)]
        fill = [0] * self.world_size
        for i, (o, dt) in enumerate(zip(self.owners, self.dtypes)):
            if i not in self.solo and dt == dtype:
                per_rank[o].append((i, fill[o]))
                fill[o] += self.numel(i)
        return per_rank, max(fill, default=0)

    @property
    def sharded_dtypes(self) -> list[torch.dtype]:
        seen: list[torch.dtype] = []
        for i, dt in enumerate(self.dtypes):
            if i not in self.solo and dt not in seen:
                seen.append(dt)
        return seen

    def loads(self) -> list[int]:
        """Flatten cost per rank."""
        out = [0] * self.world_size
        for i, o in enumerate(self.owners):
            out[o] += self.costs[i]
        return out

    def wire_elements(self) -> dict[str, int]:
        """Elements handed to collectives per step, padding included, next to a plain all-reduce.

        'segments': world · Σ_dtype padded segment (the reduce-scatter's input and the all-gather's
        output, each); 'solo': elements reduced to owners (and broadcast back, each);
        'allreduce': all elements (what a replicated step all-reduces).
        """
        seg = sum(self.layout(dt)[1] for dt in self.sharded_dtypes)
        return {
            "segments": self.world_size * seg,
            "solo": sum(self.numel(i) for i in self.solo),
            "allreduce": sum(self.numel(i) for i in range(len(self.shapes))),
        }

    @property
    def fingerprint(self) -> int:
        """A 63-bit hash of the whole plan; equal on every rank that built the same plan."""
        text = repr((self.world_size, self.shapes, [str(d) for d in self.dtypes], self.owners, sorted(self.solo)))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def flatten_cost(shape: Sequence[int], iso: bool = True) -> int:
    """Relative cost of one tensor's outer step: B·m·n·min(m, n) for matrices, else numel."""
    numel = 1
    for s in shape:
        numel *= s
    if iso and len(shape) in (2, 3):
        return numel * min(shape[-2], shape[-1])
    return numel


def plan_shards(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    iso: Sequence[bool] | bool = True,
    solo_above: Optional[float] = 1.0,
) -> ShardPlan:
    """Assign whole tensors to ranks, balancing flatten cost; deterministic from the arguments.

    Greedy longest-processing-time: tensors in order of decreasing cost (ties: lower index first)
    each go to the rank with the least cost so far (ties: lowest rank). A tensor with more than
    solo_above · (total elements) / world_size elements travels solo (None: none does).
    """
    if world_size < 1:
        raise ValueError(f"plan_shards: world_size must be >= 1, got {world_size}")
    shapes = tuple(tuple(int(s) for s in sh) for sh in shapes)
    dtypes = tuple(dtypes) if dtypes is not None else (torch.float32,) * len(shapes)
    isos = [iso] * len(shapes) if isinstance(iso, bool) else list(iso)
    if not (len(dtypes) == len(isos) == len(shapes)):
        raise ValueError("plan_shards: shapes, dtypes and iso must have one entry per tensor")
    costs = tuple(flatten_cost(sh, i) for sh, i in zip(shapes, isos))
    numels = [flatten_cost(sh, False) for sh in shapes]
    owners = [0] * len(shapes)
    load = [0] * world_size
    for i in sorted(range(len(shapes)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    solo = frozenset()
    if world_size > 1 and solo_above is not None:
        limit = solo_above * sum(numels) / world_size
        solo = frozenset(i for i, n in enumerate(numels) if n > limit)
    return ShardPlan(world_size, shapes, dtypes, costs, tuple(owners), solo)


# ----------------------------------------------------------------------------------------------
# Communication helpers


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


class _InFlight:
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


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat view of t (contiguous t), else a flat copy."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def average_(
    tensors: Iterable[torch.Tensor], group=None, *, bucket_bytes: int = BUCKET_BYTES
) -> list[torch.Tensor]:
    """All-reduce-mean a list of tensors in place over `group`, in buckets of about bucket_bytes.

    Tensors are packed per (device, dtype) end to end into flat buckets (a tensor larger than a
    bucket is split), and up to two buckets' all-reduces are in flight at once, so extra memory is
    two buckets. Call it on every rank with the same shapes and dtypes in the same order (the
    DiLoCo pseudo-gradient average). Returns the tensors as a list.
    """
    tensors = list(tensors)
    _, world = _group_info(group)
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
        error = _error_text(e)
    if world == 1:
        return tensors
    # Agree before the first all-reduce: a rank with bad input, or ranks passing different shapes
    # or dtypes (gloo would abort the process on a size mismatch), fail on every rank.
    device = _comm_device(group, next((t.device for t in tensors if isinstance(t, torch.Tensor)), None))
    agree(error, group, device, "average_", _fingerprint(describe(tensors)))
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(i)
    for (device, dtype), idx in by_kind.items():
        flats = {i: _flat(tensors[i]) for i in idx}
        entries, total = [], 0
        for i in idx:
            entries.append((i, total))
            total += tensors[i].numel()
        per = max(1, bucket_bytes // tensors[idx[0]].element_size())
        bufs = [torch.empty(min(per, total), dtype=dtype, device=device) for _ in range(3)]
        flight = _InFlight(2)
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


def _reduce_scatter_mean(plan: ShardPlan, dtype, src, rank, group, device, bucket_bytes) -> torch.Tensor:
    """This rank's segment of the mean over ranks of the sharded tensors of one dtype.

    src(i) is tensor i's flat local pseudo-gradient, or None (sent as zeros). Chunk k covers
    elements [a, b) of every rank's segment: send holds world pieces of b − a elements.
    """
    per_rank, seg = plan.layout(dtype)
    world = plan.world_size
    own = torch.empty(seg, dtype=dtype, device=device)
    if seg == 0:
        return own
    per = max(1, bucket_bytes // (world * own.element_size()))
    sends = [torch.empty(world * min(per, seg), dtype=dtype, device=device) for _ in range(3)]
    flight = _InFlight(2)
    for k, (a, b) in enumerate(_chunks(seg, per)):
        w = b - a
        send = sends[k % 3][: world * w]
        send.zero_()
        for r in range(world):
            for i, ts, bs, n in _pieces(per_rank[r], plan.numel, a, b):
                g = src(i)
                if g is not None:
                    send[r * w + bs : r * w + bs + n].copy_(g[ts : ts + n])
        flight.add(_reduce_scatter_single(own[a:b], send, group=group, async_op=True), lambda: None)
    flight.drain()
    return own.div_(world)


def _all_gather_segments(plan: ShardPlan, dtype, own, dst, rank, group, bucket_bytes) -> None:
    """Every rank's segment of one dtype, scattered into dst(i) (tensor i's flat destination)."""
    per_rank, seg = plan.layout(dtype)
    world = plan.world_size
    if seg == 0:
        return
    per = max(1, bucket_bytes // (world * own.element_size()))
    bufs = [torch.empty(world * min(per, seg), dtype=dtype, device=own.device) for _ in range(3)]
    flight = _InFlight(2)
    for k, (a, b) in enumerate(_chunks(seg, per)):
        w = b - a
        buf = bufs[k % 3][: world * w]

        def done(buf=buf, a=a, b=b, w=w):
            for r in range(world):
                for i, ts, bs, n in _pieces(per_rank[r], plan.numel, a, b):
                    dst(i)[ts : ts + n].copy_(buf[r * w + bs : r * w + bs + n])

        flight.add(_all_gather_single(buf, own[a:b], group=group, async_op=True), done)
    flight.drain()


def _reduce_to_owner(src, numel, dtype, device, owner, rank, group, bucket_bytes) -> Optional[torch.Tensor]:
    """Mean over ranks of one flat tensor, delivered to `owner` only (returned there, else None).

    src: this rank's flat values, or None (sent as zeros). Sent in chunks through a scratch buffer
    (a reduce may use a non-root's input as scratch, so grads are never handed to it directly).
    """
    world = dist.get_world_size(group)
    dst = dist.get_global_rank(group, owner) if group is not None else owner
    per = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
    out = torch.empty(numel, dtype=dtype, device=device) if rank == owner else None
    bufs = None if rank == owner else [torch.empty(min(per, numel), dtype=dtype, device=device) for _ in range(3)]
    flight = _InFlight(2)
    for k, (a, b) in enumerate(_chunks(numel, per)):
        buf = out[a:b] if rank == owner else bufs[k % 3][: b - a]
        if src is None:
            buf.zero_()
        else:
            buf.copy_(src[a:b])
        flight.add(dist.reduce(buf, dst=dst, group=group, async_op=True), lambda: None)
    flight.drain()
    return out.div_(world) if out is not None else None


def _broadcast_from_owner(flat: torch.Tensor, owner: int, group, bucket_bytes) -> None:
    """flat (contiguous) ← the owner's flat, in chunks, in place on every rank."""
    src = dist.get_global_rank(group, owner) if group is not None else owner
    per = max(1, bucket_bytes // flat.element_size())
    flight = _InFlight(2)
    for a, b in _chunks(flat.numel(), per):
        flight.add(dist.broadcast(flat[a:b], src=src, group=group, async_op=True), lambda: None)
    flight.drain()


def _agree(error: Optional[str], group, device, what: str, fp: Optional[int] = None) -> None:
    agree(error, group, device, what, fp, mismatch="the ranks built different shard plans")


def _owned_views(plan: ShardPlan, dtype, own: torch.Tensor, rank: int) -> dict[int, torch.Tensor]:
    per_rank, _ = plan.layout(dtype)
    return {i: own[off : off + plan.numel(i)].view(plan.shapes[i]) for i, off in per_rank[rank]}


# ----------------------------------------------------------------------------------------------
# Pre-averaged pseudo-gradients: shard only the flatten


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
    rank, world = _group_info(group)
    check_method(method)
    device = _comm_device(group, next((b.device for b in buckets if isinstance(b, torch.Tensor)), None))
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
        error = _error_text(e)
    _agree(error, group, device, "sharded_iso_merge_", plan.fingerprint if plan else None)

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
        error = _error_text(e)
    _agree(error, group, device, "sharded_iso_merge_")

    for blk, us in batches:
        if us is not None:
            for u, r in zip(us, blk.unbind(0)):
                unit(u).copy_(r)
    flat_units = [unit(u) for u in range(len(units))]
    for dt, own in owns.items():
        _scatter_into(plan, dt, own, flat_units, rank, group, bucket_bytes)
    for u in sorted(plan.solo):
        _broadcast_into(flat_units[u], plan.owners[u], group, bucket_bytes)
    return buckets


def _broadcast_into(t: torch.Tensor, owner: int, group, bucket_bytes) -> None:
    """t ← the owner's t (non-contiguous t through a flat copy)."""
    flat = _flat(t)
    _broadcast_from_owner(flat, owner, group, bucket_bytes)
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def _scatter_into(plan, dtype, own, tensors, rank, group, bucket_bytes) -> None:
    """All-gather every rank's segment of one dtype into `tensors` (non-contiguous ones via a copy)."""
    flats = {}

    def dst(i):
        if i not in flats:
            flats[i] = _flat(tensors[i])
        return flats[i]

    if plan.world_size == 1:
        for i, v in _owned_views(plan, dtype, own, rank).items():
            tensors[i].copy_(v)
        return
    _all_gather_segments(plan, dtype, own, dst, rank, group, bucket_bytes)
    for i, f in flats.items():
        if not tensors[i].is_contiguous():
            tensors[i].copy_(f.view(tensors[i].shape))


# ----------------------------------------------------------------------------------------------
# The sharded outer optimizer


class ShardedIsoLoCo(torch.optim.Optimizer):
    """IsoLoCo's outer step for DiLoCo over a process group, each tensor's work done by one rank.

    Use it like the replicated outer optimizer, on every rank: set p.data to the global weights
    (equal on all ranks) and p.grad to this rank's pseudo-gradient θ − θ_k (NOT yet averaged), then
    `step()`. The step averages the pseudo-gradients itself (reduce-scatter), and each rank applies
    M = iso(mean Δ) (2-D params, iso on) or mean Δ, then Nesterov (buf ← μ·buf + M;
    θ ← θ − lr·(M + μ·buf)), to the params it owns; an all-gather gives every rank the new θ. The
    result is the replicated IsoLoCo step on the averaged pseudo-gradients.

    Momentum is kept only by the owner, so state_dict()
    is per rank; it carries the plan's fingerprint and rank, and load_state_dict refuses a state
    saved under a different plan or by a different rank. param_groups are IsoLoCo's (SGD's keys plus
    iso); half-precision params keep float32 momentum, as in IsoLoCo.

    If any rank finds bad input (missing grad, wrong shape or dtype, NaN/Inf, a failed flatten),
    every rank raises DistributedStepError and no param or buffer changes on any rank.
    """

    def __init__(
        self,
        params,
        lr: float = 1.8,
        momentum: float = 0.8,
        *,
        iso: bool = True,
        method: str = "auto",
        group=None,
        bucket_bytes: int = BUCKET_BYTES,
        solo_above: Optional[float] = 1.0,
    ):
        for name, v in (("lr", lr), ("momentum", momentum)):
            if not isinstance(v, (int, float)) or not (0.0 <= v < float("inf")):
                raise ValueError(f"ShardedIsoLoCo: {name} must be a finite number >= 0, got {v!r}")
        check_method(method)
        if bucket_bytes < 1:
            raise ValueError(f"ShardedIsoLoCo: bucket_bytes must be positive, got {bucket_bytes}")
        super().__init__(params, dict(lr=float(lr), momentum=float(momentum), iso=bool(iso), **_SGD_KEYS))
        self._buckets: Optional[BucketPlan] = None  # batched Iso-C of my matrices, reused across steps
        self.method, self.group, self.bucket_bytes = method, group, bucket_bytes
        self.rank, self.world_size = _group_info(group)
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [k for k, g in enumerate(self.param_groups) for _ in g["params"]]
        for i, p in enumerate(self._params):
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"ShardedIsoLoCo: param {i} has unsupported dtype {p.dtype}")
            if p.device != self._params[0].device:
                raise ValueError(
                    f"ShardedIsoLoCo: param {i} is on {p.device}, param 0 on {self._params[0].device}; "
                    "one device per rank"
                )
        self.plan = plan_shards(
            [p.shape for p in self._params], self.world_size,
            dtypes=[p.dtype for p in self._params],
            iso=[self.param_groups[k]["iso"] and p.ndim == 2 for k, p in zip(self._group_of, self._params)],
            solo_above=solo_above,
        )
        self._data_device = self._params[0].device if self._params else torch.device("cpu")
        self._device = _comm_device(group, self._data_device)  # for the small control tensors
        _agree(None, group, self._device, "ShardedIsoLoCo()", self.plan.fingerprint)

    @property
    def mine(self) -> list[int]:
        """Indices (over all param groups, in order) of the params this rank steps."""
        return self.plan.owned(self.rank)

    # -- the step ----------------------------------------------------------------------------

    def _check_grads(self) -> list[torch.Tensor]:
        grads = []
        for i, p in enumerate(self._params):
            g = p.grad
            what = f"param {i} (shape {tuple(p.shape)}) on rank {self.rank}"
            if g is None:
                raise ValueError(f"{what} has no grad; set p.grad to the pseudo-gradient on every rank")
            if g.is_sparse:
                raise TypeError(f"{what}: sparse grads are not supported")
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(
                    f"{what}: grad has shape {tuple(g.shape)} on {g.device}, the param is on {p.device}"
                )
            if g.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{what}: grad dtype {g.dtype} is not supported")
            grads.append(g)
        check_all_finite(grads, [f"pseudo-gradient of param {i} on rank {self.rank}" for i in range(len(grads))])
        # every param is written (by its owner's update or the all-gather), so all are checked
        check_writable(self._params, [f"param {i} (shape {tuple(p.shape)}) on rank {self.rank}" for i, p in enumerate(self._params)])
        return grads

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        plan, rank, group = self.plan, self.rank, self.group
        error, grads = None, None
        try:  # a closure that raises on one rank must still reach the agreement below
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            grads = self._check_grads()
        except Exception as e:  # noqa: BLE001
            error = _error_text(e)
        flat = [None if grads is None else _flat(g) for g in (grads or self._params)]

        # 1. mean pseudo-gradients of my tensors (segments: reduce-scatter; solo: reduce to owner)
        updates: dict[int, torch.Tensor] = {}
        owns = {}
        for dt in plan.sharded_dtypes:
            if self.world_size > 1:
                own = _reduce_scatter_mean(
                    plan, dt, lambda i: flat[i], rank, group, self._data_device, self.bucket_bytes
                )
            else:
                own = self._own_single(dt, flat)
            owns[dt] = own
            updates.update(_owned_views(plan, dt, own, rank))
        for i in sorted(plan.solo):
            p = self._params[i]
            mean = _reduce_to_owner(
                flat[i], p.numel(), p.dtype, p.device, plan.owners[i], rank, group, self.bucket_bytes
            )
            if mean is not None:
                updates[i] = mean.view(p.shape)

        # 2. everything that can fail, before agreeing
        pending: list = []
        if error is None:
            try:
                idx = sorted(updates)
                check_all_finite([updates[i] for i in idx], [f"mean pseudo-gradient of param {i}" for i in idx])
                # hyper-parameters (a scheduler may have set them) and held momentum, before agreeing
                for k in sorted({self._group_of[i] for i in idx}):
                    _check_group(self.param_groups[k], f"ShardedIsoLoCo.step: param group {k}")
                held = [(i, self.state[self._params[i]].get("momentum_buffer")) for i in idx]
                held = [(i, b) for i, b in held if isinstance(b, torch.Tensor)]
                for i, b in held:
                    p = self._params[i]
                    if b.shape != p.shape or b.device != p.device or b.dtype not in (p.dtype, compute_dtype(p.dtype)):
                        raise ValueError(
                            f"param {i} (shape {tuple(p.shape)}): momentum_buffer has shape {tuple(b.shape)}, "
                            f"dtype {b.dtype} on {b.device}"
                        )
                check_all_finite([b for _, b in held], [f"momentum_buffer of param {i}" for i, _ in held])
                check_writable([b for _, b in held], [f"momentum_buffer of param {i} on rank {rank}" for i, _ in held])
                updates.update(self._iso_c(updates))
                pending = self._prepare_nesterov(updates)
            except Exception as e:  # noqa: BLE001
                error = _error_text(e)
        _agree(error, group, self._device, "ShardedIsoLoCo.step")

        # 3. Nesterov on my params, per param group (checked for overflow before agreeing)
        for apply in pending:
            apply()

        # 4. every rank gets every updated param
        for dt, own in owns.items():
            for i, v in _owned_views(plan, dt, own, rank).items():
                v.copy_(self._params[i])
            if self.world_size > 1:
                _scatter_into(plan, dt, own, [p.data for p in self._params], rank, group, self.bucket_bytes)
        for i in sorted(plan.solo):
            _broadcast_into(self._params[i].data, plan.owners[i], group, self.bucket_bytes)
        return loss

    def _prepare_nesterov(self, updates: dict[int, torch.Tensor]) -> list:
        """One overflow-checked Nesterov update per param group over my params
        (`nesterov.prepare_outer_update`), ready to apply once the ranks agree."""
        pending = []
        for k, g in enumerate(self.param_groups):
            idx = [i for i in sorted(updates) if self._group_of[i] == k]
            if not idx:
                continue
            ps = [self._params[i] for i in idx]
            bufs, fresh = [], []
            for p in ps:
                buf = self.state[p].get("momentum_buffer") if p in self.state else None
                if buf is None:  # float32 for half params, as IsoLoCo keeps them
                    buf = torch.zeros_like(p, dtype=compute_dtype(p.dtype), memory_format=torch.preserve_format)
                    fresh.append((p, buf))
                bufs.append(buf)
            names = [f"param {i} (shape {tuple(self._params[i].shape)}) on rank {self.rank}" for i in idx]
            run = prepare_outer_update(
                ps, bufs, [updates[i] for i in idx], float(g["lr"]), float(g["momentum"]), names
            )

            def apply(run=run, fresh=fresh) -> None:
                run()
                for p, buf in fresh:
                    self.state[p]["momentum_buffer"] = buf

            pending.append(apply)
        return pending

    def _iso_c(self, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Iso-C of my 2-D mean pseudo-gradients in iso groups, batched by shape as IsoLoCo does
        (buckets.BucketPlan, transposed twins together): param index → result view."""
        idx = [
            i for i in sorted(updates)
            if updates[i].ndim == 2 and updates[i].numel() and self.param_groups[self._group_of[i]]["iso"]
        ]
        if not idx:
            return {}
        views = [updates[i] for i in idx]
        if self._buckets is None or not self._buckets.matches(views):
            self._buckets = BucketPlan(views)
        iso_merge_unchecked_(self._buckets.pack(views), self.method)  # checked by the caller
        return dict(zip(idx, self._buckets.views()))

    def _own_single(self, dtype, flat) -> torch.Tensor:
        """World size 1: my segment is just my grads, copied (the grads stay untouched)."""
        per_rank, seg = self.plan.layout(dtype)
        own = torch.empty(seg, dtype=dtype, device=self._data_device)
        for i, off in per_rank[0]:
            if flat[i] is None:
                own[off : off + self.plan.numel(i)].zero_()
            else:
                own[off : off + self.plan.numel(i)].copy_(flat[i])
        return own

    # -- state -------------------------------------------------------------------------------

    def state_dict(self):
        sd = super().state_dict()
        sd["sharding"] = {"fingerprint": self.plan.fingerprint, "rank": self.rank, "world_size": self.world_size}
        return sd

    def load_state_dict(self, state_dict) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"ShardedIsoLoCo.load_state_dict: expected a dict, got {type(state_dict).__name__}")
        info = state_dict.get("sharding")
        if info is None:
            raise ValueError(
                "ShardedIsoLoCo.load_state_dict: the state has no 'sharding' entry (it was not saved by "
                "ShardedIsoLoCo.state_dict()); per-rank momentum cannot be matched to this plan"
            )
        if info["world_size"] != self.world_size or info["fingerprint"] != self.plan.fingerprint:
            raise ValueError(
                f"ShardedIsoLoCo.load_state_dict: the state was saved under a different shard plan "
                f"(world size {info['world_size']}, plan {info['fingerprint']:#x}); this optimizer has world "
                f"size {self.world_size}, plan {self.plan.fingerprint:#x}; it needs the same params (shapes, "
                "dtypes, order) and world size"
            )
        if info["rank"] != self.rank:
            raise ValueError(
                f"ShardedIsoLoCo.load_state_dict: the state was saved by rank {info['rank']}, this is rank "
                f"{self.rank}; load each rank's own state"
            )
        rest = {k: v for k, v in state_dict.items() if k != "sharding"}
        check_state_dict(self, rest, "ShardedIsoLoCo.load_state_dict")
        mine = set(self.mine)
        extra = sorted(set(state_dict["state"]) - mine)
        if extra:
            raise ValueError(
                f"ShardedIsoLoCo.load_state_dict: the state holds momentum for params {extra[:8]} that rank "
                f"{self.rank} does not own"
            )
        super().load_state_dict(rest)
        # torch casts state to each param's dtype; half params keep float32 momentum (as IsoLoCo),
        # converted from the saved tensor itself so nothing is lost to rounding
        for g, sg in zip(self.param_groups, rest["param_groups"]):
            for p, pid in zip(g["params"], sg["params"]):
                src = rest["state"].get(pid, {}).get("momentum_buffer")
                want = compute_dtype(p.dtype)
                if isinstance(src, torch.Tensor) and want != p.dtype:
                    self.state[p]["momentum_buffer"] = src.detach().to(device=p.device, dtype=want, copy=True)
