"""triton/quant.py against compress/'s torch path, bit for bit: under Triton's interpreter on CPU
tensors (this file again in a fresh Python with TRITON_INTERPRET=1, as tests/dispatch/test_triton.py runs its
kernels: the kernels' reductions are triton library functions, built at triton's import), compiled
for sm_80 and sm_90 without a GPU, and on CUDA when there is one. Sizes stay small (the interpreter
is slow). Outputs are poisoned before the kernels run, so unwritten entries show.

The interpreter converts float32 → bfloat16 by truncation (compiled kernels round to nearest even),
so bfloat16 outputs are compared there against the truncated float32 result."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from isoloco_kernels import compress as C
from isoloco_kernels.compress import FORMATS, STAT_FORMATS, Compression, codec
from isoloco_kernels.compress import feedback as fb

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()


INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and not CUDA


@pytest.mark.skipif(CUDA or INTERPRETER, reason="the kernel tests run in this process")
def test_kernels_under_the_interpreter():
    """Triton's reductions (tl.max, tl.sum) are library functions built when triton is imported, so
    the interpreter must be on from the start: this file again, in a fresh Python with TRITON_INTERPRET=1."""
    from tests.helpers import rerun_under_interpreter

    rerun_under_interpreter(__file__, min_passed=32)


@pytest.fixture(scope="module")
def interp():
    if not INTERPRETER:
        pytest.skip("runs under TRITON_INTERPRET=1 (test_kernels_under_the_interpreter)")
    from isoloco_kernels.triton import quant

    assert type(quant._quantize_ef_pack_kernel).__name__ == "InterpretedFunction"
    return quant


def _truncate_bf16(x: torch.Tensor) -> torch.Tensor:
    return (x.float().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def _same(out: torch.Tensor, want32: torch.Tensor, interpreted: bool) -> bool:
    """out (any dtype) equals the float32 result rounded to out's dtype (truncated for bfloat16 in
    the interpreter)."""
    if out.dtype == torch.bfloat16 and interpreted:
        return torch.equal(out, _truncate_bf16(want32))
    return torch.equal(out, want32.to(out.dtype))


def _inputs(n, dtype, res_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    d = (torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, n, dtype=torch.float64)).to(dtype)
    if n >= 96:
        d[32:64] = 0  # a zero block
    r = None if res_dtype is None else (0.1 * torch.randn(n, generator=g)).to(res_dtype)
    return d, r


def _run_kernel(mod, d, r, s: Compression, step=2, tid=5, first_block=0, rows=2, rdt=None):
    """(codes, scales, new residual) of the spec's quantize kernel (a statistical format's: the centroid tables
    for the scales), into outputs poisoned first."""
    n = d.numel()
    codes = torch.full(((n * s.bits + 7) // 8,), 0xAB, dtype=torch.uint8, device=d.device)
    scales = torch.full((-(-n // s.block) * s.floats_per_block,), float("nan"), device=d.device)
    new = None if s.ef_beta is None else torch.full(d.shape, float("nan"), dtype=rdt, device=d.device)
    kw = dict(fmt=s.fmt, block=s.block, beta=s.ef_beta, rows=rows)
    if s.is_stat:
        mod.stat_quantize_ef_pack(d, r, codes, scales, new, sigmas=s.sigmas, **kw)
    else:
        keys = codec.stream_keys(s.seed, step, tid) if s.rounding == "stochastic" else None
        mod.quantize_ef_pack(d, r, codes, scales, new, first_block=first_block, keys=keys, **kw)
    return codes, scales, new


def _unpack(mod, s: Compression):
    """The spec's unpack kernel launcher."""
    return mod.stat_unpack_accumulate if s.is_stat else mod.unpack_accumulate


CASES = [  # (Δ dtype, residual given, residual dtype)
    (torch.float32, False, torch.float32),
    (torch.float32, True, torch.float32),
    (torch.bfloat16, True, torch.bfloat16),
    (torch.float16, True, torch.float16),
    (torch.float32, True, torch.bfloat16),
]


def _check_quantize_kernel(mod, fmt, seed=0, **spec):
    """Codes, scales (centroid tables) and residuals bit for bit against compress's torch path: every Δ /
    residual dtype case; one entry, a partial block, several programs (2 blocks each) and a ragged end (with a
    constant block, σ = 0, for a statistical format)."""
    for k, (dt, with_res, rdt) in enumerate(CASES):
        s = Compression(fmt, 32, ef_beta=0.9, residual_dtype=rdt if rdt != dt else None, **spec)
        for n in (1, 33, 163):
            d, r = _inputs(n, dt, rdt if with_res else None, seed=100 * k + n + seed)
            if s.is_stat and n >= 160:
                d[96:128] = 0.375  # a constant block: σ = 0
            want, want_e = C.compress(d, r, s, step=2, tensor_id=5)
            codes, scales, new = _run_kernel(mod, d, r, s, rdt=rdt)
            assert torch.equal(codes, want.codes), (dt, n, (codes != want.codes).nonzero()[:4])
            assert torch.equal(scales, want.scales), (dt, n)
            # the residual before its rounding, from the same inputs in float32
            s32 = Compression(fmt, 32, ef_beta=0.9, residual_dtype=torch.float32, **spec)
            _, e32 = C.compress(d, None if r is None else r.float(), s32, step=2, tensor_id=5)
            assert _same(new, e32, interpreted=True), (dt, rdt, n)
            if rdt != torch.bfloat16:
                assert torch.equal(new, want_e)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_kernel_matches_the_torch_path(interp, fmt, rounding):
    _check_quantize_kernel(interp, fmt, rounding=rounding)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_kernel_without_feedback_and_at_block_256(interp, fmt):
    s = Compression(fmt, 256)
    d, _ = _inputs(600, torch.float32, None, seed=1)
    codes, scales, new = _run_kernel(interp, d, None, s, rows=1)
    want = C.quantize(d, s)
    assert new is None and torch.equal(codes, want.codes) and torch.equal(scales, want.scales)


def test_kernel_chunk_draws_the_whole_tensors_bits(interp):
    s = Compression("fp4", 32, "stochastic")
    d, _ = _inputs(32 * 6, torch.float32, None, seed=2)
    whole, _, _ = _run_kernel(interp, d, None, s, step=9, tid=1)
    part, _, _ = _run_kernel(interp, d[64:], None, s, step=9, tid=1, first_block=2)
    assert torch.equal(part, whole[32:])


@pytest.mark.parametrize("fmt", ["int4", "stat2"])
def test_kernel_marks_a_non_finite_block_with_a_nan_scale(interp, fmt):
    """Inf in Δ, NaN in the residual: their blocks' scale (every entry of a centroid table) NaN, no other."""
    s = Compression(fmt, 32, ef_beta=0.9)
    d, r = _inputs(100, torch.float32, torch.float32, seed=3)
    d[40] = float("inf")
    r[70] = float("nan")
    _, scales, _ = _run_kernel(interp, d, r, s)
    nan = torch.isnan(scales.view(4, -1))
    assert nan.all(1).tolist() == [False, True, True, False] and not bool(nan[[0, 3]].any())


@pytest.mark.parametrize("fmt", list(FORMATS) + list(STAT_FORMATS))
def test_unpack_kernel_matches_the_torch_path(interp, fmt):
    s = Compression(fmt, 64)
    unpack = _unpack(interp, s)
    for n in (1, 65, 300):
        d, _ = _inputs(n, torch.float32, None, seed=n)
        p = C.quantize(d, s)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            acc0 = torch.randn(n).to(out_dtype)
            acc = acc0.clone()
            unpack(p.codes, p.scales, acc, fmt=s.fmt, block=s.block, rows=2)
            assert _same(acc, acc0.float() + C.dequantize(p), interpreted=True), (n, out_dtype)
            out = torch.full((n,), float("nan"), dtype=out_dtype)
            unpack(p.codes, p.scales, out, fmt=s.fmt, block=s.block, accumulate=False)
            assert _same(out, C.dequantize(p), interpreted=True), (n, out_dtype)


def test_unpack_kernel_decodes_every_code(interp):
    """All 2^bits codes of each format, scale 1: the kernel's decode is the table's (fp8's NaN code included)."""
    for fmt in FORMATS.values():
        per, ncodes = 8 // fmt.bits, 1 << fmt.bits
        codes = torch.arange(ncodes, dtype=torch.int64)
        packed = codec.pack_codes(codes, fmt.bits, ncodes // per)
        out = torch.empty(ncodes)
        interp.unpack_accumulate(packed, torch.ones(ncodes // 32 + 1), out, fmt=fmt, block=32, accumulate=False)
        table = codec.decode_table(fmt)
        assert torch.equal(out.isnan(), table.isnan()) and torch.equal(out.nan_to_num(), table.nan_to_num()), fmt.name


@pytest.mark.parametrize(
    "s",
    [Compression("int2", 64, "stochastic", ef_beta=0.95), Compression("stat4", 128, ef_beta=0.95)],
    ids=Compression.cli,
)
def test_compress_routes_through_the_kernels(interp, monkeypatch, s):
    """compress / decompress_add_ with the Triton backend: the same payload and residual as the torch
    path, and a non-finite input refused naming the tensor, the inputs untouched."""
    d, r = _inputs(300, torch.float32, torch.float32, seed=4)
    want, want_e = C.compress(d, r, s, step=1, tensor_id=2)
    monkeypatch.setattr(fb, "backend_for", lambda x: ("triton", "test"))
    p, e = C.compress(d, r, s, step=1, tensor_id=2)
    assert torch.equal(p.codes, want.codes) and torch.equal(p.scales, want.scales) and torch.equal(e, want_e)
    acc = torch.ones(300)
    C.decompress_add_(acc, p)
    assert torch.equal(acc, 1 + C.dequantize(p))
    d[7] = float("nan")
    d0, r0 = d.clone(), r.clone()
    with pytest.raises(ValueError, match="compress: emb: Δ contains NaN"):
        C.compress(d, r, s, step=1, tensor_id=2, name="emb")
    assert torch.equal(d.nan_to_num(), d0.nan_to_num()) and torch.equal(r, r0)


@pytest.mark.parametrize(
    "s",
    [
        Compression("int2", 64, "stochastic", ef_beta=1.0, feedback="ef21"),
        Compression("stat2", 128, ef_beta=0.9, feedback="ef21"),
    ],
    ids=Compression.cli,
)
def test_track_routes_through_the_kernels(interp, monkeypatch, s):
    """track (feedback "ef21") with the Triton backend: the same payload and new estimate as the torch path."""
    d, g = _inputs(300, torch.float32, torch.float32, seed=5)
    want, want_g = C.track(d, g, s, step=3, tensor_id=1)
    monkeypatch.setattr(fb, "backend_for", lambda x: ("triton", "test"))
    p, new = C.track(d, g, s, step=3, tensor_id=1)
    assert torch.equal(p.codes, want.codes) and torch.equal(p.scales, want.scales) and torch.equal(new, want_g)


# ----------------------------------------------------------------------------------------------
# the statistical formats' kernels under the interpreter


@pytest.mark.parametrize("fmt", list(STAT_FORMATS))
def test_stat_quantize_kernel_matches_the_torch_path(interp, fmt):
    """As the blockwise formats' test, with centroid tables for scales, at the default k and another."""
    for sigmas in (None, 3.25):
        _check_quantize_kernel(interp, fmt, seed=7, sigmas=sigmas)


@pytest.mark.parametrize("fmt", list(STAT_FORMATS))
def test_stat_quantize_kernel_without_feedback_at_large_blocks(interp, fmt):
    """No residual; blocks of 256 and 1024 (one program per block), a tail block, and an all-zero block."""
    for block in (256, 1024):
        s = Compression(fmt, block)
        d, _ = _inputs(block + 300, torch.float32, None, seed=block)
        d[block : block + 256] = 0
        codes, table, new = _run_kernel(interp, d, None, s, rows=None)
        want = C.quantize(d, s)
        assert new is None and torch.equal(codes, want.codes) and torch.equal(table, want.scales), block


# ----------------------------------------------------------------------------------------------
# compiled for sm_80 and sm_90 without a GPU: every switch of both kernels


def _compiled(monkeypatch, s: Compression, dt, rdt, with_res, capability, n=5000) -> list:
    """(kernel name, MASKED, PTX) of the spec's quantize and unpack kernels (adding when the residual is given),
    each as the unmasked launch of the full programs and the masked one of the last, compiled for the GPU of
    `capability` (a cubin made)."""
    from isoloco_kernels.triton import quant
    from tests.dispatch.test_triton import _compile_launch, _launches

    d = torch.empty(n, dtype=dt)
    r = torch.empty(n, dtype=rdt) if with_res else None

    def call():
        _run_kernel(quant, d, r, s, rows=None, rdt=rdt)
        p = C.quantize(torch.zeros(n), Compression(s.format, s.block))
        _unpack(quant, s)(p.codes, p.scales, torch.empty(n, dtype=dt), fmt=s.fmt, block=s.block, accumulate=with_res)

    stat = "_stat" if s.is_stat else ""
    names = [f"{stat}_quantize_ef_pack_kernel", f"{stat}_unpack_accumulate_kernel"]
    launches = _launches(monkeypatch, quant, names, call)
    assert sorted((k.fn.__name__, kw["MASKED"]) for k, _, kw in launches) == [
        (k, m) for k in names for m in (False, True)
    ]
    out = []
    for kernel, args, kw in launches:
        compiled, _ = _compile_launch(kernel, args, kw, capability)
        assert compiled.asm["cubin"], kernel
        out.append((kernel.fn.__name__, kw["MASKED"], compiled.asm["ptx"]))
    return out


COMPILE_CASES = [  # (format, rounding, β, Δ dtype, residual dtype, residual given, block)
    ("int8", "stochastic", 0.95, torch.bfloat16, torch.float32, True, 128),
    ("fp8", "nearest", None, torch.float32, None, False, 256),
    ("int4", "nearest", 0.9, torch.float16, torch.float16, True, 32),
    ("fp4", "stochastic", 1.0, torch.float32, torch.bfloat16, False, 128),
    ("int2", "stochastic", 0.95, torch.float32, torch.float32, True, 64),
]


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
@pytest.mark.parametrize("capability", (80, 90), ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_kernels_compile_for_sm80_and_sm90(monkeypatch, capability, case):
    """Both kernels build for the GPU, each as the unmasked launch of the full programs and the masked
    one of the last, with the premises of their bit-exactness in the PTX (correctly rounded division,
    no fused multiply-add) and vector loads where unmasked."""
    fmt, rounding, beta, dt, rdt, with_res, block = case
    s = Compression(fmt, block, rounding, ef_beta=beta, residual_dtype=rdt if beta is not None else None)
    for name, masked, ptx in _compiled(monkeypatch, s, dt, rdt or dt, with_res, capability):
        assert "fma.rn.f32" not in ptx, name
        if "quantize" in name:
            assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
        if not masked:  # the full programs: 128-bit loads (quantize) and stores (unpack) of the float data
            assert ("ld.global.v4" if "quantize" in name else "st.global.v4") in ptx, name


STAT_COMPILE_CASES = [  # (format, β, Δ dtype, residual dtype, residual given, block)
    ("stat2", 0.95, torch.float32, torch.float32, True, 256),
    ("stat2", None, torch.bfloat16, None, False, 32),
    ("stat4", 0.9, torch.float16, torch.bfloat16, True, 1024),
]


@pytest.mark.skipif(INTERPRETER, reason="compiles real GPU code; the interpreter builds no kernels")
@pytest.mark.parametrize("capability", (80, 90), ids=lambda c: f"sm_{c}")
@pytest.mark.parametrize("case", STAT_COMPILE_CASES, ids=lambda c: f"{c[0]}-{c[5]}")
def test_stat_kernels_compile_for_sm80_and_sm90(monkeypatch, capability, case):
    """The statistical formats' kernels build for the GPU (full and partial programs), with the premises of
    their bit-exactness in the PTX: float64 division and square root correctly rounded (div.rn.f64, sqrt.rn.f64),
    the centroids rounded to float32 to nearest without flushing subnormals, no fused multiply-add."""
    fmt, beta, dt, rdt, with_res, block = case
    s = Compression(fmt, block, ef_beta=beta, residual_dtype=rdt if beta is not None else None)
    for name, masked, ptx in _compiled(monkeypatch, s, dt, rdt or dt, with_res, capability):
        assert "fma.rn" not in ptx, name
        if "quantize" in name:
            assert "div.rn.f64" in ptx and "sqrt.rn.f64" in ptx and "cvt.rn.f32.f64" in ptx
            assert "div.approx" not in ptx and "sqrt.approx" not in ptx and "cvt.rn.ftz.f32.f64" not in ptx
        if not masked and "quantize" in name and dt == torch.float32:
            assert "ld.global.v4" in ptx


# ----------------------------------------------------------------------------------------------
# CUDA: the kernels against the torch path on the CPU, bit for bit (no interpreter: bf16 rounds to nearest even)

cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@cuda
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_compress_is_the_cpu_compress(fmt, rounding):
    for k, (dt, with_res, rdt) in enumerate(CASES):
        s = Compression(fmt, 128, rounding, ef_beta=0.95, residual_dtype=rdt if rdt != dt else None)
        for n in (1, 1000, 300_001):
            d, r = _inputs(n, dt, rdt if with_res else None, seed=k + n)
            want, want_e = C.compress(d, r, s, step=3, tensor_id=4)
            assert fb.backend_for(d.cuda())[0] == "triton"
            p, e = C.compress(d.cuda(), None if r is None else r.cuda(), s, step=3, tensor_id=4)
            assert torch.equal(p.codes.cpu(), want.codes) and torch.equal(p.scales.cpu(), want.scales)
            assert torch.equal(e.cpu(), want_e), (dt, rdt, n)
            acc = torch.randn(n)
            got = C.decompress_add_(acc.cuda(), p).cpu()
            assert torch.equal(got, C.decompress_add_(acc, want))
            for out_dtype in (torch.bfloat16, torch.float16):
                acc16 = acc.to(out_dtype)
                assert torch.equal(C.decompress_add_(acc16.cuda(), p).cpu(), C.decompress_add_(acc16.clone(), want))


@cuda
@pytest.mark.parametrize("spec", ["stat2:256", "stat2:32", "stat4:1024", "stat4:128"])
def test_cuda_stat_compress_is_the_cpu_compress(spec):
    from isoloco_kernels.compress import parse

    for k, (dt, with_res, rdt) in enumerate(CASES):
        s = dataclasses.replace(parse(spec), ef_beta=0.95, residual_dtype=rdt if rdt != dt else None)
        for n in (1, 1000, 300_001):
            d, r = _inputs(n, dt, rdt if with_res else None, seed=k + n)
            want, want_e = C.compress(d, r, s, step=3, tensor_id=4)
            p, e = C.compress(d.cuda(), None if r is None else r.cuda(), s, step=3, tensor_id=4)
            assert torch.equal(p.codes.cpu(), want.codes) and torch.equal(p.scales.cpu(), want.scales), (spec, dt, n)
            assert torch.equal(e.cpu(), want_e), (spec, dt, rdt, n)
            acc = torch.randn(n)
            assert torch.equal(C.decompress_add_(acc.cuda(), p).cpu(), C.decompress_add_(acc, want))


@cuda
def test_cuda_refuses_nan_naming_the_tensor():
    s = Compression("int4", 128, ef_beta=0.9)
    d = torch.randn(1000, device="cuda")
    r = torch.zeros(1000, device="cuda")
    r[999] = float("inf")
    with pytest.raises(ValueError, match="compress: w: the error-feedback residual contains Inf"):
        C.compress(d, r, s, step=0, tensor_id=0, name="w")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_track_on_cuda_equals_the_cpu_path(dtype):
    """track on CUDA tensors (the compiled Triton kernels) against the torch path on the CPU: the same codes,
    tables or scales, and estimate, bit for bit, over three rounds."""
    s = Compression("stat2", 256, ef_beta=1.0, feedback="ef21")
    d, _ = _inputs(1000, dtype, None, seed=6)
    g_cpu = g_gpu = None
    for step in range(3):
        p_cpu, g_cpu = C.track(d, g_cpu, s, step=step, tensor_id=0)
        p_gpu, g_gpu = C.track(d.cuda(), g_gpu, s, step=step, tensor_id=0)
        assert torch.equal(p_gpu.codes.cpu(), p_cpu.codes) and torch.equal(p_gpu.scales.cpu(), p_cpu.scales)
        assert torch.equal(g_gpu.cpu(), g_cpu)
        d = d * 0.9
