"""The bounds a step records instead of reading a tensor again, tested as bounds.

`outer.collect` takes a held momentum buffer's largest entry from the bound recorded when this
optimizer last wrote it (`momentum._trusted_bound`, `_record_bounds`), and the Nesterov update takes
an Iso-C result's from `momentum.iso_bound`; both decide whether a write can overflow without
reading the tensor. A bound below the true largest entry lets an overflow through (`inf` written
into a momentum buffer where a ResultOverflowError with nothing written is due), so: every recorded
bound is ≥ the true largest entry, step after step, for float32, bfloat16 and float16 params (with
constant-sign grads the buffers grow as fast as they can and the bounds are tight), and an update
that overflows a buffer whose bound was recorded raises ResultOverflowError with nothing written.
"""

from __future__ import annotations

import math

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels._validate import ResultOverflowError, compute_dtype
from isoloco_kernels.flatten import registry as flatten
from isoloco_kernels.outer import core as momentum
from isoloco_kernels.outer.core import Entry

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
METHODS = [m for m in flatten.METHODS if m != "auto"]
SHAPES = ((9,), (1, 1), (1, 7), (6, 10), (9, 4))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _constant_sign_grads(ps, step: int, scale: float = 1.0) -> None:
    """Positive grads, entries in [0.5, 1]·scale, the first entry of each exactly `scale` (so the
    buffers' largest entries grow along a known element as fast as constant-sign grads allow)."""
    g = _gen(100 + step)
    for p in ps:
        t = (0.5 + 0.5 * torch.rand(p.shape, generator=g)) * scale
        t.view(-1)[0] = scale
        p.grad = t.to(p.dtype)


def _bound(opt, p) -> tuple[float, float]:
    """(the bound recorded on p's momentum buffer, its true largest entry)."""
    buf = opt.state[p]["momentum_buffer"]
    b = momentum._trusted_bound(opt, buf)
    assert b is not None, "the step recorded no bound on a buffer it wrote"
    return b, float(buf.abs().max())


@pytest.mark.parametrize("iso", [False, True], ids=["sgd", "iso"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_recorded_buffer_bound_is_at_least_the_largest_entry(dtype, iso):
    ps = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    opt = ik.IsoLoCo(ps, lr=0.5, momentum=0.9, iso=iso)
    for step in range(8):
        _constant_sign_grads(ps, step)
        opt.step()
        for p in ps:
            bound, true = _bound(opt, p)
            assert bound >= true, f"step {step}, {tuple(p.shape)} {dtype}: bound {bound} < largest entry {true}"
            if p.ndim == 1 or not iso:
                # the grad's own bound (its exact largest entry): tight, within the slack per step
                assert bound <= true * 1.01 ** (step + 1) * 1.001, (step, p.shape, bound, true)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_bound_stands_in_only_for_the_buffer_it_was_recorded_on(dtype):
    """Written elsewhere since (in place, or replaced), a buffer has no trusted bound."""
    p = torch.zeros(5, dtype=dtype)
    opt = ik.IsoLoCo([p], lr=0.5, momentum=0.9)
    _constant_sign_grads([p], 0)
    opt.step()
    buf = opt.state[p]["momentum_buffer"]
    assert momentum._trusted_bound(opt, buf) is not None
    buf.mul_(100)
    assert momentum._trusted_bound(opt, buf) is None
    opt.state[p]["momentum_buffer"] = buf.clone()
    assert momentum._trusted_bound(opt, opt.state[p]["momentum_buffer"]) is None


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _matrices():
    """Matrices whose Iso-C result reaches as far towards its bound as the shapes allow: a 1 × 1
    (iso(Δ) = Δ), rows and columns (iso(Δ) = Δ), a Hadamard matrix (every σ equal), constant-sign
    and random ones, one of them rank-deficient."""
    g = _gen(7)
    yield "1x1", torch.full((1, 1), -3.0)
    yield "row", torch.rand(1, 9, generator=g) + 0.5
    yield "column", -(torch.rand(7, 1, generator=g) + 0.5)
    yield "hadamard", 2.0 * _hadamard(8)
    yield "constant-sign", torch.rand(6, 10, generator=g) + 0.5
    yield "random", torch.randn(10, 6, generator=g)
    yield "rank-1", torch.randn(8, 1, generator=g) @ torch.randn(1, 5, generator=g)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_iso_c_bound_is_at_least_the_results_largest_entry(dtype, method):
    import warnings

    for name, x in _matrices():
        x = x.to(dtype)
        e = Entry(0, 0, x, x, {"iso": True}, name, amax_g=float(x.abs().max()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallbacks of the iterative methods
            out = ik.iso_flatten(x, method=method)
        bound, true = momentum.iso_bound(e), float(out.abs().max())
        assert bound >= true, f"{name} {dtype} {method}: iso_bound {bound} < largest entry {true}"
        if name in ("1x1", "row", "column"):
            assert bound <= 2.0 * math.sqrt(x.numel()) * e.amax_g  # the bound's own formula, no looser


def _overflow_setup(dtype: torch.dtype):
    """A vector param and its momentum buffer in the dtype the buffer may overflow: float32 (the
    compute dtype of float32 and bfloat16 params) or, for a float16 param, float16 (a buffer in the
    param's own dtype, which the optimizer accepts and keeps)."""
    p = torch.zeros(6, dtype=dtype)
    bdt = torch.float16 if dtype == torch.float16 else torch.float32
    opt = ik.IsoLoCo([p], lr=1e-30 if bdt == torch.float32 else 1e-6, momentum=0.9)
    if bdt != compute_dtype(dtype):
        opt.state[p]["momentum_buffer"] = torch.zeros(6, dtype=bdt)
    # μ = 0.9 with constant grads G: the buffer tends to 10·G; G = max/8 overflows it after ~16 steps
    return p, opt, torch.finfo(bdt).max / 8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_overflow_through_a_recorded_bound_raises_with_nothing_written(dtype):
    p, opt, big = _overflow_setup(dtype)
    for step in range(40):
        p.grad = torch.full_like(p, big)
        buf = opt.state[p].get("momentum_buffer")
        trusted = buf is not None and momentum._trusted_bound(opt, buf) is not None
        before = (p.clone(), None if buf is None else buf.clone())
        try:
            opt.step()
        except ResultOverflowError as e:
            assert "overflows the momentum buffer" in str(e) and "nothing was written" in str(e), str(e)
            assert trusted, "the overflowing step did not go through a recorded bound"
            assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["momentum_buffer"], before[1])
            assert step >= 10, f"raised at step {step}, before the buffer could overflow"
            return
        buf = opt.state[p]["momentum_buffer"]
        assert bool(torch.isfinite(buf).all()), f"step {step}: inf written into the momentum buffer"
        bound, true = _bound(opt, p)
        assert bound >= true, f"step {step}: bound {bound} < largest entry {true}"
    pytest.fail("the buffer never overflowed")
