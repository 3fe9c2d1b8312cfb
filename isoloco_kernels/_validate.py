"""Input checks shared by the ops and the optimizer. Every check runs before anything is written."""
from __future__ import annotations

from typing import Sequence

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half and bfloat16 inputs are computed in float32; float32 and float64 keep their dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_matrix_tensor(x, what: str) -> None:
    """Type, dtype and rank of one [m, n] / [B, m, n] operand; cheap, no device sync."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{what}: dtype {x.dtype} is not supported; use float16, bfloat16, float32 or float64"
        )
    if x.ndim not in (2, 3):
        raise ValueError(
            f"{what}: expected a [m, n] matrix or a [B, m, n] batch, got shape {tuple(x.shape)}"
        )


def _describe_nonfinite(x: torch.Tensor, what: str) -> str:
    x3 = x.detach().reshape(-1, *x.shape[-2:]) if x.ndim >= 2 else x.detach().reshape(1, 1, -1)
    bad = (~torch.isfinite(x3)).flatten(1)
    idx = bad.any(1).nonzero().flatten().tolist()
    first = idx[0]
    row = x3[first].flatten()[bad[first]]
    kinds = []
    if torch.isnan(row).any():
        kinds.append("NaN")
    if torch.isinf(row).any():
        kinds.append("Inf")
    where = f"matrix {first}" if x.ndim == 3 else "the matrix"
    more = f" ({len(idx)} matrices in all: {idx[:8]}{'…' if len(idx) > 8 else ''})" if x.ndim == 3 else ""
    return f"{what}: {where} contains {'/'.join(kinds)} ({int(bad[first].sum())} elements){more}"


def check_all_finite(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Raise ValueError naming the first tensor (and matrix) holding NaN or Inf.

    One reduction per tensor and one host sync per device, so the check is cheap on a GPU.
    """
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            by_device.setdefault(t.device, []).append((i, torch.isfinite(t).all()))
    bad: list[int] = []
    for items in by_device.values():
        ok = torch.stack([f for _, f in items]).cpu()
        bad += [i for (i, _), good in zip(items, ok.tolist()) if not good]
    if bad:
        i = min(bad)
        raise ValueError(_describe_nonfinite(tensors[i], names[i]))
