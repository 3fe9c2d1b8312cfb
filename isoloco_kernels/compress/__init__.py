"""Compressed exchange: blockwise int8 / fp8 / int4 / fp4 / int2 formats, error feedback, pack / unpack — torch paths
beside the Triton kernels (triton/quant.py). Imports only _validate, reference and triton/; the routes import it.

    spec.py        Compression (format, block, rounding, β, residual dtype, update leg, seed), parse, bytes_of
    codec.py       the torch path: scales, rounding, random bits, pack / unpack, Packed
    feedback.py    compress (Δ + residual → payload, new residual) and decompress_add_, and which backend serves
    reference.py   the contract in float64 (tests compare to it)
"""

from .codec import Packed, dequantize, quantize
from .feedback import backend_for, compress, decompress_add_, residual_dtype_for
from .spec import FORMATS, Compression, allreduce_bytes, bytes_of, exchange_bytes, parse, residual_bytes

__all__ = [
    "Compression",
    "FORMATS",
    "Packed",
    "allreduce_bytes",
    "backend_for",
    "bytes_of",
    "compress",
    "decompress_add_",
    "dequantize",
    "exchange_bytes",
    "parse",
    "quantize",
    "residual_bytes",
    "residual_dtype_for",
]
