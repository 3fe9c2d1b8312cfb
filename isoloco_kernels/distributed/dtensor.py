"""`IsoLoCo.step` on DTensor params: FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`).

Nesterov runs on the local shards (momentum buffers are DTensors placed like their params). Iso-C
of each 2-D grad takes a route (`_Routes`, the router: per matrix "gram", "owner" or "gather" on a
1-D mesh by bytes per rank, `routes.route_for`, overridden by `opt.dtensor_route`; "local" for
replicated matrices; "general", `full_tensor()`, on meshes with several dimensions); the routes
and their collectives are in routes.py, gram_route.py and collectives.py. Every route's result is
in the grad's compute dtype (float32 for float16/bfloat16, as in single-process IsoLoCo); the
param is rounded to its dtype once, by the overflow-checked Nesterov.
All-or-nothing across the mesh (`agree.Agreement` over the mesh: settled before the collectives
and before the writes); the collectives are planned before the first agreement (`_Routes`; the
Gram route's exact path from its agreed flags) and a rank whose local work fails between them
still joins each one, so the failure reaches every rank, never a hang. Every buffer handed to a
collective is made on the mesh group's `agree.comm_device`; results move to the local shards'
device. Contract and measurements: docs/distributed.md, "IsoLoCo with FSDP2 / torchtitan + torchft".
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._validate import _overlap, _span, compute_dtype, is_dtensor, local
from ..outer.core import Entry, collect, nesterov_rows, prepare_nesterov
from .agree import Agreement, fingerprint, largest_mesh, optimizer_settings
from .collectives import GatherSegments, OwnerSplits, gather_buffers, owner_buffers
from .plan import ShardLayout, shard_sizes
from .routes import Stats, iso_updates, route_for

# torch.distributed.tensor takes seconds to import; it is imported only once a DTensor exists
# (then it is in sys.modules already), so plain-tensor users never pay for it.

__all__ = ["ROUTES", "check_loaded_state", "check_params", "is_dtensor", "local", "route_for", "step_", "uses_dtensor"]

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
    nd = [(gi, pi, p) for gi, pi, p in params if p.ndim > 2]
    if getattr(opt, "iso_nd", False) and nd:
        gi, pi, p = nd[0]
        raise ValueError(
            f"IsoLoCo: iso_nd=True is not supported for DTensor params (param_groups[{gi}]['params'][{pi}] "
            f"has shape {tuple(p.shape)}); leave iso_nd=False: N-D grads then get DiLoCo's plain update"
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
            raise ValueError(
                f"{name} shares memory with {whose}; a momentum buffer needs its own memory "
                "(pass a copy, e.g. buf.clone()); nothing was loaded"
            )
        if not is_dtensor(b):
            continue
        if not is_dtensor(p):
            raise TypeError(f"{name} is a DTensor but its param is a plain tensor; nothing was loaded")
        if (
            b.device_mesh != p.device_mesh
            or tuple(b.placements) != tuple(p.placements)
            or b.shape != p.shape
            or lb.shape != local(p).shape
        ):
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
        raise ValueError(
            f"IsoLoCo: {name}: local grad shard {tuple(local(g).shape)} differs from the param's "
            f"{tuple(local(p).shape)}"
        )
    if p.device_mesh.ndim == 1 and p.ndim >= 1 and p.placements[0].is_shard():
        dim, me = p.placements[0].dim, p.device_mesh.get_local_rank()
        want = shard_sizes(p.shape[dim], p.device_mesh.size())[me][1]
        if local(p).shape[dim] != want:
            raise ValueError(
                f"IsoLoCo: {name}: local shard has {local(p).shape[dim]} rows along dim "
                f"{dim}, the torch.chunk layout gives {want} on mesh rank {me}"
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
                    buf.detach(), p.device_mesh, p.placements, src_data_rank=None
                )
            elif is_dtensor(buf) and tuple(buf.placements) != tuple(p.placements):
                raise ValueError(
                    f"IsoLoCo: a momentum_buffer has placements {buf.placements}, its param {p.placements}"
                )


def _collect_entries(opt) -> list[Entry]:
    """Every param with a grad, checked locally (`outer.collect` plus the DTensor layout)."""
    _reshard_momentum(opt)
    rank = dist.get_rank()
    return collect(
        opt,
        "IsoLoCo.step",
        f"param_groups[{{gi}}]['params'][{{pi}}] (shape {{shape}}) on rank {rank}",
        _check_grad,
    )


def step_(opt, failed: Optional[BaseException] = None) -> None:
    """One IsoLoCo outer step over DTensor params (IsoLoCo.step calls this). All-or-nothing.

    failed: what the closure raised on this rank; it reaches every rank as a DistributedStepError."""
    ag = Agreement("IsoLoCo.step", mesh=_agreement_mesh(opt))
    mode = opt.dtensor_route  # checked when set (IsoLoCo.dtensor_route)
    entries, routes, fp, settings = ag.attempt(_checked, opt, failed, mode) or ([], None, 0, None)
    ag.settle(fp, settings)  # everything that can fail on one rank came before this first collective
    if not entries:
        return
    stats = Stats()
    updates = iso_updates(opt.method, entries, routes, ag, stats)  # its collectives run on every rank
    apply = ag.attempt(_prepare_nesterov, opt, entries, updates)
    ag.settle()
    opt.dtensor_stats = stats
    apply()


def _checked(opt, failed, mode):
    """The step's local checks, before any collective: (entries, their routes, the fingerprint
    and settings the ranks must share)."""
    if failed is not None:
        raise failed
    if mode not in ROUTES:
        raise ValueError(f"IsoLoCo: dtensor_route must be one of {ROUTES}, got {mode!r}")
    entries = _collect_entries(opt)
    routes = _Routes(entries, mode)  # every collective's size, before any of them runs
    routes.allocate()  # and their buffers, before the ranks agree
    fp = fingerprint([(e.gi, e.pi, tuple(e.p.shape), str(e.p.placements), str(e.g.dtype)) for e in entries])
    return entries, routes, fp, optimizer_settings(opt, method=opt.method, dtensor_route=mode)


def _prepare_nesterov(opt, entries: list[Entry], updates: dict[int, torch.Tensor]):
    """Nesterov on the local shards (`outer.prepare_nesterov`: DTensor momentum, checked for
    overflow, nothing written until the returned function runs)."""
    return prepare_nesterov(opt, nesterov_rows(entries, updates, "IsoLoCo: "))


class _Routes:
    """The router: each Iso-C matrix's route, its `ShardLayout` (1-D mesh, Shard) and the size of
    every buffer each collective sends and receives, from the shapes the ranks agree on, so a
    rank whose local work failed can still join each collective with a buffer of the right size.

    Lists of (key, entry indices, sizes) in the order the step issues them: `gram` per mesh,
    `gather` and `owner` per (mesh, grad dtype); `general` and `local` entry indices."""

    def __init__(self, entries: list[Entry], mode: str):
        self.routes: dict[int, str] = {}
        self.layouts: dict[int, ShardLayout] = {}
        for k, e in enumerate(entries):
            if not e.iso:
                continue
            p, mesh = e.p, e.p.device_mesh
            if mesh.ndim > 1:
                self.routes[k] = "general" if any(pl.is_shard() for pl in p.placements) else "local"
                continue
            dim = _shard_dim(p.placements[0])
            self.routes[k] = route_for(tuple(p.shape), dim, mesh.size(), e.g.element_size(), mode)
            if dim is not None:
                self.layouts[k] = ShardLayout.of(p)
        by: dict[str, dict] = {"gram": {}, "gather": {}, "owner": {}}
        for k, r in self.routes.items():
            if r in by:
                g = entries[k].g
                by[r].setdefault(g.device_mesh if r == "gram" else (g.device_mesh, g.dtype), []).append(k)
        self.gram = [(mesh, ks, [min(entries[k].p.shape) for k in ks]) for mesh, ks in by["gram"].items()]
        self.gather = [(key, ks, GatherSegments([self.layouts[k] for k in ks])) for key, ks in by["gather"].items()]
        self.owner = [
            (key, ks, OwnerSplits([self.layouts[k] for k in ks], [entries[k].name for k in ks]))
            for key, ks in by["owner"].items()
        ]
        self.general = [k for k, r in self.routes.items() if r == "general"]
        self.local = [k for k, r in self.routes.items() if r == "local"]
        self.buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def allocate(self) -> None:
        """Every buffer of the gather and owner routes' collectives (`collectives.gather_buffers`,
        `owner_buffers`), made in the step's checks, before the ranks first agree: a rank that
        cannot allocate one (out of memory) fails every rank there, before any collective."""
        for (mesh, dtype), _, segs in self.gather:
            self.buffers[("gather", mesh, dtype)] = gather_buffers(mesh.get_group(0), dtype, segs)
        for (mesh, dtype), _, sp in self.owner:
            g = mesh.get_group(0)
            self.buffers[("owner out", mesh, dtype)] = owner_buffers(g, dtype, sp.out_send, sp.out_recv)
            self.buffers[("owner back", mesh, dtype)] = owner_buffers(g, compute_dtype(dtype), sp.out_recv, sp.out_send)
