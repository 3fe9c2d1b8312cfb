"""Iso-C flatten of one [m, n] or [B, m, n] tensor, in place: method choice and dispatch.

Every backend takes a [B, m, n] view and writes the result back with `copy_` only after the whole
batch is computed, so a failure leaves the input untouched.

Methods: "svd" and "eigh" (exact.py), "polar" (polar.py: matmul-only Polar Express iteration in
the compute dtype, residual-checked, exact fallback for the matrices that miss the check),
"polar_bf16" (the same with bfloat16 GEMMs in all but the last steps; ~1e-2 relative error), "gram"
(gram.py: the Polar Express iteration on the small Gram matrix in float64, exact to condition number
~1e5 for float32 input; residual-checked, SVD for the matrices that miss) and "auto" (see
`resolve_method`).
"""
from __future__ import annotations

import functools
import os
import re

import torch

from . import exact, gram, polar

METHODS = ("auto", "svd", "eigh", "polar", "polar_bf16", "gram")

_BACKENDS = {
    "svd": exact.flatten_svd_,
    "eigh": exact.flatten_eigh_,
    "polar": functools.partial(polar.flatten_polar_, mode="fp32"),
    "polar_bf16": functools.partial(polar.flatten_polar_, mode="bf16"),
    "gram": gram.flatten_gram_,
}


def check_method(method) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


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
    GEMM rate is `fp64_rate` × its float32 rate (r = short side, k = long side): gram's float64
    FLOPs `gram.gram_flops` = 4kr² + (8T + 5)·r³ (T = 15) over the rate against polar's float32
    T'·(4kr² + 2r³) (T' = 10). At rate 1 (A100/H100/H200) gram wins from k ≈ 2.9r (2.2× at
    k = 8r; 2.1× polar's time on square ones); at rate 0.5 from k ≈ 7r."""
    if fp64_rate <= 0:
        return False
    r, k = min(m, n), max(m, n)
    t_gram = gram.gram_flops(k, r) / fp64_rate
    t_polar = polar.STEPS * (4.0 * k * r * r + 2.0 * r**3)
    return t_gram <= t_polar


def resolve_method(method: str, x3: torch.Tensor) -> str:
    """The backend `method` means for this tensor. "auto":
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
    if method != "auto":
        return method
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
    _BACKENDS[resolve_method(method, x3)](x3)
