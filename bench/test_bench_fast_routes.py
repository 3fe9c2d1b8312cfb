"""method="fast" before and after its Gram route, on wide bucket sets, beside torch's baselines.

One case = (implementation, set). Implementations, all in place on float32 buckets:
  fast-direct     fast's direct route only (as before the Gram route: 3 float32-accurate steps, 7 in
                  bfloat16 on CPUs with bfloat16 units, the float64 certificate)
  fast            fast as it routes now (fast.route_for: the Gram route on wide buckets)
  svd-batched     one batched torch.linalg.svd per bucket, (U·mean σ)·Vᵀ (the exact baseline)
  linalg-polar    torch.linalg.polar (where torch has it), batched, for Q, then s̄ = ⟨Δ, Q⟩ / r
Sets (CPU-sized, the shapes of the 1B model's buckets scaled down 8× on each side):
  wide-1b/8       6 × 256×1024 (its MLP matrices, k = 4r) and 1 × 256×16032 (its vocabulary, k = 62.6r)
  square-1b/8     8 × 256×256 (its attention matrices)
Each case records its error against reference.py (float64) and its flatness, the route fast took
per bucket, and the modelled FLOPs of both routes (fast_gram.py, checked against
torch.utils.flop_counter in tests/flatten/test_fast_gram.py).
Roofline (harness.roofline, the ceilings of the same run): the FLOPs of what each impl runs, per GEMM
unit, fast-direct fast_gram.direct_work at fast's schedule (its precise steps, then the rest in
bfloat16 where the device has it, float32 on a CPU without, the float64 certificate), fast
fast.fast_work on the route route_for picks for the device, the torch baselines the svd model in
float32 (exact.svd_flops); a unit without a measured ceiling (bf16 and the eigensolver on a CPU)
is left out of the bound. Bytes: read every bucket and write it back, 2 × the set's size.

    pytest bench/test_bench_fast_routes.py --benchmark-only --bench-seconds 2 --bench-threads 1
"""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch

from bench import harness
from isoloco_kernels.flatten import fast, fast_gram, polar
from isoloco_kernels.flatten.iteration_stats import FlattenFallbackWarning
from isoloco_kernels.reference import iso_flatten_ref

SETS = {"wide-1b/8": [(6, 256, 1024), (1, 256, 16032)], "square-1b/8": [(8, 256, 256)]}
# --bench-dry-run: the same aspects, 4× smaller on each side and fewer matrices
DRY_SHAPES = {"wide-1b/8": [(2, 64, 256), (1, 64, 4008)], "square-1b/8": [(2, 64, 64)]}
IMPLS = ["fast-direct", "fast"] + [b for b in harness.BASELINES if b != "svd-loop"]
ERROR_SANITY = 0.3  # the training grade's band on real pseudo-gradients; garbage gives ~1


def _src(shapes) -> list[torch.Tensor]:
    """Pseudo-gradient-like buckets: a decaying spectrum (σ_i ∝ 1 / (1 + i/8)) in random bases."""
    g = torch.Generator().manual_seed(7)
    out = []
    for b, m, n in shapes:
        r = min(m, n)
        u, _ = torch.linalg.qr(torch.randn(b, m, r, generator=g))
        v, _ = torch.linalg.qr(torch.randn(b, n, r, generator=g))
        s = 1.0 / (1.0 + torch.arange(r) / 8.0)
        out.append(((u * s) @ v.mT).contiguous())
    return out


def _run(impl: str, buckets: list[torch.Tensor]) -> None:
    for b in buckets:
        if impl == "fast-direct":
            fast.flatten_fast_(b, route="direct")
        elif impl == "fast":
            fast.flatten_fast_(b)
        else:
            harness.BASELINE_FNS[impl]([b])


def _work(impl: str, shapes, kind: str) -> dict[str, float]:
    """Modelled FLOPs per GEMM unit of `impl` on these [B, m, n] buckets (module docstring)."""
    if impl in harness.BASELINES:
        return harness.flatten_work([impl] * len(shapes), shapes, "fp32")
    out: dict[str, float] = {}
    for b, m, n in shapes:
        k, r = max(m, n), min(m, n)
        if impl == "fast-direct":
            w = fast_gram.direct_work(k, r, fast.PRECISE_STEPS, fast.STEPS)
        else:
            w = fast.fast_work(k, r, kind)
        for unit, f in w.items():
            unit = "fp32" if unit == "bf16" and kind == "cpu-no-bf16" else unit  # fast.low_dtype there
            out[unit] = out.get(unit, 0.0) + b * f
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape_set", list(SETS))  # not "set_name": these are not bench.shapes sets
def test_fast_routes(benchmark, impl, shape_set, bench_seconds, bench_dry, ceilings):
    set_name = shape_set
    src = _src((DRY_SHAPES if bench_dry else SETS)[set_name])
    bufs = [s.clone() for s in src]

    def setup():
        for b, s in zip(bufs, src):
            b.copy_(s)
        return (impl, bufs), {}

    benchmark.group = f"fast routes {set_name}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlattenFallbackWarning)
        setup()
        t0 = time.perf_counter()
        _run(impl, bufs)  # untimed warm-up; sets the rounds
        rounds = max(1, min(20, math.ceil(bench_seconds / max(time.perf_counter() - t0, 1e-6))))
        benchmark.pedantic(_run, setup=setup, rounds=rounds, warmup_rounds=0)
    errs, flat = [], []
    for s, b in zip(src, bufs):
        ref = iso_flatten_ref(s[:1])
        errs.append(float((b[:1].double() - ref).norm() / ref.norm()))
        sv = torch.linalg.svdvals(b[:1].double())
        flat.append(float((sv / sv.mean() - 1).abs().max()))
    kind = fast.device_kind(src[0])
    shapes = [tuple(s.shape) for s in src]

    def flops(work) -> float:
        return sum(bb * sum(work(max(m, n), min(m, n)).values()) for bb, m, n in shapes)

    work = _work(impl, shapes, kind)
    nbytes = 2.0 * sum(s.numel() * s.element_size() for s in src)
    benchmark.extra_info.update(
        kind="fast_route",
        device=src[0].device.type,
        dtype="fp32",
        set=set_name,
        impl=impl,
        shapes=shapes,
        err_max=max(errs),
        flatness_max=max(flat),
        routes=[fast.route_for(m, n, kind) for _, m, n in shapes],
        device_kind=kind,
        flops_direct=flops(lambda k, r: fast_gram.direct_work(k, r, fast.PRECISE_STEPS, polar.STEPS)),
        flops_now=flops(lambda k, r: fast.fast_work(k, r, kind)),
        flops=work,
        bytes=nbytes,
        **harness.roofline_and_rates(harness.median(benchmark), work, nbytes, ceilings(src[0].device)),
    )
    assert max(errs) <= ERROR_SANITY, f"{impl}: error {max(errs):.3g}"
