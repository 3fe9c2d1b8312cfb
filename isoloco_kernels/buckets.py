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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ._validate import SUPPORTED_DTYPES, check_writable, compute_dtype

__all__ = ["Bucket", "BucketPlan", "bucket_key", "signature"]


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
