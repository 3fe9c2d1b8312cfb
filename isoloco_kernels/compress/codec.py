"""The torch path: blockwise quantize, pack, unpack and dequantize (spec.py says the formats).

One flat tensor of n entries is cut into ceil(n/block) blocks (the last one short, as if padded
with zeros). Per block, in the compute dtype c (float32 for float16/bfloat16/float32 input,
float64 for float64):

    s = float32(absmax / vmax)            0 when below 2^-126 (then the block is sent as zeros)
    y = x / s                             one correctly rounded division in c
    a = min(|y|, vmax); float formats: e = max(⌊log2 a⌋, emin), step 2^(e − mant); ints: step 1
    t = a / step; ℓ = ⌊t⌋ + up           nearest: up = frac(t) > ½, or = ½ with ⌊t⌋ odd (ties to even)
                                          stochastic: up = u < frac(t), u = bits·2^-24 (`random_bits`)
    level = sign(y)·ℓ·step; dequantized value = level·s (one float32 product)

Codes: ints in two's complement of `bits` bits; floats sign-magnitude, the magnitude's code being
(e − emin)·2^mant + ℓ (fp8 is exactly the float8_e4m3fn bit pattern; zero is always code 0).
Packing: entry i of a byte's 8/bits entries sits at bits [i·bits, (i+1)·bits) (entry 0 lowest);
ceil(n·bits/8) bytes, the unused high bits of the last byte zero. Every step is exact but the
division and the final product, so the Triton kernels (triton/quant.py) give the same bits.

The statistical formats (stat2, stat4) code each entry by its bin and send each block's centroid table in
place of the scale (compress/stat.py has their arithmetic); packing is the same, the codes being bin indices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .._validate import compute_dtype
from .spec import MIN_SCALE, Compression, Format, _check_u32, bytes_of, format_of, whole_tensor_spec
from .stat import encode_stat_blocks

__all__ = [
    "Packed",
    "MIN_SCALE",
    "stream_keys",
    "random_bits",
    "decode_table",
    "encode_levels",
    "block_scales",
    "encode_blocks",
    "quantize",
    "dequantize",
    "unpack_add_",
    "pack_codes",
    "unpack_codes",
]

_M32 = 0xFFFFFFFF
_FP8 = getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True, eq=False)
class Packed:
    """One compressed tensor: `codes` (uint8, ceil(numel·bits/8) bytes) and `scales` (float32: one per
    block, or in a statistical format the blocks' centroid tables, 2^bits per block, block after block), for
    `numel` entries in `format` with `block` entries per scale (or table)."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    format: str
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the packed codes plus 4 per scale or centroid (= spec.bytes_of)."""
        return self.codes.numel() + 4 * self.scales.numel()

    def wire(self) -> torch.Tensor:
        """One uint8 buffer to send: the scales' (or tables') bytes, then the codes (`nbytes` long)."""
        return torch.cat([self.scales.contiguous().view(torch.uint8), self.codes])

    @staticmethod
    def from_wire(buf: torch.Tensor, spec: Compression, numel: int) -> "Packed":
        """The Packed that `wire()` made, from its buffer (views into `buf`, no copy)."""
        if buf.dtype != torch.uint8 or buf.ndim != 1 or buf.numel() != bytes_of(spec, numel):
            raise ValueError(
                f"Packed.from_wire: expected a 1-D uint8 buffer of {bytes_of(spec, numel)} bytes for {numel} "
                f"entries in {spec.cli()}, got {tuple(buf.shape)} {buf.dtype}"
            )
        nb = 4 * spec.floats_per_block * (-(-numel // spec.block))
        scales = buf[:nb].view(torch.float32) if nb else torch.empty(0, device=buf.device)
        return Packed(buf[nb:], scales, numel, spec.format, spec.block)


# ----------------------------------------------------------------------------------------------
# random bits: a counter-based hash, the same on every rank and in every backend


def mix32(x):
    """A 32-bit integer hash (bijective; H. Wellons' "lowbias32" constants) of a Python int in
    [0, 2^32), or of an int32 tensor holding the bits (uint32 multiplies wrap; right shifts masked)."""
    if isinstance(x, int):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & _M32
        x ^= x >> 15
        x = (x * 0x846CA68B) & _M32
        return x ^ (x >> 16)
    x = x ^ ((x >> 16) & 0xFFFF)
    x = (x.view(torch.uint32) * 0x7FEB352D).view(torch.int32)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = (x.view(torch.uint32) * 0x846CA68B).view(torch.int32)
    return x ^ ((x >> 16) & 0xFFFF)


def _i32(k: int) -> int:
    """The int32 with the bits of the uint32 k."""
    return k - (1 << 32) if k >= 1 << 31 else k


def stream_keys(seed: int, step: int, tensor_id: int) -> tuple[int, int]:
    """The two 32-bit keys of one (seed, step, tensor) stream."""
    ka = mix32(mix32(mix32(seed ^ 0x243F6A88) ^ step) ^ tensor_id)
    return ka, mix32(ka ^ 0x9E3779B9)


def random_bits(keys: tuple[int, int], first: int, count: int, device=None) -> torch.Tensor:
    """32 random bits (as int32) for each element index first … first + count − 1 of a whole tensor:
    mix32(mix32(lo ^ ka) ^ ((kb + hi) mod 2^32)), lo/hi the index's low/high 32 bits."""
    ka, kb = keys
    index = torch.arange(first, first + count, dtype=torch.int64, device=device)
    lo = (index & _M32).to(torch.int32)  # wraps to the same 32 bits
    if first + count <= 1 << 32:
        kb_hi = _i32(kb)
    else:
        kb_hi = (((index >> 32) + kb) & _M32).to(torch.int32)
    return mix32(mix32(lo ^ _i32(ka)) ^ kb_hi)


# ----------------------------------------------------------------------------------------------
# the grid


def _pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^k exactly, for integer tensors k within dtype's normal exponent range."""
    if dtype == torch.float64:
        return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _decode_value(code: int, fmt: Format) -> float:
    """The grid level of one code (Python float, exact)."""
    if not fmt.is_float:
        return float(code - (1 << fmt.bits) if code >> (fmt.bits - 1) else code)
    mag = code & ((1 << (fmt.bits - 1)) - 1)
    if fmt.name == "fp8" and mag == 0x7F:
        return math.nan  # e4m3fn's NaN code: never produced
    f, m = mag >> fmt.mant, mag & ((1 << fmt.mant) - 1)
    value = math.ldexp(m + (f > 0) * (1 << fmt.mant), max(f, 1) - 1 + fmt.emin - fmt.mant)
    return -value if code >> (fmt.bits - 1) else value


_TABLES: dict[tuple[str, bool], torch.Tensor] = {}


def decode_table(fmt: Format, emulate: bool = False) -> torch.Tensor:
    """float32 [2^bits]: code → grid level. fp8 comes from torch.float8_e4m3fn where torch has it
    (emulate=True, or no such dtype: from the e4m3 formula; the two agree, tests/test_compress.py)."""
    key = (fmt.name, emulate or _FP8 is None)
    if key not in _TABLES:
        if fmt.name == "fp8" and not key[1]:
            table = torch.arange(256, dtype=torch.uint8).view(_FP8).float()
        else:
            table = torch.tensor([_decode_value(c, fmt) for c in range(1 << fmt.bits)], dtype=torch.float32)
        _TABLES[key] = table
    return _TABLES[key]


def encode_levels(y: torch.Tensor, fmt: Format, u: Optional[torch.Tensor] = None, emulate: bool = False):
    """(codes int32, levels in y's dtype) of y = x / s (module docstring); u: uniforms in [0, 1) for
    stochastic rounding, None for nearest (torch.round: ties to even). fp8 nearest on float32 goes
    through torch's e4m3fn cast (also ties to even) unless emulate=True; the rest is the arithmetic
    of the module docstring."""
    a = y.abs().clamp_(max=fmt.vmax)
    if fmt.name == "fp8" and u is None and not emulate and _FP8 is not None and y.dtype == torch.float32:
        f8 = a.to(_FP8)
        codes, levels = f8.view(torch.uint8).to(torch.int32), f8.to(y.dtype)
    else:
        if fmt.is_float:
            e = torch.frexp(a.clamp(min=2.0**fmt.emin))[1] - 1  # ⌊log2 a⌋, emin below 2^emin
            t = a * _pow2(fmt.mant - e, y.dtype)  # exact: a power of two
        else:
            t = a
        if u is None:
            n = torch.round(t).to(torch.int32)
        else:
            fl = t.floor()
            n = fl.to(torch.int32) + (u < t - fl).to(torch.int32)
        if fmt.is_float:
            codes = (e - fmt.emin) * (1 << fmt.mant) + n
            levels = n.to(y.dtype) * _pow2(e - fmt.mant, y.dtype)
        else:
            codes, levels = n, n.to(y.dtype)
    levels = torch.copysign(levels, y).add_(0.0)  # the sign of y; a zero level is +0 (−0 + 0 = +0)
    neg = (levels < 0).to(torch.int32)
    if fmt.is_float:
        codes = codes | (neg << (fmt.bits - 1))
    else:
        codes = (codes * (1 - 2 * neg)) & ((1 << fmt.bits) - 1)  # two's complement in `bits` bits
    return codes, levels


# ----------------------------------------------------------------------------------------------
# pack / unpack


def pack_codes(codes: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] from integer codes in [0, 2^bits) (len a multiple of 8/bits, ≥ nbytes·8/bits)."""
    per = 8 // bits
    c = codes.to(torch.uint8)
    if per > 1:
        c = c.view(-1, per)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
        c = (c << shifts).sum(1, dtype=torch.uint8)  # the fields do not overlap: sum = or
    return c[:nbytes].contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [count] codes from `pack_codes`' bytes (entries past the bytes read as 0)."""
    per = 8 // bits
    b = packed.to(torch.int32)
    if per > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=b.device)
        b = ((b[:, None] >> shifts) & ((1 << bits) - 1)).flatten()
    if b.numel() < count:
        b = torch.cat([b, b.new_zeros(count - b.numel())])
    return b[:count]


# ----------------------------------------------------------------------------------------------
# quantize / dequantize


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[nb, block] view of the flat x in its compute dtype, zero-padded to whole blocks."""
    flat = x.reshape(-1).to(compute_dtype(x.dtype))
    pad = -flat.numel() % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def block_scales(xb: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float32 [nb]: float32(absmax / vmax) per row of xb, 0 below MIN_SCALE."""
    s = (xb.abs().amax(1) / fmt.vmax).to(torch.float32)
    return torch.where(s < MIN_SCALE, torch.zeros_like(s), s)


def quantize_blocks(xb: torch.Tensor, spec: Compression, step: int, tensor_id: int, first_block: int, emulate=False):
    """(codes int32 [nb·block], scales float32 [nb], dequantized values in xb's dtype [nb·block]) of
    the finite blocks xb [nb, block] (the contract of the module docstring)."""
    fmt = spec.fmt
    scales = block_scales(xb, fmt)
    if not bool(torch.isfinite(scales).all()):  # only float64 input can get here (absmax/vmax > float32's max)
        raise ValueError(f"a block's absmax / {fmt.vmax:g} exceeds float32's range: the scale cannot be sent")
    s = scales.to(xb.dtype)[:, None]
    live = s > 0
    y = xb / torch.where(live, s, torch.ones_like(s))
    if not bool(live.all()):
        y.mul_(live)  # blocks sent as zeros
    u = None
    if spec.rounding == "stochastic":
        bits = random_bits(stream_keys(spec.seed, step, tensor_id), first_block * spec.block, xb.numel(), xb.device)
        u = ((bits >> 8) & 0xFFFFFF).to(torch.float32).view_as(xb) * 2.0**-24
    codes, levels = encode_levels(y, fmt, u, emulate=emulate)
    deq = (levels.to(torch.float32) * scales[:, None]).to(xb.dtype)  # one float32 product per entry
    return codes.flatten(), scales, deq.flatten()


def encode_blocks(xb: torch.Tensor, n: int, spec: Compression, step: int, tensor_id: int, first_block: int):
    """(codes int32, scales or centroid tables float32, dequantized values in xb's dtype) of the finite blocks
    xb [nb, block] of a tensor of n entries: `quantize_blocks` (blockwise formats) or the statistical formats'
    `encode_stat_blocks`."""
    if spec.is_stat:
        return encode_stat_blocks(xb, n, spec)
    return quantize_blocks(xb, spec, step, tensor_id, first_block)


def check_call(spec, step: int, tensor_id: int, first_block: int) -> None:
    """The checks every entry point makes on (spec, step, tensor_id, first_block)."""
    if not isinstance(spec, Compression):
        raise TypeError(f"spec must be a Compression, got {type(spec).__name__}")
    whole_tensor_spec(spec, "compress")
    _check_u32(step, "step")
    _check_u32(tensor_id, "tensor_id")
    if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
        raise ValueError(f"first_block must be a non-negative int, got {first_block!r}")


def quantize(x: torch.Tensor, spec: Compression, *, step: int = 0, tensor_id: int = 0, first_block: int = 0) -> Packed:
    """Compress the flattened x (float16/bfloat16/float32/float64, finite) into a Packed, on x's
    device, with the torch path. `first_block`: x's first block's index in its whole tensor (a
    chunk starting at a block boundary draws the bits the whole tensor would). Raises ValueError
    on NaN/Inf in x."""
    check_call(spec, step, tensor_id, first_block)
    if not torch.is_floating_point(x) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"quantize: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    n = x.numel()
    if n and not bool(torch.isfinite(x).all()):
        raise ValueError(f"quantize: tensor {tensor_id} contains NaN or Inf; nothing was quantized")
    codes, scales, _ = encode_blocks(_blocks(x.detach(), spec.block), n, spec, step, tensor_id, first_block)
    return Packed(pack_codes(codes, spec.bits, (n * spec.bits + 7) // 8), scales, n, spec.format, spec.block)


def _per_block(fmt) -> int:
    """float32 values per block of a format: its scale (1) or its centroid table (2^bits)."""
    return getattr(fmt, "bins", 1)


def _check_packed(p: Packed) -> None:
    if not isinstance(p, Packed):
        raise TypeError(f"expected a Packed, got {type(p).__name__}")
    fmt = format_of(p.format)
    bits, nb = fmt.bits, -(-p.numel // p.block) * _per_block(fmt)
    what = "scales" if _per_block(fmt) == 1 else "centroids"
    if p.codes.numel() != (p.numel * bits + 7) // 8 or p.scales.numel() != nb or p.codes.dtype != torch.uint8:
        raise ValueError(
            f"Packed of {p.numel} entries in {p.format} (block {p.block}): expected {(p.numel * bits + 7) // 8} "
            f"uint8 code bytes and {nb} {what}, got {p.codes.numel()} {p.codes.dtype} and {p.scales.numel()}"
        )


def dequantize(p: Packed, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat [numel] tensor a Packed stands for: level·s (or its bin's centroid) in float32, then cast to
    `dtype`."""
    _check_packed(p)
    fmt = format_of(p.format)
    nb = -(-p.numel // p.block)
    codes = unpack_codes(p.codes, fmt.bits, nb * p.block)
    if _per_block(fmt) > 1:
        table = p.scales.to(torch.float32).view(nb, fmt.bins)
        values = torch.gather(table, 1, codes.view(nb, p.block).long())
        return values.flatten()[: p.numel].to(dtype)
    levels = torch.index_select(decode_table(fmt).to(p.codes.device), 0, codes).view(nb, p.block)
    return (levels * p.scales.to(torch.float32)[:, None]).flatten()[: p.numel].to(dtype)


def unpack_add_(acc: torch.Tensor, p: Packed) -> torch.Tensor:
    """acc += dequantize(p) (acc flat-viewable, numel entries; the sum in float32 for float16 /
    bfloat16 / float32 acc, rounded once to acc's dtype). Returns acc."""
    if acc.numel() != p.numel:
        raise ValueError(f"unpack_add_: acc has {acc.numel()} entries, the payload {p.numel}")
    flat = acc.view(-1)
    flat.add_(dequantize(p, torch.float32 if acc.dtype != torch.float64 else torch.float64))
    return acc
