"""The DTensor step's routes: Iso-C of matrices whose grads are sharded over a device mesh.

On a 1-D mesh, per matrix (`route_for`, by bytes sent per rank and the flatten's work;
`opt.dtensor_route` overrides):

- "gram": shards along the long side: one float64 all-reduce of the short-side Gram matrices per
  mesh, then every rank writes its own piece (gram_route.py); what A₀ cannot resolve takes the
  exact path: the ranks agree on which, all-gather them and flatten them by float64 svd;
- "owner": one owner per matrix (`plan.plan_shards`), one all-to-all there and one back per dtype;
- "gather": one padded all-gather, every rank flattens every matrix.
Replicated matrices are flattened locally; meshes with several dimensions use `full_tensor()`.
Every result is in the grad's compute dtype (float32 for float16/bfloat16). The collectives are
planned before the step's first agreement (dtensor.py's `_Routes`) and issued in that order on
every rank; the local work between them runs under the step's `Agreement.attempt`, so a rank whose
work failed still joins each one with buffers of the planned size.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._validate import local
from ..outer.core import Entry, bucket_flatten
from .collectives import (
    GatherSegments,
    all_gather_shards,
    gather_buffers,
    owner_collect,
    owner_exchange,
    owner_receive,
    owner_return,
    owner_unpack,
)
from .gram_route import agree_exact, gram_route
from .plan import ShardLayout

__all__ = ["Stats", "gather_bytes", "gram_bytes", "iso_updates", "owner_bytes", "route_for", "route_seconds"]


#: What "auto" weighs the gather against the owner route with: bytes over the link (NVLink 4 one
#: way on an 8×H200 board, 450 GB/s) and the flatten's work ("polar"'s FLOP model at the H200's
#: measured float32 GEMM rate, 50.8 TFLOP/s, 2026-12-04). Constants, not settings: every rank must
#: choose the same routes.
LINK_BYTES_PER_S = 450e9
FLATTEN_FLOPS_PER_S = 50.8e12


def route_for(shape, dim: Optional[int], world: int, elem_size: int, mode: str = "auto") -> str:
    """ "local", "gram", "owner" or "gather" for an m×n matrix sharded along `dim` (None: replicated)
    on a 1-D mesh of `world` ranks. "auto": the Gram where the shard is the long side and its
    all-reduce sends fewer bytes per rank than the owner route; else the owner route or the gather,
    whichever is modelled faster (`route_seconds`: bytes over the link plus the flatten, which the
    owner route splits over the ranks and the gather repeats on every rank). The gather sends fewer
    bytes than the owner route where W·b < b + max(b, 4) (2-byte grads at W = 2), yet its repeated
    flatten costs more than those bytes save for every matrix with both sides above 2."""
    if world == 1 or dim is None:
        return "local"
    if mode in ("gather", "owner"):
        return mode
    m, n = shape
    long_side = (dim == 0 and m >= n) or (dim == 1 and n >= m)
    if long_side and (mode == "gram" or gram_bytes(shape, world) < owner_bytes(shape, dim, world, elem_size)):
        return "gram"
    if mode == "gram":
        return "owner"
    owner = route_seconds("owner", shape, dim, world, elem_size)
    return "gather" if route_seconds("gather", shape, dim, world, elem_size) < owner else "owner"


def route_seconds(route: str, shape, dim: int, world: int, elem_size: int) -> float:
    """Modelled seconds of the owner route or the gather for one matrix, per rank: its bytes over
    the link (`LINK_BYTES_PER_S`) plus its share of the flatten (`FLATTEN_FLOPS_PER_S`): 1/W of it
    for the owner route (owners balanced over the ranks), all of it for the gather."""
    from ..flatten.registry import flops_per_dtype

    r, k = min(shape), max(shape)
    work = sum((flops_per_dtype("polar", k, r) or {}).values()) / FLATTEN_FLOPS_PER_S
    if route == "owner":
        return owner_bytes(shape, dim, world, elem_size) / LINK_BYTES_PER_S + work / world
    if route == "gather":
        return gather_bytes(shape, dim, world, elem_size) / LINK_BYTES_PER_S + work
    raise ValueError(f"route_seconds: no model for route {route!r}")


def gather_bytes(shape, dim: int, world: int, elem_size: int) -> float:
    """Bytes one rank sends in a ring all-gather of the matrix (segments padded to the largest shard)."""
    from .plan import shard_sizes

    longest = max(s for _, s in shard_sizes(shape[dim], world))
    return (world - 1) * longest * shape[1 - dim] * elem_size


def gram_bytes(shape, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of the d×d float64 Gram matrix."""
    d = min(shape)
    return 2 * (world - 1) / world * 8 * d * d


def owner_bytes(shape, dim: int, world: int, elem_size: int) -> float:
    """Bytes sent per rank, averaged over the ranks, when one owner gathers the matrix, flattens it and
    scatters the result back (owners balanced over the ranks): (W−1)/W² of the matrix each way, out in
    the grad's dtype, back in its compute dtype (float32 for 2-byte grads)."""
    back = max(elem_size, 4)
    return (world - 1) / world * shape[0] * shape[1] * (elem_size + back) / world


class Stats:
    """What the last step handed to collectives (elements, by route), for tests and benchmarks."""

    def __init__(self):
        self.gram_elements = 0  # float64 elements all-reduced
        self.gather_elements = 0  # elements in all-gather outputs (all ranks' padded segments)
        self.full_tensor_elements = 0  # elements materialized by the general (multi-dim mesh) path
        self.owner_elements = 0  # elements this rank sent to other ranks in the owner route's all-to-alls
        self.gram_iterated = 0  # Gram-route matrices written by gram.py's iteration on A₀
        self.gram_fallbacks = 0  # Gram-route matrices that missed its checks (then exact)
        self.gram_exact = 0  # Gram-route matrices no A₀ served: all-gathered and flattened by svd

    def __repr__(self):
        return (
            f"Stats(gram={self.gram_elements}, gather={self.gather_elements}, "
            f"owner={self.owner_elements}, full={self.full_tensor_elements})"
        )


def iso_updates(method: str, entries: list[Entry], routes, ag, stats: Stats) -> dict[int, torch.Tensor]:
    """Local shard of iso(Δ) for every routed grad, in the grad's compute dtype: entry index →
    tensor (None-free only when no local work failed; the caller settles `ag` next).

    Every rank issues the collectives of `routes` in their order whatever happens locally."""
    out: dict[int, torch.Tensor] = {}
    full: dict[int, torch.Tensor] = {}  # whole matrices flattened on every rank (local, gather, general)
    lay = routes.layouts

    # Gram route: one float64 all-reduce per mesh; what its A₀ cannot serve takes the exact path
    for mesh, ks, ds in routes.gram:
        res, flags = gram_route(mesh, ks, ds, entries, lay, method, ag.attempt, stats)
        out.update(res or {})
        exact = agree_exact(mesh, ks, res, flags)
        stats.gram_exact += len(exact)
        got = _gather_whole(mesh, entries, lay, exact, ag, stats)
        results = ag.attempt(_flatten_whole, entries, got, "svd") or {}
        for k in results:
            out[k] = ag.attempt(_my_shard, entries[k], lay.get(k), results[k])

    # gather route: one padded all-gather per (mesh, dtype)
    for (mesh, dtype), ks, segs in routes.gather:
        full.update(_gather_whole(mesh, entries, lay, ks, ag, stats, segs, routes.buffers[("gather", mesh, dtype)]))

    # owner route, out: each rank's shards to the matrix's owner, one all-to-all per (mesh, dtype)
    owned: dict[int, torch.Tensor] = {}  # whole matrices this rank flattens for the others
    for (mesh, dtype), ks, splits in routes.owner:
        bufs = routes.buffers[("owner out", mesh, dtype)]
        ag.attempt(owner_collect, splits, [local(entries[k].g) for k in ks], bufs[0])
        stats.owner_elements += owner_exchange(mesh.get_group(0), bufs, splits.out_send, splits.out_recv)
        got = ag.attempt(owner_unpack, splits, bufs[1], _devices(entries, ks))
        owned.update({ks[j]: t for j, t in (got or {}).items()})

    # general path (meshes with several dimensions): full_tensor() per matrix, a collective each
    for k in routes.general:
        f = entries[k].g.full_tensor()
        stats.full_tensor_elements += f.numel()
        full[k] = f
    for k in routes.local:
        full[k] = local(entries[k].g)

    # flatten the whole matrices with the optimizer's method, batched by shape
    results = ag.attempt(_flatten_whole, entries, {**full, **owned}, method) or {}
    for k in full:
        if k in results:
            out[k] = ag.attempt(_my_shard, entries[k], lay.get(k), results[k])

    # owner route, back: each owner sends every rank its piece of the results, in their compute dtype
    for (mesh, dtype), ks, splits in routes.owner:
        bufs = routes.buffers[("owner back", mesh, dtype)]
        ag.attempt(owner_return, splits, {j: results.get(k) for j, k in enumerate(ks)}, bufs[0])
        stats.owner_elements += owner_exchange(mesh.get_group(0), bufs, splits.out_recv, splits.out_send)
        mine = ag.attempt(owner_receive, splits, bufs[1], _devices(entries, ks))
        out.update({ks[j]: t for j, t in (mine or {}).items()})
    return out


def _devices(entries, ks) -> list[torch.device]:
    return [local(entries[k].g).device for k in ks]


def _gather_whole(
    mesh,
    entries: list[Entry],
    layouts,
    ks: list[int],
    ag,
    stats,
    segs: Optional[GatherSegments] = None,
    buffers: Optional[tuple] = None,
) -> dict[int, torch.Tensor]:
    """Whole matrices of the entries `ks` (all 1-D-mesh Shard) on every rank, on their shards'
    device: one padded all-gather per grad dtype (the gather route's, and the Gram route's exact
    path). `segs`, `buffers`: the planned segments and their buffers (`_Routes.allocate`), for `ks`
    of one dtype; without them (the exact path, decided by an agreement) the buffers are allocated
    here and the ranks agree that every one has them before the all-gather. Empty once local work
    failed."""
    out: dict[int, torch.Tensor] = {}
    by: dict[torch.dtype, list[int]] = {}
    for k in ks:
        by.setdefault(entries[k].g.dtype, []).append(k)
    for dtype, dks in by.items():
        s = segs if segs is not None else GatherSegments([layouts[k] for k in dks])
        bufs = buffers
        if bufs is None:
            bufs = ag.attempt(gather_buffers, mesh.get_group(0), dtype, s)
            ag.settle()  # a rank that could not allocate them fails every rank here, not in the all-gather
        got, n = all_gather_shards(
            mesh.get_group(0), s, [local(entries[k].g) for k in dks], _devices(entries, dks), ag.attempt, bufs
        )
        stats.gather_elements += n
        if got is not None:
            out.update(zip(dks, got))
    return out


def _flatten_whole(entries: list[Entry], whole: dict[int, torch.Tensor], method: str) -> dict[int, torch.Tensor]:
    """iso() of whole matrices, batched by shape in their compute dtype (`outer.bucket_flatten`):
    entry index → result view. A result that does not fit its dtype is named by its param."""
    ks = list(whole)
    mats = [whole[k] for k in ks]  # made of shards every rank checked finite before the first agreement
    _, views = bucket_flatten(mats, method, [f"IsoLoCo: {entries[k].name}" for k in ks])
    return dict(zip(ks, views))


def _my_shard(entry: Entry, layout: Optional[ShardLayout], whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a whole (flattened) matrix, laid out like the param's local shard
    (`layout`: the matrix's on a 1-D mesh; None where it is replicated or the mesh has more dims)."""
    p = entry.p
    if layout is not None:
        return layout.piece(whole)
    if not any(pl.is_shard() for pl in p.placements):
        return whole
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
