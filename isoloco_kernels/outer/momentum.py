"""Momentum buffers and the Nesterov half of the outer step (`prepare_nesterov`), with the bounds
that let a step skip re-reading a buffer.

`prepare_nesterov` makes the missing buffers (zeros in the compute dtype, joined to the state only
once written), runs every check of the fused `nesterov_outer_` call before any write
(`ops.prepare_nesterov_outer_`) from the largest entries `outer.collect` found (`nesterov_rows`;
`iso_bound` for an Iso-C result), and after the writes records a bound on each buffer it wrote
with the buffer's version counter (`_record_bounds`): while nothing else writes the buffer, the
next step's `collect` takes that bound instead of reading it (`_trusted_bound`). Every bound must
be ≥ the buffer's true largest entry, or an overflow could be written unseen (tests/test_bounds.py).
Re-exported by core.py, the outer-step core.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Optional, Sequence

import torch

from .._validate import compute_dtype
from ..ops import prepare_nesterov_outer_
from .sgd_state import is_dtensor, local

__all__ = ["iso_bound", "nesterov_rows", "prepare_nesterov"]


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
            written += [
                (b, _BOUND_SLACK * (mu * fn.amax[n + i] + fn.amax[2 * n + i]))
                for i, b in enumerate(bs)
                if id(b) not in scratch
            ]
        for p, buf in fresh:
            opt.state[p]["momentum_buffer"] = buf
        _record_bounds(opt, written)

    return apply
