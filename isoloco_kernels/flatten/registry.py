"""Iso-C flatten of one [m, n] or [B, m, n] tensor, in place: the method registry and "auto".

`METHODS` maps each flatten method's name to its `Method`: what runs and the facts the library,
the benchmark (bench/harness.py) and the tests (tests/test_methods.py) read. Every method takes a
[B, m, n] view and writes the result back with `copy_` only after the whole batch is computed, so
a failure leaves the input untouched.

Methods: "svd" and "eigh" (exact.py), "polar" (polar.py: matmul-only Polar Express iteration in
the compute dtype, residual-checked, exact fallback for the matrices that miss the check),
"polar_bf16" (the same with bfloat16 GEMMs in all but the last steps; ~1e-2 relative error at
condition number ≤ 1e2 only), "fast" (fast.py: the training grade, float32-accurate steps first and
bfloat16 after, its flat spectrum certified per matrix, "polar" for the rest), "polar_tf32x3"
(polar with its float32 GEMMs as 3xTF32 on tensor cores, polar's contract), "gram"
(gram.py: the Polar Express iteration on the small Gram matrix in float64, exact to condition number
~1e5 for float32 input; residual-checked, SVD for the matrices that miss) and "auto" (see
`resolve_method`). A new method: its module, one line in `METHODS`, one tolerance row in
tests/helpers.py.

Bounded workspace: a method's scratch grows with the batch it is given (`WORKSPACE_MODEL`: bytes per
element and per r² of each matrix, measured on the CPU with torch's MemTracker, bench/memory_model.py),
so `flatten_chunked_` hands a [B, m, n] tensor to the method in slices of at most `chunk_rows`
matrices, each slice's scratch within `workspace_bytes()` (2 GiB unless $ISOLOCO_WORKSPACE_BYTES says
otherwise). A single matrix whose own scratch is larger than that is flattened alone: the bound is then
that matrix's scratch. Every door into the flatten (the isoloco ops, ops.py) runs through it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from typing import Callable, Optional

import torch

from .._validate import ResultOverflowError, compute_dtype
from . import exact, fast, gram, polar
from .iteration_stats import Recorder

#: The key of `Method.flops` for GEMMs in the input's compute dtype (float32; float64 for float64).
COMPUTE = "compute"


@dataclasses.dataclass(frozen=True)
class Method:
    """One flatten method.

    run: the in-place flatten of a [B, m, n] view (all-or-nothing; input checked by the op).
    flops: (k, r) -> {GEMM dtype: modelled FLOPs} of one r×k matrix (r ≤ k); dtypes "fp64",
        "bf16", "tf32x3" (float32 through three TF32 GEMMs) or COMPUTE; None where the work is not modelled ("auto": it depends on the shape).
    exact: a direct factorisation (LAPACK / cuSOLVER): reference.py's result at every condition
        number, computed in float64 whatever the input dtype; no iteration, no residual check
        (eigh hands what its Gram matrix cannot resolve to svd itself).
    checks_finite: run() itself refuses NaN/Inf input (ValueError naming the matrix, nothing
        written; LAPACK raises its own error instead); the op checks every method's input first.
    stats: the running statistics of a residual-checked method (`Recorder`: last(), reset(),
        its fallback warning class `stats.warning`); None for the others.
    fallback: the method that recomputes the matrices missing the residual check.
    resolve: for "auto": x3 -> the method that serves this tensor.
    """

    run: Callable[[torch.Tensor], None]
    flops: Optional[Callable[[int, int], dict]] = None
    exact: bool = False
    checks_finite: bool = False
    stats: Optional[Recorder] = None
    fallback: Optional[str] = None
    resolve: Optional[Callable[[torch.Tensor], str]] = None


class Registry(dict):
    """name -> Method. Iterates, tests membership and prints as its names (as the tuple it was)."""

    def __repr__(self) -> str:
        return repr(tuple(self))


def _run_auto(x3: torch.Tensor) -> None:
    METHODS[resolve_method("auto", x3)].run(x3)


def _one_dtype(dtype: str, flops: Callable[[int, int], float]) -> Callable[[int, int], dict]:
    return lambda k, r: {dtype: flops(k, r)}


def _polar(mode: str) -> Method:
    """Polar Express in `mode` ("fp32", "tf32x3" or "bf16" GEMMs); it hands what it cannot certify
    to gram."""
    run = functools.partial(polar.flatten_polar_, mode=mode)
    flops = functools.partial(polar.polar_work, mode=mode)
    return Method(run=run, flops=flops, checks_finite=True, stats=polar.RECORDER, fallback="gram")


METHODS = Registry(
    auto=Method(run=_run_auto, resolve=lambda x3: _resolve_auto(x3)),
    svd=Method(run=exact.flatten_svd_, flops=_one_dtype("fp64", exact.svd_flops), exact=True),
    eigh=Method(run=exact.flatten_eigh_, flops=_one_dtype("fp64", exact.eigh_flops), exact=True),
    polar=_polar("fp32"),
    polar_bf16=_polar("bf16"),
    polar_tf32x3=_polar("tf32x3"),
    gram=Method(
        run=gram.flatten_gram_,
        flops=_one_dtype("fp64", gram.gram_flops),
        checks_finite=True,
        stats=gram.RECORDER,
        fallback="svd",
    ),
    fast=Method(
        run=fast.flatten_fast_, flops=fast.fast_work, checks_finite=True, stats=fast.RECORDER, fallback="polar"
    ),
)


def check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS!r}, got {method!r}")


def flops_per_dtype(method: str, k: int, r: int, compute: str = "fp32") -> Optional[dict]:
    """Modelled FLOPs of flattening one r×k matrix (r ≤ k) with `method` (not "auto"), per GEMM
    dtype, COMPUTE named as `compute`; None where the method's work is not modelled."""
    m = METHODS.get(method)
    if m is None or m.flops is None:
        return None
    out: dict = {}
    for dt, f in m.flops(k, r).items():
        dt = compute if dt == COMPUTE else dt
        out[dt] = out.get(dt, 0.0) + f
    return out


def exact_method_for(x3: torch.Tensor) -> str:
    """The faster exact method for a [B, m, n] batch: "eigh" or "svd".

    On CUDA: "eigh" (one batched float64 eigh of the small Gram matrix; cuSOLVER's SVD loops per
    matrix above 32×32). On the CPU: "eigh" when the long side k is at least twice the short side
    r (the Gram matrix is r×r, and k·r² GEMM work beats an r×k SVD) or when r ≤ 64, else "svd"
    (the timings behind the rule: bench/results/notes-timings.md). Both are exact.
    """
    if x3.dtype == torch.float64:
        return "svd"  # the Gram matrix squares cond: eigh misses float64 accuracy beyond cond ~1e4
    if x3.is_cuda:
        return "eigh"
    _, m, n = x3.shape
    r, k = min(m, n), max(m, n)
    return "eigh" if (k >= 2 * r or r <= 64) else "svd"


# float64 : float32 GEMM throughput of CUDA devices by compute capability (data sheets; float32
# without TF32, the polar path refuses TF32). Only these have a float64 unit worth using; every
# other device (consumer and workstation parts, 1:32 to 1:64, and unknown ones) counts as 0.
FP64_RATE = {
    (6, 0): 0.5,  # P100: 5.3 vs 10.6 TFLOP/s
    (7, 0): 0.5,  # V100: 7.8 vs 15.7
    (8, 0): 1.0,  # A100: 19.5 (float64 tensor cores) vs 19.5
    (9, 0): 1.0,  # H100 / H200: 67 vs 67
    (10, 0): 0.5,  # B200: 40 vs 80
}
# Parts that share a compute capability above but carry a cut-down float64 unit (~1 TFLOP/s
# against 51–67 float32: H800 and H20 are sm_90), matched as words in the device name: rate 0.
FP64_WEAK_NAMES = ("H800", "H20")
# Override for every device (a number ≥ 0; 0 keeps "auto" off "gram"): for parts the tables miss.
FP64_RATE_ENV = "ISOLOCO_FP64_RATE"


def _fp64_rate(device: torch.device) -> float:
    """The float64 : float32 GEMM rate "auto" assumes for a CUDA device: $ISOLOCO_FP64_RATE if
    set, else 0 for a name in FP64_WEAK_NAMES, else FP64_RATE by compute capability (0 if absent)."""
    env = os.environ.get(FP64_RATE_ENV, "").strip()
    if env:
        try:
            rate = float(env)
        except ValueError:
            rate = float("nan")
        if not rate >= 0:  # NaN too
            raise ValueError(f"{FP64_RATE_ENV} must be a number >= 0 (float64 : float32 GEMM rate), got {env!r}")
        return rate
    device = torch.device(device)
    return _device_fp64_rate(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_fp64_rate(index: int) -> float:
    name = torch.cuda.get_device_name(index)
    if any(re.search(rf"\b{re.escape(w)}\b", name) for w in FP64_WEAK_NAMES):
        return 0.0
    return FP64_RATE.get(tuple(torch.cuda.get_device_capability(index)), 0.0)


def gram_beats_polar(m: int, n: int, fp64_rate: float) -> bool:
    """Whether "gram" is modelled faster than "polar" for an m×n matrix on a device whose float64
    GEMM rate is `fp64_rate` × its float32 rate (r = short side, k = long side), from the
    registry's FLOP models: gram's float64 4kr² + (8T + 5)·r³ (T = 15, `gram.gram_flops`) over
    the rate against polar's float32 T'·(4kr² + 2r³) (T' = 10, `polar.polar_flops`). At rate 1
    (A100/H100/H200) gram wins from k ≈ 2.9r (2.2× at k = 8r; 2.1× polar's time on square ones);
    at rate 0.5 from k ≈ 7r."""
    if fp64_rate <= 0:
        return False
    r, k = min(m, n), max(m, n)
    t_gram = sum(flops_per_dtype("gram", k, r).values()) / fp64_rate
    t_polar = sum(flops_per_dtype("polar", k, r).values())
    return t_gram <= t_polar


def resolve_method(method: str, x3: torch.Tensor) -> str:
    """The method `method` means for this [B, m, n] tensor: itself, unless its registry entry
    resolves (`Method.resolve`), as "auto" does (`_resolve_auto`)."""
    m = METHODS.get(method)
    return m.resolve(x3) if m is not None and m.resolve is not None else method


def _resolve_auto(x3: torch.Tensor) -> str:
    """What "auto" runs:
    - float64 input, on every device: "svd" (the only method exact to float64 at any condition
      number: the Gram matrix squares it, the iterations stop at their residual check).
    - CUDA: "gram" where the device has a strong float64 unit (`FP64_RATE`) and the shape makes it
      cheaper (`gram_beats_polar`), else "polar" (batched float32 GEMMs on tensor cores). Either
      way accurate: polar's matrices that miss its residual check go to "gram".
    - CPU: the faster exact method (`exact_method_for`), where LAPACK beats the iterations
      (bench/results/gram.md: on a 2-core x86 CPU, whose float64 GEMMs run at half the float32
      rate, gram took 1.1–7× eigh's time on every bucket but the widest, 4×128×6144, where it was
      1.12× faster — inside that machine's noise; no shape class for gram on CPUs).
    """
    if x3.dtype == torch.float64:
        return "svd"
    if x3.is_cuda:
        _, m, n = x3.shape
        return "gram" if gram_beats_polar(m, n, _fp64_rate(x3.device)) else "polar"
    return exact_method_for(x3)


def iso_flatten_impl(x: torch.Tensor, method: str) -> None:
    """The flatten behind the isoloco::iso_flatten_ op, for input the op checked (ops.py: type,
    rank, method, writable, finite)."""
    if x.numel() == 0:
        return
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    METHODS[resolve_method(method, x3)].run(x3)


# -- the bounded workspace: one rule behind every door -----------------------------------------

#: Default scratch one flatten call may take beside its input (bytes): 2 GiB.
WORKSPACE_BYTES = 2 << 30
#: Environment override of WORKSPACE_BYTES (an integer number of bytes > 0).
WORKSPACE_ENV = "ISOLOCO_WORKSPACE_BYTES"

#: Peak scratch of each method per matrix of a [B, r, k] batch (r ≤ k), in bytes: a·r·k + b·r²,
#: (a, b) per compute dtype. Fitted to torch MemTracker peaks on the CPU over wide, tall and square
#: batches of random Gaussians (some of whose matrices take each method's fallback), then raised
#: by the fit's worst under-estimate and 20 %: `python bench/memory_model.py --fit` measures them.
WORKSPACE_MODEL = {
    torch.float32: {
        "svd": (50.7, 9.7),
        "eigh": (42.1, 9.7),
        "polar": (18.9, 20.5),
        "polar_bf16": (27.5, 13.7),
        "gram": (7.0, 44.9),
        "polar_tf32x3": (48.0, 15.0),
        "fast": (25.1, 27.6),
    },
    torch.float64: {
        "svd": (50.7, 9.7),
        "eigh": (57.3, 17.3),
        "polar": (36.5, 41.4),
        "polar_bf16": (39.4, 12.3),
        "gram": (13.8, 39.1),
        "polar_tf32x3": (36.5, 41.4),
        "fast": (33.5, 49.4),
    },
}


def workspace_bytes() -> int:
    """The scratch budget of one flatten call: $ISOLOCO_WORKSPACE_BYTES if set, else WORKSPACE_BYTES."""
    env = os.environ.get(WORKSPACE_ENV, "").strip()
    if not env:
        return WORKSPACE_BYTES
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{WORKSPACE_ENV} must be a whole number of bytes > 0, got {env!r}")
    return value


def method_workspace(method: str, m: int, n: int, dtype: torch.dtype, kind: str = "cuda") -> int:
    """Modelled peak scratch (bytes) of flattening one m×n matrix whose compute dtype is `dtype`
    with `method` (a registry name other than "auto"; `WORKSPACE_MODEL`, its largest coefficients
    for a method it has no row for). "fast" on a shape its Gram route serves on a device of `kind`
    (fast.route_for) takes that route's model instead (fast_gram.workspace: O(r²) and one block)."""
    if method == "fast":
        from . import fast_gram

        if fast.route_for(m, n, kind) == "gram":
            return fast_gram.workspace(m, n, 8 if compute_dtype(dtype) == torch.float64 else 4)
    table = WORKSPACE_MODEL[torch.float64 if compute_dtype(dtype) == torch.float64 else torch.float32]
    # a method without a row: the largest of every row's coefficients (an upper bound, not a model)
    a, b = table.get(method) or (max(a for a, _ in table.values()), max(b for _, b in table.values()))
    r, k = min(m, n), max(m, n)
    if method == "gram":  # its column blocks stop growing at gram.COLUMN_BLOCK_BYTES (the fit's a·r·k below)
        from .gram import COLUMN_BLOCK_BYTES

        return math.ceil(min(a * r * k, COLUMN_BLOCK_BYTES) + b * r * r)
    return math.ceil(a * r * k + b * r * r)


def chunk_rows(method: str, x3: torch.Tensor, workspace: Optional[int] = None) -> int:
    """How many matrices of the [B, m, n] batch x3 one call of `method` may take so that its
    modelled scratch stays within `workspace` (default `workspace_bytes()`); at least 1."""
    _, m, n = x3.shape
    resolved = resolve_method(method, x3[:1])
    per = method_workspace(resolved, m, n, x3.dtype, fast.device_kind(x3) if resolved == "fast" else "cuda")
    if resolved == "polar" or resolved == "polar_bf16":  # the matrices missing its check go to gram
        per = max(per, method_workspace("gram", m, n, x3.dtype))
    budget = workspace_bytes() if workspace is None else workspace
    return max(1, min(x3.shape[0], budget // max(per, 1)))


def flatten_chunked_(x: torch.Tensor, method: str, workspace: Optional[int] = None) -> None:
    """The flatten of a checked [m, n] or [B, m, n] tensor (finite, writable: the op's checks,
    done by the caller) in slices of `chunk_rows` matrices, each in place: scratch bounded by
    `workspace` instead of growing with B. A slice whose result does not fit its dtype raises
    ResultOverflowError with the matrix index in x; the slices before it are already written, so
    callers flatten scratch buffers (the optimizers' buckets) or copies (the iso_merge_ op)."""
    if x.numel() == 0:
        return
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    step = chunk_rows(method, x3, workspace)
    for start in range(0, x3.shape[0], step):
        try:
            iso_flatten_impl(x3[start : start + step], method)
        except ResultOverflowError as e:
            if e.matrix is None:
                raise
            i = start + e.matrix
            raise ResultOverflowError(str(e).replace(f"matrix {e.matrix}", f"matrix {i}", 1), matrix=i) from None
