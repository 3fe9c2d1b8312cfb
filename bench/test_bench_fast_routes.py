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
torch.utils.flop_counter in tests/test_fast_gram.py).

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


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape_set", list(SETS))  # not "set_name": these are not bench.shapes sets
def test_fast_routes(benchmark, impl, shape_set, bench_seconds, bench_dry):
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

    benchmark.extra_info.update(
        set=set_name,
        impl=impl,
        shapes=shapes,
        err_max=max(errs),
        flatness_max=max(flat),
        routes=[fast.route_for(m, n, kind) for _, m, n in shapes],
        device_kind=kind,
        flops_direct=flops(lambda k, r: fast_gram.direct_work(k, r, fast.PRECISE_STEPS, polar.STEPS)),
        flops_now=flops(lambda k, r: fast.fast_work(k, r, kind)),
    )
    assert max(errs) <= ERROR_SANITY, f"{impl}: error {max(errs):.3g}"
