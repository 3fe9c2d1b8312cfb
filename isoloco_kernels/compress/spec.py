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

Statistical formats (`STAT_FORMATS`; compress/stat.py has the exact arithmetic): per block of `block` entries,
2^bits bins of equal width over μ ± k·σ (μ, σ: the block's mean and standard deviation; k = `sigmas`, the outer
bins open-ended), each entry coded by its bin, and each bin decoding to its centroid, the mean of the block's
entries in it (an empty bin: its midpoint, clamped to the block's range). The block's centroid table travels
with the codes, 2^bits float32 values per block; μ and σ only place the bins and are not sent:

    format  bits  bins  default k   bytes per tensor of n entries
    stat2   2     4     2.0         ceil(n/4) + 16·ceil(n/block)       (block 256: 0.078× float32)
    stat4   4     16    2.5         ceil(n/2) + 64·ceil(n/block)       (block 1024: 0.141× float32)

Rounding is "nearest" only (a bin's centroid is the mean of its entries; entries beyond the outer centroids
could not round to them unbiasedly). Blocks: 32 … 1024 (the table's bytes amortize over larger blocks).

Which params travel at all compressed is the spec's `skip` rule ("none": every one, the default): a rule over a
model's params, applied by the caller per param (`Compression.for_tensor`, `skip_mask`); the functions that
compress or count one tensor take a per-tensor spec (skip "none") and refuse a rule they cannot apply.
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
    "StatFormat",
    "STAT_FORMATS",
    "STAT_BLOCKS",
    "ROUNDINGS",
    "UPDATES",
    "FEEDBACKS",
    "LEGS",
    "RESIDUAL_DTYPES",
    "SCALE_BYTES",
    "Compression",
    "parse",
    "format_of",
    "bytes_of",
    "residual_bytes",
    "allreduce_bytes",
    "exchange_bytes",
    "skip_mask",
    "model_exchange_bytes",
    "model_residual_bytes",
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


@dataclass(frozen=True)
class StatFormat:
    """A statistical format: per block, `bins` = 2^bits bins of equal width over μ ± k·σ, each decoding to its
    centroid (module docstring); `sigmas` is the default k."""

    name: str
    bits: int
    sigmas: float

    @property
    def bins(self) -> int:
        return 1 << self.bits


#: The statistical formats (each block's centroid table on the wire); FORMATS holds the blockwise absmax ones.
STAT_FORMATS = {
    "stat2": StatFormat("stat2", 2, 2.0),
    "stat4": StatFormat("stat4", 4, 2.5),
}
ROUNDINGS = ("nearest", "stochastic")
#: How the owner's update travels back: in the spec's format, or in the parameters' dtype.
UPDATES = ("compressed", "full")
#: Where error feedback runs when ef_beta is set: both legs, each worker's Δ only (the default), the owner's
#: update only; or "ef21": no residual, each worker sends the correction to its tracked estimate of its Δ and
#: the owner steps on its tracked estimate of the mean (`Compression`).
FEEDBACKS = ("both", "workers", "owner", "ef21")
#: The two legs a spec compresses: each worker's Δ ("workers") and the owner's update ("owner").
LEGS = ("workers", "owner")
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCKS = (32, 64, 128, 256)
#: The statistical formats' blocks: larger ones too, over which a centroid table's bytes amortize.
STAT_BLOCKS = (32, 64, 128, 256, 512, 1024)
#: The smallest scale sent (float32's smallest normal); a block whose absmax / vmax is smaller is sent as zeros
#: (a statistical block: whose absmax is smaller).
MIN_SCALE = 2.0**-126
#: Scales and centroids are float32: 4 bytes each.
SCALE_BYTES = 4
#: k (`sigmas`) is a multiple of 1/16 in (0, 16]: every bin edge k·(2j − bins)/bins is then an exact binary
#: fraction, the same number in every backend.
SIGMAS_STEP = 1 / 16
SIGMAS_MAX = 16.0
#: The terms of a skip rule (`Compression.skip`), joined by "+"; "none" alone keeps every param compressed.
SKIP_TERMS = ("vectors", "vocab=<size>", "name=<prefix>")
_U32 = 1 << 32


def format_of(name: str):
    """The Format (FORMATS) or StatFormat (STAT_FORMATS) called `name`."""
    if name in FORMATS:
        return FORMATS[name]
    if name in STAT_FORMATS:
        return STAT_FORMATS[name]
    raise ValueError(f"unknown compression format {name!r}: one of {list(FORMATS) + list(STAT_FORMATS)}")


def _skip_terms(rule: str) -> tuple[bool, tuple[int, ...], tuple[str, ...]]:
    """(vectors, vocabulary sizes, name prefixes) of a skip rule; ValueError naming a bad term."""
    if not isinstance(rule, str):
        raise TypeError(f"Compression.skip must be a string ('none' or terms joined by '+'), got {rule!r}")
    text = rule.strip()
    if text.lower() == "none":
        return False, (), ()
    vectors, vocabs, names = False, set(), set()
    for term in text.split("+"):
        term = term.strip()
        key, eq, value = term.partition("=")
        key = key.strip().lower()
        if key == "vectors" and not eq:
            vectors = True
        elif key == "vocab" and eq:
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 1:
                raise ValueError(
                    f"Compression.skip {rule!r}: vocab= takes a positive int (the vocabulary size), got {value!r}"
                )
            vocabs.add(size)
        elif key == "name" and eq:
            prefix = value.strip()
            if not prefix or ":" in prefix:
                raise ValueError(
                    f"Compression.skip {rule!r}: name= takes a non-empty param-name prefix without ':', got {value!r}"
                )
            names.add(prefix)
        else:
            raise ValueError(
                f"Compression.skip {rule!r}: unknown term {term!r}; a rule is 'none' or terms joined by '+' "
                f"from {list(SKIP_TERMS)}"
            )
    return vectors, tuple(sorted(vocabs)), tuple(sorted(names))


def _skip_text(vectors: bool, vocabs, names) -> str:
    terms = (["vectors"] if vectors else []) + [f"vocab={v}" for v in vocabs] + [f"name={p}" for p in names]
    return "+".join(terms) or "none"


def _check_u32(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int in [0, 2^32), got {value!r}")
    if not 0 <= value < _U32:
        raise ValueError(f"{what} must be in [0, 2^32), got {value}")
    return value


@dataclass(frozen=True)
class Compression:
    """How one pseudo-gradient is compressed (module docstring: formats, rounding, bytes).

    format          "int8", "fp8", "int4", "fp4" or "int2" (blockwise absmax), "stat2" or "stat4" (statistical)
    block           entries per float32 absmax scale: 32, 64, 128 or 256; per centroid table (statistical
                    formats): 32 … 1024
    rounding        "nearest" (ties to even) or "stochastic" (unbiased, counter-hash bits; blockwise formats only)
    ef_beta         error feedback decay β in (0, 1], or None (off: no residual kept)
    residual_dtype  None (the parameter's dtype), torch.float32, torch.bfloat16 or torch.float16
    update          "compressed": the owner's update goes back in `format` too; "full": in the
                    parameters' dtype
    seed            mixed into the stochastic rounding bits (an int in [0, 2^32))
    feedback        where error feedback runs (ef_beta set): "workers" (the default: each worker's residual on
                    its Δ only; the update sent without one), "both" legs, or "owner" (the owner's residual on
                    the update only; every Δ sent without one; refused with update="full", which has no update
                    leg); or "ef21", tracking instead of a residual: worker k keeps an estimate g_k of its Δ and
                    sends c_k = Q(Δ_k − β·g_k), g_k ← β·g_k + c_k; the owner keeps G ← β·G + mean_k c_k
                    (the mean of the g_k) and merges G, so the quantization error never enters the pre-Iso-C
                    mean; the update goes back without a residual (the mean merges only: "iso_c", "mean");
                    with ef_beta None only the default is accepted
    sigmas          k of the statistical formats (bins over μ ± k·σ): None takes the format's default (2.0 for
                    stat2, 2.5 for stat4); a multiple of 1/16 in (0, 16]. None for the blockwise formats.
    skip            which params stay in full precision: "none" (the default: every param compressed, as before
                    the field existed) or terms joined by "+": "vectors" (every param of fewer than 2 dims),
                    "vocab=<V>" (every matrix with a dimension V: the embedding and the output head when no
                    hidden size equals V), "name=<prefix>" (params whose name starts with it; needs names).
                    A rule over a model: the caller applies it per param (`for_tensor`, `skip_mask`)

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
    sigmas: Optional[float] = None
    skip: str = "none"

    def __post_init__(self):
        if self.format not in FORMATS and self.format not in STAT_FORMATS:
            raise ValueError(
                f"Compression.format must be one of {list(FORMATS) + list(STAT_FORMATS)}, got {self.format!r}"
            )
        stat = self.format in STAT_FORMATS
        if isinstance(self.block, bool) or not isinstance(self.block, int):
            raise TypeError(f"Compression.block must be an int, got {self.block!r}")
        blocks = STAT_BLOCKS if stat else BLOCKS
        if self.block not in blocks:
            raise ValueError(
                f"Compression.block must be one of {list(blocks)} for {self.format} (a power of two), got {self.block}"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"Compression.rounding must be one of {list(ROUNDINGS)}, got {self.rounding!r}")
        if stat and self.rounding != "nearest":
            raise ValueError(
                f"Compression.rounding={self.rounding!r} with {self.format}: the statistical formats round to the "
                "nearest bin only (a bin decodes to the mean of its entries; entries beyond the outer centroids "
                "cannot round to them unbiasedly); use rounding='nearest' or a blockwise format"
            )
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
        if self.feedback == "ef21" and self.residual_dtype is not None:
            raise ValueError(
                f"Compression.residual_dtype={self.residual_dtype} with feedback='ef21': the workers' and the owner's "
                "estimates are both kept in the compute dtype (float32; float64 for float64 params), so the owner's "
                "stays the mean of the workers' (a narrower one stops moving while the owner's keeps adding); leave "
                "residual_dtype None"
            )
        if self.feedback == "owner" and self.update == "full":
            raise ValueError(
                "Compression.feedback='owner' with update='full': the update goes back in full, without a leg "
                "to feed back, so no error feedback would run; use feedback='workers' or update='compressed'"
            )
        k = self.sigmas
        if not stat:
            if k is not None:
                raise ValueError(
                    f"Compression.sigmas applies to the statistical formats {list(STAT_FORMATS)} only; "
                    f"{self.format} has none (got {k!r})"
                )
        elif k is None:
            object.__setattr__(self, "sigmas", STAT_FORMATS[self.format].sigmas)
        else:
            if isinstance(k, bool) or not isinstance(k, (int, float)):
                raise TypeError(f"Compression.sigmas must be a float (k: bins over μ ± k·σ) or None, got {k!r}")
            if not (math.isfinite(k) and 0.0 < k <= SIGMAS_MAX and float(k) / SIGMAS_STEP == int(k / SIGMAS_STEP)):
                raise ValueError(
                    f"Compression.sigmas must be a multiple of 1/16 in (0, {SIGMAS_MAX:g}] (bin edges exact in "
                    f"binary), got {k}"
                )
            object.__setattr__(self, "sigmas", float(k))
        object.__setattr__(self, "skip", _skip_text(*_skip_terms(self.skip)))

    @property
    def fmt(self):
        """The Format (blockwise) or StatFormat (statistical) of `format`."""
        return format_of(self.format)

    @property
    def bits(self) -> int:
        return self.fmt.bits

    @property
    def is_stat(self) -> bool:
        """Whether `format` is a statistical format (a centroid table per block)."""
        return self.format in STAT_FORMATS

    @property
    def floats_per_block(self) -> int:
        """float32 values sent per block: the scale (1), or the centroid table (2^bits)."""
        return STAT_FORMATS[self.format].bins if self.is_stat else 1

    @property
    def skip_prefixes(self) -> tuple[str, ...]:
        """The param-name prefixes the `skip` rule names (its name= terms)."""
        return _skip_terms(self.skip)[2]

    def skips(self, shape, name: Optional[str] = None) -> bool:
        """Whether the `skip` rule keeps a param of this shape (and name) in full precision. Raises ValueError
        when the rule names params (a "name=" term) and no name is given: it cannot tell."""
        vectors, vocabs, names = _skip_terms(self.skip)
        dims = tuple(int(d) for d in shape)
        if vectors and len(dims) < 2:
            return True
        if len(dims) >= 2 and any(v in dims for v in vocabs):
            return True
        if names:
            if name is None:
                raise ValueError(
                    f"Compression.skip={self.skip!r} names params (name=...), but no name was given for the param "
                    f"of shape {dims}: pass the params' names"
                )
            return any(name.startswith(p) for p in names)
        return False

    def for_tensor(self, shape, name: Optional[str] = None) -> Optional["Compression"]:
        """The spec one param of this shape (and name) is compressed with: None when the `skip` rule keeps it
        in full precision, else this spec with skip "none" (what `compress`, `bytes_of`, … take)."""
        if self.skip == "none":
            return self
        return None if self.skips(shape, name) else dataclasses.replace(self, skip="none")

    def leg(self, leg: str) -> "Compression":
        """The spec leg `leg` compresses with: "workers" (each worker's Δ) or "owner" (the owner's update).
        This spec when its error feedback runs on that leg, else the same spec without error feedback
        (ef_beta and residual_dtype None, feedback the default): no residual is made or kept for that leg."""
        if leg not in LEGS:
            raise ValueError(f"Compression.leg: leg must be one of {list(LEGS)}, got {leg!r}")
        if self.ef_beta is None or self.feedback in ("both", leg) or (self.feedback, leg) == ("ef21", "workers"):
            return self
        return dataclasses.replace(self, ef_beta=None, residual_dtype=None, feedback="workers")

    def keeps(self, leg: str) -> bool:
        """Whether leg `leg` keeps a tensor between steps: a residual (error feedback on that leg; none for an
        update sent in full) or, under feedback "ef21", the tracked estimate (each worker's g_k; the owner's G)."""
        if self.feedback == "ef21":
            return self.leg(leg) is not None  # every leg (an unknown one refused by name)
        return self.leg(leg).ef_beta is not None and not (leg == "owner" and self.update == "full")

    def cli(self) -> str:
        """The `parse` string of this spec's format, block, β, rounding, feedback, k and skip rule
        ("int4:128:0.95"; the feedback only when not the default "workers", and then the rounding spelt out
        before it, "int2:128:0.95:nearest:both"; else the rounding only when not "nearest"; then the named
        fields sigmas= when not the format's default and skip= when not "none")."""
        beta = "none" if self.ef_beta is None else f"{self.ef_beta:g}"
        if self.feedback != "workers":
            text = f"{self.format}:{self.block}:{beta}:{self.rounding}:{self.feedback}"
        else:
            tail = ":stochastic" if self.rounding == "stochastic" else ""
            text = f"{self.format}:{self.block}:{beta}{tail}"
        if self.is_stat and self.sigmas != STAT_FORMATS[self.format].sigmas:
            text += f":sigmas={self.sigmas:g}"
        if self.skip != "none":
            text += f":skip={self.skip}"
        return text


#: The fields a spec string may name ("stat2:256:0.95:sigmas=2.5:skip=vectors"), after the positional ones.
NAMED_FIELDS = ("sigmas", "skip")


def parse(text: str, **fields) -> Compression:
    """A spec from a CLI string "format[:block[:beta[:rounding[:feedback]]]][:name=value …]", e.g. "int4:128:0.95"
    (4-bit ints, 128 entries per scale, error feedback with β 0.95 on each worker's Δ only, the default placement)
    or "fp8" (the defaults for the rest); beta "none" or "off" switches error feedback off; feedback
    "workers", "both" or "owner" places it ("int4:128:0.95:nearest:both": on each worker's Δ and on the
    owner's update, the placement before "workers" became the default). After the positional fields, named
    ones: "sigmas=<k>" (the statistical formats' k) and "skip=<rule>" ("stat2:256:0.95:skip=vectors+vocab=256").
    Keyword `fields` set the other Compression fields. Raises ValueError naming the string for a malformed one."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"compression spec: expected 'format[:block[:beta[:rounding[:feedback]]]]', got {text!r}")
    parts, named = [], {}
    for part in text.strip().split(":"):
        key, eq, value = part.partition("=")
        if not eq:
            if named:
                raise ValueError(
                    f"compression spec {text!r}: positional field {part!r} after a named one (named fields come last)"
                )
            parts.append(part)
            continue
        key = key.strip().lower()
        if key not in NAMED_FIELDS:
            raise ValueError(
                f"compression spec {text!r}: unknown named field {key!r} (named fields: {list(NAMED_FIELDS)})"
            )
        if key in named:
            raise ValueError(f"compression spec {text!r}: the field {key!r} is named twice")
        named[key] = value.strip()
    if len(parts) > 5:
        raise ValueError(
            f"compression spec {text!r}: at most 5 fields (format:block:beta:rounding:feedback), got {len(parts)}"
        )
    kw = dict(fields, format=parts[0].lower())
    if "sigmas" in named:
        try:
            kw["sigmas"] = float(named["sigmas"])
        except ValueError:
            raise ValueError(f"compression spec {text!r}: sigmas must be a float, got {named['sigmas']!r}") from None
    if "skip" in named:
        kw["skip"] = named["skip"]
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


def whole_tensor_spec(spec, what: str) -> None:
    """Refuse, naming `what`, a spec whose skip rule is not "none": a function that compresses or counts one
    tensor cannot apply a rule over a model's params (the caller takes `spec.for_tensor(shape, name)`)."""
    if not isinstance(spec, Compression):
        raise TypeError(f"{what}: spec must be a Compression, got {type(spec).__name__}")
    if spec.skip != "none":
        raise ValueError(
            f"{what}: the spec's skip={spec.skip!r} keeps some params in full precision, a rule over a model's "
            "params; this call compresses or counts one tensor and cannot apply it. Take spec.for_tensor(shape, "
            "name) for each param (None: it travels in full precision), or use skip='none'"
        )


def bytes_of(spec: Compression, numel: int) -> int:
    """Exact bytes of one compressed tensor of `numel` entries: packed codes plus float32 scales (one per
    block), or the statistical formats' centroid tables (2^bits float32 values per block)."""
    whole_tensor_spec(spec, "bytes_of")
    n = _numel(numel)
    return (n * spec.bits + 7) // 8 + SCALE_BYTES * spec.floats_per_block * (-(-n // spec.block))


def residual_bytes(spec: Compression, numel: int, param_dtype: torch.dtype, leg: str = "workers") -> int:
    """Memory of the tensor leg `leg` keeps per param (`Compression.keeps`) — "workers": a worker's residual on its
    Δ (or its ef21 estimate); "owner": the owner's residual on the update (or its ef21 estimate of the mean),
    whose default dtype is float32 for float32 / bfloat16 / float16 params; 0 where the leg keeps none."""
    whole_tensor_spec(spec, "residual_bytes")
    if not spec.keeps(leg):
        return 0
    if (leg == "owner" or spec.feedback == "ef21") and spec.residual_dtype is None:
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
    whole_tensor_spec(spec, "exchange_bytes")
    if world < 1:
        raise ValueError(f"world must be ≥ 1, got {world}")
    share = (world - 1) / world
    back = (
        bytes_of(spec, numel)
        if spec.update == "compressed"
        else numel * torch.empty((), dtype=param_dtype).element_size()
    )
    return share * (bytes_of(spec, numel) + back)


# -- a model's params under a skip rule ------------------------------------------------------------------------


def _model(spec: Compression, shapes, dtypes, names, what: str):
    """(per-param specs or None, dtypes) of a model's params, checked."""
    if not isinstance(spec, Compression):
        raise TypeError(f"{what}: spec must be a Compression, got {type(spec).__name__}")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    dtypes = [torch.float32] * len(shapes) if dtypes is None else list(dtypes)
    if names is not None:
        names = list(names)
    if len(dtypes) != len(shapes) or (names is not None and len(names) != len(shapes)):
        raise ValueError(f"{what}: shapes, dtypes and names must be as many (one per param)")
    specs = [spec.for_tensor(s, None if names is None else names[i]) for i, s in enumerate(shapes)]
    return shapes, specs, dtypes


def skip_mask(spec: Compression, shapes, names=None) -> list[bool]:
    """Per param (shapes in order; names too where the caller has them): True where the spec's skip rule keeps
    it in full precision. Raises ValueError where the rule names params and `names` is None."""
    return [s is None for s in _model(spec, shapes, None, names, "skip_mask")[1]]


def model_exchange_bytes(spec: Compression, shapes, world: int, dtypes=None, names=None) -> float:
    """Bytes one rank sends per step on the compressed owner route for a model's params (`exchange_bytes` per
    compressed param; a param the skip rule keeps goes in its dtype both ways — Δ to its owner, θ' back, as
    update="full" sends it: 2·(W − 1)/W·itemsize per entry). dtypes: the params' (default float32)."""
    if world < 1:
        raise ValueError(f"world must be ≥ 1, got {world}")
    shapes, specs, dtypes = _model(spec, shapes, dtypes, names, "model_exchange_bytes")
    total = 0.0
    for shape, s, dt in zip(shapes, specs, dtypes):
        n = math.prod(shape)
        if s is None:
            total += 2 * (world - 1) / world * torch.empty((), dtype=dt).element_size() * n
        else:
            total += exchange_bytes(s, n, world, dt)
    return total


def model_residual_bytes(spec: Compression, shapes, dtypes=None, names=None, leg: str = "workers") -> int:
    """Memory of a model's error-feedback residuals on leg `leg` (`residual_bytes` per compressed param; a param
    the skip rule keeps in full precision keeps none)."""
    shapes, specs, dtypes = _model(spec, shapes, dtypes, names, "model_residual_bytes")
    return sum(residual_bytes(s, math.prod(sh), dt, leg) for sh, s, dt in zip(shapes, specs, dtypes) if s is not None)
