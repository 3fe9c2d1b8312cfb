"""Every flatten method on real pseudo-gradients (bench/data/captured, see bench/captured.py).

The synthetic sets of test_bench_flatten.py have clean spectra; these are the averaged Δ the
reference loop saved, with condition numbers up to ~5e5. Per case: time, error against
reference.iso_flatten_ref (float64, every matrix), how many matrices the polar and gram checks
sent to a fallback, and the condition numbers of the set (median, max).
Roofline as test_bench_flatten.py's (bench/harness.py): the flops of the method each bucket resolves
to (the registry's models, float32 compute), and compulsory bytes, the flatten reads every bucket and
writes it back (2 × the set's float32 size); the work of matrices sent to a fallback is not counted.
"""

from __future__ import annotations

import math
import statistics
import time

import pytest
import torch

import isoloco_kernels as ik
from bench import harness
from bench.captured import load_captured_sets
from isoloco_kernels.flatten import gram, polar
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.reference import iso_flatten_ref

METHODS = tuple(m for m in flatten.METHODS if m not in ("auto", "polar_bf16")) + ("auto",)
ERROR_SANITY = 0.25  # garbage (Δ itself, zeros) gives ~1; accuracy contracts are tests/'s job

_SETS = load_captured_sets(device=torch.device("cpu"), dtype=torch.float32)
_REFS: dict[str, list[torch.Tensor]] = {}


def _refs(name: str) -> list[torch.Tensor]:
    if name not in _REFS:
        _REFS[name] = [iso_flatten_ref(b) for b in _SETS[name]["src"]]
    return _REFS[name]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("capture", sorted(_SETS))  # not "set_name": --bench-sets selects synthetic sets
def test_captured(benchmark, method, capture, bench_seconds, ceilings):
    set_name = capture
    entry = _SETS[set_name]
    src = entry["src"]
    work = [b.clone() for b in src]

    def setup():
        for w, s in zip(work, src):
            w.copy_(s)
        return (work,), {}

    def run(buckets):
        polar.reset_stats()
        gram.reset_stats()
        ik.iso_merge_(buckets, method=method)

    benchmark.group = f"captured {set_name}"
    setup()
    t0 = time.perf_counter()
    run(work)  # untimed: warm-up and the time that sets the rounds, as harness.run_timed does
    rounds = max(1, min(50, math.ceil(bench_seconds / max(time.perf_counter() - t0, 1e-6))))
    benchmark.pedantic(run, setup=setup, rounds=rounds, warmup_rounds=0)
    ps, gs = polar.last_stats(), gram.last_stats()
    refs = _refs(set_name)
    num = sum(float((w.double() - r).norm() ** 2) for w, r in zip(work, refs)) ** 0.5
    den = sum(float(r.norm() ** 2) for r in refs) ** 0.5
    err = num / den
    worst = max(float((w.double() - r).norm() / r.norm()) for w, r in zip(work, refs))
    conds = [c for per_bucket in entry["cond_stored"] for c in per_bucket]
    device = src[0].device
    resolved = harness.resolved_methods(method, entry["shapes"], device)
    flops = harness.flatten_work(resolved, entry["shapes"], "fp32")
    nbytes = 2.0 * sum(b.numel() * b.element_size() for b in src)
    benchmark.extra_info.update(
        kind="captured",
        impl=method,
        device=device.type,
        dtype="fp32",
        set=set_name,
        method=method,
        resolved=resolved,
        matrices=sum(b for b, _, _ in entry["shapes"]),
        err_rel_fro=err,
        err_worst_bucket=worst,
        polar_fallbacks=ps.recomputed,
        gram_fallbacks=gs.recomputed,
        cond_median=statistics.median(conds),
        cond_max=max(conds),
        flops=flops,
        bytes=nbytes,
        **harness.roofline_and_rates(harness.median(benchmark), flops, nbytes, ceilings(device)),
    )
    assert err == err and err <= ERROR_SANITY, f"{method} on {set_name}: error {err:.3g}"
