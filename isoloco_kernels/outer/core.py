"""The outer-step core shared by `IsoLoCo` (optim/isoloco.py), `ShardedIsoLoCo` and the DTensor step.

One place for what every outer optimizer of this package does alike, so each check has one
behaviour: grad collection with every input check before any write (`collect`), and Iso-C of the
step's matrices batched by shape (`bucket_flatten`). The step's other phases have rooms of their
own, re-exported here: group and hyper-parameter checks, constructor defaults and SGD-shaped state
(`check_group`, `outer_defaults`, `SGD_KEYS`, `check_state_dict`, `load_sgd_state`: sgd_state.py);
momentum buffers and the Nesterov update (`prepare_nesterov`: made on first use in the compute
dtype, joined to the state only once written; momentum.py). The update rule is
`reference.isoloco_step_ref`.

The trust boundary of a step (docs/guarantees.md): `collect` reads every grad and param once,
in one fused pass with one host sync per device, and a held momentum buffer only when something
other than this optimizer wrote it since its last step (identity and version counter; otherwise
the bound recorded at that write stands in: `momentum._trusted_bound`); the Nesterov update gets
those numbers and reads p, buf and u only to update them. Writes that bypass the version counter
(`buf.data`, DLPack, other libraries' kernels) are outside the boundary; params are read every
step for that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    amaxes,
    check_amax_finite,
    check_writable,
    compute_dtype,
    read_write_overlaps,
)
from ..flatten.buckets import BucketPlan, flatten_chunked_
from .momentum import _trusted_bound, iso_bound, nesterov_rows, prepare_nesterov
from .sgd_state import (
    SGD_KEYS,
    check_group,
    check_hyper,
    check_param_dtypes,
    check_state_dict,
    is_dtensor,
    load_sgd_state,
    local,
    outer_defaults,
    sgd_keywords,
)

__all__ = [
    "SGD_KEYS",
    "Entry",
    "bucket_flatten",
    "check_group",
    "check_hyper",
    "check_param_dtypes",
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
