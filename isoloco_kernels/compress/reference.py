"""The compression contract in float64: the truth tests compare the torch path and the kernels to.

Written to be obviously right, not fast: the grid is the explicit list of levels of the format
(`levels_ref`), rounding picks between the two neighbours of |y| in that list, the random bits are
Python integer arithmetic. For one flat tensor x and a spec (compress/spec.py):

    per block of `block` entries:  s = float32(absmax / vmax), 0 if below 2^-126
    y = x / s (float64); a = min(|y|, vmax); lo ≤ a ≤ hi the neighbouring non-negative levels
    nearest:     the closer one; on a tie the one at an even position in the level list
    stochastic:  hi when u < (a − lo)/(hi − lo), u = (bits >> 8)·2^-24, bits = random_bits_ref(...)
    level = sign(y)·(lo or hi); value = level·s

Error feedback: v = Δ + e; c = value(v); e ← β·(v − c).
Tracking (feedback "ef21"): v = Δ − β·g; c = value(v); g ← β·g + c.

Statistical formats (`stat_quantize_ref`), per block of m entries, in Python integers and floats (a Python
int / int is correctly rounded, as float64 division of the exactly converted integers is):

    a = max|x|; a < 2^-126: codes 0, table 0.   E = max(frexp(a)[1], −125)
    y = ldexp(x, 24 − E); q = int(y) (toward zero); S1 = Σ q, S2 = Σ q²
    μ = S1 / m; σ = sqrt(max(float(S2) / m − μ·μ, 0)); edges μ + σ·k·(2j − NB)/NB, j = 1 … NB − 1
    code = how many edges y is at or above; centroid = Σ q of the bin / its count, or (empty bin) the
    midpoint μ + σ·k·(2c + 1 − NB)/NB clamped to [min q, max q]; table = float32(ldexp(centroid, E − 24))
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Optional

import numpy as np
import torch

from .spec import Compression, Format

__all__ = [
    "mix32_ref",
    "random_bits_ref",
    "levels_ref",
    "quantize_ref",
    "dequantize_ref",
    "stat_quantize_ref",
    "stat_dequantize_ref",
    "error_feedback_ref",
    "tracking_ref",
]

_M32 = 0xFFFFFFFF


def mix32_ref(x: int) -> int:
    """lowbias32 on a Python int in [0, 2^32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def random_bits_ref(seed: int, step: int, tensor_id: int, index: int) -> int:
    """The 32 random bits of entry `index` of tensor `tensor_id` at `step`."""
    ka = mix32_ref(mix32_ref(mix32_ref(seed ^ 0x243F6A88) ^ step) ^ tensor_id)
    kb = mix32_ref(ka ^ 0x9E3779B9)
    lo, hi = index % 2**32, index // 2**32
    return mix32_ref(mix32_ref(lo ^ ka) ^ ((kb + hi) % 2**32))


def levels_ref(fmt: Format) -> list[float]:
    """The format's non-negative levels, ascending (the grid is these and their negatives)."""
    if not fmt.is_float:
        return [float(k) for k in range(int(fmt.vmax) + 1)]
    sub = [k * 2.0 ** (fmt.emin - fmt.mant) for k in range(1 << fmt.mant)]
    normal = []
    e = fmt.emin
    while True:
        for m in range(1 << fmt.mant):
            v = (1 + m / (1 << fmt.mant)) * 2.0**e
            if v > fmt.vmax:
                return sub + normal
            normal.append(v)
        e += 1


def quantize_ref(
    x: torch.Tensor,
    spec: Compression,
    step: int = 0,
    tensor_id: int = 0,
    first_block: int = 0,
    y_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(levels float64 [n], scales float64 [nb]) of the flattened x: value i = levels[i]·scales[i // block].

    y_dtype=torch.float32 rounds y = x / s to float32 (as the float32 compute path does; every later
    step is exact there), so that path must then agree level for level."""
    fmt, B = spec.fmt, spec.block
    rnd = np.float32 if y_dtype == torch.float32 else float
    xs = x.detach().to("cpu", torch.float64).flatten().tolist()
    grid = levels_ref(fmt)
    levels, scales = [], []
    for b0 in range(0, len(xs), B):
        chunk = xs[b0 : b0 + B]
        s = float(torch.tensor(max(abs(t) for t in chunk) / fmt.vmax, dtype=torch.float32))
        s = 0.0 if s < 2.0**-126 else s
        scales.append(s)
        for i, t in enumerate(chunk):
            y = float(rnd(t / s)) if s > 0 else 0.0
            a = min(abs(y), fmt.vmax)
            k = bisect.bisect_right(grid, a) - 1  # grid[k] ≤ a < grid[k + 1]
            if grid[k] == a:
                q = a
            else:
                lo, hi = grid[k], grid[k + 1]
                if spec.rounding == "nearest":
                    up = a - lo > hi - a or (a - lo == hi - a and k % 2 == 1)
                else:
                    bits = random_bits_ref(spec.seed, step, tensor_id, first_block * B + b0 + i)
                    up = (bits >> 8) * 2.0**-24 < (a - lo) / (hi - lo)
                q = hi if up else lo
            levels.append(-q if y < 0 else q)
    return torch.tensor(levels, dtype=torch.float64), torch.tensor(scales, dtype=torch.float64)


def dequantize_ref(levels: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """level·scale per entry, float64 (exact)."""
    return levels * scales.repeat_interleave(block)[: levels.numel()]


def stat_quantize_ref(x: torch.Tensor, spec: Compression) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int64 [n], table float64 [nb, bins], float32 values) of the flattened x in the statistical format
    of `spec` (module docstring): value i = table[i // block, codes[i]]."""
    B, bins, ks = spec.block, spec.fmt.bins, round(spec.sigmas * 16)
    xs = x.detach().to("cpu", torch.float64).flatten().tolist()
    codes, tables = [], []
    for b0 in range(0, len(xs), B):
        chunk = xs[b0 : b0 + B]
        m = len(chunk)
        a = max(abs(t) for t in chunk)
        if a < 2.0**-126:
            codes += [0] * m
            tables.append([0.0] * bins)
            continue
        e = max(math.frexp(a)[1], -125)
        y = [math.ldexp(t, 24 - e) for t in chunk]
        q = [int(t) for t in y]
        mu = sum(q) / m
        sd = math.sqrt(max(float(sum(t * t for t in q)) / m - mu * mu, 0.0))
        edges = [mu + sd * (ks * (2 * j - bins) / (16 * bins)) for j in range(1, bins)]
        cs = [sum(t >= edge for edge in edges) for t in y]
        table = []
        for c in range(bins):
            members = [qi for qi, ci in zip(q, cs) if ci == c]
            if members:
                centroid = sum(members) / len(members)
            else:
                centroid = min(max(mu + sd * (ks * (2 * c + 1 - bins) / (16 * bins)), min(q)), max(q))
            table.append(float(np.float32(math.ldexp(centroid, e - 24))))
        codes += cs
        tables.append(table)
    return torch.tensor(codes, dtype=torch.int64), torch.tensor(tables, dtype=torch.float64).view(-1, bins)


def stat_dequantize_ref(codes: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """table[i // block, codes[i]] per entry, float64 (exact)."""
    rows = torch.arange(codes.numel()) // block
    return table[rows, codes]


def error_feedback_ref(
    delta: torch.Tensor,
    residual: Optional[torch.Tensor],
    spec: Compression,
    step: int = 0,
    tensor_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(levels, scales, sent values, new residual) in float64: v = Δ + e, c = Q(v), e ← β·(v − c). For a
    statistical format: (codes, centroid tables, sent values, new residual)."""
    v = delta.detach().to("cpu", torch.float64).flatten()
    if residual is not None:
        v = v + residual.detach().to("cpu", torch.float64).flatten()
    if not all(math.isfinite(t) for t in v.tolist()):
        raise ValueError("error_feedback_ref: Δ + e is not finite")
    if spec.is_stat:
        levels, scales = stat_quantize_ref(v, spec)
        sent = stat_dequantize_ref(levels, scales, spec.block)
    else:
        levels, scales = quantize_ref(v, spec, step, tensor_id)
        sent = dequantize_ref(levels, scales, spec.block)
    new = None if spec.ef_beta is None else spec.ef_beta * (v - sent)
    return levels, scales, sent, new


def tracking_ref(
    delta: torch.Tensor,
    estimate: Optional[torch.Tensor],
    spec: Compression,
    step: int = 0,
    tensor_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sent values, new estimate) in float64 of tracking (feedback "ef21"): v = Δ − β·g, c = Q(v) without
    feedback, g ← β·g + c."""
    g = torch.zeros(delta.numel(), dtype=torch.float64)
    if estimate is not None:
        g = estimate.detach().to("cpu", torch.float64).flatten()
    v = delta.detach().to("cpu", torch.float64).flatten() - spec.ef_beta * g
    plain = dataclasses.replace(spec, ef_beta=None, residual_dtype=None, feedback="workers")
    sent = error_feedback_ref(v, None, plain, step, tensor_id)[2]
    return sent, spec.ef_beta * g + sent
