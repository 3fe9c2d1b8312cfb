"""`IsoLoCo.step` on DTensor params: FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`).

Nesterov runs on the local shards (momentum buffers are DTensors placed like their params). Iso-C
of a 2-D param sharded on a 1-D mesh takes one of three routes, chosen per matrix by bytes per rank
(`route_for`, `wire_bytes`; `opt.dtensor_route` overrides):

- "gram": shards along the long side: the short-side Gram A₀ = Σᵢ YᵢᵀYᵢ (float64, all matrices of
  the step in one all-reduce), then on every rank gram.py's iteration on A₀ (method "gram") or
  float64 eigh, and each rank writes its own shard s̄·Yᵢ·P. A matrix its A₀ cannot resolve (the
  iteration's checks or eigh's resolution fail: rank-deficient, or too ill-conditioned for
  reference.py's rank cut to be read off A₀) takes the exact path, as in single-process IsoLoCo:
  the ranks agree on which (one small all-reduce), all-gather them and flatten them by float64 svd;
- "owner": one owner per matrix (`plan_owners`), one all-to-all there and one back per dtype;
- "gather": one padded all-gather, every rank flattens every matrix.
Replicated matrices are flattened locally; meshes with several dimensions use `full_tensor()`.
Every route's result is in the grad's compute dtype (float32 for float16/bfloat16, as in
single-process IsoLoCo); the param is rounded to its dtype once, by the overflow-checked Nesterov.
All-or-nothing across the mesh (`agree.agree_on_mesh` before the collectives and before the writes);
the collectives are planned before the first agreement (`_StepPlan`; the Gram route's exact path
from its agreed flags) and a rank whose local work fails between them still joins each one
(`_Guard`), so the failure reaches every rank, never a hang. Every buffer handed to a collective
is made on the mesh group's `agree.comm_device`; results move to the local shards' device.
Contract and measurements: README "IsoLoCo with FSDP2 / torchtitan + torchft".
"""
from __future__ import annotations

import hashlib
import sys
from typing import Optional

import torch
import torch.distributed as dist

from .._validate import ResultOverflowError, _overlap, _span, check_all_finite, compute_dtype
from ..buckets import BucketPlan
from ..ops import iso_merge_unchecked_
from ..outer import Entry, collect, is_dtensor, local, prepare_nesterov
from .agree import agree_on_mesh, comm_device, error_text, largest_mesh, optimizer_settings

# torch 2.14 renamed the single-tensor all-gather; older releases only have the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)

# torch.distributed.tensor takes seconds to import; it is imported only once a DTensor exists
# (then it is in sys.modules already), so plain-tensor users never pay for it.


def _dt():
    return sys.modules.get("torch.distributed.tensor")

__all__ = ["ROUTES", "check_loaded_state", "check_params", "is_dtensor", "local", "route_for", "step_", "uses_dtensor", "wire_bytes"]

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


def check_loaded_state(opt, state_dict, where: str) -> None:
    """What `outer.check_state_dict` leaves to this module, checked before anything is loaded
    (IsoLoCo.load_state_dict calls it first; a malformed dict is left to that check):

    - a momentum_buffer sharing memory with a param (its own or another): torch's loader would keep
      it as it is, so the buffer would be the param and every later step would refuse to run;
    - a DTensor momentum_buffer must sit on its param's mesh with its placements, global and local
      shape (a whole plain tensor is fine: the step reshards it); a plain param takes no DTensor."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict):
        return
    saved = state_dict.get("param_groups")
    if not isinstance(saved, (list, tuple)) or len(saved) != len(opt.param_groups):
        return
    pairs = []
    for g, mine in zip(saved, opt.param_groups):
        if not isinstance(g, dict) or len(g.get("params", ())) != len(mine["params"]):
            return
        pairs += zip(g["params"], mine["params"])
    storages: dict[tuple, list] = {}  # (device, storage) → the params in it
    for pid, p in pairs:
        lp = local(p)
        if lp.numel() and lp.untyped_storage().data_ptr():
            storages.setdefault((lp.device, lp.untyped_storage().data_ptr()), []).append((pid, lp))
    for pid, p in pairs:
        entry = state_dict["state"].get(pid)
        b = entry.get("momentum_buffer") if isinstance(entry, dict) else None
        if not isinstance(b, torch.Tensor):
            continue
        name = f"{where}: param {pid} (shape {tuple(p.shape)}) momentum_buffer"
        lb = local(b).detach()
        near = storages.get((lb.device, lb.untyped_storage().data_ptr()), []) if lb.numel() else []
        other = next((q for q, lp in near if _shares_elements(lb, lp.detach())), None)
        if other is not None:
            whose = "its own param" if other == pid else f"param {other}"
            raise ValueError(f"{name} shares memory with {whose}; a momentum buffer needs its own memory "
                             "(pass a copy, e.g. buf.clone()); nothing was loaded")
        if not is_dtensor(b):
            continue
        if not is_dtensor(p):
            raise TypeError(f"{name} is a DTensor but its param is a plain tensor; nothing was loaded")
        if (b.device_mesh != p.device_mesh or tuple(b.placements) != tuple(p.placements)
                or b.shape != p.shape or lb.shape != local(p).shape):
            raise ValueError(
                f"{name} is a DTensor of shape {tuple(b.shape)} (local {tuple(lb.shape)}) with placements "
                f"{b.placements} on {b.device_mesh}; its param has shape {tuple(p.shape)} (local "
                f"{tuple(local(p).shape)}) with placements {p.placements} on {p.device_mesh} (save and load "
                "under the same mesh and placements, or load whole tensors); nothing was loaded"
            )


def _shares_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors in one storage have an element in common (byte spans first, then exact)."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1 and _overlap(a, b)


def _agreement_mesh(opt):
    """The mesh the ranks agree over (`agree.largest_mesh` of the params' meshes)."""
    return largest_mesh([p for g in opt.param_groups for p in g["params"]])


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
    scatters the result back (owners balanced over the ranks): (W−1)/W² of the matrix each way, out in
    the grad's dtype, back in its compute dtype (float32 for 2-byte grads)."""
    back = max(elem_size, 4)
    return (world - 1) / world * shape[0] * shape[1] * (elem_size + back) / world


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
        self.gram_fallbacks = 0  # Gram-route matrices that missed its checks (then exact)
        self.gram_exact = 0  # Gram-route matrices no A₀ served: all-gathered and flattened by svd

    def __repr__(self):
        return (f"_Stats(gram={self.gram_elements}, gather={self.gather_elements}, "
                f"owner={self.owner_elements}, full={self.full_tensor_elements})")


def step_(opt, failed: Optional[BaseException] = None) -> None:
    """One IsoLoCo outer step over DTensor params (IsoLoCo.step calls this). All-or-nothing.

    failed: what the closure raised on this rank; it reaches every rank as a DistributedStepError."""
    mesh0 = _agreement_mesh(opt)
    mode = getattr(opt, "dtensor_route", "auto")
    entries, plan, error, fp, settings = [], None, None, 0, None
    try:  # everything that can fail on one rank comes before its first collective
        if failed is not None:
            raise failed
        if mode not in ROUTES:
            raise ValueError(f"IsoLoCo: dtensor_route must be one of {ROUTES}, got {mode!r}")
        entries = _gather_entries(opt)
        plan = _StepPlan(entries, mode)  # every collective's size, before any of them runs
        fp = _fingerprint(entries)
        settings = optimizer_settings(opt, method=opt.method, dtensor_route=mode)
    except Exception as e:
        error, fp, settings = error_text(e), 0, None
    agree_on_mesh(error, mesh0, "IsoLoCo.step", fp, settings=settings)
    if not entries:
        return
    stats = _Stats()
    error, apply = None, None
    try:
        updates = _iso_updates(opt, entries, plan, stats)
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


class _StepPlan:
    """The collectives of one step, planned from the shapes the ranks agreed on: each Iso-C
    matrix's route and the size of every buffer each collective sends and receives, so a rank
    whose local work failed can still join each collective with a buffer of the right size.

    Lists of (key, entry indices, sizes) in the order the step issues them: `gram` per mesh,
    `gather` and `owner` per (mesh, grad dtype); `general` and `local` entry indices."""

    def __init__(self, entries: list[Entry], mode: str):
        self.routes: dict[int, str] = {}
        for k, e in enumerate(entries):
            if not e.iso:
                continue
            p, mesh = e.p, e.p.device_mesh
            if mesh.ndim > 1:
                self.routes[k] = "general" if any(pl.is_shard() for pl in p.placements) else "local"
            else:
                dim = _shard_dim(p.placements[0])
                self.routes[k] = route_for(tuple(p.shape), dim, mesh.size(), e.g.element_size(), mode)
        by: dict[str, dict] = {"gram": {}, "gather": {}, "owner": {}}
        for k, r in self.routes.items():
            if r in by:
                g = entries[k].g
                by[r].setdefault(g.device_mesh if r == "gram" else (g.device_mesh, g.dtype), []).append(k)
        self.gram = [(mesh, ks, [min(entries[k].p.shape) for k in ks]) for mesh, ks in by["gram"].items()]
        self.gather = [(key, ks, _GatherLayout(key[0], [entries[k] for k in ks])) for key, ks in by["gather"].items()]
        self.owner = [(key, ks, _OwnerLayout(key[0], [entries[k] for k in ks])) for key, ks in by["owner"].items()]
        self.general = [k for k, r in self.routes.items() if r == "general"]
        self.local = [k for k, r in self.routes.items() if r == "local"]


class _Guard:
    """Runs the local work between the step's collectives. The first exception is kept, and from
    then on the rank skips its local work but still joins every remaining collective (sending
    zeros), so no rank waits on it; the step raises the exception after the last collective and
    the agreement that follows turns it into a DistributedStepError on every rank."""

    def __init__(self):
        self.error: Optional[BaseException] = None

    def run(self, fn, *args):
        """fn(*args), or None once any local work of this step failed."""
        if self.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:
            self.error = e
            return None


def _result_dtype(g: torch.Tensor) -> torch.dtype:
    """The dtype of a route's Iso-C result: the grad's compute dtype (float32 for float16 and
    bfloat16, as single-process IsoLoCo keeps it); it is rounded to the param's dtype once, when
    Nesterov writes the param."""
    return compute_dtype(g.dtype)


def _iso_updates(opt, entries: list[Entry], plan: _StepPlan, stats: _Stats) -> dict[int, torch.Tensor]:
    """Local shard of iso(Δ) for every 2-D grad of an iso group, in the grad's compute dtype:
    entry index → tensor.

    Every rank issues the collectives of `plan` in its order whatever happens locally: the local
    work between them runs under one `_Guard`, and a rank whose work failed sends zeros of the
    planned sizes. The first local error is raised after the last collective."""
    guard = _Guard()
    out: dict[int, torch.Tensor] = {}
    full: dict[int, torch.Tensor] = {}  # whole matrices flattened on every rank (local, gather, general)

    # Gram route: one float64 all-reduce per mesh; what its A₀ cannot serve takes the exact path
    for mesh, ks, ds in plan.gram:
        group = mesh.get_group(0)
        buf = torch.zeros(sum(d * d for d in ds), dtype=torch.float64, device=comm_device(group))
        ys, off = {}, 0
        for k, d in zip(ks, ds):
            ys[k] = guard.run(_gram_into, entries[k], buf[off : off + d * d].view(d, d))
            off += d * d
        dist.all_reduce(buf, group=group)
        stats.gram_elements += buf.numel()
        res = guard.run(_gram_results, entries, ks, ds, ys, buf, opt.method, stats)
        if res:
            out.update(res)
        exact = _agree_exact(mesh, ks, res)
        stats.gram_exact += len(exact)
        got = _gather_whole(mesh, entries, exact, guard, stats)
        results = guard.run(_flatten_whole, entries, got, "svd") or {}
        for k in results:
            out[k] = guard.run(_my_shard, entries[k], results[k])

    # gather route: one padded all-gather per (mesh, dtype)
    for (mesh, dtype), ks, layout in plan.gather:
        full.update(_gather_whole(mesh, entries, ks, guard, stats, layout))

    # owner route, out: each rank's shards to the matrix's owner, one all-to-all per (mesh, dtype)
    owned: dict[int, torch.Tensor] = {}  # whole matrices this rank flattens for the others
    for (mesh, dtype), ks, layout in plan.owner:
        ents = [entries[k] for k in ks]
        recv = _owner_all_to_all(mesh, dtype, layout.out_send, layout.out_recv, guard, stats,
                                 _owner_pack, ents, layout)
        got = guard.run(_owner_unpack, ents, layout, recv)
        if got is not None:
            owned.update({ks[j]: t for j, t in got.items()})

    # general path (meshes with several dimensions): full_tensor() per matrix, a collective each
    for k in plan.general:
        f = entries[k].g.full_tensor()
        stats.full_tensor_elements += f.numel()
        full[k] = f
    for k in plan.local:
        full[k] = local(entries[k].g)

    # flatten the whole matrices with the optimizer's method, batched by shape
    results = guard.run(_flatten_whole, entries, {**full, **owned}, opt.method) or {}
    for k in full:
        if k in results:
            out[k] = guard.run(_my_shard, entries[k], results[k])

    # owner route, back: each owner sends every rank its shard of the results, in their compute dtype
    for (mesh, dtype), ks, layout in plan.owner:
        ents = [entries[k] for k in ks]
        recv = _owner_all_to_all(mesh, compute_dtype(dtype), layout.back_send, layout.back_recv, guard, stats,
                                 _owner_return, mesh, ents, layout, {j: results.get(k) for j, k in enumerate(ks)})
        mine = guard.run(_owner_receive, ents, layout, recv)
        if mine is not None:
            out.update({ks[j]: t for j, t in mine.items()})
    if guard.error is not None:
        raise guard.error
    return out


def _owner_all_to_all(mesh, dtype, send_split, recv_split, guard, stats, pack, *args) -> torch.Tensor:
    """One all-to-all of the owner route on the mesh's communication device: `pack(*args, send)`
    fills the send buffer (guarded: a rank that failed sends zeros but still joins)."""
    group = mesh.get_group(0)
    send = torch.zeros(sum(send_split), dtype=dtype, device=comm_device(group))
    guard.run(pack, *args, send)
    recv = torch.empty(sum(recv_split), dtype=dtype, device=comm_device(group))
    dist.all_to_all_single(recv, send, recv_split, send_split, group=group)
    stats.owner_elements += send.numel() - send_split[mesh.get_local_rank()]
    return recv


def _flatten_whole(entries: list[Entry], whole: dict[int, torch.Tensor], method: str) -> dict[int, torch.Tensor]:
    """iso() of whole matrices, batched by shape in their compute dtype (`BucketPlan`): entry
    index → result view. A result that does not fit its dtype is named by its param."""
    if not whole:
        return {}
    ks = list(whole)
    mats = [whole[k] for k in ks]
    plan = BucketPlan(mats)
    buffers = plan.pack(mats)
    check_all_finite(mats, [f"IsoLoCo: {entries[k].name}: the whole grad" for k in ks])
    try:
        iso_merge_unchecked_(buffers, method)
    except ResultOverflowError as e:
        b = plan.buckets[e.bucket]
        raise ResultOverflowError(f"IsoLoCo: {entries[ks[b.members[e.matrix]]].name}: the Iso-C result of its "
                                  f"grad does not fit {b.dtype}; nothing was changed") from None
    return dict(zip(ks, plan.views()))


def _agree_exact(mesh, ks: list[int], served: Optional[dict]) -> list[int]:
    """The Gram-route matrices of `ks` that no A₀ served (`served`: this rank's results, None once
    its local work failed), as every rank of the mesh sees them: every rank holds the same A₀ and
    decides alike, and one small all-reduce (max) of the flags makes that exact even where LAPACK
    differs between ranks in its last bits; a failed rank flags nothing, so it joins the others."""
    group = mesh.get_group(0)
    flags = torch.zeros(len(ks), dtype=torch.int64, device=comm_device(group))
    if served is not None:
        flags.copy_(torch.tensor([int(k not in served) for k in ks], dtype=torch.int64))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [k for k, f in zip(ks, flags.tolist()) if f]


def _gather_whole(mesh, entries: list[Entry], ks: list[int], guard, stats,
                  layout: Optional["_GatherLayout"] = None) -> dict[int, torch.Tensor]:
    """Whole matrices of the entries `ks` (all 1-D-mesh Shard) on every rank, on their shards'
    device: one padded all-gather per grad dtype (the gather route's, and the Gram route's exact
    path). `layout`: the planned one, for `ks` of one dtype. Empty once local work failed."""
    out: dict[int, torch.Tensor] = {}
    by: dict[torch.dtype, list[int]] = {}
    for k in ks:
        by.setdefault(entries[k].g.dtype, []).append(k)
    group = mesh.get_group(0)
    for dtype, dks in by.items():
        ents = [entries[k] for k in dks]
        lay = layout if layout is not None else _GatherLayout(mesh, ents)
        send = torch.zeros(lay.longest, dtype=dtype, device=comm_device(group))
        guard.run(_gather_pack, mesh, ents, lay, send)
        recv = torch.empty(mesh.size() * lay.longest, dtype=dtype, device=comm_device(group))
        _all_gather_single(recv, send, group=group)
        stats.gather_elements += recv.numel()
        got = guard.run(_gather_unpack, ents, lay, recv)
        if got is not None:
            out.update(zip(dks, got))
    return out


def _gram_into(entry, slot: torch.Tensor) -> torch.Tensor:
    """slot ← YᵀY for this rank's shard Y (long side down, float64); returns Y."""
    p, g = entry.p, entry.g
    x = local(g).to(torch.float64)
    y = x if p.placements[0].dim == 0 else x.mT
    slot.copy_(y.mT @ y)
    return y


def _gram_results(entries, ks, ds, ys, buf: torch.Tensor, method: str, stats) -> dict[int, torch.Tensor]:
    """This rank's shard of s̄·Q for the Gram-route matrices `ks` of one mesh that their all-reduced
    A₀ (the flat buffer) serves (`_gram_polar`); the others are left out (the exact path's)."""
    items, off = [], 0
    for k, d in zip(ks, ds):
        a0 = buf[off : off + d * d].view(d, d).to(ys[k].device)
        items.append((k, entries[k], ys[k], a0))
        off += d * d
    return _gram_polar(items, method, stats)


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
    """This rank's shard of s̄·Q for each (entry index, entry, Y, A₀) that A₀ serves, batched per
    (d, long side, dtype) as the single-process methods decide: gram.py's iteration on A₀
    (`gram.gram_from_a0`, with its residual and rank-cut checks) where the method asks for it,
    else float64 eigh where it resolves the spectrum (`exact.eigh_polar`, reference.py's rank cut).
    A matrix either misses is left out: it needs the exact path (svd of the whole matrix), as in
    `flatten_gram_` and `flatten_eigh_`. Every rank holds the same A₀, so every rank decides alike."""
    out = {}
    by: dict[tuple, list] = {}
    for it in items:
        p, g = it[1].p, it[1].g
        how = _gram_method(method, min(p.shape), max(p.shape), local(g).device, g.dtype)
        by.setdefault((it[3].shape[0], max(p.shape), g.dtype, how), []).append(it)
    for (d, n, dtype, how), its in by.items():
        a = torch.stack([it[3] for it in its])
        check_all_finite([a], ["Gram matrix"])
        if how == "gram":
            from ..gram import gram_from_a0

            yg, sbar, _, ok = gram_from_a0(a, long_side=n, dtype=dtype)
            w = yg * sbar[:, None, None]  # s̄·Qᵀ = Xᵀ·Wᵀ; y: this rank's rows of Xᵀ (long side down)
            served = {it[0]: it[2] @ ww.mT for it, ww, good in zip(its, w, ok.tolist()) if good}
            if stats is not None:
                stats.gram_iterated += len(served)
                stats.gram_fallbacks += len(its) - len(served)
        else:
            served = _gram_eigh(its, a, n, dtype)
        for it in its:
            if it[0] in served:
                q, p, g = served[it[0]], it[1].p, it[1].g
                out[it[0]] = (q if p.placements[0].dim == 0 else q.mT).to(_result_dtype(g))
    return out


def _gram_eigh(its, a: torch.Tensor, n: int, dtype) -> dict[int, torch.Tensor]:
    """{entry index: s̄·Qᵀ's rows on this rank} by float64 eigh of the stacked A₀ `a` for the
    matrices it resolves (`exact.eigh_polar`: the rank bound is A₀'s nonzero diagonal, the cut
    reference.py's); the others are left out."""
    from ..exact import eigh_polar

    d = a.shape[-1]
    nzd = a.diagonal(dim1=-2, dim2=-1) != 0  # X's nonzero short-side lines
    pm, nuc, ok = eigh_polar(a, nzd.sum(-1), d, n, dtype)
    out = {}
    for (k, _, y, _), pp, s, good, cols in zip(its, pm, nuc, ok.tolist(), nzd):
        if good:
            # Qᵀ = Xᵀ·P on this rank's rows; zero columns of Q stay exactly zero
            out[k] = ((y @ pp) * (s / d)) * cols.to(y.dtype)
    return out


class _GatherLayout:
    """Where each matrix's shards sit in the gather route's padded segments: per matrix, per rank
    (start, size) along its shard dim and the offset in that rank's segment; the longest segment."""

    def __init__(self, mesh, ents):
        world = mesh.size()
        self.sizes, self.offs = [], []
        seg = [0] * world
        for e in ents:
            dim = e.p.placements[0].dim
            sizes = shard_sizes(e.p.shape[dim], world)
            self.sizes.append(sizes)
            self.offs.append(list(seg))
            for r in range(world):
                seg[r] += sizes[r][1] * e.p.shape[1 - dim]
        self.longest = max(seg)


def _gather_pack(mesh, ents, layout: _GatherLayout, send: torch.Tensor) -> None:
    """This rank's shards into its segment of the all-gather."""
    me = mesh.get_local_rank()
    for e, o in zip(ents, layout.offs):
        loc = local(e.g)
        send[o[me] : o[me] + loc.numel()].copy_(loc.reshape(-1))


def _gather_unpack(ents, layout: _GatherLayout, recv: torch.Tensor) -> list[torch.Tensor]:
    """Whole matrices from every rank's segment of the all-gather."""
    world = len(layout.sizes[0]) if layout.sizes else 1
    recv = recv.view(world, layout.longest)
    out = []
    for e, sizes, o in zip(ents, layout.sizes, layout.offs):
        dim = e.p.placements[0].dim
        other = e.p.shape[1 - dim]
        pieces = []
        for r in range(world):
            n = sizes[r][1]
            flat = recv[r, o[r] : o[r] + n * other]
            pieces.append(flat.view(n, other) if dim == 0 else flat.view(other, n))
        out.append(torch.cat(pieces, dim=dim).to(local(e.g).device))
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


class _OwnerLayout:
    """The owner route's two all-to-alls for one (mesh, dtype): each matrix's owner (`plan_owners`)
    and the per-rank split sizes, out (shards to the owners) and back (results to every rank)."""

    def __init__(self, mesh, ents):
        world, me = mesh.size(), mesh.get_local_rank()
        self.world, self.me = world, me
        self.owners = plan_owners([tuple(e.p.shape) for e in ents], world)
        self.mine = [j for j, o in enumerate(self.owners) if o == me]
        numel = [[_shard_numel(e.p, r, world)[0] for r in range(world)] for e in ents]
        self.out_send = [sum(numel[j][me] for j, o in enumerate(self.owners) if o == r) for r in range(world)]
        self.out_recv = [sum(numel[j][r] for j in self.mine) for r in range(world)]
        self.back_send, self.back_recv = self.out_recv, self.out_send


def _owner_pack(ents, layout: _OwnerLayout, send: torch.Tensor) -> None:
    """This rank's shard of each matrix into the owner's part of the outgoing all-to-all."""
    off = [sum(layout.out_send[:r]) for r in range(layout.world)]
    for e, o in zip(ents, layout.owners):
        loc = local(e.g)
        send[off[o] : off[o] + loc.numel()].copy_(loc.reshape(-1))
        off[o] += loc.numel()


def _owner_unpack(ents, layout: _OwnerLayout, recv: torch.Tensor) -> dict[int, torch.Tensor]:
    """{j: whole matrix} for the matrices this rank owns, from every rank's shard."""
    pieces: dict[int, list] = {j: [] for j in layout.mine}
    pos = 0
    for r in range(layout.world):
        for j in layout.mine:
            n, shape = _shard_numel(ents[j].p, r, layout.world)
            pieces[j].append(recv[pos : pos + n].view(shape))
            pos += n
    return {j: torch.cat(pieces[j], dim=ents[j].p.placements[0].dim).to(local(ents[j].g).device)
            for j in layout.mine}


def _owner_return(mesh, ents, layout: _OwnerLayout, results: dict, send: torch.Tensor) -> None:
    """The owner's results (whole matrices, compute dtype) into the returning all-to-all: each
    rank's shard of each matrix this rank owns. Every result must be there."""
    pos = 0
    for r in range(layout.world):
        for j in layout.mine:
            n, _ = _shard_numel(ents[j].p, r, layout.world)
            res = results.get(j)
            if res is None:
                raise RuntimeError(f"IsoLoCo: {ents[j].name}: the owner has no Iso-C result to return")
            dim = ents[j].p.placements[0].dim
            a, size = shard_sizes(res.shape[dim], layout.world)[r]
            send[pos : pos + n].copy_(res.narrow(dim, a, size).reshape(-1))
            pos += n


def _owner_receive(ents, layout: _OwnerLayout, recv: torch.Tensor) -> dict[int, torch.Tensor]:
    """{j: this rank's shard of the result} for every matrix, from the owners' parts."""
    out, pos = {}, 0
    for r in range(layout.world):
        for j, o in enumerate(layout.owners):
            if o == r:
                n, shape = _shard_numel(ents[j].p, layout.me, layout.world)
                out[j] = recv[pos : pos + n].view(shape).to(local(ents[j].g).device)
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
