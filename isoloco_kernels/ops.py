"""The isoloco torch ops: every schema, its fake (meta) impl and its implementation — the one door into
the kernels. `iso_merge_`, `iso_flatten`, every optimizer's step and the sharded routes call these ops
(through `torch.ops.isoloco`); nothing goes around them to a flatten method or a backend.

    isoloco::iso_merge_(Tensor(a!)[] buckets, str method="auto", bool checked=False) -> ()
        Iso-C flatten of every bucket ([m, n] or [B, m, n]) in place (see reference.py for the math),
        each in slices of bounded scratch (`flatten.registry.workspace_bytes`), all or nothing across
        the buckets (the slices before the last are flattened into copies, written back once every
        bucket succeeded). checked=True is for callers that already read every bucket for the
        finiteness rule and own them as scratch (the optimizers' packed buffers, checked in the pass
        over their grads): no second read, and each bucket is flattened in place slice by slice with
        no copies (a failure may leave earlier slices written).
    isoloco::iso_flatten_(Tensor(a!) x, str method="auto") -> ()
        iso_merge_([x], method): the same checks, the same bounded scratch, all or nothing.
    isoloco::iso_scale_(Tensor(a!) x, Tensor q) -> Tensor
        The Iso-C epilogue: s̄ = ⟨x, q⟩ / min(m, n) per matrix, x ← s̄·q; returns s̄ (float32, or
        float64 for float64 x), shape x.shape[:-2].
    isoloco::nesterov_outer_(Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor[] updates,
                             float lr, float momentum, float[]? amax=None) -> ()
        reference.nesterov_ref's step of every tensor. amax: upper bounds the caller already holds on
        the largest |entry| of params, bufs and updates (3n values, that order; NaN where unknown):
        those tensors are not read again for the finiteness rule (the optimizers found them in the
        pass that checked their grads). A bound below the true value voids rule 2 for that tensor.

Every implementation checks its arguments and the finiteness rule (below: one check per op, the same on
every device) and then runs what `dispatch.select` picks: on CUDA the compiled extension's kernels
(csrc/, registered as the private ops csrc_iso_scale_ / csrc_nesterov_outer_), the same kernels
through CuPy, Triton or torch; torch on the CPU. The Python API over the ops (`iso_merge_`,
`iso_flatten`, `backends`) is api.py, which imports this module.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._validate import (
    SUPPORTED_DTYPES,
    ResultOverflowError,
    amaxes,
    check_all_finite,
    check_amax_finite,
    check_matrix_tensor,
    check_writable,
    compute_dtype,
    is_fake,
    read_write_overlaps,
)
from .dispatch import _ext
from .dispatch import table as dispatch
from .dispatch.table import update_compute_dtype
from .flatten.registry import check_method, chunk_rows, flatten_chunked_

_lib = torch.library.Library("isoloco", "DEF")  # noqa: TOR901 (owned by this module)

# Not capturable in a CUDA graph: the flatten syncs with the host (method choice, fallbacks), the
# Nesterov kernels launch from a pointer table built on the host each call. torch.compile's CUDA
# graphs skip graphs holding these ops (torch >= 2.8 has the tag; older torch: none).
_HOST_BOUND = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)

# One flatten for every device: the method registry and "auto" live in flatten/registry.py, the bounded
# scratch too; `torch.ops.isoloco.iso_flatten_(x)` means `iso_merge_([x])`.
_lib.define('iso_merge_(Tensor(a!)[] buckets, str method="auto", bool checked=False) -> ()', tags=_HOST_BOUND)
_lib.define('iso_flatten_(Tensor(a!) x, str method="auto") -> ()', tags=_HOST_BOUND)
# Iso-C epilogue; CUDA kernel in csrc/iso_scale.cu.
_lib.define("iso_scale_(Tensor(a!) x, Tensor q) -> Tensor")
# Multi-tensor Nesterov outer update; CUDA kernel in csrc/nesterov.cu.
_lib.define(
    "nesterov_outer_(Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor[] updates, "
    "float lr, float momentum, float[]? amax=None) -> ()",
    tags=_HOST_BOUND,
)

# The compiled extension's kernels, behind the checks of the public ops (called by dispatch/table.py only).
_lib.define("csrc_iso_scale_(Tensor(a!) x, Tensor q) -> Tensor")
_lib.define(
    "csrc_nesterov_outer_(Tensor(a!)[] params, Tensor(b!)[] bufs, Tensor[] updates, float lr, float momentum) -> ()",
    tags=_HOST_BOUND,
)

_ext.load()  # registers the csrc_* CUDA kernels, if the extension was built


# ----------------------------------------------------------------------------------------------
# The finiteness rule: one for every op, checked here, so it is the same on every backend
# (docs/guarantees.md):
#   1. Every tensor an op reads, and lr and momentum, is finite: a NaN or Inf raises ValueError
#      naming the operand (and matrix), before anything is written.
#   2. What an op writes or returns is its result rounded to the output dtype, never an overflow of
#      an intermediate: where a bound from the inputs' largest entries says the compute dtype could
#      overflow, that part is computed aside in float64 (iso_scale_ at a power-of-two scale of each
#      operand; iso_flatten_'s methods always scale each matrix). A result that is not finite in its dtype raises ResultOverflowError
#      (a ValueError) naming the tensor or matrix, with nothing written.


def _safe(dtype: torch.dtype) -> float:
    """Magnitudes below this leave room for one more rounding and an add in `dtype`."""
    return torch.finfo(dtype).max / 4


def _merge_(buckets: list[torch.Tensor], method: str, names: list[str], checked: bool) -> None:
    """iso_merge_'s implementation: every check of every bucket, then the flatten (see the schema)."""
    check_method(method)
    for b, name in zip(buckets, names):
        check_matrix_tensor(b, name)
    check_writable(buckets, names)
    if not checked:
        check_all_finite(buckets, names)
    todo = [i for i, b in enumerate(buckets) if b.numel()]
    if checked:
        for i in todo:
            _flatten_bucket_(buckets[i], method, names[i], bucket=i)
        return
    last = max(todo, key=lambda i: buckets[i].numel(), default=None)
    aside = {i: buckets[i].clone() for i in todo if i != last}
    for i, c in aside.items():
        _flatten_bucket_(c, method, names[i], bucket=i)
    if last is not None:  # its last slice in place, the slices before it aside
        x3 = buckets[last] if buckets[last].ndim == 3 else buckets[last].unsqueeze(0)
        cut = (x3.shape[0] - 1) // chunk_rows(method, x3) * chunk_rows(method, x3)
        head = x3[:cut].clone()
        _flatten_bucket_(head, method, names[last], bucket=last)
        _flatten_bucket_(x3[cut:], method, names[last], offset=cut, bucket=last)
        x3[:cut].copy_(head)
    for i, c in aside.items():
        buckets[i].copy_(c)


def _flatten_bucket_(x: torch.Tensor, method: str, name: str, bucket: int, offset: int = 0) -> None:
    """One checked bucket flattened in place in slices of bounded scratch (`flatten.registry.flatten_chunked_`); a
    result that does not fit names the bucket and the matrix (offset: x's first matrix in the bucket)."""
    try:
        flatten_chunked_(x, method)
    except ResultOverflowError as e:
        j = None if e.matrix is None else e.matrix + offset
        raise ResultOverflowError(
            f"{name}: {str(e).replace(f'matrix {e.matrix}', f'matrix {j}', 1)}", matrix=j, bucket=bucket
        ) from None


@torch.library.impl(_lib, "iso_merge_", "CompositeExplicitAutograd")
def _iso_merge_impl(buckets: list[torch.Tensor], method: str = "auto", checked: bool = False) -> None:
    _merge_(list(buckets), method, [f"bucket {i}" for i in range(len(buckets))], checked)


@torch.library.register_fake("isoloco::iso_merge_", lib=_lib)
def _iso_merge_fake(buckets: list[torch.Tensor], method: str = "auto", checked: bool = False) -> None:
    _check_shapes_only(list(buckets), method, [f"bucket {i}" for i in range(len(buckets))])


def _check_shapes_only(buckets: list[torch.Tensor], method: str, names: list[str]) -> None:
    """The fake (meta) kernel's checks: metadata only for FakeTensors (tracing); a plain meta tensor, which
    holds no data to flatten, is refused by name, as on every other device."""
    check_method(method)
    for b, name in zip(buckets, names):
        check_matrix_tensor(b, name)
    real = [(b, name) for b, name in zip(buckets, names) if not is_fake(b)]
    if real:
        check_writable([b for b, _ in real], [name for _, name in real])


@torch.library.impl(_lib, "iso_flatten_", "CompositeExplicitAutograd")
def _iso_flatten_(x: torch.Tensor, method: str = "auto") -> None:
    _merge_([x], method, ["iso_flatten_: x"], checked=False)


@torch.library.register_fake("isoloco::iso_flatten_", lib=_lib)
def _iso_flatten_fake(x: torch.Tensor, method: str = "auto") -> None:
    _check_shapes_only([x], method, ["iso_flatten_: x"])


def _check_scale_args(x: torch.Tensor, q: torch.Tensor) -> None:
    check_matrix_tensor(x, "iso_scale_: x")
    check_matrix_tensor(q, "iso_scale_: q")
    if x.shape != q.shape or x.device != q.device:
        raise ValueError(
            f"iso_scale_: q must match x in shape and device, got x {tuple(x.shape)} on {x.device}"
            f" and q {tuple(q.shape)} on {q.device}"
        )


@torch.library.impl(_lib, "iso_scale_", "CPU")
@torch.library.impl(_lib, "iso_scale_", "CUDA")
def _iso_scale_impl(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    _check_scale_args(x, q)
    check_writable([x], ["iso_scale_: x"])
    if read_write_overlaps([q], [x]):  # the CUDA kernels read q while other blocks write x
        raise RuntimeError(
            "iso_scale_: q shares memory with x, which the op writes while reading q; pass a "
            "copy (e.g. q.clone()); nothing was written"
        )
    ax, aq = amaxes([x, q])
    check_amax_finite([x, q], [ax, aq], ["iso_scale_: x", "iso_scale_: q"])
    # |s̄| ≤ Σ|x·q| / min(m, n) ≤ max(m, n)·ax·aq and |s̄·q| ≤ |s̄|·aq (rule 2)
    s_bound = max(x.shape[-2:]) * ax * aq
    if s_bound < _safe(compute_dtype(x.dtype)) and s_bound * aq < _safe(x.dtype):
        return dispatch.select("iso_scale_", x.device, x, q).run(x, q)
    return _iso_scale_aside(x, q, ax, aq)


def _mul_pow2(t: torch.Tensor, e: int) -> torch.Tensor:
    """t·2^e in steps that are each a representable power of two (exact unless t·2^e over- or
    underflows t's dtype)."""
    while e:
        k = max(-1000, min(1000, e))
        t = t * 2.0**k
        e -= k
    return t


def _iso_scale_aside(x: torch.Tensor, q: torch.Tensor, ax: float, aq: float) -> torch.Tensor:
    """iso_scale_ in float64 on x / 2^ex and q / 2^eq (exact scalings), checked before writing."""
    ex = math.frexp(ax)[1] if ax > 0 else 0
    eq = math.frexp(aq)[1] if aq > 0 else 0
    x3, q3 = x.reshape(-1, *x.shape[-2:]), q.reshape(-1, *q.shape[-2:])
    qs = _mul_pow2(q3.to(torch.float64), -eq)
    t = (_mul_pow2(x3.to(torch.float64), -ex) * qs).sum((-2, -1)) / max(min(x.shape[-2:]), 1)
    out = _mul_pow2(t[:, None, None] * qs, ex + 2 * eq).to(x.dtype)
    sdt = compute_dtype(x.dtype)
    sbar = _mul_pow2(t, ex + eq).to(sdt)
    bad = (~(torch.isfinite(out).flatten(1).all(1) & torch.isfinite(sbar))).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        what = f"the result s̄·q does not fit {x.dtype}" if torch.isfinite(sbar[i]) else f"s̄ does not fit {sdt}"
        raise ResultOverflowError(
            f"iso_scale_: matrix {i}: {what} (s̄ = {float(_mul_pow2(t[i], ex + eq)):.4g}, the inputs are "
            f"finite); nothing was written",
            matrix=i,
        )
    x.copy_(out.reshape(x.shape))
    return sbar.reshape(x.shape[:-2])


@torch.library.register_fake("isoloco::iso_scale_", lib=_lib)
def _iso_scale_fake(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    _check_scale_args(x, q)
    return x.new_empty(x.shape[:-2], dtype=compute_dtype(x.dtype))


def check_nesterov_args(params, bufs, updates, lr, momentum, amax=None) -> None:
    """Lengths, shapes, devices and dtypes of a nesterov_outer_ call; cheap, no device sync."""
    if not (len(params) == len(bufs) == len(updates)):
        raise ValueError(
            f"nesterov_outer_: params, bufs and updates must have one entry each per tensor, got "
            f"{len(params)}, {len(bufs)} and {len(updates)}"
        )
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        for name, t in (("param", p), ("buf", b), ("update", u)):
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"nesterov_outer_: {name} {i} has unsupported dtype {t.dtype}")
        if not (p.shape == b.shape == u.shape):
            raise ValueError(
                f"nesterov_outer_: tensor {i}: param {tuple(p.shape)}, buf {tuple(b.shape)} and "
                f"update {tuple(u.shape)} must have the same shape"
            )
        if not (p.device == b.device == u.device == params[0].device):
            raise ValueError(
                f"nesterov_outer_: tensor {i}: param, buf and update must all be on param 0's "
                f"device {params[0].device}, got {p.device}, {b.device}, {u.device}"
            )
        if b.dtype not in (torch.float32, p.dtype):  # the kernels hold momentum in float32 or the param dtype
            raise TypeError(
                f"nesterov_outer_: buf {i} is {b.dtype}; it must be float32 or the param's dtype ({p.dtype})"
            )
    if amax is not None and len(amax) != 3 * len(params):
        raise ValueError(
            f"nesterov_outer_: amax must have 3 entries per tensor ({3 * len(params)}: params, bufs, updates), "
            f"got {len(amax)}"
        )
    if amax is not None:
        bad = next((j for j, a in enumerate(amax) if a is not None and not math.isnan(a) and not a >= 0), None)
        if bad is not None:
            raise ValueError(
                f"nesterov_outer_: amax[{bad}] is {amax[bad]}; a bound on a largest |entry| is ≥ 0 (NaN: unknown)"
            )
    if not (math.isfinite(lr) and math.isfinite(momentum)):  # NaN or ±Inf: every param would be NaN/Inf
        raise ValueError(f"nesterov_outer_: lr and momentum must be finite numbers, got lr={lr}, momentum={momentum}")


def check_nesterov_written(params, bufs) -> None:
    """The tensors nesterov_outer_ writes (params and bufs), checked all together before any is
    written: no meta/inference tensor, no grad-requiring leaf with grad mode on, no internal
    overlap, no two sharing memory (every CPU/CUDA backend runs this; fake tensors skip it)."""
    check_writable(
        [*params, *bufs],
        [f"nesterov_outer_: param {i}" for i in range(len(params))]
        + [f"nesterov_outer_: buf {i}" for i in range(len(bufs))],
    )


def check_nesterov_reads(params, bufs, updates) -> None:
    """No update shares memory with a param or buffer the op writes: the backends read the updates
    while they write, so an aliased update would be read half-updated."""
    n = len(params)
    for r, w in read_write_overlaps(list(updates), [*params, *bufs]):
        what = f"update {r}"
        whom = f"param {w}" if w < n else f"buf {w - n}"
        raise RuntimeError(
            f"nesterov_outer_: {what} shares memory with {whom}, which the op writes while reading "
            f"it; pass a copy (e.g. .clone()); nothing was written"
        )


def _nesterov_fits(p, b, ap: float, ab: float, au: float, lr: float, mu: float) -> bool:
    """Whether the compute-dtype update of one tensor provably stays finite (rule 2), from the
    largest entries: |buf'| ≤ μ·|buf| + |s·u|, |Δp| ≤ lr·(|s·u| + μ·|buf'|), |p'| ≤ |p| + |Δp|;
    lr and lr·μ must fit too (the kernels take them in the compute dtype)."""
    lim = _safe(update_compute_dtype(p.dtype, b.dtype))
    nb = mu * ab + au
    dp = lr * (au + mu * nb)
    return max(lr, lr * mu, mu, au, dp) < lim and nb < min(lim, _safe(b.dtype)) and ap + dp < _safe(p.dtype)


def _nesterov_aside(p, b, u, lr: float, mu: float, name: str, i: int):
    """One tensor's update in float64 on scratch; (p', buf') in their dtypes, or ResultOverflowError."""
    g = u.to(torch.float64)
    b64 = b.to(torch.float64).mul_(mu).add_(g)
    p64 = p.to(torch.float64).sub_(g.add_(b64, alpha=mu).mul_(lr))
    out = p64.to(p.dtype), b64.to(b.dtype)
    for what, t, t64 in (("param", out[0], p64), ("momentum buffer", out[1], b64)):
        if not bool(torch.isfinite(t).all()):
            raise ResultOverflowError(
                f"{name}: the outer update (lr={lr:g}, momentum={mu:g}) overflows the {what}'s dtype "
                f"{t.dtype} (largest new entry {float(t64.abs().max()):.4g}); nothing was written",
                tensor=i,
            )
    return out


def prepare_nesterov_outer_(params, bufs, updates, lr, momentum, amax=None, names=None) -> Callable[[], None]:
    """Every check of nesterov_outer_ (arguments, written tensors, updates aliasing them, the
    finiteness rule) and the float64 update of the tensors whose compute-dtype update could
    overflow, before any write; returns the function that writes. names[i] names tensor i in errors
    (default "nesterov_outer_: tensor i"). One fused pass and one host sync per device.

    amax: a finite upper bound on the largest |entry| of each of params, bufs, updates (3n entries,
    that order; None or NaN where unknown): those tensors are not read here. A tensor whose bound is
    too loose to show its update fits is read once more (its exact largest entry) before it is sent
    to the float64 path. The returned function's `amax` attribute holds the values used (bounds or
    exact): passed back as the op's `amax`, they let the op skip every read (`outer.prepare_nesterov`
    checks all its calls this way before the first writes)."""
    params, bufs, updates = list(params), list(bufs), list(updates)
    lr, momentum = float(lr), float(momentum)
    check_nesterov_args(params, bufs, updates, lr, momentum, amax)
    check_nesterov_written(params, bufs)
    check_nesterov_reads(params, bufs, updates)
    n = len(params)
    names = names or [f"nesterov_outer_: tensor {i}" for i in range(n)]
    tensors = [*params, *bufs, *updates]
    labels = [f"{nm}: {w}" for w in ("param", "momentum buffer", "update") for nm in names]
    known = [None] * (3 * n) if amax is None else [None if a is None or math.isnan(a) else float(a) for a in amax]
    read = [j for j in range(3 * n) if known[j] is None]
    got = amaxes([tensors[j] for j in read])
    check_amax_finite([tensors[j] for j in read], got, [labels[j] for j in read])
    for j, v in zip(read, got):
        known[j] = v
    amax = known

    def fits(i: int) -> bool:
        return _nesterov_fits(params[i], bufs[i], amax[i], amax[n + i], amax[2 * n + i], lr, momentum)

    # bounds too loose to show the update fits: the exact largest entries decide (one more pass)
    loose = [j for i in range(n) if not fits(i) for j in (i, n + i, 2 * n + i) if j not in read]
    if loose:
        exact = amaxes([tensors[j] for j in loose])
        check_amax_finite([tensors[j] for j in loose], exact, [labels[j] for j in loose])
        for j, v in zip(loose, exact):
            amax[j] = v
    aside = {
        i: _nesterov_aside(params[i], bufs[i], updates[i], lr, momentum, names[i], i) for i in range(n) if not fits(i)
    }
    rest = [i for i in range(n) if i not in aside]
    args = ([params[i] for i in rest], [bufs[i] for i in rest], [updates[i] for i in rest], lr, momentum)

    def apply() -> None:
        if args[0]:
            dispatch.select("nesterov_outer_", args[0][0].device, *args).run(*args)
            # The backends (torch's fused CPU SGD, the CUDA extension, CuPy, Triton) write through
            # kernels that leave version counters alone: bump them, as any in-place torch op does,
            # so autograd sees the write and a buffer written here is never trusted as unchanged
            # by another optimizer (outer.core's recorded bounds).
            torch.autograd.graph.increment_version([t for t in (*args[0], *args[1]) if not t.is_inference()])
        for i, (p_new, b_new) in aside.items():
            params[i].copy_(p_new)
            bufs[i].copy_(b_new)

    apply.amax = amax
    return apply


@torch.library.impl(_lib, "nesterov_outer_", "CPU")
@torch.library.impl(_lib, "nesterov_outer_", "CUDA")
def _nesterov_outer_impl(params, bufs, updates, lr, momentum, amax=None) -> None:
    prepare_nesterov_outer_(params, bufs, updates, lr, momentum, amax)()


@torch.library.impl(_lib, "nesterov_outer_", "CompositeExplicitAutograd")
def _nesterov_outer_no_tensors(params, bufs, updates, lr, momentum, amax=None) -> None:
    """Reached only when no CPU/CUDA kernel applies: a call without any tensor (empty lists) checks its
    numbers and does nothing; tensors on another device are refused by name."""
    check_nesterov_args(params, bufs, updates, lr, momentum, amax)
    if params:
        raise NotImplementedError(f"nesterov_outer_: no kernel for tensors on {params[0].device}")


@torch.library.register_fake("isoloco::nesterov_outer_", lib=_lib)
def _nesterov_outer_fake(params, bufs, updates, lr, momentum, amax=None) -> None:
    check_nesterov_args(params, bufs, updates, lr, momentum, amax)
