"""compress/feedback.py: error feedback over several steps, all-or-nothing refusals, stochastic
rounding's statistics and reproducibility, chunks drawing the whole tensor's bits, decompress_add_."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from isoloco_kernels import ResultOverflowError
from isoloco_kernels.compress import (
    FORMATS,
    Compression,
    backend_for,
    compress,
    decompress_add_,
    dequantize,
    parse,
    quantize,
)
from isoloco_kernels.compress.reference import error_feedback_ref, levels_ref

RES_DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.float32, torch.bfloat16)]


def _delta(n: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, n, dtype=torch.float64)).to(dtype)


# ----------------------------------------------------------------------------------------------
# error feedback


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_residual_carries_exactly_what_was_not_sent(fmt, rounding):
    """β = 1, float32 residual: after T steps Σ sent + e_T = Σ Δ up to float32 rounding of the sums."""
    s = Compression(fmt, 32, rounding, ef_beta=1.0)
    n, T = 300, 6
    e, sent, total = None, torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for t in range(T):
        d = _delta(n, seed=t)
        p, e = compress(d, e, s, step=t, tensor_id=3)
        sent += dequantize(p, torch.float64)
        total += d.double()
        assert e.dtype == torch.float32 and e.shape == d.shape
    gap = (sent + e.double() - total).abs().max().item()
    assert gap <= 4 * T * 2.0**-24 * total.abs().max().item(), gap


@pytest.mark.parametrize("param_dtype,res_dtype", RES_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", ["int8", "fp4", "int2"])
def test_feedback_matches_the_float64_reference_step_by_step(fmt, param_dtype, res_dtype):
    """Each step against error_feedback_ref on the same (Δ, e): the payload's levels, and e' = β·(v − c)
    rounded once to the residual dtype (a level may differ only where float32's v or y crossed a
    decision point; then the residual differs by about one step there)."""
    s = Compression(fmt, 64, ef_beta=0.9, residual_dtype=res_dtype)
    rdt = res_dtype or param_dtype
    e = None
    for t in range(4):
        d = _delta(333, param_dtype, seed=10 + t)
        p, e_new = compress(d, e, s, step=t, tensor_id=1)
        lv, sc, sent, e_ref = error_feedback_ref(d, e, s, t, 1)
        assert e_new.dtype == rdt
        deq = dequantize(p, torch.float64)
        flipped = (deq - sent).abs() > 1e-6 * sent.abs().max()
        assert int(flipped.sum()) <= 2
        ok = ~flipped
        # float32's roundings of v = Δ + e and of c = level·s (relative to |v|), then e's own rounding
        v64 = d.double() + (0 if e is None else e.double())
        # (float16's subnormals: an absolute spacing of tiny·eps)
        fi = torch.finfo(rdt)
        tol = (2.0**-23 * (v64.abs() + sent.abs()) + 2 * fi.eps * e_ref.abs() + fi.tiny * fi.eps)[ok]
        assert bool(((e_new.double()[ok] - e_ref[ok]).abs() <= tol).all())
        e = e_new


def test_beta_decays_and_off_keeps_nothing():
    d = _delta(256, seed=1)
    p_off, e_off = compress(d, None, Compression("int4", 64), step=0, tensor_id=0)
    assert e_off is None
    assert torch.equal(p_off.codes, quantize(d, Compression("int4", 64)).codes)
    with pytest.raises(ValueError, match="error feedback is off"):
        compress(d, torch.zeros(256), Compression("int4", 64), step=0, tensor_id=0)
    s1, s5 = Compression("int4", 64, ef_beta=1.0), Compression("int4", 64, ef_beta=0.5)
    _, e1 = compress(d, None, s1, step=0, tensor_id=0)
    _, e5 = compress(d, None, s5, step=0, tensor_id=0)
    assert torch.equal(e5, 0.5 * e1)  # β·(v − c): scaling by 0.5 is exact
    # the residual's dtype: the spec's, else Δ's; a residual of another dtype or shape is refused
    _, eb = compress(d.bfloat16(), None, s1, step=0, tensor_id=0)
    assert eb.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="residual must be torch.float32"):
        compress(d, torch.zeros(256, dtype=torch.bfloat16), s1, step=0, tensor_id=0)
    with pytest.raises(ValueError, match="must match"):
        compress(d, torch.zeros(255), s1, step=0, tensor_id=0)


@pytest.mark.parametrize("feedback", ["workers", "owner"])
def test_a_leg_without_feedback_sends_the_plain_payload_and_keeps_nothing(feedback):
    """spec.leg(...) of the leg a placement leaves out compresses as the spec without ef_beta: the same bytes
    as quantize, no residual, a residual handed in refused; the leg with feedback runs it as "both" does."""
    d = _delta(300, seed=8)
    spec = Compression("int2", 32, "stochastic", ef_beta=0.9, residual_dtype=torch.bfloat16, feedback=feedback)
    off = spec.leg("owner" if feedback == "workers" else "workers")
    p, e = compress(d, None, off, step=2, tensor_id=5)
    q = quantize(d, Compression("int2", 32, "stochastic"), step=2, tensor_id=5)
    assert e is None and torch.equal(p.codes, q.codes) and torch.equal(p.scales, q.scales)
    with pytest.raises(ValueError, match="error feedback is off"):
        compress(d, torch.zeros(300, dtype=torch.bfloat16), off, step=2, tensor_id=5)
    both = Compression("int2", 32, "stochastic", ef_beta=0.9, residual_dtype=torch.bfloat16, feedback="both")
    p1, e1 = compress(d, None, spec.leg(feedback), step=2, tensor_id=5)
    p2, e2 = compress(d, None, both, step=2, tensor_id=5)
    assert torch.equal(p1.codes, p2.codes) and e1.dtype == torch.bfloat16 and torch.equal(e1, e2)


def test_zero_block_residual_keeps_the_unsent_values():
    s = Compression("int8", 32, ef_beta=1.0)
    d = torch.randn(96)
    d[32:64] = 1e-40  # absmax / 127 underflows float32's normals: the block is sent as zeros
    p, e = compress(d, None, s, step=0, tensor_id=0)
    assert p.scales[1] == 0 and torch.equal(dequantize(p)[32:64], torch.zeros(32))
    assert torch.equal(e[32:64], d[32:64])


# ----------------------------------------------------------------------------------------------
# all or nothing


@pytest.mark.parametrize("where", ["delta-nan", "delta-inf", "residual-nan", "residual-inf", "overflow"])
def test_non_finite_input_is_refused_naming_the_tensor_and_nothing_changes(where):
    s = Compression("int4", 32, ef_beta=0.9)
    d, e = _delta(100, seed=2), _delta(100, seed=3)
    if where.startswith("delta"):
        d[17] = math.nan if where.endswith("nan") else math.inf
        msg = "Δ contains " + ("NaN" if where.endswith("nan") else "Inf")
    elif where.startswith("residual"):
        e[5] = math.nan if where.endswith("nan") else -math.inf
        msg = "residual contains " + ("NaN" if where.endswith("nan") else "Inf")
    else:
        d[0], e[0] = 3e38, 3e38
        msg = "overflows"
    d0, e0 = d.clone(), e.clone()
    with pytest.raises(ValueError, match=f"compress: layers.3.w: .*{msg}.*nothing was quantized or written"):
        compress(d, e, s, step=0, tensor_id=7, name="layers.3.w")
    assert torch.equal(d.nan_to_num(), d0.nan_to_num()) and torch.equal(e.nan_to_num(), e0.nan_to_num())
    with pytest.raises(ValueError, match="tensor 7"):
        compress(d, e, s, step=0, tensor_id=7)


def test_bad_calls_are_refused():
    d = torch.randn(10)
    s = Compression("int8", 32)
    for kw, err in [
        (dict(step=-1, tensor_id=0), ValueError),
        (dict(step=0, tensor_id=2**32), ValueError),
        (dict(step=0.5, tensor_id=0), TypeError),
        (dict(step=0, tensor_id=0, first_block=-1), ValueError),
    ]:
        with pytest.raises(err):
            compress(d, None, s, **kw)
    with pytest.raises(TypeError):
        compress(d.long(), None, s, step=0, tensor_id=0)
    with pytest.raises(TypeError):
        compress(d, None, "int8", step=0, tensor_id=0)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_empty_and_one_entry_tensors(fmt):
    s = Compression(fmt, 32, "stochastic", ef_beta=0.95)
    p, e = compress(torch.empty(0, 3), None, s, step=0, tensor_id=0)
    assert p.nbytes == 0 and e.shape == (0, 3)
    p, e = compress(torch.tensor([-0.3]), None, s, step=0, tensor_id=0)
    assert p.nbytes == 5 and torch.equal(dequantize(p), torch.tensor([-0.3]))  # absmax → ±vmax: exact
    assert torch.equal(e, torch.zeros(1))


# ----------------------------------------------------------------------------------------------
# stochastic rounding


def _neighbour_gap(x: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """(hi − lo)·s: the spacing of the two levels around each |x| / s."""
    grid = torch.tensor(levels_ref(fmt), dtype=torch.float64)
    a = (x.abs() / scale).clamp(max=fmt.vmax)
    k = (torch.searchsorted(grid, a, right=True) - 1).clamp(max=len(grid) - 2)
    return (grid[k + 1] - grid[k]) * scale


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stochastic_rounding_is_unbiased(fmt):
    """The mean over N steps' draws is within Hoeffding's bound of x for every entry: each draw lies
    in [lo, hi], so P(|mean − x| ≥ t) ≤ 2·exp(−2N t² / (hi − lo)²); t is set for a 1e-6 chance of any
    of the n entries failing. Nearest rounding (the same data) fails the same bound: the test sees bias."""
    n, N, delta = 512, 400, 1e-6
    x = _delta(n, seed=5).double()
    s = Compression(fmt, 128, "stochastic")
    draws = torch.stack([dequantize(quantize(x, s, step=t, tensor_id=2), torch.float64) for t in range(N)])
    scale = quantize(x, s).scales.double().repeat_interleave(128)  # the scales do not depend on the draw
    gap = _neighbour_gap(x, scale, s.fmt)
    bound = gap * math.sqrt(math.log(2 * n / delta) / (2 * N)) + 1e-6 * scale
    assert bool(((draws.mean(0) - x).abs() <= bound).all())
    near = dequantize(quantize(x, Compression(fmt, 128)), torch.float64)
    assert not bool(((near - x).abs() <= bound).all())
    # each draw is one of the two neighbours
    assert bool(((draws - x).abs() <= gap * (1 + 1e-6)).all())


def test_stochastic_bits_are_reproducible_and_independent_of_the_chunking():
    """The same (seed, step, tensor, block) draws the same bits whatever else runs, and a chunk that
    starts at block b (first_block=b), as one rank of a sharded step would quantize it, gets the whole
    tensor's bytes for its blocks."""
    s = Compression("int2", 32, "stochastic")
    x = _delta(32 * 10 + 7, seed=6)
    whole = quantize(x, s, step=4, tensor_id=11)
    again = quantize(x, s, step=4, tensor_id=11)
    assert torch.equal(whole.codes, again.codes)
    assert not torch.equal(whole.codes, quantize(x, s, step=5, tensor_id=11).codes)
    assert not torch.equal(whole.codes, quantize(x, s, step=4, tensor_id=12).codes)
    assert not torch.equal(whole.codes, quantize(x, Compression("int2", 32, "stochastic", seed=1), step=4).codes)
    per_block = 32 * 2 // 8
    for b0, b1 in [(0, 3), (3, 7), (7, 11)]:
        part = quantize(x[32 * b0 : 32 * b1], s, step=4, tensor_id=11, first_block=b0)
        assert torch.equal(part.codes, whole.codes[per_block * b0 : per_block * b0 + part.codes.numel()])
        assert torch.equal(part.scales, whole.scales[b0:b1])


# ----------------------------------------------------------------------------------------------
# decompress_add_


@pytest.mark.parametrize("acc_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", ["fp4", "stat4"])
def test_decompress_add_sums_in_float32_and_rounds_once(fmt, acc_dtype):
    s = Compression(fmt, 64)
    workers = [quantize(_delta(200, seed=20 + k), s) for k in range(3)]
    acc = torch.zeros(10, 20, dtype=acc_dtype)
    want = torch.zeros(200, dtype=torch.float64 if acc_dtype == torch.float64 else torch.float32)
    for p in workers:
        assert decompress_add_(acc, p) is acc
        want = (want + dequantize(p, want.dtype)).to(acc_dtype).to(want.dtype)
    assert torch.equal(acc.flatten().to(want.dtype), want)
    with pytest.raises(ValueError, match="200 entries"):
        decompress_add_(torch.zeros(199), workers[0])
    with pytest.raises(ValueError, match="contiguous"):
        decompress_add_(torch.zeros(20, 10).t(), workers[0])
    with pytest.raises(ValueError, match="payload is on cpu, acc on meta"):
        decompress_add_(torch.zeros(200, device="meta"), workers[0])


def test_the_torch_path_serves_cpu():
    assert backend_for(torch.zeros(3)) == ("torch", "the torch path serves CPU tensors")


_FMAX = torch.finfo(torch.float32).max


@pytest.mark.parametrize(
    "spec, delta",
    [
        # a float16 residual of a large Δ: 2-bit levels leave errors of ~1e5, past float16's 65504
        (dataclasses.replace(parse("int2:128:0.9"), residual_dtype=torch.float16), 2e5 * torch.randn(256)),
        # Δ at float32's largest values: Δ − c overflows float32 itself
        (parse("int8:128:0.9"), torch.tensor([_FMAX, -_FMAX, 1.0, 0.5] * 32)),
    ],
    ids=["float16-residual", "float32-max"],
)
def test_a_residual_that_does_not_fit_is_refused_not_kept(spec, delta):
    """A step that would keep a non-finite residual is refused, naming the tensor, and returns nothing to keep:
    before, it was accepted and every later step refused the residual it had kept."""
    with pytest.raises(ResultOverflowError, match=r"compress: w\.0: the error-feedback residual .* does not fit"):
        compress(delta, None, spec, step=0, tensor_id=0, name="w.0")
