"""The norm-preserving mean (`norm_mean`), batched over a bucket and its K workers.

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
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["norm_mean_merge"]


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
