"""Peak extra memory of the flatten and of the outer step, per method, modelled on the CPU.

Two parts:

- `fit`: measure each flatten method's peak scratch with torch's MemTracker (every tensor the
  method allocates, CPU or CUDA) on a set of small wide, tall and square batches of random
  Gaussians (which send some matrices down each method's fallback), and fit bytes = a·r·k + b·r²
  per matrix (r ≤ k its sides), raised by the fit's worst under-estimate and 20 %: the
  coefficients of `isoloco_kernels.flatten.registry.WORKSPACE_MODEL` (`--fit` prints them).
- `model`: from a bucket set's shapes (bench/shapes.py), the modelled peak extra memory of
  `iso_merge_` and of `IsoLoCo.step` per method, with the flatten in slices of
  `buckets.workspace_bytes()` and without (the whole bucket at once, as before slicing).

    python bench/memory_model.py                  # the table for llama-1b and llama-8b, fp32 grads
    python bench/memory_model.py --fit            # re-measure the coefficients on this machine

What is modelled (fp32 grads; bytes):
    iso_merge_      every bucket but the last slice of the largest is copied aside, plus one
                    slice's scratch:  Σ buckets − last slice + max_bucket slice scratch
    IsoLoCo.step    the bucket buffers (the 2-D grads in their compute dtype, kept between steps)
                    plus one slice's scratch; the momentum buffers are state, not counted
The GPU run checks the model against torch.cuda.max_memory_allocated (bench/memory_peaks.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.shapes import SETS, bucket_shapes, decoder_weight_shapes  # noqa: E402
from isoloco_kernels.flatten import registry as buckets  # noqa: E402

GIB = float(1 << 30)
#: The methods the model covers (every registry method with a row; "auto" resolves to one).
METHODS = ("svd", "eigh", "polar", "polar_bf16", "polar_tf32x3", "gram", "fast")
#: modelled too: "auto" as it resolves per bucket on an H200 (gram where flatten.gram_beats_polar says so, else
#: polar, whose fallback is gram: the larger of the two)
MODEL_METHODS = METHODS + ("auto",)
FIT_SHAPES = (
    (3, 64, 512),
    (3, 128, 128),
    (3, 96, 384),
    (3, 256, 64),
    (3, 200, 210),
    (1, 8, 1000),
    (4, 40, 40),
    (3, 100, 100),
    (2, 60, 60),
    (2, 300, 30),
)


def measured_peak(x: torch.Tensor, method: str) -> int:
    """Peak bytes the flatten of x (in place) allocates beside x (MemTracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from isoloco_kernels.flatten.registry import iso_flatten_impl

    mt = MemTracker()
    with mt:
        iso_flatten_impl(x, method)
    return sum(v for per in mt.get_tracker_snapshot("peak").values() for k, v in per.items() if k == "Total")


def fit(dtype: torch.dtype, seeds: int = 3) -> dict[str, tuple[float, float]]:
    """(a, b) per method for `dtype` (see the module docstring)."""
    out = {}
    for method in METHODS:
        rows = []
        for b, m, n in FIT_SHAPES:
            r, k = min(m, n), max(m, n)
            peak = max(
                measured_peak(torch.randn(b, m, n, generator=torch.Generator().manual_seed(s)).to(dtype), method)
                for s in range(seeds)
            )
            rows.append((r * k, r * r, peak / b))
        a_mat = torch.tensor([[x, y] for x, y, _ in rows], dtype=torch.float64)
        y = torch.tensor([z for *_, z in rows], dtype=torch.float64)
        coef = torch.linalg.lstsq(a_mat, y[:, None]).solution.flatten().clamp_min(0)
        worst = max(z / max(float(coef[0]) * x + float(coef[1]) * w, 1.0) for x, w, z in rows)
        lift = 1.2 * max(worst, 1.0)
        out[method] = (round(float(coef[0]) * lift + 0.05, 1), round(float(coef[1]) * lift + 0.05, 1))
    return out


def model(spec_name: str, method: str, workspace: int | None, elem: int = 4) -> dict[str, float]:
    """Modelled peak extra bytes of iso_merge_ and IsoLoCo.step on a set's 2-D weights (fp32 grads:
    elem 4); workspace None: each bucket flattened whole."""
    dtype = torch.float32 if elem == 4 else torch.float64
    shapes = bucket_shapes([s for _, s in decoder_weight_shapes(SETS[spec_name])])
    sizes = [b * m * n * elem for b, m, n in shapes]
    grads = float(sum(sizes))

    def rows(b, m, n):
        if method == "auto":
            from isoloco_kernels.flatten import registry as flatten

            gram = buckets.method_workspace("gram", m, n, dtype)
            per = (
                gram
                if flatten.gram_beats_polar(m, n, 1.0)
                else max(gram, buckets.method_workspace("polar", m, n, dtype))
            )
        else:
            per = buckets.method_workspace(method, m, n, dtype)
        return b if workspace is None else max(1, min(b, workspace // per)), per

    scratch = 0.0
    for b, m, n in shapes:
        k, per = rows(b, m, n)
        scratch = max(scratch, float(k * per))
    big = max(range(len(shapes)), key=lambda i: sizes[i])
    b, m, n = shapes[big]
    k, _ = rows(b, m, n)
    last = ((b - 1) % k + 1) * m * n * elem  # the last slice, flattened in place
    return {"grads": grads, "iso_merge_": grads - last + scratch, "IsoLoCo.step": grads + scratch, "scratch": scratch}


def table(sets=("llama-1b", "llama-8b")) -> str:
    w = buckets.workspace_bytes()
    lines = [
        f"Modelled peak extra memory (GiB), fp32 grads; sliced: workspace {w / GIB:.0f} GiB "
        "(buckets.workspace_bytes()), whole: each bucket at once",
        "",
        "| set | 2-D grads | method | iso_merge_ sliced | iso_merge_ whole | IsoLoCo.step sliced | step whole "
        "| scratch sliced |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in sets:
        for method in MODEL_METHODS:
            s, whole = model(name, method, w), model(name, method, None)
            lines.append(
                f"| {name} | {s['grads'] / GIB:.1f} | {method} | {s['iso_merge_'] / GIB:.1f} | "
                f"{whole['iso_merge_'] / GIB:.1f} | {s['IsoLoCo.step'] / GIB:.1f} | "
                f"{whole['IsoLoCo.step'] / GIB:.1f} | {s['scratch'] / GIB:.2f} |"
            )
    lines += [
        "",
        "A single matrix whose scratch alone exceeds the workspace (llama-8b's 128256 × 4096 "
        "embedding and head) is flattened alone: its own scratch is the bound there.",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="measure the coefficients (MemTracker, CPU)")
    args = ap.parse_args()
    if args.fit:
        for dt in (torch.float32, torch.float64):
            print(dt, fit(dt))
        return
    print(table())


if __name__ == "__main__":
    main()
