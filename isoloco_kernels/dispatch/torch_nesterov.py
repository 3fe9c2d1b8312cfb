"""Multi-tensor Nesterov outer update (the last half of the IsoLoCo outer step).

For every tensor i, with s_i = scales[i] (1 when scales is None), the Nesterov step of
`reference.nesterov_ref` with g = s_i·u_i in place of the gradient (torch.optim.SGD with
nesterov=True, dampening=0; with buf starting at zero the first step gives buf = g, as SGD does). The math runs in the compute
dtype of each (param, buf) pair: float64 when either is float64, else float32 — so bfloat16 /
float16 params with float32 momentum buffers are updated in float32 and rounded once on store.

`nesterov_outer_torch` is the torch implementation (torch._foreach_* per (device, dtypes); torch's
fused CPU SGD kernel for unscaled contiguous float32/float64 CPU groups); csrc/, CuPy and Triton
serve CUDA first (dispatch/table.py). Arguments and the finiteness rule are checked in ops.py (before
any backend runs; ops.prepare_nesterov_outer_ is the optimizers' checked call).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import torch

__all__ = ["nesterov_outer_torch", "update_compute_dtype"]


def update_compute_dtype(param_dtype: torch.dtype, buf_dtype: torch.dtype) -> torch.dtype:
    """float64 when the param or its buffer is float64, else float32."""
    return torch.float64 if torch.float64 in (param_dtype, buf_dtype) else torch.float32


def _group(params, bufs, updates) -> dict[tuple, list[int]]:
    """Indices of the non-empty tensors, grouped by (device, param, buf, update dtype)."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, (p, b, u) in enumerate(zip(params, bufs, updates)):
        if p.numel():
            groups[(p.device, p.dtype, b.dtype, u.dtype)].append(i)
    return groups


def _foreach_group(P, B, U, S, lr: float, momentum: float) -> None:
    """One (device, dtypes) group with torch._foreach_*; S: per-tensor 0-d scales or None."""
    if momentum != 0 and _fused_cpu_ok(P, B, U, S):  # (with μ = 0 it would leave buf alone)
        # Same update as SGD(nesterov=True) with buf already holding the momentum (zeros at first):
        # torch's fused CPU kernel does it in one pass over p, buf and u and leaves u untouched. It serves
        # the tensors whose param and buffer are contiguous (an update that is not, e.g. a tall matrix's
        # transposed Iso-C result, is copied contiguous: one pass, cheaper than the foreach path's four);
        # the others (a channels_last param, say) take the foreach path below.
        fused = [i for i in range(len(P)) if P[i].is_contiguous() and B[i].is_contiguous()]
        if fused:
            torch._fused_sgd_(
                [P[i] for i in fused],
                [U[i].contiguous() for i in fused],
                [B[i] for i in fused],
                weight_decay=0.0,
                momentum=momentum,
                lr=lr,
                dampening=0.0,
                nesterov=True,
                maximize=False,
                is_first_step=False,
            )
        rest = sorted(set(range(len(P))) - set(fused))
        if not rest:
            return
        P, B, U = [P[i] for i in rest], [B[i] for i in rest], [U[i] for i in rest]
    cd = update_compute_dtype(P[0].dtype, B[0].dtype)
    if S is not None:
        S = [s.to(cd) for s in S]
    Bc = B if B[0].dtype == cd else [b.to(cd) for b in B]
    # Mixed-dtype foreach ops compute in the promoted dtype (cd) and round once on store, and s·u
    # enters through addcmul: no converted or scaled copy of the updates is made.
    torch._foreach_mul_(Bc, momentum)
    if S is None:
        torch._foreach_add_(Bc, U)
    else:
        torch._foreach_addcmul_(Bc, U, S)
    if P[0].dtype == cd:
        # p − lr·s·u − lr·μ·buf: two in-place passes, no temporary (the updates are read-only)
        if S is None:
            torch._foreach_add_(P, U, alpha=-lr)
        else:
            torch._foreach_addcmul_(P, U, S, value=-lr)
        torch._foreach_add_(P, Bc, alpha=-lr * momentum)
    else:
        # half params: p − lr·(s·u + μ·buf) with the sum formed in cd, rounded once
        if S is None:
            D = torch._foreach_add(U, Bc, alpha=momentum)
        else:
            D = torch._foreach_mul(Bc, momentum)
            torch._foreach_addcmul_(D, U, S)
        torch._foreach_add_(P, D, alpha=-lr)
    if Bc is not B:
        torch._foreach_copy_(B, Bc)


def _fused_cpu_ok(P, B, U, S) -> bool:
    """torch's fused SGD kernel serves an unscaled CPU group of one float32/float64 dtype (its contiguous tensors)."""
    return (
        S is None
        and hasattr(torch, "_fused_sgd_")
        and P[0].device.type == "cpu"
        and P[0].dtype == B[0].dtype == U[0].dtype
        and P[0].dtype in (torch.float32, torch.float64)
    )


def nesterov_outer_torch(
    params: Sequence[torch.Tensor],
    bufs: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    lr: float,
    momentum: float,
    scales: Optional[torch.Tensor],
) -> None:
    """The update with torch._foreach_* ops: four passes per group; no temporaries unless the
    params or bufs are half precision (then one compute-dtype temporary per tensor)."""
    lr, momentum = float(lr), float(momentum)
    per_tensor = None if scales is None else scales.unbind(0)
    for idx in _group(params, bufs, updates).values():
        _foreach_group(
            [params[i] for i in idx],
            [bufs[i] for i in idx],
            [updates[i] for i in idx],
            None if per_tensor is None else [per_tensor[i] for i in idx],
            lr,
            momentum,
        )
