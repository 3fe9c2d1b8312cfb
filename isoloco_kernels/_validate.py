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

    A one-pass screen finds the suspects: the 2-norm of every tensor in its compute dtype, one
    `_foreach_norm` and one host sync per (device, dtype). Only a tensor whose norm is not finite
    is then searched element by element (a finite tensor whose norm overflows passes there).
    """
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, compute_dtype(t.dtype)), []).append(i)
    suspects: list[int] = []
    for (_, dt), idx in groups.items():
        norms = torch.stack(torch._foreach_norm([tensors[i] for i in idx], 2, dtype=dt))
        suspects += [i for i, ok in zip(idx, torch.isfinite(norms).tolist()) if not ok]
    for i in sorted(suspects):
        if not bool(torch.isfinite(tensors[i]).all()):
            raise ValueError(_describe_nonfinite(tensors[i], names[i]))
