"""The outer step every outer optimizer of this package shares (`IsoLoCo`, `MergeLoCo`, `ShardedIsoLoCo`,
the DTensor step), in the order a step runs:

1. `collect`: every param with a grad, every input check before any write (groups: `check_group`);
2. `bucket_flatten`: Iso-C of the step's matrices, packed by shape into the [B, m, n] buffers of a
   `BucketPlan` and flattened by the `isoloco::iso_merge_` op;
3. `prepare_nesterov`: momentum buffers (made on first use in the compute dtype, joined to the state
   only once written) and the Nesterov update, every call of the `isoloco::nesterov_outer_` op checked
   before the first one writes, with the bounds found in step 1 (`nesterov_rows`, `iso_bound`) so the
   op reads nothing again; after the writes each buffer's bound is recorded (`_trusted_bound`).

The update rule is `reference.isoloco_step_ref`. The constructor, the SGD-shaped settings and the state
dict are sgd_state.py; N-D params nd.py.

The trust boundary of a step (docs/guarantees.md): `collect` reads every grad and param once,
in one fused pass with one host sync per device, and a held momentum buffer only when something
other than this optimizer wrote it since its last step (identity and version counter; otherwise
the bound recorded at that write stands in: `_trusted_bound`); the Nesterov update gets
those numbers and reads p, buf and u only to update them. Writes that bypass the version counter
(`buf.data`, DLPack, other libraries' kernels) are outside the boundary; params are read every
step for that reason. Every bound must be ≥ the buffer's true largest entry, or an overflow could be
written unseen (tests/outer/test_bounds.py).
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    amaxes,
    check_amax_finite,
    check_writable,
    compute_dtype,
    is_dtensor,
    local,
    read_write_overlaps,
)
from ..ops import prepare_nesterov_outer_  # the op's checks, run for every call before the first writes

__all__ = [
    "Bucket",
    "BucketPlan",
    "Entry",
    "bucket_flatten",
    "bucket_key",
    "check_group",
    "check_hyper",
    "collect",
    "iso_bound",
    "nesterov_rows",
    "prepare_nesterov",
    "signature",
]


# -- hyper-parameters and groups, as every step checks them -------------------------------------


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


# -- the step's matrices batched by shape: one [B, m, n] buffer per shape -------------------------


def bucket_key(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple:
    """(device, buffer dtype, canonical shape) — the bucket a 2-D tensor belongs to."""
    m, n = t.shape
    return (t.device, dtype or compute_dtype(t.dtype), (min(m, n), max(m, n)))


def signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a plan depends on: each tensor's shape, dtype and device, in order."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


@dataclass
class Bucket:
    """Matrices of one canonical shape [m, n] (m ≤ n), dtype and device, in one [B, m, n] buffer."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    members: list[int] = field(default_factory=list)  # indices into the planned tensor list
    transposed: list[bool] = field(default_factory=list)  # member stored as its transpose
    buffer: Optional[torch.Tensor] = None

    def slots(self) -> list[torch.Tensor]:
        """Each member's slot as a view in the member's own orientation."""
        return [self.buffer[j].mT if tr else self.buffer[j] for j, tr in enumerate(self.transposed)]


class BucketPlan:
    """The bucketing of a list of 2-D tensors, with its buffers; see the module docstring.

    dtype: the buffers' dtype; None (default) means each tensor's compute dtype.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, dtype: Optional[torch.dtype] = None):
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"BucketPlan: tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            if t.ndim != 2:
                raise ValueError(f"BucketPlan: tensor {i} has shape {tuple(t.shape)}; only 2-D tensors are bucketed")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"BucketPlan: tensor {i} has unsupported dtype {t.dtype}")
        self.signature = signature(tensors)
        self.buckets: list[Bucket] = []
        self.where: list[tuple[int, int]] = []  # tensor i → (bucket, position)
        index: dict[tuple, int] = {}
        for i, t in enumerate(tensors):
            key = bucket_key(t, dtype)
            if key not in index:
                index[key] = len(self.buckets)
                self.buckets.append(Bucket(shape=key[2], dtype=key[1], device=key[0]))
            b = self.buckets[index[key]]
            self.where.append((index[key], len(b.members)))
            b.members.append(i)
            b.transposed.append(t.shape[0] > t.shape[1])
        for b in self.buckets:
            b.buffer = torch.empty((len(b.members), *b.shape), dtype=b.dtype, device=b.device)
        self._views = [None] * len(tensors)
        for b in self.buckets:
            for i, v in zip(b.members, b.slots()):
                self._views[i] = v

    def __len__(self) -> int:
        return len(self.where)

    def __repr__(self) -> str:
        parts = ", ".join(f"{len(b.members)}×{b.shape[0]}×{b.shape[1]} {str(b.dtype)[6:]}" for b in self.buckets)
        return f"BucketPlan({len(self)} matrices in {len(self.buckets)} buckets: {parts})"

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The [B, m, n] buffers, one per bucket, in the order the buckets were first met."""
        return [b.buffer for b in self.buckets]

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these tensors have the shapes, dtypes and devices the plan was made for."""
        return signature(tensors) == self.signature

    def _check(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if not self.matches(tensors):
            more = "…" if len(self) > 4 else ""
            raise ValueError(
                f"BucketPlan.{what}: the tensors do not match the plan (made for {len(self)} tensors "
                f"with shapes/dtypes/devices {self.signature[:4]}{more}); make a new plan"
            )
        return tensors

    def views(self) -> list[torch.Tensor]:
        """Tensor i's slot in its bucket, as a [m_i, n_i] view in tensor i's own orientation
        (strided for transposed members). Valid until the plan is dropped."""
        return list(self._views)

    def pack(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy the tensors into their slots (cast to the buffer dtype); returns the buffers."""
        tensors = self._check(tensors, "pack")
        if tensors:
            torch._foreach_copy_(self._views, [t.detach() for t in tensors])
        return self.buffers

    def unpack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy each slot back into its tensor (cast to the tensor's dtype), in place. The
        tensors are checked first (no expanded views, no two sharing memory, …): all or none
        are written."""
        tensors = self._check(tensors, "unpack")
        check_writable([t.detach() for t in tensors], [f"BucketPlan.unpack: tensor {i}" for i in range(len(tensors))])
        if tensors:
            torch._foreach_copy_([t.detach() for t in tensors], self._views)


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
    name: str = "param_groups[{gi}]['params'][{pi}] (shape {shape})",
    check: Optional[Callable[[torch.Tensor, torch.Tensor, str], None]] = None,
    require_grads: bool = False,
    check_params: bool = True,
) -> list[Entry]:
    """Every param with a grad, checked before the step writes anything.

    Checked: each group (`check_group`); each grad dense, of a supported dtype, of its param's shape
    and on its device (or, with `check`, what that says instead: a DTensor's layout); the held buffers shaped like their params
    (`buffer_problem`); in one pass (`amaxes`: one host sync per device) the grads, the params
    (with `check_params`) and the held buffers not written by this optimizer since its last step
    (`_trusted_bound`) finite, each entry keeping those largest entries for the Nesterov bounds
    (`nesterov_rows`); every param and held buffer writable; a grad sharing memory with any of
    those is copied first. `name` names a param in errors: a format string of gi (its group), pi (its
    place in the group), i (its place over all groups) and shape; `require_grads`: a param without a
    grad is an error (the sharded step needs every rank's grads)."""
    entries: list[Entry] = []
    i = -1
    for gi, group in enumerate(opt.param_groups):
        check_group(group, f"{where}: param group {gi}")
        for pi, p in enumerate(group["params"]):
            i += 1
            g, n = p.grad, name.format(gi=gi, pi=pi, i=i, shape=tuple(p.shape))
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
            elif g.shape != p.shape or g.device != p.device:
                raise ValueError(f"{where}: {n}: grad has shape {tuple(g.shape)} on {g.device}, param is on {p.device}")
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


def bucket_flatten(
    mats: Sequence[torch.Tensor],
    method: str,
    names: Sequence[str],
    plan: Optional[BucketPlan] = None,
    merge: Optional[Callable[[list[torch.Tensor]], Any]] = None,
) -> tuple[Optional[BucketPlan], list[torch.Tensor]]:
    """Iso-C of 2-D tensors (already checked by the caller), batched by shape: packed into the
    [B, m, n] buffers of a `BucketPlan` (`plan`, reused while it matches the tensors, else a new
    one), flattened in place by `merge(buffers)` (default: the `isoloco::iso_merge_` op, in slices
    whose scratch stays within `flatten.registry.workspace_bytes()`).
    Returns (the plan, to keep for the next step; each tensor's result as a view in its own
    orientation). A result that does not fit its bucket's dtype raises ResultOverflowError naming
    its tensor by `names`."""
    if not mats:
        return plan, []
    if plan is None or not plan.matches(mats):
        plan = BucketPlan(mats)
    buffers = plan.pack(mats)
    try:
        if merge is None:  # packed from checked grads into this plan's scratch: checked=True, no copies
            torch.ops.isoloco.iso_merge_(buffers, method, True)
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


# -- momentum buffers and the Nesterov update ----------------------------------------------------


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


def iso_bound(e) -> Optional[float]:
    """A bound on the largest entry of iso(Δ) for an `outer.Entry` whose whole grad Δ is local: s̄·|Q_ij|
    ≤ σ_max ≤ √(m·n)·max|Δ| (|Q_ij| ≤ 1 for a partial isometry), doubled for the iterative
    methods' approximate Q. None for a DTensor whose local tensor is a shard (its whole matrix's
    largest entry is not known here)."""
    if (is_dtensor(e.g) and local(e.g).shape != e.g.shape) or not math.isfinite(e.amax_g):
        return None
    return 2.0 * math.sqrt(e.g.numel()) * e.amax_g  # √(m·n); N-D grads: as matrices (nd.as_matrix)


def nesterov_rows(entries: Sequence, updates: dict, prefix: str) -> list[tuple]:
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
    scratch: set[int] = set()
    for row in rows:
        p, u, lr, momentum, name = row[:5]
        ap, ab, au = row[5] if len(row) > 5 else (None, None, None)
        buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
        if float(momentum) == 0:
            # torch.optim.SGD at μ = 0 takes θ ← θ − lr·M and neither makes nor touches a momentum buffer, so a
            # schedule through μ = 0 finds the buffer as it was: the fused op writes a scratch buffer instead
            buf = torch.zeros_like(local(p), dtype=compute_dtype(p.dtype))
            scratch.add(id(buf))
            ab = 0.0
        elif buf is None:
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
    # Every call checked (and any float64 update computed) before the first writes: all or nothing across
    # devices and groups. The writes then run the `isoloco::nesterov_outer_` op with the bounds found here,
    # so the op reads nothing again.
    checked = []
    for (_, lr, mu), (ps, bs, us, names, known) in calls.items():
        amax = [k[0] for k in known] + [k[1] for k in known] + [k[2] for k in known]
        lb = [local(b) for b in bs]
        fn = prepare_nesterov_outer_(ps, lb, us, lr, mu, amax, names=names)
        checked.append((ps, lb, us, lr, mu, fn.amax, bs))

    def apply() -> None:
        written = []
        for ps, lb, us, lr, mu, amax, bs in checked:
            torch.ops.isoloco.nesterov_outer_(ps, lb, us, lr, mu, amax)
            n = len(bs)
            written += [
                (b, _BOUND_SLACK * (mu * amax[n + i] + amax[2 * n + i]))
                for i, b in enumerate(bs)
                if id(b) not in scratch
            ]
        for p, buf in fresh:
            opt.state[p]["momentum_buffer"] = buf
        _record_bounds(opt, written)

    return apply
