"""The outer-step core shared by `IsoLoCo` (optim.py), `ShardedIsoLoCo` and the DTensor step.

One place for what every outer optimizer of this package does alike, so each check has one
behaviour: group and hyper-parameter checks (`check_group`), grad collection with every input
check before any write (`collect`), constructor defaults (`outer_defaults`), Iso-C of the step's
matrices batched by shape (`bucket_flatten`), momentum buffers (`prepare_nesterov`: made on first
use in the compute dtype, joined to the state only once written), SGD-shaped state (`SGD_KEYS`,
`check_state_dict`, `restore_half_momentum`). The update rule is `reference.isoloco_step_ref`.

The trust boundary of a step (docs/guarantees.md): `collect` reads every grad and param once,
in one fused pass with one host sync per device, and a held momentum buffer only when something
other than this optimizer wrote it since its last step (identity and version counter; otherwise
the bound recorded at that write stands in); the Nesterov update gets those numbers and reads p,
buf and u only to update them. Writes that bypass the version counter (`buf.data`, DLPack, other
libraries' kernels) are outside the boundary; params are read every step for that reason.
"""

from __future__ import annotations

import math
import numbers
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    amaxes,
    check_all_finite,
    check_amax_finite,
    check_writable,
    compute_dtype,
    overflow_limit,
    read_write_overlaps,
)
from .buckets import BucketPlan, flatten_chunked_
from .flatten import check_method
from .ops import prepare_nesterov_outer_

__all__ = [
    "SGD_KEYS",
    "Entry",
    "bucket_flatten",
    "check_group",
    "check_hyper",
    "check_state_dict",
    "collect",
    "is_dtensor",
    "load_sgd_state",
    "iso_bound",
    "local",
    "nesterov_rows",
    "outer_defaults",
    "prepare_nesterov",
    "sgd_keywords",
]

#: SGD's group keys at the values that make SGD(nesterov=True) the update IsoLoCo applies.
SGD_KEYS = dict(
    dampening=0, weight_decay=0, nesterov=True, maximize=False, foreach=None, differentiable=False, fused=None
)


# -- DTensors without importing torch.distributed.tensor (seconds to import): a DTensor exists
#    only once that module is loaded.


def is_dtensor(t) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place writes reach the DTensor); other tensors as they are."""
    return t.to_local() if is_dtensor(t) else t


# -- hyper-parameters and groups --------------------------------------------------------------


def _number(v: Any, key: str, where: str) -> float:
    """v as a float; a one-element tensor counts (as torch's optimizers accept a tensor lr)."""
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta":
            raise ValueError(f"{where}: '{key}' is a meta tensor, which holds no value; pass a number")
        if v.numel() != 1:
            raise ValueError(f"{where}: a Tensor {key} must have one element, got shape {tuple(v.shape)}")
        return float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: '{key}' must be a real number, got {type(v).__name__} {v!r}")
    return float(v)


def check_hyper(lr: Any, momentum: Any, where: str) -> None:
    if not 0.0 <= _number(lr, "lr", where) < float("inf"):
        raise ValueError(f"{where}: invalid learning rate: {lr} ('lr' must be a finite number >= 0)")
    if not 0.0 <= _number(momentum, "momentum", where) < float("inf"):
        raise ValueError(f"{where}: invalid momentum value: {momentum} ('momentum' must be a finite number >= 0)")


def check_group(group: dict, where: str) -> None:
    """A group the outer step can run: lr/momentum valid, SGD's other knobs at IsoLoCo's values."""
    for key in ("lr", "momentum"):
        if key not in group:
            raise ValueError(f"{where}: the group has no '{key}'")
    check_hyper(group["lr"], group["momentum"], where)
    for key, want in (("dampening", 0), ("weight_decay", 0), ("nesterov", True), ("maximize", False)):
        if key in group and group[key] != want:
            raise ValueError(
                f"{where}: {key}={group[key]!r}, but IsoLoCo applies Nesterov momentum without "
                f"dampening, weight decay or maximize ({key} must be {want!r})"
            )
    if not isinstance(group.get("iso", True), bool):
        raise ValueError(f"{where}: iso must be a bool, got {group['iso']!r}")


def outer_defaults(
    where: str, lr: Any, momentum: Any, iso: Any, method: str, sgd: Callable[[], dict] = lambda: SGD_KEYS
) -> dict:
    """An outer optimizer's constructor arguments, checked (lr and momentum, then `sgd()`: SGD's
    other keys, then the method, then iso): the defaults dict to hand to torch.optim.Optimizer."""
    check_hyper(lr, momentum, where)
    keys = sgd()
    check_method(method)
    if not isinstance(iso, bool):
        raise ValueError(f"{where}: iso must be a bool, got {iso!r}")
    return dict(lr=lr, momentum=momentum, iso=iso, **keys)


def _flag(value, key: str, where: str, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise TypeError(f"{where}: {key} must be a bool{' or None' if allow_none else ''}, got {value!r}")


def sgd_keywords(
    where: str,
    dampening=0,
    weight_decay=0,
    nesterov=True,
    maximize=False,
    foreach=None,
    differentiable=False,
    fused=None,
) -> dict:
    """torch.optim.SGD's keywords, checked against what IsoLoCo does: the group entries to store.

    Honoured with SGD's meaning: nesterov=True, dampening=0, weight_decay=0, maximize=False (the
    update SGD(nesterov=True) applies), foreach/fused None, False or True (how SGD runs its loop;
    IsoLoCo always batches its update, so they change nothing and are kept in the group as given).
    Anything else raises a ValueError that says what to use instead (a TypeError for a wrong type)."""
    for key, v in (("dampening", dampening), ("weight_decay", weight_decay)):
        if isinstance(v, bool) or not isinstance(v, (numbers.Real, torch.Tensor)):
            raise TypeError(f"{where}: {key} must be a real number, got {v!r}")
    _flag(nesterov, "nesterov", where)
    _flag(maximize, "maximize", where)
    _flag(differentiable, "differentiable", where)
    _flag(foreach, "foreach", where, allow_none=True)
    _flag(fused, "fused", where, allow_none=True)
    if not nesterov:
        raise ValueError(
            f"{where}: nesterov=False, but IsoLoCo's momentum is Nesterov's (DiLoCo's outer step); "
            "pass nesterov=True or leave it out (for heavy-ball momentum without Iso-C use torch.optim.SGD)"
        )
    if float(dampening) != 0:
        raise ValueError(
            f"{where}: dampening={float(dampening)!r}, but Nesterov momentum has no dampening "
            "(torch.optim.SGD refuses it too); use dampening=0"
        )
    if float(weight_decay) != 0:
        raise ValueError(
            f"{where}: weight_decay={float(weight_decay)!r}, but IsoLoCo's outer step has no weight "
            "decay; use weight_decay=0 and decay the weights in the inner optimizer (e.g. AdamW's weight_decay)"
        )
    if maximize:
        raise ValueError(
            f"{where}: maximize=True is not supported; use maximize=False and write the pseudo-gradient "
            "(global − local) into p.grad, negated if the objective is to be maximized"
        )
    if differentiable:
        raise ValueError(
            f"{where}: differentiable=True is not supported: the Iso-C flatten and the update run in "
            "place outside autograd; use differentiable=False"
        )
    if foreach and fused:
        raise ValueError(
            f"{where}: foreach=True and fused=True cannot be set together (as for torch.optim.SGD); "
            "set one of them, or neither"
        )
    return {**SGD_KEYS, "foreach": foreach, "fused": fused}


def check_param_dtypes(params: Sequence[torch.Tensor], where: str) -> None:
    for i, p in enumerate(params):
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{where}: param {i} has dtype {p.dtype}; IsoLoCo supports {SUPPORTED_DTYPES}")


# -- the grads of one step ----------------------------------------------------------------------


@dataclass
class Entry:
    """One param with a grad: where it sits, the tensors, its group, and its name in errors."""

    gi: int
    pi: int
    p: torch.Tensor
    g: torch.Tensor
    group: dict
    name: str
    #: largest |entry| of the grad, the param and the held momentum buffer (local shards; None:
    #: no held buffer), from `collect`'s one pass; the buffer's may be a bound (`_trusted_bound`)
    amax_g: float = 0.0
    amax_p: float = 0.0
    amax_b: Optional[float] = None

    @property
    def iso(self) -> bool:
        """Whether the step replaces this grad by its Iso-C (a non-empty matrix in an iso group)."""
        return bool(self.group["iso"]) and self.g.ndim == 2 and self.g.numel() > 0


def buffer_problem(buf, p: torch.Tensor) -> Optional[str]:
    """Why `buf` cannot be p's momentum buffer, or None: a tensor shaped like p on p's device, in
    p's dtype or p's compute dtype (float32 for half params). DTensors: compared shard to shard."""
    if not isinstance(buf, torch.Tensor):
        return f"must be a tensor, got {type(buf).__name__}"
    lb, lp = local(buf), local(p)
    if lb.device.type == "meta":
        return "is a meta tensor (it holds no data)"
    if (
        buf.shape != p.shape
        or lb.shape != lp.shape
        or lb.device != lp.device
        or buf.dtype not in (p.dtype, compute_dtype(p.dtype))
    ):
        return (
            f"has shape {tuple(buf.shape)}, dtype {buf.dtype} on {lb.device}; want {tuple(p.shape)}, "
            f"{p.dtype} or {compute_dtype(p.dtype)}, on {lp.device}"
        )
    return None


def collect(
    opt: torch.optim.Optimizer,
    where: str,
    name: Callable[[int, int, torch.Tensor], str],
    check: Optional[Callable[[torch.Tensor, torch.Tensor, str], None]] = None,
    require_grads: bool = False,
    check_params: bool = True,
) -> list[Entry]:
    """Every param with a grad, checked before the step writes anything.

    Checked: each group (`check_group`); each grad dense, of a supported dtype, and what `check`
    adds for the optimizer (shape, device, placements); the held buffers shaped like their params
    (`buffer_problem`); in one pass (`amaxes`: one host sync per device) the grads, the params
    (with `check_params`) and the held buffers not written by this optimizer since its last step
    (`_trusted_bound`) finite, each entry keeping those largest entries for the Nesterov bounds
    (`nesterov_rows`); every param and held buffer writable; a grad sharing memory with any of
    those is copied first. `name(gi, pi, p)` names a param in errors; `require_grads`: a param
    without a grad is an error (the sharded step needs every rank's grads)."""
    entries: list[Entry] = []
    for gi, group in enumerate(opt.param_groups):
        check_group(group, f"{where}: param group {gi}")
        for pi, p in enumerate(group["params"]):
            g, n = p.grad, name(gi, pi, p)
            if g is None:
                if require_grads:
                    raise ValueError(f"{n} has no grad; set p.grad to the pseudo-gradient on every rank")
                continue
            for what, t in (("param", p), ("grad", g)):
                if local(t).device.type == "meta":
                    raise RuntimeError(
                        f"{where}: {n}: the {what} is a meta tensor (it holds no data to "
                        "compute from or write to); nothing was changed"
                    )
            if g.is_sparse:
                raise RuntimeError(f"{where}: {n} has a sparse grad; IsoLoCo needs dense grads")
            if g.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"{where}: {n}: grad dtype {g.dtype} is not supported")
            if check is not None:
                check(p, g, n)
            entries.append(Entry(gi, pi, p, g, group, n))
    held = [(e, opt.state[e.p].get("momentum_buffer")) for e in entries if e.p in opt.state]
    held = [(e, b) for e, b in held if b is not None]
    problems = [(e, why) for e, b in held if (why := buffer_problem(b, e.p))]
    # One pass over what must be read (every grad, every param, each held buffer this optimizer
    # did not write itself since: `_trusted_bound`), one host sync: the step's verdict on its input.
    trusted = {} if problems else {id(e): _trusted_bound(opt, b) for e, b in held}
    unread = [(e, b) for e, b in held if trusted.get(id(e)) is None]
    grads, params = [local(e.g) for e in entries], [local(e.p) for e in entries]
    reads = grads + (params if check_params else []) + ([] if problems else [local(b) for _, b in unread])
    amax = amaxes(reads)
    n = len(entries)
    check_amax_finite(grads, amax[:n], [f"{where}: {e.name} grad" for e in entries])
    for e, why in problems:
        raise ValueError(f"{where}: {e.name} momentum_buffer {why}")
    for k, e in enumerate(entries):
        e.amax_g = amax[k]
        e.amax_p = amax[n + k] if check_params else float("nan")
    rest = amax[2 * n if check_params else n :]
    check_amax_finite([local(b) for _, b in unread], rest, [f"{where}: {e.name} momentum_buffer" for e, _ in unread])
    for (e, _), v in zip(unread, rest):
        e.amax_b = v
    for e, _ in held:
        if trusted.get(id(e)) is not None:
            e.amax_b = trusted[id(e)]
    bnames = [f"{where}: {e.name} momentum_buffer" for e, _ in held]
    written = [local(e.p) for e in entries] + [local(b) for _, b in held]
    check_writable(written, [f"{where}: {e.name}" for e in entries] + bnames)
    if check_params:
        check_amax_finite(params, [e.amax_p for e in entries], [f"{where}: {e.name}: param" for e in entries])
    # a grad sharing memory with a param or buffer the step writes (another param, a loaded
    # buffer) would be read half-updated: the step reads a copy of it instead
    for k in sorted({r for r, _ in read_write_overlaps([local(e.g) for e in entries], written)}):
        entries[k].g = entries[k].g.detach().clone()
    return entries


# -- Iso-C of the step's matrices, batched by shape ---------------------------------------------


def iso_merge_unchecked_(buffers: Sequence[torch.Tensor], method: str) -> None:
    """`bucket_flatten`'s flatten of its buffers, packed from grads already checked finite (so no
    second check): each buffer in slices whose scratch stays within `buckets.workspace_bytes()`
    (`buckets.flatten_chunked_`). A result that does not fit raises ResultOverflowError with the
    bucket and matrix set."""
    for i, b in enumerate(buffers):
        try:
            flatten_chunked_(b, method)
        except ResultOverflowError as e:
            raise ResultOverflowError(f"bucket {i}: {e}", matrix=e.matrix, bucket=i) from None


def bucket_flatten(
    mats: Sequence[torch.Tensor],
    method: str,
    names: Sequence[str],
    plan: Optional[BucketPlan] = None,
    merge: Optional[Callable[[list[torch.Tensor]], Any]] = None,
) -> tuple[Optional[BucketPlan], list[torch.Tensor]]:
    """Iso-C of 2-D tensors (already checked by the caller), batched by shape: packed into the
    [B, m, n] buffers of a `BucketPlan` (`plan`, reused while it matches the tensors, else a new
    one), flattened in place by `merge(buffers)` (default: `method` on each buffer in slices whose
    scratch stays within `buckets.workspace_bytes()`, `buckets.flatten_chunked_`).
    Returns (the plan, to keep for the next step; each tensor's result as a view in its own
    orientation). A result that does not fit its bucket's dtype raises ResultOverflowError naming
    its tensor by `names`."""
    if not mats:
        return plan, []
    if plan is None or not plan.matches(mats):
        plan = BucketPlan(mats)
    buffers = plan.pack(mats)
    try:
        if merge is None:
            iso_merge_unchecked_(buffers, method)
        else:
            merge(buffers)
    except ResultOverflowError as e:  # name the tensor, not the internal bucket
        if e.bucket is None or e.matrix is None:
            raise
        b = plan.buckets[e.bucket]
        raise ResultOverflowError(
            f"{names[b.members[e.matrix]]}: the Iso-C result of its grad does not fit {b.dtype}; nothing was changed"
        ) from None
    return plan, plan.views()


# -- the Nesterov half of the step --------------------------------------------------------------


#: Slack on a recorded bound: the kernels round buf' = μ·buf + u once or twice (relative 2⁻⁸ in
#: bfloat16, the coarsest dtype a buffer may have), so 1 % covers every rounding of the bound.
_BOUND_SLACK = 1.01


def _trusted_bound(opt: torch.optim.Optimizer, buf: torch.Tensor) -> Optional[float]:
    """A bound on |buf| recorded when this optimizer last wrote `buf` (`prepare_nesterov`), if
    nothing wrote buf since: the same tensor object at the same version counter. None otherwise
    (a loaded or replaced buffer, or one written in place by torch since)."""
    rec = getattr(opt, "_outer_bounds", {}).get(id(buf))
    if rec is None or rec[0]() is not buf or rec[1] != local(buf)._version:
        return None
    return rec[2]


def _record_bounds(opt: torch.optim.Optimizer, written: list[tuple[torch.Tensor, float]]) -> None:
    """After the writes: for each (buffer, bound on its new entries), the bound and the buffer's
    version counter now. The table holds weak references, so it never keeps a buffer alive."""
    table = {k: v for k, v in getattr(opt, "_outer_bounds", {}).items() if v[0]() is not None}
    for buf, bound in written:
        table[id(buf)] = (weakref.ref(buf), local(buf)._version, bound)
    opt.__dict__["_outer_bounds"] = table


def iso_bound(e: Entry) -> Optional[float]:
    """A bound on the largest entry of iso(Δ) for an entry whose whole grad Δ is local: s̄·|Q_ij|
    ≤ σ_max ≤ √(m·n)·max|Δ| (|Q_ij| ≤ 1 for a partial isometry), doubled for the iterative
    methods' approximate Q. None for a DTensor whose local tensor is a shard (its whole matrix's
    largest entry is not known here)."""
    if (is_dtensor(e.g) and local(e.g).shape != e.g.shape) or not math.isfinite(e.amax_g):
        return None
    return 2.0 * math.sqrt(e.g.numel()) * e.amax_g  # √(m·n); N-D grads: as matrices (nd.as_matrix)


def nesterov_rows(entries: Sequence[Entry], updates: dict, prefix: str) -> list[tuple]:
    """The rows of `prepare_nesterov` for `collect`'s entries: entry k's update is updates[k]
    (an Iso-C result) or its own grad, with the bounds `collect` found (params, held buffers,
    grads; `iso_bound` for the Iso-C results), so the Nesterov pass reads nothing else."""
    rows = []
    for k, e in enumerate(entries):
        if k in updates:
            u, au = updates[k], iso_bound(e)
        else:
            u, au = local(e.g), e.amax_g
        ap = e.amax_p if math.isfinite(e.amax_p) else None
        rows.append((e.p, u, e.group["lr"], e.group["momentum"], f"{prefix}{e.name}", (ap, e.amax_b, au)))
    return rows


def prepare_nesterov(opt: torch.optim.Optimizer, rows) -> Callable[[], None]:
    """Everything but the writes of the Nesterov update. rows: (param, update, lr, momentum, name)
    with the update shaped like the param's local tensor, optionally a 6th item (amax of the
    param, of its held buffer, of the update: bounds already known, None where not; `nesterov_rows`).
    Momentum buffers are made where missing (zeros in the compute dtype, a DTensor for a DTensor
    param); one fused `nesterov_outer_` call per (device, lr, momentum), each checked by the op's
    finiteness rule (`ops.prepare_nesterov_outer_`), reading only the tensors whose bound is not
    known (a held buffer's bound, when not given, is the one recorded at this optimizer's last
    write of it, if nothing wrote it since). Returns the function that writes; new buffers join the state only after it ran, so a
    failure cannot leave half-made state behind. After the writes each buffer's bound is recorded
    (`_trusted_bound`): the next step need not read a buffer nothing else wrote."""
    calls: dict[tuple, tuple[list, list, list, list, list]] = {}
    fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
    for row in rows:
        p, u, lr, momentum, name = row[:5]
        ap, ab, au = row[5] if len(row) > 5 else (None, None, None)
        buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
        if buf is None:
            buf = torch.zeros_like(p, dtype=compute_dtype(p.dtype))
            fresh.append((p, buf))
            ab = 0.0
        elif ab is None:
            ab = _trusted_bound(opt, buf)
        ps, bs, us, names, known = calls.setdefault((local(p).device, float(lr), float(momentum)), ([], [], [], [], []))
        ps.append(local(p))
        bs.append(buf)
        us.append(u)
        names.append(name)
        known.append((ap, ab, au))
    applies = []
    for (_, lr, mu), (ps, bs, us, names, known) in calls.items():
        amax = [k[0] for k in known] + [k[1] for k in known] + [k[2] for k in known]
        fn = prepare_nesterov_outer_(ps, [local(b) for b in bs], us, lr, mu, None, names=names, amax=amax)
        applies.append((fn, bs, mu))

    def apply() -> None:
        written = []
        for fn, bs, mu in applies:
            fn()
            n = len(bs)
            written += [(b, _BOUND_SLACK * (mu * fn.amax[n + i] + fn.amax[2 * n + i])) for i, b in enumerate(bs)]
        for p, buf in fresh:
            opt.state[p]["momentum_buffer"] = buf
        _record_bounds(opt, written)

    return apply


# -- SGD-shaped state -----------------------------------------------------------------------------


def check_state_dict(opt: torch.optim.Optimizer, state_dict: Any, where: str) -> None:
    """Everything a (torch.optim.SGD or IsoLoCo) state dict must hold for `opt` to load it and
    step, checked before anything is loaded: the 'state' and 'param_groups' entries, each group's
    settings and param count, and each momentum_buffer (a finite floating tensor shaped like its
    param, with its own memory)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
    for key, kind in (("state", dict), ("param_groups", (list, tuple))):
        if key not in state_dict:
            raise ValueError(f"{where}: the state dict has no '{key}' entry")
        if not isinstance(state_dict[key], kind):
            raise TypeError(
                f"{where}: '{key}' must be a {getattr(kind, '__name__', 'list')}, got {type(state_dict[key]).__name__}"
            )
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise ValueError(
            f"{where}: the state dict has {len(saved)} param groups, this optimizer {len(opt.param_groups)}"
        )
    params, ids = [], []
    for gi, (g, mine) in enumerate(zip(saved, opt.param_groups)):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"{where}: param group {gi} is not a dict with a 'params' entry")
        check_group({k: v for k, v in g.items() if k != "params"}, f"{where}: param group {gi}")
        if len(g["params"]) != len(mine["params"]):
            raise ValueError(
                f"{where}: param group {gi} has {len(g['params'])} params in the state dict, {len(mine['params'])} here"
            )
        params += mine["params"]
        ids += list(g["params"])
    held: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for pid, p in zip(ids, params):
        if pid not in state_dict["state"]:
            continue
        entry = state_dict["state"][pid]
        if not isinstance(entry, dict):
            raise TypeError(f"{where}: state of param {pid} must be a dict, got {type(entry).__name__}")
        if "momentum_buffer" not in entry or entry["momentum_buffer"] is None:
            continue
        b = entry["momentum_buffer"]
        name = f"{where}: param {pid} (shape {tuple(p.shape)}) momentum_buffer"
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(b).__name__} {b!r:.40}")
        if local(b).device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (it holds no data to load)")
        if b.dtype not in SUPPORTED_DTYPES or tuple(b.shape) != tuple(p.shape):
            raise ValueError(
                f"{name} has shape {tuple(b.shape)}, dtype {b.dtype}; want {tuple(p.shape)}, one of {SUPPORTED_DTYPES}"
            )
        held.append((local(b), local(p), name))
    check_all_finite([b for b, _, _ in held], [n for _, _, n in held])
    for b, p, name in held:  # loaded in p's compute dtype: a value beyond it would load as Inf
        want = compute_dtype(p.dtype)
        if b.numel() and torch.finfo(b.dtype).max > torch.finfo(want).max:
            top = float(b.detach().abs().max())
            if top >= overflow_limit(want):
                raise ValueError(
                    f"{name} holds {top:.4g}, beyond the {want} it is kept in for this param "
                    "(it would load as Inf); nothing was loaded"
                )
    # buffers loaded as they are (same dtype and device) are written in place by later steps
    kept = [(b, n) for b, p, n in held if b.dtype == p.dtype == compute_dtype(p.dtype) and b.device == p.device]
    with torch.no_grad():
        check_writable([b for b, _ in kept], [n for _, n in kept])


def load_sgd_state(opt: torch.optim.Optimizer, state_dict: dict, where: str, load: Callable[[dict], None]) -> None:
    """Load an IsoLoCo or torch.optim.SGD state dict with `load` (torch.optim.Optimizer's), all
    checked first (`check_state_dict`): on a refused dict nothing changes. Groups without `iso`
    (SGD's) keep this optimizer's setting."""
    check_state_dict(opt, state_dict, where)
    iso_now = [g["iso"] for g in opt.param_groups]
    for gi, (g, iso) in enumerate(zip(state_dict["param_groups"], iso_now)):
        if "iso" in g and g["iso"] != iso:
            warnings.warn(
                f"{where}: param group {gi}: the state dict sets iso={g['iso']} over this optimizer's "
                f"iso={iso}, so it now steps {'with' if g['iso'] else 'without'} Iso-C (a checkpoint carries "
                "each group's lr, momentum and iso, as torch's optimizers restore their hyper-parameters); set "
                f"opt.param_groups[{gi}]['iso'] = {iso} after loading to keep this optimizer's",
                UserWarning,
                stacklevel=3,
            )
    load(state_dict)
    for g, iso in zip(opt.param_groups, iso_now):
        g.setdefault("iso", iso)
        for k, v in SGD_KEYS.items():
            g.setdefault(k, v)
    _restore_half_momentum(opt, state_dict)


def _restore_half_momentum(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """After torch's load_state_dict (which casts every floating state tensor to its param's
    dtype): half and bfloat16 params get float32 momentum again, converted from the saved tensor
    itself so nothing is lost to rounding."""
    for g, sg in zip(opt.param_groups, state_dict["param_groups"]):
        for p, pid in zip(g["params"], sg["params"]):
            want = compute_dtype(p.dtype)
            src = state_dict["state"].get(pid, {}).get("momentum_buffer")
            if isinstance(src, torch.Tensor) and want != p.dtype:
                opt.state[p]["momentum_buffer"] = src.detach().to(device=p.device, dtype=want, copy=True)
