"""The five merges on whole models' 2-D weights, K workers each: ours beside a per-matrix loop.

One case = (implementation, merge, bucket set, K, device). Implementations:
  loop     the official IsoLoCo code's way: for every weight, its K deltas in a Python loop of
           torch.linalg.svd per worker (tsv, iso_cts), per-worker topk / randperm masks (ties,
           dare), then the same combination; in the input dtype on the device
  batched  isoloco_kernels.merge on the list of [K, *shape] stacks (batched SVDs per bucket, the
           library's flatten for every polar factor, one fused pass for ties / dare)
Each case records its error against merges/reference.py (float64) on the first stack of each shape
and the bytes one rank sends in a sharded outer step of this merge, against an all-reduce's and an
all-gather's (isoloco_kernels.distributed is not yet routing merges: the all-to-all route's
bytes are modelled, ~one copy of the parameters per rank).
Roofline (harness.roofline, the ceilings of the same run): compulsory bytes only, every merge reads
its K stacks and writes one merged weight, (K + 1) × one worker's bytes, whatever it computes in
between; the SVDs and polar factors of iso_c, tsv and iso_cts are not modelled, so their fraction
is of the bandwidth bound alone (a merge far from it may still be compute-bound).
The CPU runs the small sets (ref-tiny, and llama-tiny at K 4); a GPU every set up to llama-178m.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import isoloco_kernels as ik
from bench import harness
from bench.shapes import SETS, decoder_weight_shapes
from isoloco_kernels.merges.reference import merge_ref

MERGES = ("mean", "iso_c", "tsv", "iso_cts", "ties", "dare")
ERROR_SANITY = 0.05  # garbage (one worker's Δ, zeros) gives ~1


def _stacks(set_name: str, K: int, device, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = decoder_weight_shapes(SETS[set_name])
    return [torch.randn(K, *s, generator=g, dtype=dtype).to(device) / math.sqrt(max(s)) for _, s in shapes]


def _polar(a: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(a, full_matrices=False)
    return u @ vh


def _loop_one(x: torch.Tensor, method: str) -> torch.Tensor:
    """One weight's merge as the official code computes it (per worker, per matrix)."""
    K = x.shape[0]
    if method == "mean":
        return x.mean(0)
    if method == "iso_c":
        u, s, vh = torch.linalg.svd(x.mean(0), full_matrices=False)
        return (u * s.mean()) @ vh
    r = min(x.shape[1:])
    if method == "tsv":
        k = max(1, r // K)
        parts = [torch.linalg.svd(d / K, full_matrices=False) for d in x]
        u = torch.cat([p[0][:, :k] for p in parts], 1)
        s = torch.cat([p[1][:k] for p in parts])
        v = torch.cat([p[2][:k].mT for p in parts], 1)
        return (_polar(u) * s) @ _polar(v).mT
    if method == "iso_cts":
        from isoloco_kernels.merges.reference import task_share

        c, t = task_share(r, K, 0.8)
        xs = x / K
        u, s, vh = torch.linalg.svd(xs.sum(0), full_matrices=False)
        us, ss, vs = [u[:, :c]], [s[:c]], [vh[:c].mT]
        for d in xs:
            ut, st, vt = torch.linalg.svd(d - us[0] @ (us[0].mT @ d), full_matrices=False)
            us.append(ut[:, :t])
            ss.append(st[:t])
            vs.append(vt[:t].mT)
        return torch.cat(ss).mean() * (_polar(torch.cat(us, 1)) @ _polar(torch.cat(vs, 1)).mT)
    pruned = []
    for d in x:
        n = d.numel()
        k = max(1, int(0.9 * n))
        idx = torch.topk(d.abs().flatten(), k).indices if method == "ties" else torch.randperm(n, device=d.device)[:k]
        mask = torch.zeros(n, dtype=torch.bool, device=d.device)
        mask[idx] = True
        pruned.append(d * mask.view_as(d) / (0.9 if method == "dare" else 1.0))
    st = torch.stack(pruned)
    if method == "dare":
        return st.mean(0)
    agree = torch.sign(st) == torch.sign(st.sum(0))
    return (st * agree).sum(0) / agree.sum(0).clamp_min(1)


CASES = [("ref-tiny", 4, "cpu"), ("ref-tiny", 8, "cpu"), ("llama-tiny", 4, "cpu"), ("llama-178m", 8, "cuda")]
CASES.append(("dry-tiny", 4, "cpu"))  # --bench-dry-run's (bench/conftest.py); no other mode runs it


@pytest.mark.parametrize("impl", ["loop", "batched"])
@pytest.mark.parametrize("method", MERGES)
@pytest.mark.parametrize("set_name,K,device", CASES, indirect=["device"])
def test_merge(benchmark, impl, method, set_name, K, device, bench_seconds, ceilings):
    stacks = _stacks(set_name, K, device)

    def run():
        if impl == "batched":
            return ik.merge(stacks, method)
        return [_loop_one(x, method) for x in stacks]

    benchmark.group = f"merge {method} {set_name} K{K} {device.type}"
    t0 = time.perf_counter()
    out = run()  # untimed warm-up; sets the rounds
    if device.type == "cuda":
        torch.cuda.synchronize()
    rounds = max(1, min(20, math.ceil(bench_seconds / max(time.perf_counter() - t0, 1e-6))))
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=0)
    seen, errs = set(), []
    for j, (x, o) in enumerate(zip(stacks, out)):
        if x.shape in seen:
            continue
        seen.add(x.shape)
        if method == "dare" and impl == "loop":
            continue  # another random draw than the reference's: compared by statistics in tests/
        ref = merge_ref(x.cpu(), method, stack=j)
        errs.append(float((o.cpu().double() - ref).norm() / ref.norm()))
    numel = sum(x[0].numel() for x in stacks) * 4
    world = K  # one worker per rank
    nbytes = float((K + 1) * numel)  # read the K stacks, write the merged weights
    benchmark.extra_info.update(
        kind="merge",
        device=device.type,
        dtype="fp32",
        set=set_name,
        K=K,
        method=method,
        impl=impl,
        matrices=len(stacks),
        err_max=max(errs) if errs else None,
        bytes_per_rank_all_reduce=2 * numel * (world - 1) / world,
        bytes_per_rank_all_gather=numel * (world - 1),
        bytes_per_rank_all_to_all_model=numel * (world - 1) / world + numel * (world - 1) / world,
        bytes=nbytes,
        flops=None,
        **harness.roofline_and_rates(harness.median(benchmark), None, nbytes, ceilings(device)),
    )
    assert not errs or max(errs) <= ERROR_SANITY, f"{impl} {method}: error {max(errs):.3g}"
