"""How far the workers drift apart in a round, and what the averaged pseudo-gradient looks like.

Measured every round of every mode with an outer step, for the whole model ("all") and for three
parameter groups: the token embedding ("embedding"), the output head ("head"; the embedding when
they are tied) and the middle transformer block ("middle", all its parameters):

    cosine     mean pairwise cosine of the workers' Δ_k = θ − θ_k over the K(K−1)/2 pairs, from
               ‖Σ_k u_k‖² = K + Σ_{i≠j} cos_ij with u_k = Δ_k/‖Δ_k‖ (one extra buffer, no pairs);
               None for K = 1.
    shrinkage  ‖mean_k Δ_k‖ / mean_k ‖Δ_k‖: 1 when the workers agree, ~1/sqrt(K) when their Δ_k
               are orthogonal; the factor by which averaging shrinks the step.
    norm       ‖mean_k Δ_k‖ and mean_k ‖Δ_k‖ (Frobenius).

and, for every 2-D parameter, the spectrum of the averaged Δ (σ from float64 SVD):

    erank        effective rank exp(−Σ p_i log p_i), p = σ/Σσ (Roy & Vetterli 2007);
    top_over_mean  σ₁/σ̄ with σ̄ = Σσ / min(m, n): how much Iso-C (which sets every σ to σ̄) shrinks
                 the top direction relative to the average one;
    cond         σ₁/σ_min (None for an exactly singular matrix).

Under torchrun the per-worker sums are all-reduced with the run's `Comm`, so every rank records the
same numbers as the single-process simulation (to float rounding).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

GROUPS = ("all", "embedding", "head", "middle")


def spectrum(d: torch.Tensor) -> dict:
    s = torch.linalg.svdvals(d.detach().double()).cpu()
    total = float(s.sum())
    if total == 0.0:
        return {"erank": 0.0, "top_over_mean": None, "cond": None}
    p = s / total
    p = p[p > 0]
    smin = float(s[-1])
    return {
        "erank": math.exp(float(-(p * p.log()).sum())),
        "top_over_mean": float(s[0]) / (total / s.numel()),
        "cond": float(s[0]) / smin if smin > 0 else None,
    }


class DivergenceMeter:
    """Accumulates one round's Δ_k (add_worker), then reports the round (finish)."""

    def __init__(self, model: torch.nn.Module):
        names = [n for n, _ in model.named_parameters()]
        params = list(model.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        self.names = names
        self.shapes = [p.shape for p in params]
        mid = model.cfg.n_layers // 2
        self.groups = {
            "all": list(range(len(params))),
            "embedding": [index[id(model.tok.weight)]],
            "head": [index[id(model.head.weight)]],
            "middle": [i for i, n in enumerate(names) if n.startswith(f"blocks.{mid}.")],
        }
        self._zero(params)

    def _zero(self, params: Sequence[torch.Tensor]) -> None:
        self.unit = {
            g: [torch.zeros_like(params[i], dtype=torch.float32) for i in idx] for g, idx in self.groups.items()
        }
        self.norm_sum = torch.zeros(len(self.groups), dtype=torch.float64, device=params[0].device)
        self.workers = 0

    def start_round(self) -> None:
        for bufs in self.unit.values():
            for b in bufs:
                b.zero_()
        self.norm_sum.zero_()
        self.workers = 0

    @torch.no_grad()
    def add_worker(self, delta_k: Sequence[torch.Tensor]) -> None:
        """One worker's Δ_k (one tensor per parameter, in model.parameters() order)."""
        sq = torch.stack([d.float().pow(2).sum() for d in delta_k]).double()
        for j, (g, idx) in enumerate(self.groups.items()):
            n = sq[idx].sum().sqrt()
            self.norm_sum[j] += n
            if n > 0:
                torch._foreach_add_(self.unit[g], [delta_k[i].float() / n for i in idx])
        self.workers += 1

    @torch.no_grad()
    def finish(self, comm, mean_delta: Sequence[torch.Tensor]) -> dict:
        """The round's numbers; mean_delta is the averaged Δ over all K workers."""
        K = comm.world_workers
        flat = [b for g in GROUPS for b in self.unit[g]]
        comm.average_(flat + [self.norm_sum])  # the sums over workers → means over all K
        out = {"cosine": {}, "shrinkage": {}, "norm": {}, "worker_norm": {}}
        for j, g in enumerate(GROUPS):
            idx = self.groups[g]
            mean_unit_sq = float(sum(b.double().pow(2).sum() for b in self.unit[g]))
            mean_norm = float(sum(mean_delta[i].double().pow(2).sum() for i in idx)) ** 0.5
            worker_norm = float(self.norm_sum[j])
            out["cosine"][g] = None if K < 2 else (K * mean_unit_sq - 1.0) / (K - 1)
            out["shrinkage"][g] = mean_norm / worker_norm if worker_norm > 0 else None
            out["norm"][g] = mean_norm
            out["worker_norm"][g] = worker_norm
        out["spectrum"] = {self.names[i]: spectrum(d) for i, d in enumerate(mean_delta) if d.ndim == 2}
        ranks = [s["erank"] for s in out["spectrum"].values()]
        tops = [s["top_over_mean"] for s in out["spectrum"].values() if s["top_over_mean"] is not None]
        out["spectrum_median"] = (
            {
                "erank_over_r0": _median(
                    [s["erank"] / min(self.shapes[self.names.index(n)]) for n, s in out["spectrum"].items()]
                ),
                "top_over_mean": _median(tops),
            }
            if ranks
            else {}
        )
        return out


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])
