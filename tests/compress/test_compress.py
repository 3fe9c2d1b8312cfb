"""compress/: the spec, its bytes, and the torch path's quantizer against the float64 reference
(compress/reference.py) — every format, both roundings, odd sizes, float32 / bfloat16 / float16 /
float64 inputs, zero blocks, the error bound, fp8 against torch.float8_e4m3fn, the random bits."""

from __future__ import annotations

import math

import pytest
import torch

from isoloco_kernels.compress import FORMATS, STAT_FORMATS, Compression, Packed, bytes_of, dequantize, parse, quantize
from isoloco_kernels.compress import codec as q
from isoloco_kernels.compress import spec as sp
from isoloco_kernels.compress.reference import levels_ref, quantize_ref, random_bits_ref

ROUNDINGS = ("nearest", "stochastic")
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SIZES = (0, 1, 31, 32, 33, 257, 1000)


def _x(n: int, dtype=torch.float32, seed: int = 0, zero_block: bool = True) -> torch.Tensor:
    """Fresh Gaussian entries whose magnitude varies over 6 decades along the tensor, and (when
    long enough) one all-zero block of 32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, max(n, 1), dtype=torch.float64)[:n]
    if zero_block and n >= 96:
        x[32:64] = 0
    return x.to(dtype)


def _levels(p: Packed) -> torch.Tensor:
    """The grid level of every entry of a Packed (float64)."""
    fmt = FORMATS[p.format]
    codes = q.unpack_codes(p.codes, fmt.bits, p.numel)
    return q.decode_table(fmt)[codes].double()


# ----------------------------------------------------------------------------------------------
# the spec


def test_spec_defaults_and_fields_are_checked():
    s = Compression()
    assert (s.format, s.block, s.rounding, s.ef_beta, s.residual_dtype, s.update) == (
        "int8",
        128,
        "nearest",
        None,
        None,
        "compressed",
    )
    bad = [
        (dict(format="int3"), ValueError, "format"),
        (dict(block=100), ValueError, "block"),
        (dict(block=512), ValueError, "block"),
        (dict(block=128.0), TypeError, "block"),
        (dict(block=True), TypeError, "block"),
        (dict(rounding="up"), ValueError, "rounding"),
        (dict(ef_beta=0.0), ValueError, "ef_beta"),
        (dict(ef_beta=1.5), ValueError, "ef_beta"),
        (dict(ef_beta=float("nan")), ValueError, "ef_beta"),
        (dict(ef_beta="0.9"), TypeError, "ef_beta"),
        (dict(ef_beta=True), TypeError, "ef_beta"),
        (dict(ef_beta=0.9, residual_dtype=torch.int8), ValueError, "residual_dtype"),
        (dict(residual_dtype=torch.bfloat16), ValueError, "error feedback is off"),
        (dict(update="bf16"), ValueError, "update"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**32), ValueError, "seed"),
        (
            dict(ef_beta=0.9, feedback="nowhere"),
            ValueError,
            r"feedback must be one of \['both', 'workers', 'owner', 'ef21'\]",
        ),
        (dict(ef_beta=0.9, feedback=None), ValueError, "feedback must be one of"),
        (dict(feedback="both"), ValueError, "feedback is set but ef_beta is None: error feedback is off"),
        (dict(feedback="owner"), ValueError, "feedback is set but ef_beta is None"),
        (dict(ef_beta=0.9, feedback="owner", update="full"), ValueError, "feedback='owner' with update='full'"),
    ]
    for kw, err, msg in bad:
        with pytest.raises(err, match=msg):
            Compression(**kw)
    assert Compression(ef_beta=1).ef_beta == 1.0 and isinstance(Compression(ef_beta=1).ef_beta, float)
    assert s.feedback == "workers" and Compression(ef_beta=0.9).feedback == "workers"  # each worker's Δ only
    assert Compression(feedback="workers").ef_beta is None  # the default placement with error feedback off
    assert Compression(ef_beta=0.9, feedback="both", update="full").update == "full"
    assert Compression(ef_beta=0.9, update="full").update == "full"
    with pytest.raises(Exception):
        s.block = 64  # frozen


def test_parse_reads_the_cli_string_and_round_trips():
    assert parse("int4:128:0.95") == Compression("int4", 128, ef_beta=0.95)
    assert parse("fp8") == Compression("fp8")
    assert parse("INT2:64:none:stochastic") == Compression("int2", 64, "stochastic")
    assert parse("fp4::0.9") == Compression("fp4", ef_beta=0.9)
    assert parse("int8:32", residual_dtype=None, update="full") == Compression("int8", 32, update="full")
    for s in (Compression("int2", 256, "stochastic", 0.95), Compression(), Compression("fp4", 32, ef_beta=1.0)):
        assert parse(s.cli()) == s
    for text, msg in [
        ("", "format"),
        ("int5:128", "format"),
        ("int4:12x", "block must be an int"),
        ("int4:128:abc", "beta"),
        ("int4:100", "block"),
        ("int4:128:2", "ef_beta"),
        ("int4:128:0.9:up", "rounding"),
        ("int4:128:0.9:nearest:x", "feedback must be one of"),
        ("int4:128:0.9:nearest:both:x", "at most 5"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse(text)


def test_parse_reads_the_feedback_placement_and_cli_round_trips_it():
    """The 5th field places error feedback; without it, the default "workers" (each worker's Δ only). cli()
    writes it (and the rounding, to keep the positions) only when it is not the default."""
    assert parse("int4:128:0.95") == Compression("int4", 128, ef_beta=0.95, feedback="workers")
    assert parse("int2:128:0.95:nearest:workers") == Compression("int2", 128, ef_beta=0.95)
    assert parse("int4:128:0.95:nearest:both") == Compression("int4", 128, ef_beta=0.95, feedback="both")
    assert parse("int4:64:0.9::OWNER") == Compression("int4", 64, ef_beta=0.9, feedback="owner")
    assert parse("fp8::0.9:stochastic:both") == Compression("fp8", rounding="stochastic", ef_beta=0.9, feedback="both")
    assert parse("int8:32:0.9", feedback="both") == Compression("int8", 32, ef_beta=0.9, feedback="both")
    assert Compression("int2", 128, ef_beta=0.95, feedback="both").cli() == "int2:128:0.95:nearest:both"
    assert Compression("int4", 128, "stochastic", 0.9, feedback="owner").cli() == "int4:128:0.9:stochastic:owner"
    assert Compression("int4", 128, ef_beta=0.95).cli() == "int4:128:0.95"  # the default "workers": no 5th field
    assert Compression("int4", 128, "stochastic", 0.95).cli() == "int4:128:0.95:stochastic"
    for fb in sp.FEEDBACKS:
        for rounding in ROUNDINGS:
            rdt = None if fb == "ef21" else torch.bfloat16  # tracking keeps its estimates in the compute dtype
            s = Compression("fp4", 32, rounding, 0.9, rdt, seed=4, feedback=fb)
            assert parse(s.cli(), residual_dtype=rdt, seed=4) == s, s.cli()
    for text, msg in [
        ("int4:128:none:nearest:both", "feedback is set but ef_beta is None"),
        ("int4:128::nearest:owner", "feedback is set but ef_beta is None"),
        ("int4:128:0.9:nearest:worker", "feedback must be one of"),
    ]:
        with pytest.raises(ValueError, match=f"compression spec '{text}': .*{msg}"):
            parse(text)
    with pytest.raises(ValueError, match="feedback='owner' with update='full'"):
        parse("int4:128:0.9:nearest:owner", update="full")


def test_each_leg_compresses_with_its_own_spec():
    """Compression.leg: the spec itself on a leg with feedback, else the spec without error feedback (no
    residual made or kept there); the seed, format, block, rounding and update leg stay."""
    both = Compression("int2", 64, "stochastic", 0.9, torch.bfloat16, seed=3, feedback="both")
    assert both.leg("workers") is both and both.leg("owner") is both
    plain = Compression("int2", 64, "stochastic", seed=3)
    assert plain.leg("workers") is plain and plain.leg("owner") is plain
    workers = Compression("int2", 64, "stochastic", 0.9, torch.bfloat16, seed=3)  # the default placement
    assert workers.feedback == "workers"
    owner = Compression("int2", 64, "stochastic", 0.9, torch.bfloat16, seed=3, feedback="owner")
    assert workers.leg("workers") is workers and workers.leg("owner") == plain
    assert owner.leg("owner") is owner and owner.leg("workers") == plain
    with pytest.raises(ValueError, match=r"leg must be one of \['workers', 'owner'\]"):
        both.leg("update")


# ----------------------------------------------------------------------------------------------
# bytes

#: Issue 46's targets: bytes of an fp32 all-reduce's, scales included.
TARGETS = {8: 0.27, 4: 0.14, 2: 0.08}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_defaults_meet_the_byte_targets(fmt):
    s = Compression(fmt)
    for n in (2**20, 4096 * 11008, 50257 * 768, 768):
        assert bytes_of(s, n) / (4 * n) <= TARGETS[s.bits], (fmt, n)
        for w in (2, 3, 8):
            assert sp.exchange_bytes(s, n, w) / sp.allreduce_bytes(n, w) <= TARGETS[s.bits]
    # the exact count: ceil(n·bits/8) code bytes + 4 per block
    assert [bytes_of(s, n) for n in (0, 1, 127, 128, 129)] == [
        0,
        1 + 4,
        math.ceil(127 * s.bits / 8) + 4,
        128 * s.bits // 8 + 4,
        math.ceil(129 * s.bits / 8) + 8,
    ]


def test_which_blocks_meet_the_targets():
    """Smaller blocks cost more scale bytes: the targets hold from block 64 (8- and 2-bit) and 128 (4-bit)."""
    n = 2**20
    ok = {
        (f, b)
        for f in FORMATS
        for b in sp.BLOCKS
        if bytes_of(Compression(f, b), n) / (4 * n) <= TARGETS[FORMATS[f].bits]
    }
    want = {(f, b) for f in FORMATS for b in sp.BLOCKS if b >= (128 if FORMATS[f].bits == 4 else 64)}
    assert ok == want


def test_update_leg_and_residual_memory():
    n = 1 << 16
    full = Compression("int4", update="full")
    assert sp.exchange_bytes(full, n, 4, torch.bfloat16) == 0.75 * (bytes_of(full, n) + 2 * n)
    assert sp.residual_bytes(Compression("int4"), n, torch.float32) == 0
    assert sp.residual_bytes(Compression("int4", ef_beta=0.9), n, torch.float32) == 4 * n
    assert sp.residual_bytes(Compression("int4", ef_beta=0.9, residual_dtype=torch.bfloat16), n, torch.float32) == 2 * n
    assert sp.allreduce_bytes(n, 1) == 0 and sp.allreduce_bytes(n, 2) == 4 * n
    # per leg: the owner's update residual is float32 (float64 for float64 params) unless residual_dtype says
    # otherwise, none with update="full"; a placement keeps none on the other leg
    for fb, (w, o) in {"both": (2 * n, 4 * n), "workers": (2 * n, 0), "owner": (0, 4 * n)}.items():
        spec = Compression("int4", ef_beta=0.9, feedback=fb)
        assert sp.residual_bytes(spec, n, torch.bfloat16) == w, fb
        assert sp.residual_bytes(spec, n, torch.bfloat16, leg="owner") == o, fb
    assert sp.residual_bytes(Compression("int4", ef_beta=0.9), n, torch.float32, leg="owner") == 0  # the default
    assert sp.residual_bytes(Compression("int4", ef_beta=0.9, feedback="both"), n, torch.float64, leg="owner") == 8 * n
    assert sp.residual_bytes(Compression("int4", ef_beta=0.9, update="full"), n, torch.float32, leg="owner") == 0
    both_full = Compression("int4", ef_beta=0.9, update="full", feedback="both")
    assert sp.residual_bytes(both_full, n, torch.float32, leg="owner") == 0
    bf16 = Compression("int4", ef_beta=0.9, residual_dtype=torch.bfloat16, feedback="owner")
    assert sp.residual_bytes(bf16, n, torch.float32, leg="owner") == 2 * n
    with pytest.raises(ValueError):
        bytes_of(Compression(), -1)


@pytest.mark.parametrize("fmt", list(FORMATS) + list(STAT_FORMATS))
@pytest.mark.parametrize("n", SIZES)
def test_payload_has_exactly_bytes_of_and_survives_the_wire(fmt, n):
    """ceil(n·bits/8) code bytes plus 4 a block per scale (a statistical format: its centroid table, 2^bits)."""
    s = Compression(fmt, 32)
    assert bytes_of(s, n) == math.ceil(n * s.bits / 8) + 4 * s.floats_per_block * math.ceil(n / 32)
    p = quantize(_x(n), s)
    assert p.nbytes == bytes_of(s, n) and p.codes.dtype == torch.uint8 and p.scales.dtype == torch.float32
    assert p.scales.numel() == s.floats_per_block * math.ceil(n / 32)
    buf = p.wire()
    assert buf.dtype == torch.uint8 and buf.numel() == bytes_of(s, n)
    back = Packed.from_wire(buf, s, n)
    assert torch.equal(back.codes, p.codes) and torch.equal(back.scales, p.scales)
    assert torch.equal(dequantize(back), dequantize(p))
    with pytest.raises(ValueError, match="bytes"):
        Packed.from_wire(torch.cat([buf, buf[:1]]) if n else torch.zeros(1, dtype=torch.uint8), s, n)


# ----------------------------------------------------------------------------------------------
# the torch path against the float64 reference


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_torch_path_matches_the_reference(fmt, rounding, dtype):
    """Level for level against the reference with y = x / s rounded as the compute dtype rounds it
    (every other step is exact), scales bit for bit, values within one float32 rounding."""
    s = Compression(fmt, 32, rounding)
    y_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for n in SIZES:
        x = _x(n, dtype, seed=n)
        p = quantize(x, s, step=5, tensor_id=9)
        lv, sc = quantize_ref(x, s, 5, 9, y_dtype=y_dtype)
        assert torch.equal(p.scales.double(), sc), (n, "scales")
        assert torch.equal(_levels(p), lv), (n, (_levels(p) != lv).nonzero()[:5])
        deq = dequantize(p, torch.float64)
        ref = lv * sc.repeat_interleave(32)[:n]
        assert torch.allclose(deq, ref, rtol=2.0**-23, atol=0), n
        assert dequantize(p, dtype).dtype == dtype


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_float64_contract_differs_only_at_decision_points(fmt, rounding):
    """Against the pure float64 contract (y not rounded) a level may differ only where float32's
    rounding of y moved it across a decision point: rare, and to the neighbouring level."""
    s = Compression(fmt, 64, rounding)
    x = _x(4000, seed=3)
    p = quantize(x, s, step=1)
    lv, sc = quantize_ref(x, s, 1)
    diff = (_levels(p) != lv).nonzero().flatten()
    assert diff.numel() <= 4, diff
    grid = torch.tensor(levels_ref(s.fmt))
    for i in diff.tolist():
        a, b = sorted((abs(_levels(p)[i].item()), abs(lv[i].item())))
        k = int((grid == a).nonzero())
        assert grid[k + 1] == b  # neighbours


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_nearest_error_is_at_most_half_a_step(fmt):
    """|x − deq(q(x))| ≤ ½·(step of the grid at x/s)·s, plus float32's rounding of the product."""
    s = Compression(fmt, 128)
    fmt_ = s.fmt
    x = _x(5000, seed=11).double()
    p = quantize(x.float(), s)
    deq = dequantize(p, torch.float64)
    scales = p.scales.double().repeat_interleave(128)[: x.numel()]
    a = (x.abs() / torch.where(scales > 0, scales, 1)).clamp(max=fmt_.vmax)
    if fmt_.is_float:
        e = torch.floor(torch.log2(a.clamp(min=1e-300))).clamp(min=fmt_.emin)
        step = 2.0 ** (e - fmt_.mant)
    else:
        step = torch.ones_like(a)
    bound = 0.5 * step * scales * (1 + 2.0**-20) + 2.0**-24 * deq.abs()
    assert bool(((x - deq).abs() <= bound).all())
    assert (x - deq).abs().max() > 0.1 * bound.max()  # the bound is not vacuous


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zero_and_tiny_blocks_send_exact_zeros(fmt, rounding):
    s = Compression(fmt, 32, rounding)
    x = torch.randn(160)
    x[32:64] = 0
    x[64:96] = 1e-40  # absmax / vmax below float32's smallest normal: sent as zeros
    x[96:128] = -0.0
    p = quantize(x, s)
    assert p.scales[1] == 0 and p.scales[2] == 0 and p.scales[3] == 0 and bool((p.scales[[0, 4]] > 0).all())
    deq = dequantize(p)
    assert bool(torch.isfinite(deq).all())
    assert torch.equal(deq[32:128], torch.zeros(96)) and not bool(torch.signbit(deq[32:128]).any())
    z = quantize(torch.zeros(100), s)
    assert torch.equal(z.codes, torch.zeros_like(z.codes)) and torch.equal(dequantize(z), torch.zeros(100))


def test_extreme_inputs():
    big = torch.tensor([3.0e38, -3.0e38, 1.0])
    for fmt in FORMATS:
        p = quantize(big, Compression(fmt, 32))
        assert bool(torch.isfinite(dequantize(p)).all()) and dequantize(p)[0] > 2e38
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(torch.tensor([1.0, float("inf")]), Compression())
    with pytest.raises(ValueError, match="float32's range"):
        quantize(torch.tensor([1e300], dtype=torch.float64), Compression("int2", 32))
    with pytest.raises(TypeError):
        quantize(torch.ones(3, dtype=torch.int32), Compression())


# ----------------------------------------------------------------------------------------------
# formats in detail


def test_levels_and_codes_of_every_format():
    assert levels_ref(FORMATS["int2"]) == [0.0, 1.0]
    assert levels_ref(FORMATS["int4"]) == [float(k) for k in range(8)]
    assert levels_ref(FORMATS["fp4"]) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    fp8 = levels_ref(FORMATS["fp8"])
    assert len(fp8) == 127 and fp8[1] == 2.0**-9 and fp8[8] == 2.0**-6 and fp8[-1] == 448.0
    for name, fmt in FORMATS.items():
        table = q.decode_table(fmt, emulate=True)
        half = 1 << (fmt.bits - 1)
        top = levels_ref(fmt)
        assert table[: len(top)].tolist() == top, name  # codes 0, 1, … are the non-negative levels, ascending
        assert len(top) == half or (name == "fp8" and len(top) == half - 1 and math.isnan(table[half - 1]))
        if fmt.is_float:  # sign-magnitude: code c and c | sign are ±
            assert torch.equal(table[half:].nan_to_num(7.0), -table[:half].nan_to_num(-7.0)), name
        # every level encodes to the code that decodes to it
        lv = torch.tensor(top + [-t for t in top[1:]], dtype=torch.float32)
        codes, levels = q.encode_levels(lv, fmt, emulate=True)
        assert torch.equal(levels, lv) and torch.equal(table[codes.long()], lv), name


def _fp8_probe() -> torch.Tensor:
    """float32 values over e4m3's range: random magnitudes, every level, every tie (midpoint)."""
    g = torch.Generator().manual_seed(4)
    lv = torch.tensor(levels_ref(FORMATS["fp8"]), dtype=torch.float64)
    mids = (lv[1:] + lv[:-1]) / 2
    rand = torch.exp(torch.empty(20000, dtype=torch.float64).uniform_(-16, 6.1, generator=g))
    ys = torch.cat([lv, mids, rand, torch.nextafter(mids, lv[1:]), torch.nextafter(mids, lv[:-1])])
    ys = torch.cat([ys, -ys]).clamp(max=448).float()
    return ys


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch has no float8_e4m3fn")
def test_fp8_emulation_is_torch_float8_e4m3fn():
    fmt = FORMATS["fp8"]
    t_torch, t_emu = q.decode_table(fmt), q.decode_table(fmt, emulate=True)
    assert torch.equal(t_torch.isnan(), t_emu.isnan()) and torch.equal(t_torch.nan_to_num(), t_emu.nan_to_num())
    ys = _fp8_probe()
    c_torch, l_torch = q.encode_levels(ys, fmt)
    c_emu, l_emu = q.encode_levels(ys, fmt, emulate=True)
    assert torch.equal(c_torch, c_emu) and torch.equal(l_torch, l_emu)
    cast = ys.to(torch.float8_e4m3fn).float()
    assert torch.equal(l_emu, cast)  # the same rounding as torch's cast (ties to even)


def test_ties_go_to_the_even_level():
    for name, ys, want in [
        ("int8", [0.5, 1.5, 2.5, -2.5, 126.5], [0, 2, 2, -2, 126]),
        ("int4", [0.5, 1.5, 6.5, -6.5], [0, 2, 6, -6]),
        ("int2", [0.5, -0.5, 0.75], [0, 0, 1]),
        ("fp4", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], [0, 1, 1, 2, 2, 4, 4, -4]),
        ("fp8", [2.0**-10, 3 * 2.0**-10, 17.0, 19.0, 432.0], [0, 2.0**-8, 16, 20, 448]),
    ]:
        _, levels = q.encode_levels(torch.tensor(ys, dtype=torch.float32), FORMATS[name], emulate=True)
        assert levels.tolist() == want, name


# ----------------------------------------------------------------------------------------------
# random bits


def _bits(keys, first, count) -> list[int]:
    return (q.random_bits(keys, first, count).to(torch.int64) & 0xFFFFFFFF).tolist()


def test_random_bits_match_the_reference_and_look_uniform():
    for seed, step, tid in [(0, 0, 0), (0, 1, 0), (7, 2**31 + 3, 2**32 - 1)]:
        keys = q.stream_keys(seed, step, tid)
        for first, count in [(0, 200), (2**31 - 3, 6), (2**32 - 5, 10), (2**40 + 7, 50)]:
            want = [random_bits_ref(seed, step, tid, i) for i in range(first, first + count)]
            assert _bits(keys, first, count) == want, (seed, step, tid, first)
    u = (torch.tensor(_bits(q.stream_keys(0, 3, 4), 0, 1 << 16)) >> 8).double() * 2.0**-24
    # mean and a 16-bin chi-square: both far inside what a uniform source gives (p ≈ 1e-6 bounds)
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    counts = torch.bincount((u * 16).long(), minlength=16).double()
    chi2 = ((counts - u.numel() / 16) ** 2 / (u.numel() / 16)).sum().item()
    assert chi2 < 50  # 15 degrees of freedom: P(χ² > 50) ≈ 1e-5
    a, b, c = (torch.tensor(_bits(q.stream_keys(0, st, t), 0, 4096)) for st, t in [(3, 4), (4, 4), (3, 5)])
    assert (a == b).float().mean() < 0.01 and (a == c).float().mean() < 0.01
