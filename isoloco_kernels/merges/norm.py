"""Per-worker Frobenius norms: the norm-preserving mean (`norm_mean`) and the norm clip (`clip_stacks`).

Per 2-D matrix, the mean direction at the workers' mean Frobenius norm (Decoupled DiLoCo's rule):

    norm_mean(Δ_1..Δ_K) = mean_k Δ_k · (mean_k ‖Δ_k‖_F / ‖mean_k Δ_k‖_F),   0 when mean_k Δ_k = 0

Averaging K pseudo-gradients that point in partly independent directions shrinks the merged norm
(roughly as 1/√K for independent ones); this merge undoes that shrinkage and nothing else: it keeps
the mean's spectrum (its shape) and restores only its size. It is the control that tells "Iso-C
restores the step size" from "Iso-C reshapes the spectrum" (docs/merges.md). Definition in float64:
merges/reference.py (`norm_mean_ref`).

Input: x = [B, K, m, n] in the compute dtype, each stack scaled by a power of two so that its largest
entry is in [1, 2) (exact: the caller scales the result back), so neither the squares behind the
norms overflow nor small entries underflow. At K = 1 the two norms are taken by the same reduction on
the same values, so the ratio is exactly 1 and the result is the delta bit for bit.

The clip (`clip_stacks`, the merges' and MergeLoCo's `clip=`; Covenant-72B's rule for "median"): per
tensor (a matrix, a vector, any tensor: the 2-norm of all its entries), each worker's Δ_k is scaled by

    c_k = min(1, cap / ‖Δ_k‖),   cap = median_{k: w_k > 0} ‖Δ_k‖ ("median") or the number given

so it only ever shrinks; a worker at or below the cap is left as it is, bit for bit. The median of an
even count is the mean of its two middle values. Norms are reduced in the stack's compute dtype (float32
for 16- and 32-bit stacks, float64 for float64) on a power-of-two scaled copy (no overflow, no underflow) and
returned as float64; the scaled Δ_k is rounded to the stack's dtype, which is what the
merge then reads.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from .._validate import compute_dtype

__all__ = ["Clipped", "clip_cap", "clip_stacks", "norm_mean_merge", "worker_norms", "worker_norms_each"]


def _frobenius(t: torch.Tensor) -> torch.Tensor:
    """‖·‖_F of every matrix of a [B, K, m, n] batch: [B, K]."""
    return torch.linalg.vector_norm(t, dim=(-2, -1))


def norm_mean_merge(x: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """norm_mean of a bucket [B, K, m, n] (module docstring): [B, m, n].

    weights: None (every worker 1/K), or the K workers' normalized weights ω ([K], x's dtype, Σω = 1,
    every one > 0): the weighted mean direction Σ ω_k Δ_k at the weighted mean norm Σ ω_k ‖Δ_k‖_F."""
    if weights is None:
        mean = x.mean(1)
        target = _frobenius(x).mean(1)
    else:
        mean = torch.tensordot(x, weights, dims=([1], [0]))
        target = _frobenius(x) @ weights
    size = _frobenius(mean.unsqueeze(1))[:, 0]  # the same reduction as the workers' (exact ratio 1 at K = 1)
    ratio = torch.where(size > 0, target / torch.where(size > 0, size, 1), torch.zeros_like(size))
    return mean * ratio[:, None, None]


def worker_norms(s: torch.Tensor) -> torch.Tensor:
    """Each worker's 2-norm (Frobenius for a matrix) of a finite stack [K, *shape]: float64 [K] on the CPU.
    Each worker is scaled by a power of two near its largest entry first (exact), so no square overflows
    or underflows in the compute dtype."""
    return worker_norms_each([s])[0]


def worker_norms_each(stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`worker_norms` of every stack, with one copy to the host per device (not one per stack)."""
    out: list = [None] * len(stacks)
    on: dict = {}  # device -> [(index, float64 norms on the device)]
    for i, s in enumerate(stacks):
        K = s.shape[0]
        if s.numel() == 0:
            out[i] = torch.zeros(K, dtype=torch.float64)
            continue
        x = s.detach().reshape(K, -1).to(compute_dtype(s.dtype))
        amax = x.abs().amax(1)
        _, e = torch.frexp(amax)
        scale = torch.where(amax > 0, torch.ldexp(torch.ones_like(amax), e - 1), torch.ones_like(amax))
        norms = torch.linalg.vector_norm(x / scale[:, None], dim=1)
        on.setdefault(x.device, []).append((i, norms.to(torch.float64) * scale.to(torch.float64)))
    for parts in on.values():
        host = torch.cat([n for _, n in parts]).cpu()
        for (i, _), n in zip(parts, host.split([n.numel() for _, n in parts])):
            out[i] = n
    return out


def clip_cap(norms: torch.Tensor, clip) -> float:
    """One tensor's cap from the float64 norms of the workers it is taken over (weight > 0): for "median" their
    median (the middle value, or the mean of the two middle values), else the number given. ShardedIsoLoCo
    takes its caps here too, from the norms every rank sent."""
    if clip != "median":
        return float(clip)
    v = norms.sort().values
    n = v.numel()
    return float(v[n // 2]) if n % 2 else float((v[n // 2 - 1] + v[n // 2]) / 2)


class Clipped(NamedTuple):
    """`clip_stacks`' result: the stacks to merge (a stack no worker of which was over its cap is the input
    itself), each stack's worker norms before the clip (float64 [K], CPU) and each stack's cap."""

    stacks: list
    norms: list
    caps: list


def clip_stacks(stacks: Sequence[torch.Tensor], clip, active: Optional[Sequence[int]] = None) -> Clipped:
    """Each worker's Δ of every checked, finite stack [K, *shape] clipped to its cap (module docstring).
    clip: "median" or a positive float (options.resolve_clip's); active: the workers whose norms the
    median is taken over (weight > 0; None: all). Writes nothing: a clipped stack is a new tensor."""
    out, norms, caps = [], [], []
    for s, n in zip(stacks, worker_norms_each(stacks)):
        cap = clip_cap(n if active is None else n[list(active)], clip)
        over = (n > cap).nonzero().flatten().tolist()
        if over:
            cd = compute_dtype(s.dtype)
            s = s.detach().clone()
            for k in over:
                s[k] = (s[k].to(cd) * (cap / float(n[k]))).to(s.dtype)
        out.append(s)
        norms.append(n)
        caps.append(cap)
    return Clipped(out, norms, caps)
