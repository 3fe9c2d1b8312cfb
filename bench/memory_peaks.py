"""Measured peak extra memory of iso_merge_ per method (and of IsoLoCo.step), beside the model.

One untimed call per (set, method): buckets of the set's 2-D weights (fp32, random, scaled like a
pseudo-gradient) on the device, `torch.cuda.reset_peak_memory_stats`, the call, then
`max_memory_allocated` minus what was allocated before it. The wall time of that single call is
recorded too (one cold call, not a benchmark). Cases run in the order given until `--seconds`
runs out; each finished case is printed and appended to `--json` at once, so a run stopped at its
time budget keeps what it measured. bench/memory_model.py gives the modelled numbers printed beside.

    python bench/memory_peaks.py --device cuda --json peaks.json
    python bench/memory_peaks.py --device cpu --sets ref-tiny      # the dry run: CPU, MemTracker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.memory_model import GIB, model  # noqa: E402
from bench.shapes import SETS, bucket_shapes, decoder_weight_shapes  # noqa: E402

#: (case, set, method) in the order they run: llama-1b with the GPU methods (seconds each), the
#: step on it, then the 8B set (tens of seconds each; eigh and svd take minutes there: modelled
#: only), and eigh on llama-1b last (svd: cuSOLVER's SVD loops per matrix for minutes).
PLAN = (
    *(("merge", "llama-1b", m) for m in ("auto", "gram", "polar", "polar_bf16", "fast")),
    ("step", "llama-1b", "auto"),
    *(("merge", "llama-8b", m) for m in ("auto", "gram", "polar", "polar_bf16")),
    ("merge", "llama-1b", "eigh"),
)


def _buckets(spec_name: str, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = bucket_shapes([s for _, s in decoder_weight_shapes(SETS[spec_name])])
    return [torch.randn(b, m, n, generator=gen, device=device).mul_(1e-3) for b, m, n in shapes]


class _Peak:
    """Peak bytes allocated beside what existed at entry: CUDA's allocator stats, or MemTracker on the CPU."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            self.mt = MemTracker()
            self.mt.__enter__()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self.t0
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.seconds = time.perf_counter() - self.t0
            self.mt.__exit__(*exc)
            snap = self.mt.get_tracker_snapshot("peak")
            self.bytes = sum(v for per in snap.values() for k, v in per.items() if k == "Total")
        return False


def merge_peak(spec_name: str, method: str, device) -> dict:
    import isoloco_kernels as ik

    xs = _buckets(spec_name, device)
    with _Peak(torch.device(device)) as pk:
        ik.iso_merge_(xs, method=method)
    del xs
    return _record("iso_merge_", spec_name, method, device, pk, lambda m: m["iso_merge_"])


def step_peak(spec_name: str, method: str, device) -> dict:
    """IsoLoCo.step's second step (the bucket buffers and momentum exist: what a training run sees)."""
    import isoloco_kernels as ik

    xs = _buckets(spec_name, device)
    params = [torch.zeros(x.shape[1:], device=device) for x in xs for _ in range(x.shape[0])]
    opt = ik.IsoLoCo(params, lr=1.8, momentum=0.8, method=method)
    for p, g in zip(params, (g for x in xs for g in x.unbind(0))):
        p.grad = g
    opt.step()
    with _Peak(torch.device(device)) as pk:
        opt.step()
    # the buffers exist already: the model's step less the grads
    return _record("IsoLoCo.step (2nd)", spec_name, method, device, pk, lambda m: m["IsoLoCo.step"] - m["grads"])


def _record(case: str, spec_name: str, method: str, device, pk: _Peak, modelled) -> dict:
    """One finished case: its measured peak and time beside `modelled(the model's numbers)` bytes."""
    m = _modelled(spec_name, method, device)
    return {
        "case": case,
        "set": spec_name,
        "method": method,
        "peak_gib": pk.bytes / GIB,
        "model_gib": modelled(m) / GIB,
        "grads_gib": m["grads"] / GIB,
        "seconds": pk.seconds,
    }


def _modelled(spec_name: str, method: str, device) -> dict:
    """bench/memory_model.py's numbers at the current workspace; "auto" as the larger of what it
    resolves to (on a GPU gram or polar per shape, on the CPU eigh or svd)."""
    from isoloco_kernels.flatten.registry import workspace_bytes

    auto = ("gram", "polar") if torch.device(device).type == "cuda" else ("eigh", "svd")
    names = auto if method == "auto" else (method,)
    runs = [model(spec_name, n, workspace_bytes()) for n in names]
    return {k: max(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sets", default=None, help="comma-separated sets (default: PLAN's cases)")
    ap.add_argument("--methods", default=None, help="comma-separated methods (default: PLAN's cases)")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="start no case after this")
    ap.add_argument("--json", default=None, help="append one JSON object per finished case")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    cases = [({"merge": merge_peak, "step": step_peak}[c], s, m) for c, s, m in PLAN]
    if args.sets or args.methods:
        sets = args.sets.split(",") if args.sets else ["llama-1b", "llama-8b"]
        methods = args.methods.split(",") if args.methods else ["auto", "gram", "polar"]
        cases = [(merge_peak, s, m) for s in sets for m in methods] + [(step_peak, sets[0], methods[0])]
    print("| case | set | method | 2-D grads GiB | peak extra GiB | modelled GiB | one call s |")
    print("|---|---|---|---:|---:|---:|---:|")
    for fn, s, m in cases:
        if time.perf_counter() - t0 > args.seconds:
            print(f"stopped at the time budget before {fn.__name__} {s} {m}")
            break
        try:
            r = fn(s, m, args.device)
        except torch.OutOfMemoryError as e:  # the finding itself: record it and go on
            r = {"case": fn.__name__, "set": s, "method": m, "error": f"out of memory: {str(e)[:200]}"}
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        if "error" in r:
            print(f"| {r['case']} | {s} | {m} | | {r['error']} | | |")
        else:
            print(
                f"| {r['case']} | {s} | {m} | {r['grads_gib']:.2f} | {r['peak_gib']:.2f} | "
                f"{r['model_gib']:.2f} | {r['seconds']:.2f} |",
                flush=True,
            )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
