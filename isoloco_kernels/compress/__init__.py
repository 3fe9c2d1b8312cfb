"""Compressed exchange: blockwise int8 / fp8 / int4 / fp4 / int2 and statistical stat2 / stat4 formats, error
feedback, pack / unpack, which params stay in full precision (skip) — torch paths beside the Triton kernels
(triton/quant.py). Imports only _validate, reference and triton/; the routes import it.

    spec.py        Compression (format, block, rounding, β, residual dtype, update leg, seed, feedback, k, skip),
                   parse, bytes_of, the skip rule over a model's params and its bytes
    codec.py       the torch path: scales, rounding, random bits, pack / unpack, Packed
    stat.py        the statistical formats' torch path: bins over μ ± kσ, centroid tables
    feedback.py    compress (Δ + residual → payload, new residual) and decompress_add_, and which backend serves
    reference.py   the contract in float64 (tests compare to it)
"""

from .codec import Packed, dequantize, quantize
from .feedback import backend_for, compress, decompress_add_, residual_dtype_for, track
from .spec import (
    FORMATS,
    STAT_FORMATS,
    Compression,
    allreduce_bytes,
    bytes_of,
    exchange_bytes,
    model_exchange_bytes,
    model_residual_bytes,
    parse,
    residual_bytes,
    skip_mask,
)

__all__ = [
    "Compression",
    "FORMATS",
    "STAT_FORMATS",
    "Packed",
    "allreduce_bytes",
    "backend_for",
    "bytes_of",
    "compress",
    "decompress_add_",
    "dequantize",
    "exchange_bytes",
    "model_exchange_bytes",
    "model_residual_bytes",
    "parse",
    "quantize",
    "residual_bytes",
    "residual_dtype_for",
    "skip_mask",
    "track",
]
