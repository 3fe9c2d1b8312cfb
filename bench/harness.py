"""What every benchmark case shares: machine ceilings, the timed run, work models, error, memory.

Timing. Cases are timed by pytest-benchmark (`benchmark.pedantic`) with a host clock; on a GPU the
timed function ends with `torch.cuda.synchronize()` and the untimed setup (restoring the inputs)
ends with one too, so each round measures exactly the kernels of that round (plus one sync,
~10 µs). Before timing, one untimed run gives the error, the peak memory and a first time, from
which the number of rounds is chosen to fill `--bench-seconds` (at least 1, at most 200 rounds);
methods that may compile kernels on first use get a second untimed run first.

Ceilings. Measured once per device in the same run:
  copy     dst.copy_(src) of a buffer far larger than the last-level cache; bytes = read + write.
           On a CPU dst.add_(src) instead (bytes = 2 reads + 1 write): a CPU copy_ pays a hidden
           read of dst before writing it, so counting read + write would understate the bandwidth.
  matmul   a square GEMM per dtype: 2·n³ flops.
On a GPU with triton.testing.do_bench (CUDA events, L2 flushed before every rep, median); on the
CPU the fastest of several perf_counter runs after a warm-up (other jobs on a shared CPU only slow
runs down, so the fastest is the best estimate of what the machine can do).

Work models (what "TFLOP/s" and "GB/s" count; per matrix, k = long side, r = short side): each
flatten method's own, `Method.flops` in isoloco_kernels.flatten.METHODS, per GEMM dtype:
  svd      8·k·r² + 20·r³ in fp64   (exact.svd_flops: thin R-SVD plus Q = U·Vᵀ)
  eigh     4·k·r² + 11·r³ in fp64   (exact.eigh_flops: Gram, Q, eigensolver, V Σ⁻¹ Vᵀ)
  polar    T'·(4·k·r² + 2·r³) in the compute dtype, T' steps (polar.polar_flops); polar_bf16 runs
           all but the last BF16_FP32_STEPS of them in bf16
  gram     4·k·r² + (8·T + 5)·r³ in fp64 (gram.gram_flops)
  the torch.linalg.svd baselines: svd's model in the compute dtype (fp32).
  bytes    compulsory traffic only: a flatten reads Δ and writes the result (2 × its size); a
           Nesterov step reads p, buf, u and writes p, buf (5 × the params' size).
The other suites, each in its module's docstring: a merge of K stacks reads the K and writes one
((K + 1) × one stack's size, its SVDs not modelled); a captured set is flattened like a synthetic
one (the registry's flops, 2 × its size); fast's routes count the route they run (fast_gram.py's
direct_work / fast.fast_work, the svd model for torch's baselines); the distributed step counts the
bytes handed to its collectives plus its rank's Nesterov and flatten traffic, and that rank's flatten
flops; a whole IsoLoCo.step (test_bench_step.py) is modelled like test_outer_step's.
The roofline time of a case is max(Σ flops / matmul ceiling of the dtype the GEMMs run in, bytes / copy bandwidth);
"frac_roofline" is that time over the measured median, "frac_matmul" and "frac_copy" the two
bounds alone over the median.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from typing import Callable, Sequence

import torch

MAX_ROUNDS = 200


# ----------------------------------------------------------------------------------------------
# devices and timing


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def host_syncs(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Host syncs of one fn() (CUDA: torch.cuda.set_sync_debug_mode's warnings, one per synchronizing
    call); None on the CPU."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def _best_time(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Fastest of `reps` runs of fn() after one warm-up (host clock, synced): a ceiling is what the
    machine can do, and on a shared machine other jobs only ever slow a run down."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _device_time(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of fn() on a GPU with device events, L2 flushed between reps."""
    try:
        from triton.testing import do_bench
    except ImportError:  # events by hand, no flush (inputs are far larger than L2 anyway)
        fn()
        torch.cuda.synchronize(device)
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)
    return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def measure_ceilings(device: torch.device | str, *, dry: bool = False) -> dict:
    """Copy bandwidth (GB/s) and matmul throughput (TFLOP/s per dtype) of `device`; dry: on a
    copy buffer 256× and matrices 16× smaller on a side (--bench-dry-run: cases checked in seconds)."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    out: dict = {"device": _device_name(device)}
    n_copy = (1 << 28) if gpu else (1 << 26)  # fp32 elements: 1 GiB on a GPU, 256 MiB on a CPU
    if dry:
        n_copy >>= 8
        out["dry_run"] = True
    src = torch.randn(n_copy, device=device)
    dst = torch.empty_like(src)
    if gpu:
        t = _device_time(lambda: dst.copy_(src), device)
        moved, out["copy_kind"] = 2 * src.nbytes, "dst.copy_(src): read + write"
    else:
        # A CPU copy_ also reads dst before writing it (read-for-ownership), which a byte count of
        # read + write misses; an in-place dst.add_(src) has no hidden traffic, like an optimizer.
        dst.copy_(src)
        t = _best_time(lambda: dst.add_(src), device, 9)
        moved, out["copy_kind"] = 3 * src.nbytes, "dst.add_(src): read dst, src + write dst"
    out["copy_GBps"] = moved / t / 1e9
    out["copy_bytes"] = moved
    src = dst = None  # free them before the matmuls (the lambdas above hold the names, not the tensors)

    plans = (
        [
            ("bf16", torch.bfloat16, 8192, False),
            ("fp32", torch.float32, 8192, False),
            ("tf32", torch.float32, 8192, True),
            ("fp64", torch.float64, 4096, False),
        ]
        if gpu
        else [("fp32", torch.float32, 2048, False), ("fp64", torch.float64, 1536, False)]
    )
    out["matmul_TFLOPs"], out["matmul_n"] = {}, {}
    for name, dt, n, tf32 in plans:
        n = n // 16 if dry else n
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)
        c = torch.empty(n, n, device=device, dtype=dt)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            fn = lambda: torch.mm(a, b, out=c)  # noqa: E731
            t = _device_time(fn, device) if gpu else _best_time(fn, device, 5)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        out["matmul_TFLOPs"][name] = 2 * n**3 / t / 1e12
        out["matmul_n"][name] = n
        a = b = c = None
    if gpu:
        torch.cuda.empty_cache()
    else:
        out["threads"] = torch.get_num_threads()
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def run_timed(
    benchmark,
    target: Callable[[], object],
    setup: Callable[[], object],
    *,
    device: torch.device | str,
    seconds: float,
    first_s: float,
    may_compile: bool,
) -> float | None:
    """Time `target` with pytest-benchmark; `setup` (untimed) restores inputs before each round.

    `first_s` is the time of an untimed run already made. Returns the median in seconds, or None
    when benchmarking is disabled (--benchmark-disable runs target once, untimed).
    """

    def _setup():
        setup()
        sync(device)

    est = first_s
    if may_compile and first_s > seconds / 4:  # the first run may have included a JIT compile
        _setup()
        t0 = time.perf_counter()
        target()
        est = time.perf_counter() - t0
    rounds = max(1, min(MAX_ROUNDS, math.ceil(seconds / max(est, 1e-6))))

    benchmark.pedantic(target, setup=_setup, rounds=rounds, warmup_rounds=0, iterations=1)
    return median(benchmark)


def median(benchmark) -> float | None:
    """The median of a case timed with benchmark.pedantic; None when benchmarking is disabled."""
    return None if benchmark.stats is None else benchmark.stats.stats.median


# ----------------------------------------------------------------------------------------------
# work models


#: The short dtype names of the cases and of the matmul ceilings.
NAMED_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dt: name for name, dt in NAMED_DTYPES.items()}


def _svd_loop_(buckets):
    for b in buckets:
        for x in b:
            u, s, vh = torch.linalg.svd(x, full_matrices=False)
            x.copy_((u * s.mean()) @ vh)


def _svd_batched_(buckets):
    for b in buckets:
        u, s, vh = torch.linalg.svd(b, full_matrices=False)
        b.copy_((u * s.mean(-1)[:, None, None]) @ vh)


def _linalg_polar_(buckets):
    for b in buckets:
        tall = b.shape[-2] >= b.shape[-1]
        q, _ = torch.linalg.polar(b if tall else b.mT)  # batched; m ≥ n only
        q = q if tall else q.mT
        sbar = (b * q).sum((-2, -1), keepdim=True) / min(b.shape[-2:])
        b.copy_(q * sbar)


#: The torch baselines of the flatten benchmarks, in place on a list of [B, m, n] buckets: torch.linalg.svd
#: per matrix (the published code's way) and batched, then (U·mean σ)·Vᵀ; torch.linalg.polar (torch ≥ 2.14;
#: LAPACK / cuSOLVER's SVD inside) where torch has it, then s̄ = ⟨Δ, Q⟩ / min(m, n). Work: the svd model.
BASELINE_FNS = {"svd-loop": _svd_loop_, "svd-batched": _svd_batched_}
if hasattr(torch.linalg, "polar"):
    BASELINE_FNS["linalg-polar"] = _linalg_polar_
BASELINES = tuple(BASELINE_FNS)


def roofline(flops: dict[str, float] | None, nbytes: float, ceilings: dict) -> dict:
    """The case's roofline time: max(Σ flops[dt] / matmul ceiling[dt], bytes / copy bandwidth).

    flops maps a GEMM dtype ("fp32", "bf16", "fp64", …) to the flops done in it; None when the
    method's work is not modelled (then only the bandwidth bound counts)."""
    t_flop = 0.0
    for dt, f in (flops or {}).items():
        peak = ceilings["matmul_TFLOPs"].get(dt)
        if dt in ("tf32x3", "tf32x2"):  # three (two) TF32 GEMMs per product; float32 where there is no TF32
            tf32 = ceilings["matmul_TFLOPs"].get("tf32")
            peak = tf32 / int(dt[-1]) if tf32 else ceilings["matmul_TFLOPs"].get("fp32")
        if peak is None:  # no ceiling measured for this dtype here: the bound is left out
            continue
        t_flop += f / (peak * 1e12)
    t_byte = nbytes / (ceilings["copy_GBps"] * 1e9)
    return {"roofline_s": max(t_flop, t_byte), "roofline_flop_s": t_flop, "roofline_byte_s": t_byte}


def rates(median_s: float | None, flops: dict[str, float] | None, nbytes: float, roof: dict) -> dict:
    """Achieved rates of a case with median `median_s` seconds and its fractions of the ceilings."""
    if not median_s:
        return {}
    out = {
        "median_s": median_s,
        "GBps": nbytes / median_s / 1e9,
        "frac_copy": roof["roofline_byte_s"] / median_s,
        "frac_roofline": roof["roofline_s"] / median_s,
    }
    if flops:
        out["TFLOPs"] = sum(flops.values()) / median_s / 1e12
        out["frac_matmul"] = roof["roofline_flop_s"] / median_s
    return out


def roofline_and_rates(median_s: float | None, flops: dict[str, float] | None, nbytes: float, ceilings: dict) -> dict:
    """A case's roofline (`roofline`) and, when it was timed, its rates (`rates`): the fields of its record."""
    roof = roofline(flops, nbytes, ceilings)
    return {**roof, **rates(median_s, flops, nbytes, roof)}


def resolved_methods(impl: str, shapes, device) -> list[str]:
    """The method each [B, m, n] bucket runs: isoloco methods ask flatten.resolve_method (which
    looks at shape and device only; a zero-stride stand-in avoids allocating), others are
    themselves (the baselines)."""
    from isoloco_kernels.flatten import registry as flatten

    if impl not in flatten.METHODS:
        return [impl] * len(shapes)
    one = torch.empty(1, device=device)
    return [flatten.resolve_method(impl, one.expand(b, m, n)) for b, m, n in shapes]


resolved_backends = resolved_methods  # the old name (bench/test_bench_optim.py)


def fallback_recorders(resolved: Sequence[str]) -> dict:
    """{recorder name: (Recorder, the method its flagged matrices go to)} of every residual-checked
    method these methods reach, their fallbacks included (registry: Method.stats, Method.fallback)."""
    from isoloco_kernels.flatten import registry as flatten

    out, todo, seen = {}, list(resolved), set()
    while todo:
        name = todo.pop()
        m = flatten.METHODS.get(name)
        if name in seen or m is None:
            continue
        seen.add(name)
        if m.stats is not None:
            out.setdefault(m.stats.name, (m.stats, m.fallback))
            todo.append(m.fallback)
    return out


def recorder_names() -> list[str]:
    """The names of every residual-checked method's statistics (the *_fallbacks fields)."""
    from isoloco_kernels.flatten import registry as flatten

    return sorted({m.stats.name for m in flatten.METHODS.values() if m.stats is not None})


def flatten_work(resolved: Sequence[str], shapes, dtype: str) -> dict[str, float] | None:
    """Modelled flops per GEMM dtype of flattening `shapes` with these methods (the registry's
    models; None where one is not modelled)."""
    from isoloco_kernels.flatten import exact
    from isoloco_kernels.flatten import registry as flatten
    from isoloco_kernels.reference import compute_dtype

    cd = DTYPE_NAMES[compute_dtype(NAMED_DTYPES[dtype])]
    out: dict[str, float] = {}
    for r, (b, m, n) in zip(resolved, shapes):
        k, s = max(m, n), min(m, n)
        work = {cd: exact.svd_flops(k, s)} if r in BASELINES else flatten.flops_per_dtype(r, k, s, cd)
        if work is None:
            return None
        for dt, f in work.items():
            out[dt] = out.get(dt, 0.0) + b * f
    return out


# ----------------------------------------------------------------------------------------------
# error and memory


def rel_fro(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(aggregate ‖out − ref‖_F / ‖ref‖_F over all pairs, largest per-pair relative error), float64.

    A NaN anywhere makes both NaN (never passes as small)."""
    num = den = 0.0
    worst = 0.0
    for o, r in zip(outs, refs):
        o64 = o.detach().to("cpu", torch.float64)
        r64 = r.detach().to("cpu", torch.float64)
        d = (o64 - r64).norm().item() ** 2
        n = r64.norm().item() ** 2
        num, den = num + d, den + n
        e = math.sqrt(d / n) if n > 0 else math.sqrt(d)
        worst = e if (e != e or e > worst) else worst
    agg = math.sqrt(num / den) if den > 0 else math.sqrt(num)
    return agg, worst


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
        return True
    except OSError:
        return False


def peak_extra_memory(fn: Callable[[], object], device: torch.device | str) -> tuple[float, dict]:
    """Run fn() once; returns (seconds, {"peak_extra_bytes", "mem_method"}).

    GPU: torch.cuda.max_memory_allocated() during the call minus memory_allocated() before — exact
    for the caching allocator's live tensors. CPU: peak RSS (VmHWM, reset through
    /proc/self/clear_refs) minus RSS before — an estimate: freed heap pages that the allocator keeps
    are not counted again, and other threads' allocations are. None where /proc is not writable.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        t = time.perf_counter() - t0
        extra = torch.cuda.max_memory_allocated(device) - base
        return t, {"peak_extra_bytes": float(extra), "mem_method": "cuda max_memory_allocated"}
    ok = _reset_peak_rss()
    rss0 = _proc_status_kb("VmRSS")
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    hwm = _proc_status_kb("VmHWM")
    if not ok or rss0 is None or hwm is None:
        return t, {"peak_extra_bytes": None, "mem_method": "unavailable (/proc/self/clear_refs)"}
    return t, {"peak_extra_bytes": float(max(hwm - rss0, 0) * 1024), "mem_method": "cpu peak RSS estimate"}


def describe(benchmark, kind: str, impl: str, set_name: str, spec, device, dtype: str, **extra) -> None:
    """What one benchmark case measured, in its JSON record (read by bench/report.py)."""
    benchmark.extra_info.update(
        kind=kind, impl=impl, set=set_name, set_note=spec.note, device=device.type, dtype=dtype, **extra
    )
