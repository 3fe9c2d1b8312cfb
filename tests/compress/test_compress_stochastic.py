"""Stochastic rounding (rounding="stochastic", the blockwise formats): unbiased within a bound derived from the
draws' own variance, deterministic in (seed, step, tensor, element) and nothing else (not torch's global RNG),
each worker's stream its own and every rank's draws the same; refused for the statistical formats."""

from __future__ import annotations

import math

import pytest
import torch

from isoloco_kernels.compress import FORMATS, Compression, compress, dequantize, quantize
from isoloco_kernels.compress.reference import levels_ref
from isoloco_kernels.distributed.sharded import UPDATE_STREAM, stream_spec


def _x(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, n, dtype=torch.float64)).float()


def _neighbours(x: torch.Tensor, scale: torch.Tensor, fmt):
    """(lo, hi) levels around |x|/s, times s (float64): the two values a draw can take (signed as x)."""
    grid = torch.tensor(levels_ref(fmt), dtype=torch.float64)
    a = (x.double().abs() / torch.where(scale > 0, scale, 1)).clamp(max=fmt.vmax)
    k = (torch.searchsorted(grid, a, right=True) - 1).clamp(max=len(grid) - 2)
    lo, hi = grid[k] * scale, grid[k + 1] * scale
    return lo * x.sign(), hi * x.sign(), a


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_mean_of_many_draws_is_x_within_five_standard_errors(fmt):
    """Each draw of entry i is lo_i or hi_i (its two neighbouring grid values), hi_i with probability
    p_i = (|x_i| − lo_i)/(hi_i − lo_i): mean x_i, variance V_i = p_i(1 − p_i)(hi_i − lo_i)². Over N steps (each step
    its own bits) and n entries, Z = Σ_t Σ_i (d_ti − x_i) / sqrt(N·Σ_i V_i) has mean 0 and variance 1 and, a sum of
    n·N independent bounded terms, is normal to good accuracy: |Z| ≤ 5 fails with probability 6e-7 when unbiased.
    A bias of b·(hi − lo) on every entry moves Z by about b·sqrt(nN)·(hi − lo)/sqrt(V̄). Per entry the mean is within
    5 of its own standard errors where N·p_i(1 − p_i) ≥ 25 (the normal regime), which round to nearest fails on
    most such entries."""
    n, N = 2048, 200
    x = _x(n, seed=7)
    s = Compression(fmt, 128, "stochastic", seed=3)
    scale = quantize(x, s).scales.double().repeat_interleave(128)[:n]
    lo, hi, _ = _neighbours(x, scale, s.fmt)
    p = torch.where(hi != lo, (x.double() - lo) / (hi - lo), 0.0).clamp(0, 1)
    var = p * (1 - p) * (hi - lo) ** 2
    tol = 2.0**-22 * hi.abs() + 1e-9 * scale
    total = torch.zeros(n, dtype=torch.float64)
    for t in range(N):
        d = dequantize(quantize(x, s, step=t, tensor_id=4), torch.float64)
        assert bool((((d - lo).abs() <= tol) | ((d - hi).abs() <= tol)).all())  # a neighbour (float32's product)
        total += d - x.double()
    z = total.sum() / math.sqrt(N * var.sum())
    assert abs(z) <= 5, z
    normal = N * p * (1 - p) >= 25
    assert int(normal.sum()) > n // 4
    se = (var / N).sqrt()
    assert bool(((total / N).abs()[normal] <= 5 * se[normal] + tol[normal]).all())
    near = dequantize(quantize(x, Compression(fmt, 128)), torch.float64) - x.double()
    assert float((near.abs()[normal] > 5 * se[normal]).float().mean()) > 0.3  # nearest's per-entry bias is seen


def test_draws_depend_on_seed_step_tensor_and_element_only():
    """Not on torch's global RNG, the process, or what else was quantized: a fixed function of its inputs, so two
    ranks (or a resumed run) draw the same bits."""
    x = _x(1000, seed=1)
    s = Compression("int2", 64, "stochastic", seed=11)
    torch.manual_seed(0)
    a = quantize(x, s, step=5, tensor_id=2)
    torch.manual_seed(12345)
    torch.rand(1000)
    quantize(_x(77, seed=2), s, step=5, tensor_id=2)
    b = quantize(x, s, step=5, tensor_id=2)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    for other in (
        quantize(x, Compression("int2", 64, "stochastic", seed=12), step=5, tensor_id=2),
        quantize(x, s, step=6, tensor_id=2),
        quantize(x, s, step=5, tensor_id=3),
    ):
        assert not torch.equal(a.codes, other.codes)
    pa, ea = compress(x, None, Compression("int4", 64, "stochastic", 0.9, seed=11), step=5, tensor_id=2)
    pb, eb = compress(x, None, Compression("int4", 64, "stochastic", 0.9, seed=11), step=5, tensor_id=2)
    assert torch.equal(pa.codes, pb.codes) and torch.equal(ea, eb)


def test_each_worker_draws_its_own_stream_and_every_rank_the_same():
    """The routes' streams (distributed/sharded.py `stream_spec`): worker k's Δ draws with the spec's seed mixed
    with stream k + 1, the owner's update with stream 0. The same stream gives the same spec on every rank, so
    the bits of a (stream, step, tensor, element) are one number everywhere; different workers' streams are
    independent (their rounding errors do not line up and average out in the mean of K payloads)."""
    s = Compression("int2", 64, "stochastic", seed=9)
    specs = [stream_spec(s, k) for k in range(6)]
    assert stream_spec(s, 3) == specs[3] and specs[UPDATE_STREAM] == stream_spec(s, 0)
    assert len({sp.seed for sp in specs}) == 6
    x = _x(4096, seed=3)
    draws = [dequantize(quantize(x, sp, step=1, tensor_id=0)) for sp in specs[1:4]]
    lo, hi, _ = _neighbours(x, quantize(x, s).scales.double().repeat_interleave(64)[:4096], s.fmt)
    split = (hi - lo).abs() > 0
    agree = [(draws[i] == draws[j])[split].float().mean().item() for i, j in ((0, 1), (0, 2), (1, 2))]
    p = ((x.double() - lo) / (hi - lo))[split].clamp(0, 1)
    want = float((p * p + (1 - p) * (1 - p)).mean())  # independent draws agree this often
    assert all(abs(a - want) < 0.03 for a in agree), (agree, want)


@pytest.mark.parametrize("fmt", ["stat2", "stat4"])
def test_the_statistical_formats_refuse_stochastic_rounding(fmt):
    with pytest.raises(ValueError, match="round to the nearest bin only"):
        Compression(fmt, rounding="stochastic")
