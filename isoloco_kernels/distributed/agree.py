"""Agree before writing: the one protocol every collective entry point uses.

Before a collective operation writes anything, every rank contributes a few int64 to one small all-gather (its
vote): whether this rank's checks (or anything it computed so far) raised, a fingerprint of what the ranks must
pass alike (the tensors' shapes and dtypes, the plan, and every setting that changes which collectives run or
what is written: lr, momentum, iso, method, route, chunk sizes), and a checksum of values the ranks must hold
alike (`replicas`: a replica's params, grads already averaged). If any rank failed or they differ, every rank
raises DistributedStepError naming the ranks and their errors (the texts travel by `gather_objects`, in
pre-made blocks), the settings that differ and where, or the first value that differs and what to do, and
nothing was written on any rank. A rank that fails must still reach the agreement (so callers catch its
exception first); a rank that dies is caught by the process group's timeout.

`agree` runs over a process group (one all-gather); `agree_on_mesh` over a DeviceMesh of any number of
dimensions (one all-reduce per dimension), for the DTensor step. `Agreement` is the protocol the entry points
but ShardedIsoLoCo run on them (check → agree → compute → agree → write): local work under `attempt`, one
`settle` per agreement; `ShardedIsoLoCo.step` keeps its failure itself and votes once. `control_plane` makes
every control tensor before an entry point's first collective, so no vote allocates. Every tensor the package
hands to a collective of a group lives on `comm_device(group)`.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import pickle
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .errors import DistributedStepError

# torch 2.14 renamed the single-tensor all-gather; older releases only have the old name (the package's one copy
# of this shim; builds without torch.distributed have neither: importing stays fine, calling raises in group_info).
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)

__all__ = [
    "Agreement",
    "DistributedStepError",
    "agree",
    "agree_on_mesh",
    "construct_together",
    "control_plane",
    "listed",
    "all_gather_single",
    "check_on_comm_device",
    "comm_device",
    "describe",
    "error_text",
    "fingerprint",
    "gather_objects",
    "group_info",
    "largest_mesh",
    "optimizer_settings",
]


_UNCHANGED = "nothing was changed on any rank"
_WRITTEN = "after the ranks began writing (the tensors it writes may have changed)"


def group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def comm_device(group=None) -> torch.device:
    """The device of every tensor this package hands to a collective of `group`, decided from the
    group's backend alone (so every rank decides alike, whatever it holds): a group with NCCL
    ("nccl", or "cpu:gloo,cuda:nccl") communicates on this process's CUDA device (the group's
    bound device, else `torch.cuda.current_device()`); any other backend (gloo) on the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return torch.device("cpu")
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def check_on_comm_device(tensors, names, group) -> None:
    """Refuse, by name, tensors handed to the group's collectives in place that are not on its communication
    device (a CPU tensor on NCCL, which refuses it; a CUDA tensor on gloo), before any collective sees them."""
    want = comm_device(group)
    for t, name in zip(tensors, names):
        if isinstance(t, torch.Tensor) and t.device != want:
            raise ValueError(
                f"{name} is on {t.device}, but the process group ({dist.get_backend(group)}) communicates on "
                f"{want}; put the tensors on {want} (for NCCL: torch.cuda.set_device(local_rank) first)"
            )


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def fingerprint(obj) -> int:
    """A 63-bit hash of a value's repr (shapes, dtype names, …): equal on ranks passing alike."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1


def describe(tensors) -> tuple:
    """What the ranks must agree on for a list of tensors: shape and dtype of each, in order."""
    return tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__ for t in tensors)


def _setting(v: Any) -> str:
    """A setting as the ranks compare it: numbers by value (a one-element tensor lr counts as its
    number; NaN equals NaN), everything else by repr."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return repr(int(v))
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        v = float(v)
        return "nan" if math.isnan(v) else repr(v)
    return repr(v)


def optimizer_settings(opt, **extra) -> dict[str, str]:
    """What the ranks of one outer optimizer must share, by name: every param group's hyper-parameters
    (`param_groups[i]['lr']`, …) and param count, plus `extra` (method, route, chunk size, …)."""
    out = {k: _setting(v) for k, v in extra.items()}
    for gi, g in enumerate(opt.param_groups):
        for k, v in g.items():
            out[f"param_groups[{gi}]['{k}']"] = str(len(v)) + " params" if k == "params" else _setting(v)
    return out


# The agreements' control tensors, made once per (length, device, thread) and reused. An entry point makes them
# before its first collective (`control_plane`, from `Agreement` and the sharded step's entry; an optimizer's
# constructor first), so a vote allocates nothing.
_CONTROL = threading.local()

#: int64 words of one rank's vote: failed?, the settings' fingerprint, ask, has its object blocks, replicas' checksum
VOTE_WORDS = 5


def control_tensor(key: str, numel: int, device) -> torch.Tensor:
    """The thread's int64 control tensor `key` of `numel` elements on `device`, made on first use."""
    made = _CONTROL.__dict__.setdefault("made", {})
    if (key, numel, str(device)) not in made:
        made[key, numel, str(device)] = _new_control(numel, device)
    return made[key, numel, str(device)]


def _new_control(numel: int, device) -> torch.Tensor:  # the agreements' one device allocation
    return torch.zeros(numel, dtype=torch.int64, device=device)


def _made(key: str, numel: int, device) -> bool:
    return (key, numel, str(device)) in _CONTROL.__dict__.get("made", {})


#: The object exchange's block per rank, in bytes: a header word (the object's size), then a piece of the object.
OBJECT_BYTES = 1024


def object_blocks(world: int, device) -> tuple:
    """The object exchange's int64 control tensors: my block, every rank's, and (off the CPU) their host copy."""
    w = OBJECT_BYTES // 8
    host = None if torch.device(device).type == "cpu" else control_tensor("objects-host", w * world, "cpu")
    return control_tensor("objects-mine", w, device), control_tensor("objects-every", w * world, device), host


def _vote_tensors(world: int, device) -> tuple:
    """A vote's own control tensors: my row and every rank's (`VOTE_WORDS` int64 each): a few bytes."""
    return control_tensor("vote-mine", VOTE_WORDS, device), control_tensor("vote-every", VOTE_WORDS * world, device)


def _has_blocks(world: int, device) -> bool:
    w = OBJECT_BYTES // 8
    cpu = torch.device(device).type == "cpu"
    return _made("objects-every", w * world, device) and (cpu or _made("objects-host", w * world, "cpu"))


def control_plane(group=None, world: Optional[int] = None) -> Optional[BaseException]:
    """Make every control tensor an agreement over `group` uses, before the caller's first collective: the
    vote's own first (`VOTE_WORDS` int64 per rank), then the object exchange's blocks (1 KB per rank). Made once
    per thread, size and device; afterwards this allocates nothing. Returns the failure to make the blocks (out
    of memory), which the caller keeps as its own failure: its vote then says no, and the error texts travel
    through the vote's own tensors instead (more all-gather rounds, nothing allocated). A rank that cannot make
    the vote's own few bytes raises here, before any collective: the one allocation no vote can report."""
    if world is None:
        world = group_info(group)[1]
    if world == 1:
        return None
    device = comm_device(group)
    _vote_tensors(world, device)
    try:
        object_blocks(world, device)
    except Exception as e:  # noqa: BLE001 — reported by this rank's vote
        return e
    return None


def _exchange(data: bytes, group, world: int, mine: torch.Tensor, every: torch.Tensor, host) -> list:
    """Every rank's bytes `data` through the blocks `mine` (one rank's: a size word, then a piece) and `every`:
    as many all-gathers as the longest needs."""
    piece, start, end = mine.numel() * 8 - 8, 0, 1
    mine[0], parts = len(data), [bytearray() for _ in range(world)]
    while start < end:  # the first round tells every rank how many follow: the longest object's
        chunk = bytearray(data[start : start + piece]) or bytearray(1)  # (frombuffer refuses an empty one)
        mine.view(torch.uint8)[8 : 8 + len(chunk)].copy_(torch.frombuffer(chunk, dtype=torch.uint8))
        all_gather_single(every, mine, group=group)
        rows = every if host is None else host.copy_(every)
        values = rows.view(world, -1)
        sizes = values[:, 0].tolist()
        for r, part in enumerate(parts):
            part += bytes(values.view(torch.uint8)[r, 8 : 8 + min(piece, max(sizes[r] - start, 0))].tolist())
        start, end = start + piece, max(sizes)
    return parts


def gather_objects(obj, group, *, small: bool = False) -> list:
    """Every rank's picklable `obj`, in rank order, over `comm_device(group)`: all-gathers of the pre-made
    blocks (`object_blocks`), each carrying every rank's size and its next piece, as many as the longest
    needs (one for error texts). No tensor is made between them, so no rank fails alone in between.
    small: through the vote's own tensors instead (a rank could not make the blocks: every rank passes it)."""
    _, world = group_info(group)
    device = comm_device(group)
    if small:  # (off the CPU, each round's read-back copies a few bytes to the host)
        (mine, every), host = _vote_tensors(world, device), None
    else:
        mine, every, host = object_blocks(world, device)
    parts = _exchange(pickle.dumps(obj), group, world, mine, every, host)
    return [pickle.loads(part) for part in parts]


def _by_value(values: list, names: list) -> str:
    """'a on ranks 0, 2, b on rank 1': each distinct value (repr strings) and the ranks holding it."""
    groups: dict[str, list] = {}
    for v, name in zip(values, names):
        groups.setdefault(v, []).append(name)
    return ", ".join(
        f"{v if len(v) <= 200 else v[:200] + '…'} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in groups.items()
    )


def _differences(settings: list, names: list) -> str:
    """'name: value on ranks [..], value on ranks [..]' for each setting the ranks disagree on."""
    keys = []
    for s in settings:
        for k in s or {}:
            if k not in keys:
                keys.append(k)
    parts = []
    for k in keys:
        values = [(s or {}).get(k, "<unset>") for s in settings]
        if len(set(values)) > 1:
            parts.append(f"{k}: {_by_value(values, names)}")
    return "; ".join(parts)


def _settings_fp(fp: Optional[int], settings: Optional[dict]) -> int:
    if not settings:
        return fp or 0
    return fingerprint((fp or 0, sorted(settings.items())))


def _replica_difference(replicas: list, names: list) -> str:
    """Where the ranks' replicas differ: the first value whose checksum differs, the ranks holding each
    version of it, how many others differ, and what to do. replicas: per rank (label, value names,
    checksums, hint), or None (a rank that sent none)."""
    label, what, _, hint = next(r for r in replicas if r is not None)
    sums = [r[2] if r is not None else [] for r in replicas]
    n = max(len(s) for s in sums)
    differ = [j for j in range(n) if len({(s[j] if j < len(s) else None) for s in sums}) > 1]
    if not differ:
        return f"their {label} differ"
    j = differ[0]
    versions: dict = {}
    for r, s in enumerate(sums):
        versions.setdefault(s[j] if j < len(s) else None, []).append(names[r])
    held = ", ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'hold' if len(rs) > 1 else 'holds'} "
        f"{'one version' if k == 0 else 'another'}"
        for k, rs in enumerate(versions.values())
    )
    more = f"; {len(differ) - 1} more of the {n} {label} differ too" if len(differ) > 1 else ""
    return f"{what[j]} is the first that differs ({held}){more}. {hint}"


def _raise(
    what: str,
    world: int,
    failed: list,
    texts: list,
    settings: list,
    prints: list,
    mismatch: str,
    names=None,
    replicas: Optional[list] = None,
) -> None:
    names = names or list(range(world))
    if failed:
        head = f"{what} failed on {len(failed)} of {world} ranks"
        detail = "; ".join(f"rank {names[r]}: {texts[r]}" for r in failed)
    elif diff := _differences(settings, names):
        head, detail = f"{what}: the ranks' settings differ", diff
    elif replicas and any(r is not None for r in replicas):
        label = next(r for r in replicas if r is not None)[0]
        head, detail = f"{what}: the ranks' {label} differ", _replica_difference(replicas, names)
    else:
        head = f"{what}: {mismatch}"
        detail = (
            "fingerprints "
            + _by_value([f"{p:#x}" for p in prints], names)
            + "; every rank must pass the same tensor shapes and dtypes in the same order"
        )
    raise DistributedStepError(f"{head}, {_UNCHANGED}: {detail}")


def agree(
    error: Optional[str],
    group,
    what: str,
    *,
    fp: Optional[int] = None,
    mismatch: str = "the ranks passed different tensors",
    settings: Optional[dict] = None,
    ask: bool = False,
    replicas: Optional[tuple] = None,
) -> bool:
    """Every rank learns whether any rank failed, and whether the fingerprints (`fp` and the
    named `settings`) and the `replicas` match; all raise DistributedStepError if not. Returns whether
    any rank passed `ask=True` (a question every rank must then answer alike, in the same all-gather).

    replicas: (label, names, checksums, hint): values every rank must hold alike (a replica's params, grads
    already averaged), one 64-bit checksum each; when they differ the error names the first that differs,
    the ranks holding each version, how many others differ, and then `hint` (what to do).

    One all-gather of `VOTE_WORDS` int64 per rank (failed, the settings' fingerprint, ask, whether it has the
    object exchange's blocks, the replicas' checksum); the error texts, settings and checksums are gathered
    only when something failed or differs. fp=None and no settings: no fingerprint comparison. The control
    tensors are the ones `control_plane` made (made here when it was not called): a rank that cannot make the
    object blocks votes no, and the texts then travel through the vote's own tensors.
    """
    _, world = group_info(group)
    if world == 1:  # nothing to compare with: no collective, no host sync
        if error is not None:
            _raise(what, 1, [0], [error], [settings], [_settings_fp(fp, settings)], mismatch)
        return ask
    device = comm_device(group)
    check = fp is not None or bool(settings)
    mine, every = _vote_tensors(world, device)
    if not _has_blocks(world, device):
        failure = control_plane(group, world)
        if failure is not None and error is None:
            error = error_text(failure)
    sums = None if replicas is None else [int(c) for c in replicas[2]]
    row = [
        int(error is not None),
        _settings_fp(fp, settings) if check else 0,
        int(ask),
        int(_has_blocks(world, device)),
        0 if sums is None else fingerprint(tuple(sums)),
    ]
    mine.copy_(torch.tensor(row))
    all_gather_single(every, mine, group=group)
    rows = every.view(world, VOTE_WORDS).tolist()
    failed, prints, reps = [r for r, row in enumerate(rows) if row[0]], [row[1] for row in rows], {r[4] for r in rows}
    if not failed and (not check or len(set(prints)) == 1) and len(reps) == 1:
        return any(row[2] for row in rows)
    small = not all(row[3] for row in rows)
    mine_rep = None if replicas is None else (replicas[0], list(replicas[1]), sums, replicas[3])
    got = gather_objects((error, settings, mine_rep), group, small=small)
    _raise(
        what,
        world,
        failed,
        [t for t, _, _ in got],
        [s for _, s, _ in got],
        prints,
        mismatch,
        replicas=[r for _, _, r in got],
    )


_MESH_MISMATCH = "the ranks hold different sets of grads (shapes, placements or dtypes)"


def agree_on_mesh(
    error: Optional[str], mesh, what: str, fp: int = 0, mismatch: str = _MESH_MISMATCH, settings: Optional[dict] = None
) -> None:
    """`agree` over every rank of a DeviceMesh: one all-reduce per mesh dimension of a [3·size]
    int64 vector (on the mesh groups' `comm_device`) holding this rank's failure flag, fingerprint
    (`fp` and the named `settings`) and whether it has the object exchange's blocks, at its own slots (the
    sum over the dimensions fills every slot). Error texts and settings travel only when something failed
    or differs."""
    size = mesh.size()
    ranks = mesh.mesh.flatten().tolist()
    if size == 1:  # nothing to compare with: no collective, no host sync
        if error is not None:
            _raise(what, 1, [0], [error], [settings], [_settings_fp(fp, settings)], mismatch, names=ranks)
        return
    me = ranks.index(dist.get_rank())
    groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    v = control_tensor("mesh", 3 * size, comm_device(groups[0]))
    blocks = True
    for g in groups:  # the error path's blocks, made with the agreement's own (`control_plane`)
        failure = control_plane(g)
        if failure is not None:
            blocks, error = False, error if error is not None else error_text(failure)
    v.zero_()
    v[me], v[size + me], v[2 * size + me] = int(error is not None), _settings_fp(fp, settings), int(blocks)
    for g in groups:
        dist.all_reduce(v, group=g)
    vals = v.tolist()
    failed, prints = [r for r, f in enumerate(vals[:size]) if f], vals[size : 2 * size]
    if not failed and len(set(prints)) == 1:
        return
    small = not all(vals[2 * size :])
    known = {me: (error, settings)}
    for g in groups:
        known = {k: t for part in gather_objects(known, g, small=small) for k, t in part.items()}
    texts, sets = zip(*(known.get(i, (None, None)) for i in range(size)))
    _raise(what, size, failed, texts, sets, prints, mismatch, names=ranks)


class Agreement:
    """The step protocol of a collective entry point: check → agree → compute → agree → write.

    Local work runs under `attempt`; its first exception is kept, and from then on this rank skips
    its local work (attempt returns None) but still joins every collective the caller issues, so no
    rank waits on it. `settle` is one agreement over the process group `group` (or the DeviceMesh
    `mesh`): if any rank's attempts failed, or the fingerprints or settings differ, every rank
    raises DistributedStepError and nothing has been written anywhere (writes come after the last
    settle). `alone`: a group of one rank, where attempt raises at once and settle has nothing to do.
    """

    def __init__(self, what: str, group=None, mesh=None, *, alone: bool = False, mismatch: Optional[str] = None):
        self.what, self.group, self.mesh, self.alone, self.mismatch = what, group, mesh, alone, mismatch
        self.error: Optional[BaseException] = None
        if not alone:  # every control tensor, before the caller's first collective (`control_plane`)
            for g in [mesh.get_group(d) for d in range(mesh.ndim)] if mesh is not None else [group]:
                self.error = self.error or control_plane(g)

    def attempt(self, fn: Callable, *args):
        """fn(*args), or None once any attempt of this rank failed (the failure is kept for `settle`)."""
        if self.error is not None:
            return None
        if self.alone:
            return fn(*args)
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 — every rank must learn of it at the next settle
            self.error = e
            return None

    def settle(
        self,
        fp: Optional[int] = None,
        settings: Optional[dict] = None,
        *,
        own_error=False,
        ask=False,
        written=False,
        replicas: Optional[tuple] = None,
    ) -> bool:
        """One agreement on (failed?, fingerprint `fp` and `settings`); raises DistributedStepError on
        every rank if any rank failed or they differ. own_error: a rank that failed raises its own
        exception instead (the others still DistributedStepError naming it). Returns whether any
        rank passed `ask=True` (over a process group; on a mesh or alone: this rank's `ask`).
        replicas: values every rank must hold alike (`agree`'s; over a process group only).
        written: the closing agreement of a call that wrote while its collectives ran (the error
        then says the tensors may have changed, instead of that nothing was)."""
        if self.alone:
            if written and self.error is not None:
                raise self.error
            return ask
        text = None if self.error is None else error_text(self.error)
        settings = None if self.error is not None else settings
        replicas = None if self.error is not None else replicas
        extra = {} if self.mismatch is None else {"mismatch": self.mismatch}
        try:
            if self.mesh is not None:
                agree_on_mesh(text, self.mesh, self.what, fp or 0, settings=settings, **extra)
                return ask
            return agree(text, self.group, self.what, fp=fp, settings=settings, ask=ask, replicas=replicas, **extra)
        except DistributedStepError as e:
            if own_error and self.error is not None:
                raise self.error from None
            if written:
                raise DistributedStepError(str(e).replace(_UNCHANGED, _WRITTEN)) from None
            raise


def listed(params):
    """params (an iterable of tensors or of param-group dicts) as a list the caller can read and
    still pass on: generators are drained once, each group's own iterable too."""
    if isinstance(params, torch.Tensor):
        return params  # the optimizer refuses it itself
    out = []
    for item in params:
        if isinstance(item, dict) and "params" in item and not isinstance(item["params"], torch.Tensor):
            item = {**item, "params": list(item["params"])}
        out.append(item)
    return out


def _dtensor_mesh(params) -> Optional[Any]:
    """The mesh the DTensor step agrees over, for DTensor params; None without DTensors (or when
    the meshes do not nest: the optimizer then refuses them alike on every rank)."""
    from .._validate import is_dtensor

    def tensors(x) -> list:  # a tensor, a (name, tensor) pair, or a group's list of either
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
            x = x[1]
        return [x] if isinstance(x, torch.Tensor) else []

    flat = []
    for item in params if isinstance(params, list) else ():
        ps = item["params"] if isinstance(item, dict) else [item]
        flat += [t for p in ([ps] if isinstance(ps, torch.Tensor) else ps) for t in tensors(p) if is_dtensor(t)]
    if not flat:
        return None
    try:
        return largest_mesh(flat)
    except ValueError:
        return None


def largest_mesh(dtensors) -> Any:
    """The mesh DTensors agree over: the one with most ranks; every other mesh must lie inside it."""
    meshes = []
    for t in dtensors:
        if t.device_mesh not in meshes:
            meshes.append(t.device_mesh)
    big = max(meshes, key=lambda m: (m.size(), m.ndim))
    ranks = lambda m: frozenset(m.mesh.reshape(-1).tolist())  # noqa: E731
    for m in meshes:
        if not ranks(m) <= ranks(big):
            raise ValueError(
                f"IsoLoCo: params live on meshes with ranks {sorted(ranks(m))} and {sorted(ranks(big))}; "
                "every mesh must lie inside the largest one (the step agrees over it)"
            )
    return big


def construct_together(where: str, process_group, params, build: Callable[[], None], settings: Callable[[], dict]):
    """Run an outer optimizer's `build()` so that every rank constructs or none does, instead of leaving the
    others waiting at their first collective. The ranks agree over `process_group`, or over the device
    mesh of DTensor params (neither, or one rank: `build()` alone): a rank whose build raised raises its
    own exception after the agreement, the others DistributedStepError naming it; settings that differ
    between ranks (`settings()`) raise DistributedStepError on every rank, naming them. `params` must be
    a list (`listed`)."""
    mesh = _dtensor_mesh(params) if process_group is None else None
    if (process_group is None and mesh is None) or (
        mesh.size() if mesh is not None else group_info(process_group)[1]
    ) == 1:
        build()
        return
    ag = Agreement(where, process_group, mesh)
    ag.attempt(build)
    ag.settle(settings=ag.attempt(settings), own_error=True)
