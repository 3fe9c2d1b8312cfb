"""Exact fingerprints of tensors' bits: what replicas compare to know they hold the same values.

`bit_fingerprints(tensors)` gives each tensor a 64-bit hash of its shape, dtype and every
element's bit pattern in logical (row-major) order: h = Σᵢ bits(xᵢ)·wᵢ mod 2⁶⁴ with wᵢ an odd
pseudo-random weight of the position i (splitmix64 of i). Tensors with the same bits have the same
hash on every device and every machine; a change of any one element (one ulp, a sign, -0.0 for
0.0) always changes it (wᵢ is odd, so bits·wᵢ ≢ 0), and a permutation or scattered noise changes it
but with probability 2⁻⁶⁴. One pass over each tensor in int64 slices of `CHUNK` elements; one host
sync per device.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

__all__ = ["CHUNK", "bit_fingerprints"]

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
