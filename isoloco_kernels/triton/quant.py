"""Triton kernels of the compressed exchange (compress/): blockwise quantize + error feedback + pack,
and unpack + accumulate, one pass over the data each.

    _quantize_ef_pack_kernel    v = Δ + e (float32); per block s = float32(absmax / vmax) (0 below
                                2^-126); codes of v / s, nearest (ties to even) or stochastic from the
                                counter hash; packed 8/bits per byte; e' = β·(v − level·s)
    _unpack_accumulate_kernel   out (+)= level(code)·s, the sum in float32, rounded once to out's dtype

The contract is compress/codec.py's (the torch path, which tests compare these to bit for bit):
every step is exact but the division v / s (div_rn: correctly rounded, as torch's) and the float32
products and sums, which are launched with fp fusion off so no FMA changes a rounding. Formats
come in as constexprs (bits, float or int, mantissa bits, smallest normal exponent, vmax).
Program p handles ROWS blocks of BLOCK entries; offsets are int64. The programs whose entries all
lie below n run without masks (MASKED=False: vectorized loads and stores), the last partial one in a
second launch with them. A block holding NaN/Inf writes a
NaN scale, which the caller checks (one sync) before it hands anything out.

The statistical formats (stat2, stat4; compress/stat.py is their contract) have their own pair:

    _stat_quantize_ef_pack_kernel    v = Δ + e (float32); per block the fixed point q = trunc(v·2^(24−E)) in
                                     int64, its mean and standard deviation from integer sums (float64), the
                                     codes = bins over μ ± kσ, the centroid table (float64 means, one rounding
                                     to float32), codes packed; e' = β·(v − table[code])
    _stat_unpack_accumulate_kernel   out (+)= table[block, code], the sum in float32

Their sums are integer sums (exact in any order) and their float64 steps single IEEE operations (division
and square root correctly rounded), so they give the torch path's bits too.

The counter hash is triton/mix.py's mix32 (compress/codec.py's); the tests run these kernels under
the interpreter in a fresh Python with TRITON_INTERPRET=1 (tests/test_compress_triton.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .mix import mix32

#: Entries per program (ROWS = ENTRIES // BLOCK blocks).
ENTRIES = 2048
NUM_WARPS = 4
_MIN_SCALE = 2.0**-126


@triton.jit
def _pow2(k):
    """2^k as float32, k an int32 tensor in the normal range."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load(ptr, offs, n, MASKED: tl.constexpr):
    """ptr[offs], with offs ≥ n read as 0 when MASKED (the last program); unmasked loads vectorize."""
    if MASKED:
        x = tl.load(ptr + offs, mask=offs < n, other=0)
    else:
        x = tl.load(ptr + offs)
    return x


@triton.jit
def _store(ptr, offs, value, n, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=offs < n)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def _blocks(pid0, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """This program's ROWS block indices (int64) and the [ROWS, BLOCK] offsets of their entries."""
    rows = (pid0 + tl.program_id(0)).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return rows, j


@triton.jit
def _load_v(delta_ptr, res_ptr, j, n, HAS_RES: tl.constexpr, MASKED: tl.constexpr):
    """v = Δ + e in float32 (Δ alone without HAS_RES)."""
    v = _load(delta_ptr, j, n, MASKED).to(tl.float32)
    if HAS_RES:
        v = v + _load(res_ptr, j, n, MASKED).to(tl.float32)
    return v


@triton.jit
def _store_residual(new_res_ptr, j, v, c, beta, n, MASKED: tl.constexpr):
    """e' = β·(v − c), rounded once to the residual's dtype."""
    _store(new_res_ptr, j, (beta * (v - c)).to(new_res_ptr.dtype.element_ty), n, MASKED)


@triton.jit
def _pack_store(
    codes_ptr,
    code,
    rows,
    j,
    n,
    n_bytes,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Store the [ROWS, BLOCK] codes of BITS bits: a byte each at 8 bits, else 8 // BITS to a byte, the
    first entry in the low bits (codec.pack_codes's layout)."""
    if BITS == 8:
        _store(codes_ptr, j, code.to(tl.uint8), n, MASKED)
    else:
        PER: tl.constexpr = 8 // BITS
        fields = tl.reshape(code, (ROWS, BLOCK // PER, PER)) << (tl.arange(0, PER) * BITS)[None, None, :]
        byte = tl.sum(fields, 2)  # the fields do not overlap: sum = or
        b = rows[:, None] * (BLOCK // PER) + tl.arange(0, BLOCK // PER)[None, :]
        _store(codes_ptr, b, byte.to(tl.uint8), n_bytes, MASKED)


@triton.jit
def _load_codes(codes_ptr, j, n, BITS: tl.constexpr, MASKED: tl.constexpr):
    """The codes (int32, in [0, 2^BITS)) of entries j as _pack_store stores them; 0 at j ≥ n when MASKED."""
    if BITS == 8:
        code = _load(codes_ptr, j, n, MASKED).to(tl.int32)
    else:
        PER: tl.constexpr = 8 // BITS
        if MASKED:
            byte = tl.load(codes_ptr + j // PER, mask=j < n, other=0).to(tl.int32)
        else:
            byte = tl.load(codes_ptr + j // PER).to(tl.int32)
        code = (byte >> ((j % PER) * BITS).to(tl.int32)) & ((1 << BITS) - 1)
    return code


@triton.jit
def _accumulate_store(out_ptr, j, c, n, ACCUMULATE: tl.constexpr, MASKED: tl.constexpr):
    """out[j] (+)= c (float32): with ACCUMULATE the sum in float32; one rounding to out's dtype."""
    if ACCUMULATE:
        total = _load(out_ptr, j, n, MASKED).to(tl.float32) + c
    else:
        total = c
    _store(out_ptr, j, total.to(out_ptr.dtype.element_ty), n, MASKED)


@triton.jit(do_not_specialize=["pid0", "first_block", "key_a", "key_b"])
def _quantize_ef_pack_kernel(
    delta_ptr,
    res_ptr,
    new_res_ptr,
    codes_ptr,
    scales_ptr,
    pid0,
    n,
    n_blocks,
    n_bytes,
    first_block,
    key_a,
    key_b,
    beta,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    IS_FLOAT: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    VMAX: tl.constexpr,
    HAS_RES: tl.constexpr,
    FEEDBACK: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    MASKED: tl.constexpr,
):
    rows, j = _blocks(pid0, BLOCK, ROWS)
    v = _load_v(delta_ptr, res_ptr, j, n, HAS_RES, MASKED)
    av = tl.abs(v)
    bad = tl.sum(((v != v) | (av == float("inf"))).to(tl.int32), 1)
    s = tl.math.div_rn(tl.max(av, 1), tl.full([ROWS], VMAX, tl.float32))
    s = tl.where(s < 1.1754943508222875e-38, 0.0, s)  # float32's smallest normal: MIN_SCALE
    nonzero = s[:, None] > 0
    y = tl.where(nonzero, tl.math.div_rn(v, tl.where(nonzero, s[:, None], 1.0)), 0.0)
    a = tl.minimum(tl.abs(y), VMAX)
    if IS_FLOAT:
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
        t = a * _pow2(MANT - e)  # exact
    else:
        t = a
    fl = tl.floor(t)
    frac = t - fl
    ni = fl.to(tl.int32)
    if STOCHASTIC:
        g = first_block.to(tl.int64) * BLOCK + j
        lo = (g & 0xFFFFFFFF).to(tl.uint32)
        hi = (g >> 32).to(tl.uint32)
        h = mix32(mix32(lo ^ key_a.to(tl.uint32)) ^ (key_b.to(tl.uint32) + hi))
        up = (h >> 8).to(tl.float32) * 5.9604644775390625e-08 < frac  # u = bits · 2^-24
    else:
        up = (frac > 0.5) | ((frac == 0.5) & ((ni & 1) == 1))
    ni = ni + up.to(tl.int32)
    neg = (y < 0) & (ni > 0)
    if IS_FLOAT:
        code = (e - EMIN) * (1 << MANT) + ni
        code = tl.where(neg, code | (1 << (BITS - 1)), code)
        level = ni.to(tl.float32) * _pow2(e - MANT)
    else:
        code = tl.where(neg, -ni, ni) & ((1 << BITS) - 1)
        level = ni.to(tl.float32)
    if FEEDBACK:
        level = tl.where(neg, -level, level)
        c = level * s[:, None]
        _store_residual(new_res_ptr, j, v, c, beta, n, MASKED)
    _store(scales_ptr, rows, tl.where(bad > 0, float("nan"), s), n_blocks, MASKED)
    _pack_store(codes_ptr, code, rows, j, n, n_bytes, BLOCK, ROWS, BITS, MASKED)


@triton.jit(do_not_specialize=["pid0"])
def _unpack_accumulate_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    pid0,
    n,
    n_blocks,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    IS_FLOAT: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    NAN_CODE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    MASKED: tl.constexpr,
):
    rows, j = _blocks(pid0, BLOCK, ROWS)
    code = _load_codes(codes_ptr, j, n, BITS, MASKED)
    s = _load(scales_ptr, rows, n_blocks, MASKED)
    if IS_FLOAT:
        mag = code & ((1 << (BITS - 1)) - 1)
        f = mag >> MANT
        m = mag & ((1 << MANT) - 1)
        level = tl.where(f == 0, m, m + (1 << MANT)).to(tl.float32) * _pow2(tl.maximum(f, 1) - 1 + EMIN - MANT)
        if NAN_CODE >= 0:
            level = tl.where(mag == NAN_CODE, float("nan"), level)
        level = tl.where((code >> (BITS - 1)) != 0, -level, level)
    else:
        level = (code - ((code >> (BITS - 1)) << BITS)).to(tl.float32)
    c = level * s[:, None]
    _accumulate_store(out_ptr, j, c, n, ACCUMULATE, MASKED)


@triton.jit(do_not_specialize=["pid0"])
def _stat_quantize_ef_pack_kernel(
    delta_ptr,
    res_ptr,
    new_res_ptr,
    codes_ptr,
    table_ptr,
    pid0,
    n,
    n_blocks,
    n_bytes,
    beta,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    KS: tl.constexpr,
    HAS_RES: tl.constexpr,
    FEEDBACK: tl.constexpr,
    MASKED: tl.constexpr,
):
    NB: tl.constexpr = 1 << BITS
    rows, j = _blocks(pid0, BLOCK, ROWS)
    v = _load_v(delta_ptr, res_ptr, j, n, HAS_RES, MASKED)
    finite = tl.abs(v) < float("inf")  # NaN compares false
    bad = tl.sum((~finite).to(tl.int32), 1)
    v = tl.where(finite, v, 0.0)  # a non-finite block is refused by the caller; keep its arithmetic quiet
    valid = j < n
    a = tl.max(tl.abs(v), 1)
    live = a >= 1.1754943508222875e-38  # MIN_SCALE: below it the block is sent as zeros
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126, -125)  # 2^(e−1) ≤ a < 2^e
    up = ((24 - e + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    down = ((e - 24 + 1023).to(tl.int64) << 52).to(tl.float64, bitcast=True)
    y = v.to(tl.float64) * up[:, None]  # exact
    q = tl.where(valid, y.to(tl.int64), 0)  # toward zero
    m = tl.maximum(tl.sum(valid.to(tl.int32), 1), 1).to(tl.float64)  # ≥ 1 entry in every real block
    mu = tl.sum(q, 1).to(tl.float64) / m
    var = tl.sum(q * q, 1).to(tl.float64) / m - mu * mu
    sd = tl.sqrt(tl.where(var > 0.0, var, 0.0))
    code = tl.zeros([ROWS, BLOCK], tl.int32)
    for jj in tl.static_range(1, NB):
        edge = mu + sd * (KS * (2 * jj - NB) / (16 * NB))  # an exact binary fraction times σ
        code += (y >= edge[:, None]).to(tl.int32)
    code = tl.where(valid & live[:, None], code, 0)
    qmin = tl.min(tl.where(valid, q, 1 << 62), 1).to(tl.float64)
    qmax = tl.max(tl.where(valid, q, -(1 << 62)), 1).to(tl.float64)
    c = tl.zeros([ROWS, BLOCK], tl.float32)
    for cc in tl.static_range(NB):
        inside = (code == cc) & valid
        count = tl.sum(inside.to(tl.int32), 1)
        mean = tl.sum(tl.where(inside, q, 0), 1).to(tl.float64) / tl.maximum(count, 1).to(tl.float64)
        mid = mu + sd * (KS * (2 * cc + 1 - NB) / (16 * NB))
        empty = tl.minimum(tl.maximum(mid, qmin), qmax)
        value = (tl.where(count > 0, mean, empty) * down).to(tl.float32)
        value = tl.where(live, value, 0.0)
        value = tl.where(bad > 0, float("nan"), value)
        _store(table_ptr, rows * NB + cc, value, n_blocks * NB, MASKED)
        c = tl.where(code == cc, value[:, None], c)
    if FEEDBACK:
        _store_residual(new_res_ptr, j, v, c, beta, n, MASKED)
    _pack_store(codes_ptr, code, rows, j, n, n_bytes, BLOCK, ROWS, BITS, MASKED)


@triton.jit(do_not_specialize=["pid0"])
def _stat_unpack_accumulate_kernel(
    codes_ptr,
    table_ptr,
    out_ptr,
    pid0,
    n,
    n_blocks,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BITS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    MASKED: tl.constexpr,
):
    NB: tl.constexpr = 1 << BITS
    rows, j = _blocks(pid0, BLOCK, ROWS)
    code = _load_codes(codes_ptr, j, n, BITS, MASKED)
    if MASKED:
        c = tl.load(table_ptr + rows[:, None] * NB + code, mask=j < n, other=0.0)
    else:
        c = tl.load(table_ptr + rows[:, None] * NB + code)
    _accumulate_store(out_ptr, j, c, n, ACCUMULATE, MASKED)


def _launches(n: int, block: int, rows: int):
    """(pid0, programs, MASKED) per launch: the programs whose entries all lie below n run unmasked
    (their loads and stores vectorize), the last, partial one masked; then the number of blocks."""
    full, per = n // (rows * block), rows * block
    out = [(0, full, False)] if full else []
    if full * per < n:
        out.append((full, 1, True))
    return out, -(-n // block)


def _launch(kernel, n: int, fmt, block: int, rows: Optional[int], tensors, scalars, **constexprs) -> None:
    """kernel(*tensors, pid0, n, n_blocks, *scalars) over n entries, ROWS blocks of BLOCK entries a
    program (rows None: ENTRIES // block), with the format's constexprs (a blockwise format's grid; a
    statistical format's bits only) and `constexprs`: one launch per entry of `_launches`."""
    rows = rows or max(1, ENTRIES // block)
    launches, nb = _launches(n, block, rows)
    grid = {} if hasattr(fmt, "bins") else dict(IS_FLOAT=fmt.is_float, MANT=fmt.mant, EMIN=fmt.emin)
    for pid0, programs, masked in launches:
        kernel[(programs,)](
            *tensors,
            pid0,
            n,
            nb,
            *scalars,
            BLOCK=block,
            ROWS=rows,
            BITS=fmt.bits,
            MASKED=masked,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
            **grid,
            **constexprs,
        )


def _i32(k: int) -> int:
    """A uint32 key as the int32 with the same bits (one kernel signature for every key)."""
    return k - (1 << 32) if k >= 1 << 31 else k


def _quantize_ready(name: str, delta: torch.Tensor, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a quantize launcher has entries to launch over (False for an empty Δ); any of Δ and `tensors`
    that is not contiguous is refused, naming the launcher."""
    if delta.numel() == 0:
        return False
    for t in (delta, *tensors):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name}: every tensor must be contiguous")
    return True


def _launch_quantize(
    kernel, delta, residual, codes, side, new_residual, *, fmt, block, rows, beta, scalars=(), **constexprs
) -> None:
    """kernel(Δ, residual, new_residual, codes, side, pid0, n, n_blocks, n_bytes, *scalars, β) over Δ's entries,
    the tensors not given passed as Δ (never read: HAS_RES and FEEDBACK say which are), β 0 without feedback."""
    _launch(
        kernel,
        delta.numel(),
        fmt,
        block,
        rows,
        (
            delta,
            residual if residual is not None else delta,
            new_residual if new_residual is not None else delta,
            codes,
            side,
        ),
        (codes.numel(), *scalars, float(beta) if beta is not None else 0.0),
        HAS_RES=residual is not None,
        FEEDBACK=beta is not None,
        **constexprs,
    )


def _launch_unpack(name: str, kernel, codes, side, out, *, fmt, block, accumulate, rows, **constexprs) -> None:
    """kernel(codes, side, out, pid0, n, n_blocks) over out's entries (none: nothing launched); a
    non-contiguous out is refused, naming the launcher."""
    n = out.numel()
    if n == 0:
        return
    if not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous")
    _launch(kernel, n, fmt, block, rows, (codes, side, out), (), ACCUMULATE=accumulate, **constexprs)


def quantize_ef_pack(
    delta: torch.Tensor,
    residual: Optional[torch.Tensor],
    codes: torch.Tensor,
    scales: torch.Tensor,
    new_residual: Optional[torch.Tensor],
    *,
    fmt,
    block: int,
    first_block: int = 0,
    keys: Optional[tuple[int, int]] = None,
    beta: Optional[float] = None,
    rows: Optional[int] = None,
) -> None:
    """Fill codes (uint8 [ceil(n·bits/8)]), scales (float32 [ceil(n/block)]) and, with `beta`,
    new_residual (Δ's shape, any float dtype) from the contiguous Δ (float16/bfloat16/float32) and
    residual (None: zeros). fmt: the format (compress/'s Format: bits, is_float, mant, emin, vmax).
    keys: stream_keys(...) for stochastic rounding, None for nearest."""
    if not _quantize_ready("quantize_ef_pack", delta, residual, codes, scales, new_residual):
        return
    ka, kb = keys if keys is not None else (0, 0)
    _launch_quantize(
        _quantize_ef_pack_kernel,
        delta,
        residual,
        codes,
        scales,
        new_residual,
        fmt=fmt,
        block=block,
        rows=rows,
        beta=beta,
        scalars=(first_block, _i32(ka), _i32(kb)),
        VMAX=float(fmt.vmax),
        STOCHASTIC=keys is not None,
    )


def unpack_accumulate(
    codes: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    fmt,
    block: int,
    accumulate: bool = True,
    rows: Optional[int] = None,
) -> None:
    """out (+)= level·s for the contiguous out (any float dtype, numel entries): accumulate=False
    writes the dequantized values, True adds them (in float32, one rounding to out's dtype). fmt: as
    quantize_ef_pack's."""
    _launch_unpack(
        "unpack_accumulate",
        _unpack_accumulate_kernel,
        codes,
        scales,
        out,
        fmt=fmt,
        block=block,
        accumulate=accumulate,
        rows=rows,
        NAN_CODE=0x7F if fmt.is_float and fmt.bits == 8 else -1,
    )


def stat_quantize_ef_pack(
    delta: torch.Tensor,
    residual: Optional[torch.Tensor],
    codes: torch.Tensor,
    table: torch.Tensor,
    new_residual: Optional[torch.Tensor],
    *,
    fmt,
    block: int,
    sigmas: float,
    beta: Optional[float] = None,
    rows: Optional[int] = None,
) -> None:
    """The statistical formats' quantize_ef_pack: fill codes (uint8 [ceil(n·bits/8)]), table (float32
    [ceil(n/block)·2^bits]: each block's centroids, NaN for a block holding NaN/Inf) and, with `beta`,
    new_residual from the contiguous Δ (float16/bfloat16/float32) and residual (None: zeros). fmt: compress/'s
    StatFormat (bits); sigmas: k, a multiple of 1/16."""
    if not _quantize_ready("stat_quantize_ef_pack", delta, residual, codes, table, new_residual):
        return
    ks = round(sigmas * 16)
    if ks != sigmas * 16:
        raise ValueError(f"stat_quantize_ef_pack: sigmas must be a multiple of 1/16, got {sigmas}")
    _launch_quantize(
        _stat_quantize_ef_pack_kernel,
        delta,
        residual,
        codes,
        table,
        new_residual,
        fmt=fmt,
        block=block,
        rows=rows,
        beta=beta,
        KS=ks,
    )


def stat_unpack_accumulate(
    codes: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    *,
    fmt,
    block: int,
    accumulate: bool = True,
    rows: Optional[int] = None,
) -> None:
    """out (+)= table[block, code] for the contiguous out (any float dtype, numel entries): the statistical
    formats' unpack_accumulate (accumulate=True adds in float32 and rounds once to out's dtype)."""
    _launch_unpack(
        "stat_unpack_accumulate",
        _stat_unpack_accumulate_kernel,
        codes,
        table,
        out,
        fmt=fmt,
        block=block,
        accumulate=accumulate,
        rows=rows,
    )
