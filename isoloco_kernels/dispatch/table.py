"""Which backend serves each op: one ordered table per (op, device type), the only place a backend is chosen,
with the torch candidate every table ends with (the CPU kernels of the ops).

Each candidate says whether it can run here (`available() -> (ok, why)`) and whether it takes
this call's arguments (`supports(*args) -> (ok, why)`); `select(op, device, *args)` returns the
first that does. The registered CUDA (and CPU) implementations in ops.py
call `select`, and `backends()` reports from the same tables, so what it says is what runs.
Arguments are checked once, in ops.py, before `select` (every candidate gets the same input).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .._validate import compute_dtype

__all__ = ["Candidate", "TABLES", "iso_scale_torch", "nesterov_outer_torch", "report", "select", "update_compute_dtype"]

OK = (True, "")


@dataclass(frozen=True)
class Candidate:
    name: str
    available: Callable[[], tuple[bool, str]]
    supports: Callable[..., tuple[bool, str]]
    run: Callable[..., Any]


def _always(*_args) -> tuple[bool, str]:
    return OK


# -- availability -------------------------------------------------------------------------------


def _capability(device) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device))


def _csrc_device_problem(device, extension: bool) -> str:
    """Why the csrc kernels cannot run on `device` ("" if they can): below sm_80 (bfloat16
    conversions), or, for the compiled extension, no cubin or PTX it can load."""
    from . import _ext as ext

    return ext.device_problem(_capability(device), ext.built_archs() if extension else None)


def _current_device_problem(extension: bool) -> str:
    if not torch.cuda.is_available():
        return ""  # nothing to run on; supports() sees the tensors' device
    return _csrc_device_problem(torch.cuda.current_device(), extension)


def _ext(op: str) -> Callable[[], tuple[bool, str]]:
    def available() -> tuple[bool, str]:
        from . import _ext as ext

        if not ext.LOADED:
            return False, ext.STATUS.split(" (")[0] + " (backends()['cuda_extension'] says why)"
        if not ext.has_kernel(f"csrc_{op}", "CUDA"):
            return False, f"the loaded extension has no kernel for isoloco::csrc_{op}"
        why = _current_device_problem(extension=True)
        return (False, why) if why else OK

    return available


def _cupy_available() -> tuple[bool, str]:
    from . import _cupy

    ok, why = _cupy.available()
    if not ok:
        return False, why
    why = _current_device_problem(extension=False)
    return (False, why) if why else OK


def _triton_available() -> tuple[bool, str]:
    from .. import triton as tk

    return OK if tk.AVAILABLE else (False, "triton does not import")


# -- what each candidate takes ------------------------------------------------------------------


def _csrc_on(device, extension: bool) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, f"needs CUDA tensors, got {device}"
    why = _csrc_device_problem(device, extension)
    return (False, why) if why else OK


def _on_cuda(extension: bool) -> Callable[..., tuple[bool, str]]:
    """supports() of a csrc candidate for iso_scale_(x, q): CUDA tensors on a device it runs on."""
    return lambda x, *_rest: _csrc_on(x.device, extension)


def _params_on_cuda(extension: bool) -> Callable[..., tuple[bool, str]]:
    """supports() of a csrc candidate for nesterov_outer_(params, …)."""
    return lambda params, *_rest: OK if not params else _csrc_on(params[0].device, extension)


def _triton_nesterov_supports(params, bufs, *_rest) -> tuple[bool, str]:
    from .. import triton as tk

    if params and not tk.usable_for(params[0]):
        return False, "the Triton kernels cannot run on these tensors here"
    bad = next((i for i, (p, b) in enumerate(zip(params, bufs)) if not (p.is_contiguous() and b.is_contiguous())), None)
    return OK if bad is None else (False, f"param or buf {bad} is not contiguous")


def _triton_iso_scale_supports(x, q) -> tuple[bool, str]:
    from .. import triton as tk

    return OK if tk.usable_for(x) else (False, "the Triton kernels cannot run on these tensors here")


# -- the torch candidates: the CPU kernels, and the last CUDA fallback ---------------------------
#
# nesterov_outer_: for every tensor i, the Nesterov step of `reference.nesterov_ref` with g = u_i
# (torch.optim.SGD with nesterov=True, dampening=0; with buf starting at zero the first step gives
# buf = g, as SGD does). The math runs in the compute dtype of each (param, buf) pair: float64 when either
# is float64, else float32, so bfloat16 / float16 params with float32 momentum buffers are updated in
# float32 and rounded once on store. torch._foreach_* per (device, dtypes); torch's fused CPU SGD kernel
# for contiguous float32/float64 CPU groups.


def iso_scale_torch(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The Iso-C epilogue in torch: s̄ = ⟨Δ, Q⟩ / min(m, n) per matrix, then Δ ← s̄·Q (Q the polar factor
    of Δ, so ⟨Δ, Q⟩ = Σσ: the Iso-C result without an SVD)."""
    m, n = x.shape[-2:]
    cd = compute_dtype(x.dtype)
    xc, qc = x.to(cd), q.to(cd)
    sbar = (xc * qc).sum((-2, -1)) / max(min(m, n), 1)  # 0, not NaN, for empty matrices
    x.copy_(sbar[..., None, None] * qc)
    return sbar.to(torch.float32) if cd != torch.float64 else sbar


def update_compute_dtype(param_dtype: torch.dtype, buf_dtype: torch.dtype) -> torch.dtype:
    """float64 when the param or its buffer is float64, else float32."""
    return torch.float64 if torch.float64 in (param_dtype, buf_dtype) else torch.float32


def _group(params, bufs, updates) -> dict[tuple, list[int]]:
    """Indices of the non-empty tensors, grouped by (device, param, buf, update dtype)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        if p.numel():
            groups[(p.device, p.dtype, b.dtype, u.dtype)].append(i)
    return groups


def _foreach_group(P, B, U, lr: float, momentum: float) -> None:
    """One (device, dtypes) group with torch._foreach_*."""
    if momentum != 0 and _fused_cpu_ok(P, B, U):  # (with μ = 0 it would leave buf alone)
        # Same update as SGD(nesterov=True) with buf already holding the momentum (zeros at first):
        # torch's fused CPU kernel does it in one pass over p, buf and u and leaves u untouched. It serves
        # the tensors whose param and buffer are contiguous (an update that is not, e.g. a tall matrix's
        # transposed Iso-C result, is copied contiguous: one pass, cheaper than the foreach path's four);
        # the others (a channels_last param, say) take the foreach path below.
        fused = [i for i in range(len(P)) if P[i].is_contiguous() and B[i].is_contiguous()]
        if fused:
            torch._fused_sgd_(
                [P[i] for i in fused],
                [U[i].contiguous() for i in fused],
                [B[i] for i in fused],
                weight_decay=0.0,
                momentum=momentum,
                lr=lr,
                dampening=0.0,
                nesterov=True,
                maximize=False,
                is_first_step=False,
            )
        rest = sorted(set(range(len(P))) - set(fused))
        if not rest:
            return
        P, B, U = [P[i] for i in rest], [B[i] for i in rest], [U[i] for i in rest]
    cd = update_compute_dtype(P[0].dtype, B[0].dtype)
    Bc = B if B[0].dtype == cd else [b.to(cd) for b in B]
    # Mixed-dtype foreach ops compute in the promoted dtype (cd) and round once on store: no converted
    # copy of the updates is made.
    torch._foreach_mul_(Bc, momentum)
    torch._foreach_add_(Bc, U)
    if P[0].dtype == cd:
        # p − lr·u − lr·μ·buf: two in-place passes, no temporary (the updates are read-only)
        torch._foreach_add_(P, U, alpha=-lr)
        torch._foreach_add_(P, Bc, alpha=-lr * momentum)
    else:
        # half params: p − lr·(u + μ·buf) with the sum formed in cd, rounded once
        D = torch._foreach_add(U, Bc, alpha=momentum)
        torch._foreach_add_(P, D, alpha=-lr)
    if Bc is not B:
        torch._foreach_copy_(B, Bc)


def _fused_cpu_ok(P, B, U) -> bool:
    """torch's fused SGD kernel serves a CPU group of one float32/float64 dtype (its contiguous tensors)."""
    return (
        hasattr(torch, "_fused_sgd_")
        and P[0].device.type == "cpu"
        and P[0].dtype == B[0].dtype == U[0].dtype
        and P[0].dtype in (torch.float32, torch.float64)
    )


def nesterov_outer_torch(
    params: Sequence[torch.Tensor],
    bufs: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    lr: float,
    momentum: float,
) -> None:
    """The update with torch._foreach_* ops: four passes per group; no temporaries unless the
    params or bufs are half precision (then one compute-dtype temporary per tensor)."""
    lr, momentum = float(lr), float(momentum)
    for idx in _group(params, bufs, updates).values():
        _foreach_group([params[i] for i in idx], [bufs[i] for i in idx], [updates[i] for i in idx], lr, momentum)


# -- implementations ----------------------------------------------------------------------------


def _csrc_iso_scale(x, q):
    return torch.ops.isoloco.csrc_iso_scale_(x, q)


def _csrc_nesterov(params, bufs, updates, lr, momentum):
    torch.ops.isoloco.csrc_nesterov_outer_(params, bufs, updates, lr, momentum)


def _cupy_iso_scale(x, q):
    from . import _cupy

    return _cupy.iso_scale_(x, q)


def _cupy_nesterov(*args):
    from . import _cupy

    _cupy.nesterov_outer_(*args)


def _triton_iso_scale(x, q):
    from ..triton.iso_scale import iso_scale_triton

    return iso_scale_triton(x, q)


def _triton_nesterov(*args):
    from ..triton.nesterov import nesterov_outer_triton

    nesterov_outer_triton(*args)


def _torch_iso_scale(x, q):
    return iso_scale_torch(x, q)


def _torch_nesterov(*args):
    nesterov_outer_torch(*args)


def _cuda_chain(op: str, on_cuda, runs, triton_supports, torch_name: str) -> list[Candidate]:
    """An op's CUDA candidates in preference order: the compiled extension, the same kernels through
    CuPy/NVRTC, Triton, torch. runs = (csrc, cupy, triton, torch)."""
    csrc, cupy, triton, torch_run = runs
    return [
        Candidate("csrc (compiled extension)", _ext(op), on_cuda(True), csrc),
        Candidate("csrc through CuPy/NVRTC", _cupy_available, on_cuda(False), cupy),
        Candidate("triton", _triton_available, triton_supports, triton),
        Candidate(torch_name, lambda: OK, _always, torch_run),
    ]


_ISO_SCALE_RUNS = (_csrc_iso_scale, _cupy_iso_scale, _triton_iso_scale, _torch_iso_scale)
_NESTEROV_RUNS = (_csrc_nesterov, _cupy_nesterov, _triton_nesterov, _torch_nesterov)

TABLES: dict[tuple[str, str], list[Candidate]] = {
    ("iso_scale_", "cuda"): _cuda_chain("iso_scale_", _on_cuda, _ISO_SCALE_RUNS, _triton_iso_scale_supports, "torch"),
    ("iso_scale_", "cpu"): [Candidate("torch", lambda: OK, _always, _torch_iso_scale)],
    ("nesterov_outer_", "cuda"): _cuda_chain(
        "nesterov_outer_", _params_on_cuda, _NESTEROV_RUNS, _triton_nesterov_supports, "torch (foreach)"
    ),
    ("nesterov_outer_", "cpu"): [Candidate("torch (fused SGD kernel / foreach)", lambda: OK, _always, _torch_nesterov)],
}


def _device_type(device) -> str:
    kind = torch.device(device).type
    return kind if kind in ("cuda", "cpu") else "cpu"


def select(op: str, device, *args) -> Candidate:
    """The first candidate for (op, device type) that is available here and takes `args`
    (no args: the first available one)."""
    for c in TABLES[(op, _device_type(device))]:
        if c.available()[0] and (not args or c.supports(*args)[0]):
            return c
    raise RuntimeError(f"no backend for {op} on {device}")  # the torch candidates always serve


def report(op: str, device: str = "cuda") -> list[tuple[str, bool, str]]:
    """(name, available, why not) for every candidate of (op, device), in order."""
    return [(c.name, *c.available()) for c in TABLES[(op, device)]]
