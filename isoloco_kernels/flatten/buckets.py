"""Group matrices by shape into batched [B, m, n] buffers, so one batched flatten serves many.

A model's 2-D parameters come in a handful of shapes (per layer: q/k/v/o, up/down, ...), so the
Iso-C flatten of every pseudo-gradient runs as one batched call per shape instead of one per
matrix. A matrix and its transpose share a bucket, since iso(Δᵀ) = iso(Δ)ᵀ: each bucket holds its
matrices in one canonical orientation, m ≤ n (wide or square), and tall members are stored
transposed.

    plan = BucketPlan(grads)          # once; reuse while the tensors keep shape/dtype/device
    plan.pack(grads)                  # every step: copy into the buffers (transposing tall ones)
    iso_merge_(plan.buffers)          # flatten each bucket in place
    plan.views()                      # each tensor's result, a view in its own orientation
    plan.unpack(grads)                # or copy the results back

Memory: one buffer per bucket, [B, m, n] in the compute dtype (float32 for float16/bfloat16/float32
inputs, float64 for float64), so the buffers together take as many elements as the planned
matrices — `plan.nbytes` says how many bytes. They are allocated when the plan is made and reused by
every pack.

1-D and ≥3-D tensors are not matrices and are not planned here; callers pass them through (Iso-C
and IsoLoCo average them plainly).

Bounded workspace: a flatten method's scratch grows with the batch it is given (`WORKSPACE_MODEL`:
bytes per element and per r² of each matrix, measured on the CPU with torch's MemTracker,
bench/memory_model.py), so `flatten_chunked_` hands a [B, m, n] buffer to the method in slices
of at most `chunk_rows` matrices, each slice's scratch within `workspace_bytes()` (2 GiB unless
$ISOLOCO_WORKSPACE_BYTES says otherwise). A single matrix whose own scratch is larger than that
is flattened alone: the bound is then that matrix's scratch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .._validate import SUPPORTED_DTYPES, ResultOverflowError, check_writable, compute_dtype

__all__ = [
    "WORKSPACE_BYTES",
    "WORKSPACE_ENV",
    "WORKSPACE_MODEL",
    "Bucket",
    "BucketPlan",
    "bucket_key",
    "chunk_rows",
    "flatten_chunked_",
    "method_workspace",
    "signature",
    "workspace_bytes",
]

#: Default scratch one flatten call may take beside its input (bytes): 2 GiB.
WORKSPACE_BYTES = 2 << 30
#: Environment override of WORKSPACE_BYTES (an integer number of bytes > 0).
WORKSPACE_ENV = "ISOLOCO_WORKSPACE_BYTES"

#: Peak scratch of each method per matrix of a [B, r, k] batch (r ≤ k), in bytes: a·r·k + b·r²,
#: (a, b) per compute dtype. Fitted to torch MemTracker peaks on the CPU over wide, tall and square
#: batches of random Gaussians (some of whose matrices take each method's fallback), then raised
#: by the fit's worst under-estimate and 20 %: `python bench/memory_model.py --fit` measures them.
WORKSPACE_MODEL = {
    torch.float32: {
        "svd": (50.7, 9.7),
        "eigh": (42.1, 9.7),
        "polar": (18.9, 20.5),
        "polar_bf16": (27.5, 13.7),
        "gram": (7.0, 44.9),
        "polar_tf32x3": (48.0, 15.0),
        "fast": (25.1, 27.6),
    },
    torch.float64: {
        "svd": (50.7, 9.7),
        "eigh": (57.3, 17.3),
        "polar": (36.5, 41.4),
        "polar_bf16": (39.4, 12.3),
        "gram": (13.8, 39.1),
        "polar_tf32x3": (36.5, 41.4),
        "fast": (33.5, 49.4),
    },
}


def bucket_key(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> tuple:
    """(device, buffer dtype, canonical shape) — the bucket a 2-D tensor belongs to."""
    m, n = t.shape
    return (t.device, dtype or compute_dtype(t.dtype), (min(m, n), max(m, n)))


def signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """What a plan depends on: each tensor's shape, dtype and device, in order."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


@dataclass
class Bucket:
    """Matrices of one canonical shape [m, n] (m ≤ n), dtype and device, in one [B, m, n] buffer."""

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    members: list[int] = field(default_factory=list)  # indices into the planned tensor list
    transposed: list[bool] = field(default_factory=list)  # member stored as its transpose
    buffer: Optional[torch.Tensor] = None

    def slots(self) -> list[torch.Tensor]:
        """Each member's slot as a view in the member's own orientation."""
        return [self.buffer[j].mT if tr else self.buffer[j] for j, tr in enumerate(self.transposed)]


class BucketPlan:
    """The bucketing of a list of 2-D tensors, with its buffers; see the module docstring.

    dtype: the buffers' dtype; None (default) means each tensor's compute dtype.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], *, dtype: Optional[torch.dtype] = None):
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"BucketPlan: tensor {i} is a {type(t).__name__}, not a torch.Tensor")
            if t.ndim != 2:
                raise ValueError(f"BucketPlan: tensor {i} has shape {tuple(t.shape)}; only 2-D tensors are bucketed")
            if t.dtype not in SUPPORTED_DTYPES:
                raise TypeError(f"BucketPlan: tensor {i} has unsupported dtype {t.dtype}")
        self.signature = signature(tensors)
        self.buckets: list[Bucket] = []
        self.where: list[tuple[int, int]] = []  # tensor i → (bucket, position)
        index: dict[tuple, int] = {}
        for i, t in enumerate(tensors):
            key = bucket_key(t, dtype)
            if key not in index:
                index[key] = len(self.buckets)
                self.buckets.append(Bucket(shape=key[2], dtype=key[1], device=key[0]))
            b = self.buckets[index[key]]
            self.where.append((index[key], len(b.members)))
            b.members.append(i)
            b.transposed.append(t.shape[0] > t.shape[1])
        for b in self.buckets:
            b.buffer = torch.empty((len(b.members), *b.shape), dtype=b.dtype, device=b.device)
        self._views = [None] * len(tensors)
        for b in self.buckets:
            for i, v in zip(b.members, b.slots()):
                self._views[i] = v

    def __len__(self) -> int:
        return len(self.where)

    def __repr__(self) -> str:
        parts = ", ".join(f"{len(b.members)}×{b.shape[0]}×{b.shape[1]} {str(b.dtype)[6:]}" for b in self.buckets)
        return f"BucketPlan({len(self)} matrices in {len(self.buckets)} buckets: {parts})"

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The [B, m, n] buffers, one per bucket, in the order the buckets were first met."""
        return [b.buffer for b in self.buckets]

    @property
    def nbytes(self) -> int:
        """Memory held by the buffers."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def matches(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these tensors have the shapes, dtypes and devices the plan was made for."""
        return signature(tensors) == self.signature

    def _check(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if not self.matches(tensors):
            more = "…" if len(self) > 4 else ""
            raise ValueError(
                f"BucketPlan.{what}: the tensors do not match the plan (made for {len(self)} tensors "
                f"with shapes/dtypes/devices {self.signature[:4]}{more}); make a new plan"
            )
        return tensors

    def views(self) -> list[torch.Tensor]:
        """Tensor i's slot in its bucket, as a [m_i, n_i] view in tensor i's own orientation
        (strided for transposed members). Valid until the plan is dropped."""
        return list(self._views)

    def pack(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy the tensors into their slots (cast to the buffer dtype); returns the buffers."""
        tensors = self._check(tensors, "pack")
        if tensors:
            torch._foreach_copy_(self._views, [t.detach() for t in tensors])
        return self.buffers

    def unpack(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy each slot back into its tensor (cast to the tensor's dtype), in place. The
        tensors are checked first (no expanded views, no two sharing memory, …): all or none
        are written."""
        tensors = self._check(tensors, "unpack")
        check_writable([t.detach() for t in tensors], [f"BucketPlan.unpack: tensor {i}" for i in range(len(tensors))])
        if tensors:
            torch._foreach_copy_([t.detach() for t in tensors], self._views)


def workspace_bytes() -> int:
    """The scratch budget of one flatten call: $ISOLOCO_WORKSPACE_BYTES if set, else WORKSPACE_BYTES."""
    env = os.environ.get(WORKSPACE_ENV, "").strip()
    if not env:
        return WORKSPACE_BYTES
    try:
        value = int(env)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{WORKSPACE_ENV} must be a whole number of bytes > 0, got {env!r}")
    return value


def method_workspace(method: str, m: int, n: int, dtype: torch.dtype, kind: str = "cuda") -> int:
    """Modelled peak scratch (bytes) of flattening one m×n matrix whose compute dtype is `dtype`
    with `method` (a registry name other than "auto"; `WORKSPACE_MODEL`, its largest coefficients
    for a method it has no row for). "fast" on a shape its Gram route serves on a device of `kind`
    (fast.route_for) takes that route's model instead (fast_gram.workspace: O(r²) and one block)."""
    if method == "fast":
        from . import fast, fast_gram

        if fast.route_for(m, n, kind) == "gram":
            return fast_gram.workspace(m, n, 8 if compute_dtype(dtype) == torch.float64 else 4)
    table = WORKSPACE_MODEL[torch.float64 if compute_dtype(dtype) == torch.float64 else torch.float32]
    # a method without a row: the largest of every row's coefficients (an upper bound, not a model)
    a, b = table.get(method) or (max(a for a, _ in table.values()), max(b for _, b in table.values()))
    r, k = min(m, n), max(m, n)
    if method == "gram":  # its column blocks stop growing at gram.COLUMN_BLOCK_BYTES (the fit's a·r·k below)
        from .gram import COLUMN_BLOCK_BYTES

        return math.ceil(min(a * r * k, COLUMN_BLOCK_BYTES) + b * r * r)
    return math.ceil(a * r * k + b * r * r)


def chunk_rows(method: str, x3: torch.Tensor, workspace: Optional[int] = None) -> int:
    """How many matrices of the [B, m, n] batch x3 one call of `method` may take so that its
    modelled scratch stays within `workspace` (default `workspace_bytes()`); at least 1."""
    from .registry import resolve_method

    _, m, n = x3.shape
    resolved = resolve_method(method, x3[:1])
    from .fast import device_kind

    per = method_workspace(resolved, m, n, x3.dtype, device_kind(x3))
    if resolved == "polar" or resolved == "polar_bf16":  # the matrices missing its check go to gram
        per = max(per, method_workspace("gram", m, n, x3.dtype))
    budget = workspace_bytes() if workspace is None else workspace
    return max(1, min(x3.shape[0], budget // max(per, 1)))


def flatten_chunked_(x: torch.Tensor, method: str, workspace: Optional[int] = None) -> None:
    """The flatten of a checked [m, n] or [B, m, n] tensor (finite, writable: the op's checks,
    done by the caller) in slices of `chunk_rows` matrices, each in place: scratch bounded by
    `workspace` instead of growing with B. A slice whose result does not fit its dtype raises
    ResultOverflowError with the matrix index in x; the slices before it are already written, so
    callers flatten scratch buffers (IsoLoCo's buckets) or copies (iso_merge_)."""
    from .registry import iso_flatten_impl

    if x.numel() == 0:
        return
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    step = chunk_rows(method, x3, workspace)
    for start in range(0, x3.shape[0], step):
        try:
            iso_flatten_impl(x3[start : start + step], method)
        except ResultOverflowError as e:
            if e.matrix is None:
                raise
            i = start + e.matrix
            raise ResultOverflowError(str(e).replace(f"matrix {e.matrix}", f"matrix {i}", 1), matrix=i) from None
