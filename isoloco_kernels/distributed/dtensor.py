"""`IsoLoCo.step` on DTensor params: FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`).

Nesterov runs on the local shards (momentum buffers are DTensors placed like their params). Iso-C
of a 2-D param sharded on a 1-D mesh takes one of three routes, chosen per matrix by bytes per rank
(`route_for`, `wire_bytes`; `opt.dtensor_route` overrides):

- "gram": shards along the long side: the short-side Gram A₀ = Σᵢ YᵢᵀYᵢ (float64, all matrices of
  the step in one all-reduce), then on every rank gram.py's iteration on A₀ (method "gram") or
  float64 eigh, and each rank writes its own shard s̄·Yᵢ·P;
- "owner": one owner per matrix (`plan_owners`), one all-to-all there and one back per dtype;
- "gather": one padded all-gather, every rank flattens every matrix.
Replicated matrices are flattened locally; meshes with several dimensions use `full_tensor()`.
All-or-nothing across the mesh (`agree.agree_on_mesh` before the collectives and before the writes).
Contract and measurements: README "IsoLoCo with FSDP2 / torchtitan + torchft".
"""
from __future__ import annotations

import hashlib
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .._validate import check_all_finite
from ..buckets import BucketPlan
from ..ops import iso_merge_unchecked_
from ..outer import Entry, collect, is_dtensor, local, prepare_nesterov
from .agree import agree_on_mesh, error_text, optimizer_settings

# torch 2.14 renamed the single-tensor all-gather; older releases only have the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)

# torch.distributed.tensor takes seconds to import; it is imported only once a DTensor exists
# (then it is in sys.modules already), so plain-tensor users never pay for it.


def _dt():
    return sys.modules.get("torch.distributed.tensor")

__all__ = ["ROUTES", "check_params", "is_dtensor", "local", "route_for", "step_", "uses_dtensor", "wire_bytes"]

ROUTES = ("auto", "gram", "owner", "gather")


def uses_dtensor(opt) -> bool:
    """True when the optimizer's params are DTensors (checked by `check_params`: all or none)."""
    return any(is_dtensor(p) for g in opt.param_groups for p in g["params"])


# ----------------------------------------------------------------------------------------------
# Construction checks


def _placement_ok(pl, ndim: int, mesh_ndim: int) -> Optional[str]:
    """None if this placement is supported, else why not."""
    if pl.is_replicate():
        return None
    kind = type(pl).__name__
    # _StridedShard (FSDP over TP on the same dim) only arises on meshes with several dimensions,
    # which take the general full_tensor() path
    if kind == "Shard" or (kind == "_StridedShard" and mesh_ndim > 1):
        return None if 0 <= pl.dim < max(ndim, 1) else f"{pl} is out of range for a {ndim}-D tensor"
    return f"placement {pl} is not supported (only Shard(dim) and Replicate)"


def _shard_dim(pl) -> Optional[int]:
    return pl.dim if pl.is_shard() else None


def _ranks(mesh) -> frozenset:
    return frozenset(mesh.mesh.reshape(-1).tolist())


def check_params(opt) -> bool:
    """Refuse what the DTensor step cannot run; True when the params are DTensors.

    Called by IsoLoCo whenever a param group is added (so also at construction)."""
    params = [(gi, pi, p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
    kinds = [is_dtensor(p) for _, _, p in params]
    if not any(kinds):
        return False
    if not all(kinds):
        gi, pi, _ = params[kinds.index(False)]
        raise TypeError(
            f"IsoLoCo: param_groups[{gi}]['params'][{pi}] is a plain tensor while other params are "
            "DTensors; put all params on a device mesh (e.g. fully_shard the whole model) or use "
            "one optimizer per kind"
        )
    if getattr(opt, "process_group", None) is not None:
        raise ValueError(
            "IsoLoCo: process_group= splits the flatten of replicated params; DTensor params "
            "communicate over their own device mesh, so leave process_group=None"
        )
    for gi, pi, p in params:
        for pl in p.placements:
            why = _placement_ok(pl, p.ndim, p.device_mesh.ndim)
            if why:
                raise ValueError(
                    f"IsoLoCo: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, placements "
                    f"{p.placements}): {why}"
                )
    _agreement_mesh(opt)  # raises if the meshes do not nest
    return True


def _meshes(opt) -> list:
    seen = []
    for g in opt.param_groups:
        for p in g["params"]:
            if p.device_mesh not in seen:
                seen.append(p.device_mesh)
    return seen


def _agreement_mesh(opt):
    """The mesh the ranks agree over: the one with most ranks; every other mesh must lie inside."""
    meshes = _meshes(opt)
    big = max(meshes, key=lambda m: (m.size(), m.ndim))
    for m in meshes:
        if not _ranks(m) <= _ranks(big):
            raise ValueError(
                f"IsoLoCo: params live on meshes with ranks {sorted(_ranks(m))} and {sorted(_ranks(big))}; "
                "every mesh must lie inside the largest one (the step agrees over it)"
            )
    return big


# ----------------------------------------------------------------------------------------------
# The route of one matrix, and what it costs on the wire


def shard_sizes(length: int, world: int) -> list[tuple[int, int]]:
    """(start, size) of each rank's piece of a dimension of `length` over `world` ranks
    (torch.chunk sizes, empty pieces at the end: DTensor's Shard and FSDP2's layout)."""
    chunk = -(-length // world) if length else 0
    out = []
    for r in range(world):
        a = min(r * chunk, length)
        out.append((a, min(a + chunk, length) - a))
    return out


def route_for(shape, dim: Optional[int], world: int, elem_size: int, mode: str = "auto") -> str:
    """"local", "gram", "owner" or "gather" for an m×n matrix sharded along `dim` (None: replicated)
    on a 1-D mesh of `world` ranks (see the module docstring for the rule)."""
    if world == 1 or dim is None:
        return "local"
    if mode in ("gather", "owner"):
        return mode
    m, n = shape
    long_side = (dim == 0 and m >= n) or (dim == 1 and n >= m)
    if long_side and (mode == "gram" or gram_bytes(shape, world) < owner_bytes(shape, dim, world, elem_size)):
        return "gram"
    return "owner"


def gram_bytes(shape, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of the d×d float64 Gram matrix."""
    d = min(shape)
    return 2 * (world - 1) / world * 8 * d * d


def gather_bytes(shape, dim: int, world: int, elem_size: int) -> float:
    """Bytes one rank sends in a ring all-gather of the matrix (segments padded to the largest shard)."""
    longest = max(s for _, s in shard_sizes(shape[dim], world))
    return (world - 1) * longest * shape[1 - dim] * elem_size


def owner_bytes(shape, dim: int, world: int, elem_size: int) -> float:
    """Bytes sent per rank, averaged over the ranks, when one owner gathers the matrix, flattens it and
    scatters the result back (owners balanced over the ranks): 2·(W−1)/W² of the matrix."""
    return 2 * (world - 1) / world * shape[0] * shape[1] * elem_size / world


def wire_bytes(shapes, world: int, elem_size: int = 4, mode: str = "auto", dim: int = 0) -> dict[str, float]:
    """Bytes sent per rank (owner: the mean over ranks) in one outer step for the 2-D `shapes` under
    FSDP's Shard(dim) on a 1-D mesh of `world` ranks: each route alone ("gram_or_gather": the Gram
    where the shard is the long side, else the all-gather), and the routes `mode` picks. 1-D params
    cost nothing (Nesterov is local). Keys: "allgather", "owner", "gram_or_gather", "chosen"."""
    out = {"gram_or_gather": 0.0, "owner": 0.0, "allgather": 0.0, "chosen": 0.0}
    for sh in shapes:
        if len(sh) != 2:
            continue
        cost = {
            "gram": gram_bytes(sh, world),
            "gather": gather_bytes(sh, dim, world, elem_size),
            "owner": owner_bytes(sh, dim, world, elem_size),
            "local": 0.0,
        }
        out["allgather"] += cost["gather"]
        out["owner"] += cost["owner"]
        long_side = route_for(sh, dim, world, elem_size, "gram") == "gram"
        out["gram_or_gather"] += cost["gram"] if long_side else cost["gather"]
        out["chosen"] += cost[route_for(sh, dim, world, elem_size, mode)]
    return out


# ----------------------------------------------------------------------------------------------
# Agreement


def _fingerprint(entries: list[Entry]) -> int:
    text = repr([(e.gi, e.pi, tuple(e.p.shape), str(e.p.placements), str(e.g.dtype)) for e in entries])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


# ----------------------------------------------------------------------------------------------
# The step


def _check_grad(p, g, name: str) -> None:
    """What a DTensor param's grad and momentum must be beyond `outer.collect`'s checks."""
    if not is_dtensor(g):
        raise TypeError(f"IsoLoCo: {name} is a DTensor but its grad is a {type(g).__name__}")
    if g.shape != p.shape or g.device_mesh != p.device_mesh or tuple(g.placements) != tuple(p.placements):
        raise ValueError(
            f"IsoLoCo: {name}: grad has shape {tuple(g.shape)}, placements {g.placements}; the "
            f"param has placements {p.placements} on its mesh (set p.grad with the param's placements)"
        )
    if local(g).shape != local(p).shape:
        raise ValueError(f"IsoLoCo: {name}: local grad shard {tuple(local(g).shape)} differs from the param's "
                         f"{tuple(local(p).shape)}")
    if p.device_mesh.ndim == 1 and p.ndim >= 1 and p.placements[0].is_shard():
        pl = p.placements[0]
        w, me = p.device_mesh.size(), p.device_mesh.get_local_rank()
        want = shard_sizes(p.shape[pl.dim], w)[me][1]
        if local(p).shape[pl.dim] != want:
            raise ValueError(
                f"IsoLoCo: {name}: local shard has {local(p).shape[pl.dim]} rows along dim "
                f"{pl.dim}, the torch.chunk layout gives {want} on mesh rank {me}"
            )


def _reshard_momentum(opt) -> None:
    """Whole-tensor momentum buffers (from a plain IsoLoCo / SGD state dict, loaded on every rank)
    become DTensors placed like their params, locally (no communication), values unchanged."""
    for g in opt.param_groups:
        for p in g["params"]:
            buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
            if isinstance(buf, torch.Tensor) and not is_dtensor(buf) and buf.shape == p.shape:
                from torch.distributed.tensor import distribute_tensor

                opt.state[p]["momentum_buffer"] = distribute_tensor(
                    buf.detach(), p.device_mesh, p.placements, src_data_rank=None)
            elif is_dtensor(buf) and tuple(buf.placements) != tuple(p.placements):
                raise ValueError(f"IsoLoCo: a momentum_buffer has placements {buf.placements}, its param "
                                 f"{p.placements}")


def _gather_entries(opt) -> list[Entry]:
    """Every param with a grad, checked locally (`outer.collect` plus the DTensor layout)."""
    _reshard_momentum(opt)
    rank = dist.get_rank()
    return collect(opt, "IsoLoCo.step",
                   lambda gi, pi, p: f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) on rank {rank}",
                   _check_grad)


class _Stats:
    """What the last step handed to collectives (elements, by route), for tests and benchmarks."""

    def __init__(self):
        self.gram_elements = 0  # float64 elements all-reduced
        self.gather_elements = 0  # elements in all-gather outputs (all ranks' padded segments)
        self.full_tensor_elements = 0  # elements materialized by the general (multi-dim mesh) path
        self.owner_elements = 0  # elements this rank sent to other ranks in the owner route's all-to-alls
        self.gram_iterated = 0  # Gram-route matrices written by gram.py's iteration on A₀
        self.gram_fallbacks = 0  # Gram-route matrices that missed its check and took the eigh

    def __repr__(self):
        return (f"_Stats(gram={self.gram_elements}, gather={self.gather_elements}, "
                f"owner={self.owner_elements}, full={self.full_tensor_elements})")


def step_(opt) -> None:
    """One IsoLoCo outer step over DTensor params (IsoLoCo.step calls this). All-or-nothing."""
    mesh0 = _agreement_mesh(opt)
    mode = getattr(opt, "dtensor_route", "auto")
    entries, error = [], None
    try:
        if mode not in ROUTES:
            raise ValueError(f"IsoLoCo: dtensor_route must be one of {ROUTES}, got {mode!r}")
        entries = _gather_entries(opt)
    except Exception as e:
        error = error_text(e)
    agree_on_mesh(error, mesh0, "IsoLoCo.step", _fingerprint(entries) if error is None else 0,
                  settings=None if error else optimizer_settings(opt, method=opt.method, dtensor_route=mode))
    if not entries:
        return
    stats = _Stats()
    error, apply = None, None
    try:
        updates = _iso_updates(opt, entries, mode, stats)
        apply = _prepare_nesterov(opt, entries, updates)
    except Exception as e:  # the collectives inside always ran; see _iso_updates
        error = error_text(e)
    agree_on_mesh(error, mesh0, "IsoLoCo.step")
    opt.dtensor_stats = stats
    apply()


def _prepare_nesterov(opt, entries: list[Entry], updates: dict[int, torch.Tensor]):
    """Nesterov on the local shards (`outer.prepare_nesterov`: DTensor momentum, checked for
    overflow, nothing written until the returned function runs)."""
    return prepare_nesterov(opt, [(e.p, updates.get(k, local(e.g)), e.group["lr"], e.group["momentum"],
                                   f"IsoLoCo: {e.name}") for k, e in enumerate(entries)])


def _iso_updates(opt, entries, mode: str, stats: _Stats) -> dict[int, torch.Tensor]:
    """Local shard of iso(Δ) for every 2-D grad of an iso group: entry index → tensor.

    Collectives are issued in entry order whatever happens locally (a failed local step sends
    zeros), so one rank's exception cannot leave the others waiting; the first local error is
    raised after all of them ran."""
    first_error: list[BaseException] = []

    def attempt(fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            if not first_error:
                first_error.append(e)
            return None

    chosen = [k for k, e in enumerate(entries) if e.iso]
    routes: dict[int, str] = {}
    for k in chosen:
        p, g = entries[k].p, entries[k].g
        mesh = p.device_mesh
        if mesh.ndim > 1:
            routes[k] = "general" if any(pl.is_shard() for pl in p.placements) else "local"
        else:
            routes[k] = route_for(tuple(p.shape), _shard_dim(p.placements[0]), mesh.size(), g.element_size(), mode)
    out: dict[int, torch.Tensor] = {}
    full: dict[int, torch.Tensor] = {}  # whole matrices flattened on every rank (local, gather, general)

    # Gram route: one float64 all-reduce per mesh
    by_mesh: dict = {}
    for k in chosen:
        if routes[k] == "gram":
            by_mesh.setdefault(entries[k].p.device_mesh, []).append(k)
    for mesh, ks in by_mesh.items():
        ds = [min(entries[k].p.shape) for k in ks]
        buf = torch.zeros(sum(d * d for d in ds), dtype=torch.float64, device=local(entries[ks[0]].g).device)
        ys, off = {}, 0
        for k, d in zip(ks, ds):
            ys[k] = attempt(_gram_into, entries[k], buf[off : off + d * d].view(d, d))
            off += d * d
        dist.all_reduce(buf, group=mesh.get_group(0))
        stats.gram_elements += buf.numel()
        off = 0
        grams = {}
        for k, d in zip(ks, ds):
            grams[k] = buf[off : off + d * d].view(d, d)
            off += d * d
        res = attempt(_gram_polar, [(k, entries[k], ys[k], grams[k]) for k in ks if ys[k] is not None],
                      opt.method, stats)
        if res:
            out.update(res)

    # gather route: one padded all-gather per (mesh, dtype)
    by_kind: dict = {}
    for k in chosen:
        if routes[k] == "gather":
            g = entries[k].g
            by_kind.setdefault((g.device_mesh, g.dtype), []).append(k)
    for (mesh, dtype), ks in by_kind.items():
        got = _all_gather_shards(mesh, dtype, [entries[k] for k in ks], attempt, stats)
        if got is not None:
            full.update(zip(ks, got))

    # owner route, out: each rank's shards to the matrix's owner, one all-to-all per (mesh, dtype)
    owner_groups: dict = {}
    for k in chosen:
        if routes[k] == "owner":
            g = entries[k].g
            owner_groups.setdefault((g.device_mesh, g.dtype), []).append(k)
    owned: dict[int, torch.Tensor] = {}  # whole matrices this rank flattens for the others
    plans = {}
    for (mesh, dtype), ks in owner_groups.items():
        ents = [entries[k] for k in ks]
        owners = plan_owners([tuple(e.p.shape) for e in ents], mesh.size())
        plans[(mesh, dtype)] = owners
        got = _owner_collect(mesh, dtype, ents, owners, attempt, stats)
        owned.update({ks[j]: t for j, t in got.items()})
    full.update(owned)

    # general path (meshes with several dimensions): full_tensor() per matrix
    for k in chosen:
        if routes[k] == "general":
            f = entries[k].g.full_tensor()
            stats.full_tensor_elements += f.numel()
            full[k] = f
        elif routes[k] == "local":
            full[k] = local(entries[k].g)

    # flatten the whole matrices with the optimizer's method, batched by shape, then keep my shard
    ks = [k for k in chosen if k in full]
    if ks and not first_error:
        mats = [full[k] for k in ks]
        plan = attempt(BucketPlan, mats)
        if plan is not None:
            buffers = plan.pack(mats)
            if attempt(check_all_finite, mats, [f"matrix {k}" for k in ks]) is None and not first_error:
                attempt(iso_merge_unchecked_, buffers, opt.method)
            for k, v in zip(ks, plan.views()):
                if k in owned:
                    owned[k] = v
                else:
                    out[k] = attempt(_my_shard, entries[k], v)

    # owner route, back: each owner sends every rank its shard of the results (sent even after a
    # local failure, so no rank waits; the agreement after this step stops the writes then)
    for (mesh, dtype), ks in owner_groups.items():
        ents = [entries[k] for k in ks]
        results = {j: owned.get(k) for j, k in enumerate(ks)}
        mine = _owner_return(mesh, dtype, ents, plans[(mesh, dtype)], results, stats)
        out.update({ks[j]: t for j, t in mine.items()})
    if first_error:
        raise first_error[0]
    return out


def _gram_into(entry, slot: torch.Tensor) -> torch.Tensor:
    """slot ← YᵀY for this rank's shard Y (long side down, float64); returns Y."""
    p, g = entry.p, entry.g
    x = local(g).to(torch.float64)
    y = x if p.placements[0].dim == 0 else x.mT
    slot.copy_(y.mT @ y)
    return y


def _gram_method(method: str, d: int, n: int, device, dtype) -> str:
    """"gram" when the optimizer's method runs the Gram-space iteration on a d×n matrix (method
    "gram", or "auto" resolving to it for this shape and device), else "eigh"."""
    if method == "gram":
        return "gram"
    if method == "auto":
        from ..flatten import resolve_method

        probe = torch.empty((), dtype=dtype, device=device).expand(1, d, n)  # no allocation
        return "gram" if resolve_method("auto", probe) == "gram" else "eigh"
    return "eigh"


def _gram_polar(items, method: str = "eigh", stats=None) -> dict[int, torch.Tensor]:
    """This rank's shard of s̄·Q for each (entry index, entry, Y, A₀), batched per d: gram.py's
    iteration on A₀ (`gram.gram_from_a0`) where the method asks for it, float64 eigh otherwise and
    for the matrices that miss the iteration's residual check (every rank holds the same A₀, so
    every rank takes the same decision)."""
    out = {}
    by_d: dict[tuple, list] = {}
    for it in items:
        p, g = it[1].p, it[1].g
        how = _gram_method(method, min(p.shape), max(p.shape), local(g).device, g.dtype)
        by_d.setdefault((it[3].shape[0], how), []).append(it)
    for (d, how), its in by_d.items():
        a = torch.stack([it[3] for it in its])
        check_all_finite([a], ["Gram matrix"])
        if how == "gram":
            from ..gram import gram_from_a0

            yg, sbar, _, ok = gram_from_a0(a)
            w = yg * sbar[:, None, None]
            rest = []
            for it, ww, good in zip(its, w, ok.tolist()):
                if not good:
                    rest.append(it)
                    continue
                k, entry, y, _ = it
                p, g = entry.p, entry.g
                q = y @ ww.mT  # y: this rank's rows of Xᵀ (long side down); s̄·Qᵀ = Xᵀ·Wᵀ
                res = q if p.placements[0].dim == 0 else q.mT
                out[k] = res.to(g.dtype)
            if stats is not None:
                stats.gram_iterated += len(its) - len(rest)
                stats.gram_fallbacks += len(rest)
            if rest:
                out.update(_gram_eigh(rest, d))
        else:
            out.update(_gram_eigh(its, d))
    return out


def _gram_eigh(its, d: int) -> dict[int, torch.Tensor]:
    """s̄·Q by float64 eigh of A₀ = V diag(σ²) Vᵀ (exact.py's rank cut), this rank's shard."""
    out = {}
    a = torch.stack([it[3] for it in its])
    lam, v = torch.linalg.eigh(a)
    sig = lam.clamp_min(0).sqrt()  # ascending
    for (k, entry, y, _), s, vv, aa in zip(its, sig, v, a):
        p, g = entry.p, entry.g
        m, n = p.shape
        if g.dtype == torch.float64:
            tol = max(max(m, n) ** 0.5 * torch.finfo(torch.float64).eps, 1e-7)
        else:
            tol = max(m, n) ** 0.5 * torch.finfo(torch.float32).eps
        keep = s > tol * s[-1]
        inv = torch.where(keep, 1.0 / torch.where(keep, s, 1.0), 0.0)
        w = (vv * inv) @ vv.mT
        sbar = (s * keep).sum() / d
        q = (y @ w) * sbar
        # exact zeros stay zero: rows of Y are zero by construction; zero columns from diag(A₀)
        q = q * (aa.diagonal() != 0).to(q.dtype)
        res = q if p.placements[0].dim == 0 else q.mT
        out[k] = res.to(g.dtype)
    return out


def _all_gather_shards(mesh, dtype, ents, attempt, stats) -> Optional[list[torch.Tensor]]:
    """Whole matrices from every rank's shards: one all-gather of padded flat segments."""
    world, me = mesh.size(), mesh.get_local_rank()
    dev = local(ents[0].g).device
    layouts = []  # per entry: per rank (start, size) along its shard dim
    seg = [0] * world
    offs = []  # per entry: per rank offset in that rank's segment
    for e in ents:
        p = e.p
        dim = p.placements[0].dim
        sizes = shard_sizes(p.shape[dim], world)
        other = p.shape[1 - dim]
        layouts.append(sizes)
        offs.append(list(seg))
        for r in range(world):
            seg[r] += sizes[r][1] * other
    longest = max(seg)
    send = torch.zeros(longest, dtype=dtype, device=dev)
    for e, o in zip(ents, offs):
        loc = local(e.g)
        attempt(lambda: send[o[me] : o[me] + loc.numel()].copy_(loc.reshape(-1)))
    recv = torch.empty(world * longest, dtype=dtype, device=dev)
    _all_gather_single(recv, send, group=mesh.get_group(0))
    stats.gather_elements += recv.numel()
    recv = recv.view(world, longest)
    out = []
    for e, sizes, o in zip(ents, layouts, offs):
        p = e.p
        dim = p.placements[0].dim
        other = p.shape[1 - dim]
        pieces = []
        for r in range(world):
            n = sizes[r][1]
            flat = recv[r, o[r] : o[r] + n * other]
            pieces.append(flat.view(n, other) if dim == 0 else flat.view(other, n))
        out.append(torch.cat(pieces, dim=dim))
    return out


def plan_owners(shapes, world: int) -> list[int]:
    """Owner rank of each matrix: largest flatten cost (m·n·min(m, n)) first, each to the least
    loaded rank (ties: lowest rank); the same on every rank, from the shapes alone."""
    load = [0] * world
    owners = [0] * len(shapes)
    for j in sorted(range(len(shapes)), key=lambda j: (-shapes[j][0] * shapes[j][1] * min(shapes[j]), j)):
        r = min(range(world), key=lambda r: (load[r], r))
        owners[j] = r
        load[r] += shapes[j][0] * shapes[j][1] * min(shapes[j])
    return owners


def _shard_numel(p, r: int, world: int) -> tuple[int, tuple[int, int]]:
    """(numel, local shape) of rank r's shard of 2-D param p under Shard(dim) on a 1-D mesh."""
    dim = p.placements[0].dim
    n = shard_sizes(p.shape[dim], world)[r][1]
    other = p.shape[1 - dim]
    return n * other, ((n, other) if dim == 0 else (other, n))


def _owner_collect(mesh, dtype, ents, owners, attempt, stats) -> dict[int, torch.Tensor]:
    """All-to-all of every rank's shards to each matrix's owner; returns {j: whole matrix} for the
    matrices this rank owns."""
    world, me = mesh.size(), mesh.get_local_rank()
    dev = local(ents[0].g).device
    send_split = [sum(_shard_numel(e.p, me, world)[0] for e, o in zip(ents, owners) if o == r) for r in range(world)]
    recv_split = [sum(_shard_numel(e.p, r, world)[0] for e, o in zip(ents, owners) if o == me) for r in range(world)]
    send = torch.zeros(sum(send_split), dtype=dtype, device=dev)
    off = [sum(send_split[:r]) for r in range(world)]
    for e, o in zip(ents, owners):
        loc = local(e.g)
        attempt(lambda: send[off[o] : off[o] + loc.numel()].copy_(loc.reshape(-1)))
        off[o] += loc.numel()
    recv = torch.empty(sum(recv_split), dtype=dtype, device=dev)
    dist.all_to_all_single(recv, send, recv_split, send_split, group=mesh.get_group(0))
    stats.owner_elements += send.numel() - send_split[me]
    mine = [j for j, o in enumerate(owners) if o == me]
    pieces: dict[int, list] = {j: [] for j in mine}
    pos = 0
    for r in range(world):
        for j in mine:
            n, shape = _shard_numel(ents[j].p, r, world)
            pieces[j].append(recv[pos : pos + n].view(shape))
            pos += n
    return {j: torch.cat(pieces[j], dim=ents[j].p.placements[0].dim) for j in mine}


def _owner_return(mesh, dtype, ents, owners, results, stats) -> dict[int, torch.Tensor]:
    """All-to-all of the owners' results back: returns {j: this rank's shard} for every matrix."""
    world, me = mesh.size(), mesh.get_local_rank()
    dev = local(ents[0].g).device
    mine = [j for j, o in enumerate(owners) if o == me]
    send_split = [sum(_shard_numel(ents[j].p, r, world)[0] for j in mine) for r in range(world)]
    recv_split = [sum(_shard_numel(e.p, me, world)[0] for e, o in zip(ents, owners) if o == r) for r in range(world)]
    send = torch.zeros(sum(send_split), dtype=dtype, device=dev)
    pos = 0
    for r in range(world):
        for j in mine:
            n, _ = _shard_numel(ents[j].p, r, world)
            res = results.get(j)
            if res is not None and res.dtype == dtype:
                dim = ents[j].p.placements[0].dim
                a, size = shard_sizes(res.shape[dim], world)[r]
                send[pos : pos + n].copy_(res.narrow(dim, a, size).reshape(-1))
            pos += n
    recv = torch.empty(sum(recv_split), dtype=dtype, device=dev)
    dist.all_to_all_single(recv, send, recv_split, send_split, group=mesh.get_group(0))
    stats.owner_elements += send.numel() - send_split[me]
    out, pos = {}, 0
    for r in range(world):
        for j, o in enumerate(owners):
            if o == r:
                n, shape = _shard_numel(ents[j].p, me, world)
                out[j] = recv[pos : pos + n].view(shape)
                pos += n
    return out


def _my_shard(entry, whole: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a whole (flattened) matrix, laid out like the param's local shard."""
    p = entry.p
    mesh = p.device_mesh
    if not any(pl.is_shard() for pl in p.placements):
        return whole
    if mesh.ndim == 1:
        dim = p.placements[0].dim
        a, n = shard_sizes(p.shape[dim], mesh.size())[mesh.get_local_rank()]
        return whole.narrow(dim, a, n)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(whole, mesh, p.placements, src_data_rank=None).to_local()
