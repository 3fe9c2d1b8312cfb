"""Paper estimate: the Iso-C flatten of whole bucket sets on one H200, "gram" against "polar".

    python bench/gram_estimate.py            # prints the markdown tables of bench/results/gram.md

Per bucket [B, m, n] (r = short side, k = long side), the FLOP models of the method registry
(isoloco_kernels.flatten.METHODS, which bench/harness.py reads too):
    polar   T'·(4kr² + 2r³) float32 FLOPs, T' = polar.STEPS (GEMMs at full float32 precision)
    gram    4kr² + (8T + 5)·r³ float64 FLOPs, T = gram.STEPS (isoloco_kernels.flatten.gram.gram_flops)
and the bytes each moves through memory at least:
    polar   per step X is read twice (X·Xᵀ and B·X) and written once, plus ⟨Δ, Q⟩ and the write:
            (3T' + 3)·|bucket in float32|
    gram    amax pass, A₀ pass, Q pass (read) and the write: 4·|bucket|, plus the float64 Y matrices
            (B·r²·8, written once, read once)
Time = max(FLOPs / rate, bytes / bandwidth) per bucket, summed. Rates: see `H200`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shapes import SETS, bucket_shapes, decoder_weight_shapes  # noqa: E402
from isoloco_kernels.flatten import gram, polar
from isoloco_kernels.flatten import registry as flatten  # noqa: E402

# (value, source). Source words: "data sheet" = NVIDIA's H200 SXM data sheet; "assumed" = not
# measured here (no GPU was available for this estimate).
H200 = {
    "fp64": (67e12, "data sheet (FP64 Tensor Core)"),
    "fp32": (67e12, "data sheet (FP32, no TF32)"),
    "bw": (4.3e12, "assumed: ≈ 90 % of the data sheet's 4.8 TB/s HBM3e"),
}


def bucket_cost(b: int, m: int, n: int, method: str, itemsize: int = 4) -> tuple[float, float, str]:
    """(FLOPs, bytes, GEMM dtype) of flattening one [b, m, n] float32 bucket with `method`."""
    r, k = min(m, n), max(m, n)
    size = b * m * n * itemsize
    nbytes = {"polar": (3 * polar.STEPS + 3) * size, "gram": 4 * size + 2 * b * r * r * 8}
    if method not in nbytes:
        raise ValueError(method)
    ((dt, flops),) = flatten.flops_per_dtype(method, k, r, "fp32").items()
    return b * flops, nbytes[method], dt


def set_rows(name: str) -> tuple[list[tuple], dict]:
    spec = SETS[name]
    shapes = bucket_shapes(s for _, s in decoder_weight_shapes(spec))
    rows, tot = [], {"polar": [0.0, 0.0, 0.0], "gram": [0.0, 0.0, 0.0], "auto": 0.0}
    for b, m, n in shapes:
        cells = []
        times = {}
        for meth in ("polar", "gram"):
            f, by, dt = bucket_cost(b, m, n, meth)
            t = max(f / H200[dt][0], by / H200["bw"][0])
            times[meth] = t
            tot[meth][0] += f
            tot[meth][1] += by
            tot[meth][2] += t
            cells += [f / 1e12, by / 1e9, t * 1e3]
        pick = "gram" if flatten.gram_beats_polar(m, n, flatten.FP64_RATE[(9, 0)]) else "polar"
        tot["auto"] += times[pick]
        rows.append((f"{b}×{m}×{n}", *cells, pick))
    return rows, tot


def main() -> None:
    print("| input | value | source |\n|---|---|---|")
    for key, label in (("fp64", "float64 GEMM rate"), ("fp32", "float32 GEMM rate"), ("bw", "memory bandwidth")):
        v, src = H200[key]
        unit = "TB/s" if key == "bw" else "TFLOP/s"
        print(f"| {label} | {v / 1e12:g} {unit} | {src} |")
    print(f"| polar steps T' | {polar.STEPS} | isoloco_kernels.flatten.polar (float32) |")
    print(f"| gram steps T | {gram.STEPS} | isoloco_kernels.flatten.gram (float64, ℓ₀ = {gram.ELL:g}) |")
    print()
    for name in ("llama-178m", "llama-1b"):
        rows, tot = set_rows(name)
        print(f"### {name}\n")
        print("| bucket | polar TFLOP | polar GB | polar ms | gram TFLOP | gram GB | gram ms | auto (H200) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]:.3g} | {r[2]:.3g} | {r[3]:.3g} | {r[4]:.3g} | {r[5]:.3g} | {r[6]:.3g} | {r[7]} |")
        p, g = tot["polar"], tot["gram"]
        print(
            f"| **total** | {p[0] / 1e12:.3g} | {p[1] / 1e9:.3g} | {p[2] * 1e3:.3g} | {g[0] / 1e12:.3g} | "
            f"{g[1] / 1e9:.3g} | {g[2] * 1e3:.3g} | auto {tot['auto'] * 1e3:.3g} ms |"
        )
        print(f"\npolar / gram time: {p[2] / g[2]:.2f}×; polar / auto: {p[2] / tot['auto']:.2f}×\n")


if __name__ == "__main__":
    main()
