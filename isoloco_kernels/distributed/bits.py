"""Exact fingerprints of tensors' bits: what replicas compare to know they hold the same values.

`bit_fingerprints(tensors)` gives each tensor a 64-bit hash of its shape, dtype and every
element's bit pattern in logical (row-major) order: h = Σᵢ bits(xᵢ)·wᵢ mod 2⁶⁴ with wᵢ an odd
pseudo-random weight of the position i (splitmix64 of i). Tensors with the same bits have the same
hash on every device and every machine; a change of any one element (one ulp, a sign, -0.0 for
0.0) always changes it (wᵢ is odd, so bits·wᵢ ≢ 0), and a permutation or scattered noise changes it
but with probability 2⁻⁶⁴. One pass over each tensor in int64 slices of `CHUNK` elements; one host
sync per device.

`checksums(tensors)` is the cheap one, for values the ranks re-read every step (a replica's params): one
reduction pass over each tensor's bits read as 8-byte words, in rows of `ROW` words (int64 row sums, wrapping,
no copy of the tensor: about the time of a float sum over it), then the row sums weighted as above (a pass
over 1/ROW of its words). Equal bits give equal checksums;
any single change, a sign, -0.0 for 0.0, and any change that does not cancel in every row's sum changes it
(what can pass: bits swapped within a row, or changes within a row that sum to zero).
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

__all__ = ["CHUNK", "ROW", "bit_fingerprints", "checksums"]

#: Elements per int64 slice (32 MiB a temporary): never an int64 copy of a whole tensor.
CHUNK = 1 << 22

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic on every device)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
_MASK = (1 << 64) - 1


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 by k (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _weights(a: int, b: int, device) -> torch.Tensor:
    """Odd pseudo-random int64 weights of positions [a, b): splitmix64 of the position (wrapping)."""
    z = torch.arange(a, b, dtype=torch.int64, device=device) * _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return (z ^ _srl(z, 31)) | 1


def _one(t: torch.Tensor) -> Optional[torch.Tensor]:
    """This tensor's element hash as a 0-d int64 tensor on its device (None: no elements)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return None
    bits = flat.view(_INT[flat.element_size()])
    h = torch.zeros((), dtype=torch.int64, device=flat.device)
    for a in range(0, bits.numel(), CHUNK):
        part = bits[a : a + CHUNK].to(torch.int64)
        h += (part * _weights(a, a + part.numel(), flat.device)).sum()
    return h


def _head(t: torch.Tensor) -> int:
    """64 bits of the tensor's shape and dtype (sha256: the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.sha256(repr((tuple(t.shape), str(t.dtype))).encode()).digest()[:8], "little")


def bit_fingerprints(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A 64-bit hash of each tensor's shape, dtype and bits (see the module docstring), as ints."""
    sums: list[Optional[torch.Tensor]] = [_one(t) for t in tensors]
    per_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        if s is not None:
            per_device.setdefault(s.device, []).append(i)
    values = [0] * len(tensors)
    for idx in per_device.values():
        for i, v in zip(idx, torch.stack([sums[i] for i in idx]).tolist()):
            values[i] = v & _MASK
    head = [_head(t) for t in tensors]
    return [(v ^ (h * 0x9E3779B97F4A7C15)) & _MASK for v, h in zip(values, head)]


#: 8-byte words per row of `checksums`: one int64 sum each, weighted by its row's position.
ROW = 512


def _checksum(t: torch.Tensor) -> Optional[torch.Tensor]:
    """This tensor's checksum as a 0-d int64 tensor on its device (None: no elements)."""
    flat = t.detach().reshape(-1)  # a view of a contiguous tensor
    if flat.numel() == 0:
        return None
    if (flat.storage_offset() * flat.element_size()) % 8:  # not 8-aligned: an aligned copy, so equal bits at any
        flat = flat.clone()  # offset give the same checksum (a fresh allocation starts aligned)
    raw = flat.view(torch.uint8)
    words = raw.numel() // 8
    body = raw[: words * 8].view(torch.int64)  # the bits as 8-byte words, read in place: native int64 sums
    rows = words // ROW
    h = body[rows * ROW :].sum() * _GOLDEN + raw[words * 8 :].to(torch.int64).sum() * _MIX1
    if rows:
        sums = body[: rows * ROW].view(rows, ROW).sum(dim=1)
        h = h + (sums * _weights(0, rows, flat.device)).sum()
    return h


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """A 64-bit checksum of each tensor's shape, dtype and bits (see the module docstring), as ints: one read
    of each tensor and one host sync per device."""
    sums: list[Optional[torch.Tensor]] = [_checksum(t) for t in tensors]
    values = [0] * len(tensors)
    per_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        if s is not None:
            per_device.setdefault(s.device, []).append(i)
    for idx in per_device.values():
        for i, v in zip(idx, torch.stack([sums[i] for i in idx]).tolist()):
            values[i] = v & _MASK
    return [(v ^ (_head(t) * 0x9E3779B97F4A7C15)) & _MASK for v, t in zip(values, tensors)]
