"""IsoLoCo.step() as a user takes it, phase by phase, per flatten method (fp32 params and grads,
lr 1.8, μ 0.8, steady state: the bucket buffers and momentum exist).

The whole step is timed with pytest-benchmark; its phases are timed apart on the same optimizer
and data (best of a few runs each, synced), and recorded in the case's JSON:
  checks    `collect`: every grad and param (and any buffer not written by the step itself) in one
            fused pass, one host sync (outer/core.py, "The trust boundary")
  pack      the 2-D grads copied into the [B, m, n] bucket buffers
  flatten   Iso-C of the buckets (the isoloco::iso_merge_ op on checked scratch, in slices of bounded scratch)
  prepare   the Nesterov update's checks from the numbers `collect` found (reads no tensor)
  nesterov  the update itself: reads p, buf, u, writes p, buf (20 bytes per fp32 element), as
            GB/s and as a fraction of the measured copy bandwidth
  overhead  step − (flatten + nesterov), as a fraction of the step (issue target ≤ 10 %)
  syncs     host syncs in one step (CUDA: torch.cuda.set_sync_debug_mode's warnings; target ≤ 3)
  peak      peak extra memory of one step (torch.cuda.max_memory_allocated on a GPU)
The whole step's roofline is test_bench_optim.py's test_outer_step's (bench/harness.py): the flatten
flops of the methods the buckets resolve to; compulsory bytes, Nesterov's 20 B per element plus the
read and write of every 2-D grad flattened (8 B per element), not the copies into the bucket buffers.
"""

from __future__ import annotations

import time

import pytest
import torch

from bench import harness
from bench.shapes import SETS, bucket_shapes, decoder_param_shapes, pseudo_gradient
from isoloco_kernels.flatten import registry as flatten

METHODS = ("auto",) + tuple(m for m in flatten.METHODS if m != "auto")
LR, MU = 1.8, 0.8
# CPU: the small sets only (the exact methods take minutes per step beyond them on 2 cores);
# CUDA: llama-1b with the GPU methods (the exact ones loop over cuSOLVER calls for minutes).
CPU_SETS = {"ref-tiny", "llama-tiny", "dry-tiny"}  # dry-tiny: --bench-dry-run's
GPU_EXACT = {"svd", "eigh"}


_STATE: dict = {}


def _state(spec, device):
    """(params, grads) of a model: 2-D pseudo-gradients with a real spectrum, 1-D ones small. The
    grads are made once per (set, device) and shared by the cases (never written); the params are
    fresh copies for each case."""
    key = (spec.name, str(device))
    if key not in _STATE:
        _STATE.clear()  # one set at a time: llama-1b's grads alone take 5 GB
        _STATE[key] = _make_state(spec, device)
    params, grads = _STATE[key]
    return [p.clone() for p in params], grads


def _make_state(spec, device):
    shapes = [s for _, s in decoder_param_shapes(spec)]
    gen = torch.Generator(device=device).manual_seed(5)
    grads = [
        pseudo_gradient(1, *s, dtype=torch.float32, device=device, seed=3000 + i)[0]
        if len(s) == 2
        else torch.randn(s, generator=gen, device=device) * 1e-3
        for i, s in enumerate(shapes)
    ]
    params = [torch.randn(s, generator=gen, device=device) * 0.02 for s in shapes]
    return params, grads


def _best(fn, device, setup=None, reps: int = 3) -> float:
    """Fastest of `reps` synced runs of fn() (setup() before each, untimed), after one warm-up."""
    best = float("inf")
    for i in range(reps + 1):
        if setup is not None:
            setup()
        harness.sync(device)
        t0 = time.perf_counter()
        fn()
        harness.sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def _phases(opt, device) -> dict:
    """Each phase of one step, timed apart on `opt` (its grads in place, one step taken)."""
    out = {}
    out["checks_s"] = _best(opt._collect_grads, device)
    entries = opt._collect_grads()
    chosen = [k for k, e in enumerate(entries) if e.iso]
    mats = [entries[k].g for k in chosen]
    plan = opt._plan
    out["pack_s"] = _best(lambda: plan.pack(mats), device)
    out["flatten_s"] = _best(
        lambda: torch.ops.isoloco.iso_merge_(plan.buffers, opt.method, True), device, lambda: plan.pack(mats)
    )
    iso = dict(zip(chosen, plan.views()))
    out["prepare_s"] = _best(lambda: opt._prepare_nesterov(entries, iso), device)
    apply = opt._prepare_nesterov(entries, iso)
    out["nesterov_s"] = _best(apply, device)
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("set_name", list(SETS))
@pytest.mark.parametrize("device", ["cpu", "cuda"], indirect=True)
def test_step_phases(benchmark, method, set_name, device, bench_seconds, ceilings):
    from isoloco_kernels import IsoLoCo

    spec = SETS[set_name]
    if device.type == "cpu" and set_name not in CPU_SETS:
        pytest.skip(f"{set_name}: whole steps on the CPU for {sorted(CPU_SETS)} only")
    if device.type == "cpu" and method == "polar_bf16":
        pytest.skip("polar_bf16: bf16 GEMMs have no fast path on this CPU; GPU only")
    shapes2d = bucket_shapes(s for _, s in decoder_param_shapes(spec) if len(s) == 2)
    resolved = harness.resolved_methods(method, shapes2d, device)
    if device.type == "cuda" and spec.n_params > 100e6 and set(resolved) & GPU_EXACT:
        pytest.skip(f"{method} on {set_name}: minutes per step on a GPU (cuSOLVER per matrix)")
    params, grads = _state(spec, device)
    opt = IsoLoCo(params, lr=LR, momentum=MU, method=method)
    for p, g in zip(params, grads):
        p.grad = g
    first_s, mem = harness.peak_extra_memory(opt.step, device)  # first step: buffers and momentum made
    second_s, mem2 = harness.peak_extra_memory(opt.step, device)  # steady state
    syncs = harness.host_syncs(opt.step, device)
    phases = _phases(opt, device)

    def target():
        opt.step()
        harness.sync(device)

    benchmark.group = f"step phases {set_name} {device.type}"
    median = harness.run_timed(
        benchmark,
        target,
        lambda: None,
        device=device,
        seconds=bench_seconds,
        first_s=second_s,
        may_compile=device.type == "cuda",
    )
    n = sum(p.numel() for p in params)
    nes_bytes = 20.0 * n
    flops = harness.flatten_work(resolved, shapes2d, "fp32")
    nbytes = nes_bytes + 8.0 * sum(b * m * k for b, m, k in shapes2d)
    copy = ceilings(device)["copy_GBps"]
    step_s = median or second_s
    extra = dict(
        resolved=resolved,
        n_params=n,
        host_syncs=syncs,
        first_step_s=first_s,
        peak_extra_bytes_first=mem.get("peak_extra_bytes"),
        peak_extra_bytes=mem2.get("peak_extra_bytes"),
        mem_method=mem2.get("mem_method"),
        nesterov_GBps=nes_bytes / phases["nesterov_s"] / 1e9,
        nesterov_frac_copy=nes_bytes / phases["nesterov_s"] / 1e9 / copy,
        overhead_frac=1.0 - (phases["flatten_s"] + phases["nesterov_s"]) / step_s,
        **phases,
        flops=flops,
        bytes=nbytes,
        **harness.roofline_and_rates(median, flops, nbytes, ceilings(device)),
    )
    harness.describe(benchmark, "step_phases", f"isoloco-{method}", set_name, spec, device, "fp32", **extra)
    print(
        f"\n{set_name} {device.type} {method}: step {step_s * 1e3:.2f} ms | "
        + " | ".join(f"{k[:-2]} {v * 1e3:.2f} ms" for k, v in phases.items())
        + f" | Nesterov {extra['nesterov_GBps']:.0f} GB/s = {extra['nesterov_frac_copy']:.0%} of copy"
        + f" | overhead {extra['overhead_frac']:.0%} | syncs {syncs}"
    )
    assert all(torch.isfinite(p).all() for p in params)
