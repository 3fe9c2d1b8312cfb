"""Who owns which tensor in the sharded outer step, and how the tensors travel.

`plan_shards` (a `ShardPlan`) for ShardedIsoLoCo, sharded_iso_merge_ and the DTensor owner route:
whole tensors, greedy largest-first by Iso-C cost m·n·min(m, n) (numel for 1-D tensors and for
matrices with iso off), ties to the lowest rank, so every rank derives the same plan from the
shapes alone. Tensors ride the reduce-scatter / all-gather in per-rank flat segments padded to
the longest; a tensor larger than `solo_above` · (total elements) / world travels "solo" (reduce to
its owner, broadcast back) so it pads nobody's segment.

`ShardLayout`: how one DTensor matrix is split over a 1-D mesh (its shard dim, every rank's piece
in torch.chunk sizes, this rank's piece of a whole), built once per matrix and step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["ShardLayout", "ShardPlan", "iso_cost", "owned_views", "plan_shards", "shard_sizes"]


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


def iso_cost(shape: Sequence[int], iso: bool = True) -> int:
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
    costs = tuple(iso_cost(sh, i) for sh, i in zip(shapes, isos))
    numels = [iso_cost(sh, False) for sh in shapes]
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


def owned_views(plan: ShardPlan, dtype, own: torch.Tensor, rank: int) -> dict[int, torch.Tensor]:
    per_rank, _ = plan.layout(dtype)
    return {i: own[off : off + plan.numel(i)].view(plan.shapes[i]) for i, off in per_rank[rank]}


def shard_sizes(length: int, world: int) -> list[tuple[int, int]]:
    """(start, size) of each rank's piece of a dimension of `length` over `world` ranks
    (torch.chunk sizes, empty pieces at the end: DTensor's Shard and FSDP2's layout)."""
    chunk = -(-length // world) if length else 0
    out = []
    for r in range(world):
        a = min(r * chunk, length)
        out.append((a, min(a + chunk, length) - a))
    return out


class ShardLayout:
    """An m×n matrix split along `dim` over the `world` ranks of a 1-D mesh, seen from `rank`:
    every rank's (start, size) along `dim` (`sizes`), its piece's element count and shape, and
    this rank's piece of the whole matrix."""

    def __init__(self, shape, dim: int, world: int, rank: int):
        self.shape, self.dim, self.world, self.rank = tuple(shape), dim, world, rank
        self.sizes = shard_sizes(self.shape[dim], world)
        self.other = self.shape[1 - dim]  # the length of the dimension that is not split

    @classmethod
    def of(cls, p) -> "ShardLayout":
        """The layout of a DTensor `p` with placements (Shard(dim),) on a 1-D mesh."""
        mesh = p.device_mesh
        return cls(p.shape, p.placements[0].dim, mesh.size(), mesh.get_local_rank())

    def numel(self, r: int) -> int:
        return self.sizes[r][1] * self.other

    def piece_shape(self, r: int) -> tuple[int, int]:
        n = self.sizes[r][1]
        return (n, self.other) if self.dim == 0 else (self.other, n)

    def piece(self, whole: torch.Tensor, r: Optional[int] = None) -> torch.Tensor:
        """Rank r's piece (default: this rank's) of a whole matrix, laid out like its local shard."""
        a, n = self.sizes[self.rank if r is None else r]
        return whole.narrow(self.dim, a, n)
