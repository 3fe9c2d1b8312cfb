"""The compression spec: what a compressed pseudo-gradient exchange sends, and how many bytes that is.

Formats (every one blockwise: one float32 absmax scale per `block` consecutive entries of a flat
tensor, s = absmax / vmax, the block's entries coded as grid levels ℓ with x ≈ ℓ·s):

    format  bits  grid levels ℓ (all of them; symmetric, 0 included)          vmax   half step at ℓ
    int8    8     −127 … 127 (integers; the code −128 is never sent)          127    0.5
    fp8     8     float8 e4m3fn values: ±{0, 2⁻⁹·1 … 2⁻⁹·7, 2⁻⁶ … 448}         448    2^(e−4), e = max(⌊log2|ℓ|⌋, −6)
    int4    4     −7 … 7 (the code −8 is never sent)                          7      0.5
    fp4     4     e2m1 values: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}                   6      2^(e−2), e = max(⌊log2|ℓ|⌋, 0)
    int2    2     −1, 0, +1 (ternary; the code −2 is never sent)               1      0.5

Rounding: "nearest" rounds x/s to the nearest level, ties to the even neighbour (the one whose last
code bit is 0, as IEEE round-to-nearest-even); "stochastic" rounds up with probability equal to
the distance to the lower neighbour over the step, so E[ℓ]·s = x, from random bits that are a
counter-based hash of (seed, step, tensor index, element index in the tensor) — the same bits on
every rank and for every world size (compress/codec.py, `random_bits`).

Error feedback (β = `ef_beta`, None = off): c = Q(Δ + e), e ← β·(Δ + e − c), e kept in `residual_dtype`
(None: the parameter's dtype). `feedback` places it: "workers" (the default) on each worker's Δ only, the
owner's update sent without a residual; "both" on each worker's Δ and on the owner's update; "owner" on the
update only (`Compression.leg`: the spec each leg compresses with). At 2 bits the owner-side residual raised
Iso-C's test loss (docs/compression.md, the study section), hence the default. Bytes on the wire per tensor
of n entries: ceil(n·bits/8) code bytes + 4·ceil(n/block) scale bytes (`bytes_of`); at block 128 that is
0.258× (8-bit), 0.133× (4-bit) and 0.070× (2-bit) of the same tensor in float32.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = [
    "Format",
    "FORMATS",
    "ROUNDINGS",
    "UPDATES",
    "FEEDBACKS",
    "LEGS",
    "RESIDUAL_DTYPES",
    "SCALE_BYTES",
    "Compression",
    "parse",
    "bytes_of",
    "residual_bytes",
    "allreduce_bytes",
    "exchange_bytes",
]


@dataclass(frozen=True)
class Format:
    """One element format: `bits` per entry, integer or float grid, and the float grid's shape.

    Float grids (IEEE-like, no inf/NaN codes used): `mant` mantissa bits, `emin` the smallest
    normal exponent; below 2^emin the levels are the subnormals k·2^(emin − mant)."""

    name: str
    bits: int
    is_float: bool
    vmax: float
    mant: int = 0
    emin: int = 0


FORMATS = {
    "int8": Format("int8", 8, False, 127.0),
    "fp8": Format("fp8", 8, True, 448.0, mant=3, emin=-6),
    "int4": Format("int4", 4, False, 7.0),
    "fp4": Format("fp4", 4, True, 6.0, mant=1, emin=0),
    "int2": Format("int2", 2, False, 1.0),
}
ROUNDINGS = ("nearest", "stochastic")
#: How the owner's update travels back: in the spec's format, or in the parameters' dtype.
UPDATES = ("compressed", "full")
#: Where error feedback runs when ef_beta is set: both legs, each worker's Δ only (the default), the owner's
#: update only.
FEEDBACKS = ("both", "workers", "owner")
#: The two legs a spec compresses: each worker's Δ ("workers") and the owner's update ("owner").
LEGS = ("workers", "owner")
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCKS = (32, 64, 128, 256)
#: Scales are float32: 4 bytes per block.
SCALE_BYTES = 4
_U32 = 1 << 32


def _check_u32(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int in [0, 2^32), got {value!r}")
    if not 0 <= value < _U32:
        raise ValueError(f"{what} must be in [0, 2^32), got {value}")
    return value


@dataclass(frozen=True)
class Compression:
    """How one pseudo-gradient is compressed (module docstring: formats, rounding, bytes).

    format          "int8", "fp8", "int4", "fp4" or "int2"
    block           entries per float32 absmax scale: 32, 64, 128 or 256
    rounding        "nearest" (ties to even) or "stochastic" (unbiased, counter-hash bits)
    ef_beta         error feedback decay β in (0, 1], or None (off: no residual kept)
    residual_dtype  None (the parameter's dtype), torch.float32, torch.bfloat16 or torch.float16
    update          "compressed": the owner's update goes back in `format` too; "full": in the
                    parameters' dtype
    seed            mixed into the stochastic rounding bits (an int in [0, 2^32))
    feedback        where error feedback runs (ef_beta set): "workers" (the default: each worker's residual on
                    its Δ only; the update sent without one), "both" legs, or "owner" (the owner's residual on
                    the update only; every Δ sent without one; refused with update="full", which has no update
                    leg); with ef_beta None only the default is accepted

    Wherever `compress=` is taken (`ShardedIsoLoCo`, `MergeLoCo`, the reference loop's `--compress`), its string
    form works too: "int4:128:0.95" is `parse`'s format[:block[:beta[:rounding[:feedback]]]].

    Raises:
        TypeError: a field of the wrong type (named).
        ValueError: a field's value outside the choices above (named).

    Examples:
        >>> spec = Compression(format="int4", block=128, ef_beta=0.95)  # the string "int4:128:0.95"
        >>> (spec.format, spec.block, spec.feedback)
        ('int4', 128, 'workers')
    """

    format: str = "int8"
    block: int = 128
    rounding: str = "nearest"
    ef_beta: Optional[float] = None
    residual_dtype: Optional[torch.dtype] = None
    update: str = "compressed"
    seed: int = 0
    feedback: str = "workers"

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"Compression.format must be one of {list(FORMATS)}, got {self.format!r}")
        if isinstance(self.block, bool) or not isinstance(self.block, int):
            raise TypeError(f"Compression.block must be an int, got {self.block!r}")
        if self.block not in BLOCKS:
            raise ValueError(f"Compression.block must be one of {list(BLOCKS)} (a power of two), got {self.block}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"Compression.rounding must be one of {list(ROUNDINGS)}, got {self.rounding!r}")
        beta = self.ef_beta
        if beta is not None:
            if isinstance(beta, bool) or not isinstance(beta, (int, float)):
                raise TypeError(f"Compression.ef_beta must be a float in (0, 1] or None, got {beta!r}")
            if not (math.isfinite(beta) and 0.0 < beta <= 1.0):
                raise ValueError(
                    f"Compression.ef_beta must be in (0, 1] (None switches error feedback off), got {beta}"
                )
            object.__setattr__(self, "ef_beta", float(beta))
        if self.residual_dtype is not None:
            if self.ef_beta is None:
                raise ValueError("Compression.residual_dtype is set but ef_beta is None: error feedback is off")
            if self.residual_dtype not in RESIDUAL_DTYPES:
                raise ValueError(
                    f"Compression.residual_dtype must be None (the parameter's dtype) or one of "
                    f"{[str(d) for d in RESIDUAL_DTYPES]}, got {self.residual_dtype!r}"
                )
        if self.update not in UPDATES:
            raise ValueError(f"Compression.update must be one of {list(UPDATES)}, got {self.update!r}")
        _check_u32(self.seed, "Compression.seed")
        if self.feedback not in FEEDBACKS:
            raise ValueError(f"Compression.feedback must be one of {list(FEEDBACKS)}, got {self.feedback!r}")
        if self.feedback != "workers" and self.ef_beta is None:
            raise ValueError(
                f"Compression.feedback is set but ef_beta is None: error feedback is off (feedback={self.feedback!r}; "
                "leave it at the default 'workers' or set ef_beta)"
            )
        if self.feedback == "owner" and self.update == "full":
            raise ValueError(
                "Compression.feedback='owner' with update='full': the update goes back in full, without a leg "
                "to feed back, so no error feedback would run; use feedback='workers' or update='compressed'"
            )

    @property
    def fmt(self) -> Format:
        return FORMATS[self.format]

    @property
    def bits(self) -> int:
        return FORMATS[self.format].bits

    def leg(self, leg: str) -> "Compression":
        """The spec leg `leg` compresses with: "workers" (each worker's Δ) or "owner" (the owner's update).
        This spec when its error feedback runs on that leg, else the same spec without error feedback
        (ef_beta and residual_dtype None, feedback the default): no residual is made or kept for that leg."""
        if leg not in LEGS:
            raise ValueError(f"Compression.leg: leg must be one of {list(LEGS)}, got {leg!r}")
        if self.ef_beta is None or self.feedback in ("both", leg):
            return self
        return dataclasses.replace(self, ef_beta=None, residual_dtype=None, feedback="workers")

    def cli(self) -> str:
        """The `parse` string of this spec's format, block, β, rounding and feedback ("int4:128:0.95"; the
        feedback only when not the default "workers", and then the rounding spelt out before it,
        "int2:128:0.95:nearest:both"; else the rounding only when not "nearest")."""
        beta = "none" if self.ef_beta is None else f"{self.ef_beta:g}"
        if self.feedback != "workers":
            return f"{self.format}:{self.block}:{beta}:{self.rounding}:{self.feedback}"
        tail = ":stochastic" if self.rounding == "stochastic" else ""
        return f"{self.format}:{self.block}:{beta}{tail}"


def parse(text: str, **fields) -> Compression:
    """A spec from a CLI string "format[:block[:beta[:rounding[:feedback]]]]", e.g. "int4:128:0.95" (4-bit
    ints, 128 entries per scale, error feedback with β 0.95 on each worker's Δ only, the default placement)
    or "fp8" (the defaults for the rest); beta "none" or "off" switches error feedback off; feedback
    "workers", "both" or "owner" places it ("int4:128:0.95:nearest:both": on each worker's Δ and on the
    owner's update, the placement before "workers" became the default). Keyword `fields` set the other
    Compression fields. Raises ValueError naming the string for a malformed one."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"compression spec: expected 'format[:block[:beta[:rounding[:feedback]]]]', got {text!r}")
    parts = text.strip().split(":")
    if len(parts) > 5:
        raise ValueError(
            f"compression spec {text!r}: at most 5 fields (format:block:beta:rounding:feedback), got {len(parts)}"
        )
    kw = dict(fields, format=parts[0].lower())
    try:
        if len(parts) > 1 and parts[1]:
            kw["block"] = int(parts[1])
        if len(parts) > 2 and parts[2]:
            kw["ef_beta"] = None if parts[2].lower() in ("none", "off") else float(parts[2])
    except ValueError as e:
        raise ValueError(f"compression spec {text!r}: block must be an int and beta a float or 'none' ({e})") from None
    if len(parts) > 3 and parts[3]:
        kw["rounding"] = parts[3].lower()
    if len(parts) > 4 and parts[4]:
        kw["feedback"] = parts[4].lower()
    try:
        return Compression(**kw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"compression spec {text!r}: {e}") from None


def _numel(numel) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    return numel


def bytes_of(spec: Compression, numel: int) -> int:
    """Exact bytes of one compressed tensor of `numel` entries: packed codes plus float32 scales."""
    n = _numel(numel)
    return (n * spec.bits + 7) // 8 + SCALE_BYTES * (-(-n // spec.block))


def residual_bytes(spec: Compression, numel: int, param_dtype: torch.dtype, leg: str = "workers") -> int:
    """Memory of one tensor's error-feedback residual on leg `leg` ("workers": a worker's, on its Δ; "owner":
    the owner's, on the update, whose default dtype is float32 for float32 / bfloat16 / float16 params);
    0 when error feedback is off or not on that leg (`Compression.leg`)."""
    spec = spec.leg(leg)
    if spec.ef_beta is None or (leg == "owner" and spec.update == "full"):
        return 0
    if leg == "owner" and spec.residual_dtype is None:
        param_dtype = torch.float64 if param_dtype == torch.float64 else torch.float32
    dt = spec.residual_dtype or param_dtype
    return _numel(numel) * torch.empty((), dtype=dt).element_size()


def allreduce_bytes(numel: int, world: int, itemsize: int = 4) -> float:
    """Bytes one rank sends in a ring all-reduce of `numel` entries of `itemsize` bytes:
    2·(W − 1)/W·itemsize·numel (reduce-scatter + all-gather) — the uncompressed baseline."""
    if world < 1:
        raise ValueError(f"world must be ≥ 1, got {world}")
    return 2 * (world - 1) / world * itemsize * _numel(numel)


def exchange_bytes(spec: Compression, numel: int, world: int, param_dtype: torch.dtype = torch.float32) -> float:
    """Bytes one rank sends in the compressed owner route (the model the collectives should meet):
    (W − 1)/W of the compressed Δ in the all-to-all, and (W − 1)/W of the update back in the
    all-gather, compressed (`update="compressed"`) or in `param_dtype` (`update="full"`)."""
    if world < 1:
        raise ValueError(f"world must be ≥ 1, got {world}")
    share = (world - 1) / world
    back = (
        bytes_of(spec, numel)
        if spec.update == "compressed"
        else numel * torch.empty((), dtype=param_dtype).element_size()
    )
    return share * (bytes_of(spec, numel) + back)
