"""MergeLoCo: the outer optimizer with any of the paper's five merges, for K workers in one process.

IsoLoCo's outer step reads the *averaged* pseudo-gradient, which is all Iso-C needs. TSV-M, Iso-CTS,
TIES and DARE need every worker's own Δ_k: give them as `[K, *p.shape]` stacks, one per param, and
MergeLoCo merges them (merges.merge) into p.grad, then takes IsoLoCo's Nesterov step on the merge
(momentum 0: plain SGD, as the official code's merge optimizers run):

    M = merge(Δ_1..Δ_K)      (params of groups with iso=False: the mean)
    buf ← μ·buf + M;  θ ← θ − lr·(M + μ·buf)

`merge="iso_c"` is IsoLoCo on the mean, step for step. State dicts are IsoLoCo's (SGD's); the merge,
its options and the flatten method live on the optimizer. One process: for ranks that each hold
their own worker's Δ, `ShardedIsoLoCo` serves Iso-C (other merges over ranks are not built yet).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from ..merges import check_stacks, merge_groups
from ..merges.options import resolve_options
from ..outer.sgd_state import SGDArgs, sgd_shaped
from .isoloco import IsoLoCo

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["MergeLoCo"]


class MergeLoCo(IsoLoCo):
    """IsoLoCo whose aggregation is one of the five merges (module docstring).

    Args:
        params: parameters or param groups, as for `IsoLoCo` (a group with iso=False takes the mean).
        lr: outer learning rate.
        momentum: Nesterov momentum μ (0: plain SGD on the merge, as the official merge optimizers run).
        dampening: SGD's keyword, accepted at 0 (as `IsoLoCo`).
        weight_decay: SGD's keyword, accepted at 0 (as `IsoLoCo`).
        nesterov: SGD's keyword (as `IsoLoCo`).
        merge: "iso_c" (default), "mean", "tsv", "iso_cts", "ties" or "dare".
        merge_options: that merge's options (merges/options.py), e.g. {"sparsity": 0.2}. DARE's
            `seed` is offset by the step count, so every outer step draws new drops.
        method: the flatten behind iso_c and the polar factors of tsv / iso_cts (as `IsoLoCo`).
        process_group: must be None: MergeLoCo runs its K workers in one process. SGD's other keywords
            and IsoLoCo's `iso`, `iso_nd` and `dtensor_route` are taken as `IsoLoCo` takes them.

    Raises:
        ValueError, TypeError: an unknown merge or option, a process group, DTensor params (at
            construction); at `step`/`set_deltas`, stacks that do not match the params (shape,
            device, K < 2, NaN/Inf), named, with no grad set and nothing stepped.

    Examples:
        >>> w = torch.nn.Parameter(torch.zeros(8, 4))
        >>> opt = MergeLoCo([w], lr=1.0, momentum=0.0, merge="tsv")
        >>> deltas = torch.randn(4, 8, 4)         # K = 4 workers' global − local
        >>> opt.step(deltas=[deltas])
        >>> bool(torch.allclose(w, -merge([deltas], "tsv")[0]))
        True
    """

    @sgd_shaped(
        merge="iso_c",
        merge_options=None,
        iso=True,
        method="auto",
        process_group=None,
        dtensor_route="auto",
        iso_nd=False,
    )
    def __init__(
        self,
        params: ParamsT,
        sgd: SGDArgs,
        *,
        merge: str,
        merge_options: Optional[dict],
        iso: bool,
        method: str,
        process_group: None,
        dtensor_route: str,
        iso_nd: bool,
    ):
        opts = dict(merge_options or {})
        resolve_options(merge, opts)  # refuses an unknown merge or option by name
        if process_group is not None:
            raise ValueError("MergeLoCo runs its K workers in one process: process_group must be None")
        self.merge, self.merge_options, self.merged_steps = merge, opts, 0
        super().__init__(params, **asdict(sgd), iso=iso, method=method, dtensor_route=dtensor_route, iso_nd=iso_nd)
        from ..outer.core import is_dtensor

        if any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            raise ValueError("MergeLoCo: DTensor params are not supported (merge their full tensors, or use IsoLoCo)")

    def _iso_updates(self, entries, ag=None):
        # iso_c flattens the mean as IsoLoCo does; every other merge already wrote p.grad
        return super()._iso_updates(entries, ag) if self.merge == "iso_c" else {}

    def set_deltas(self, deltas: Sequence[Optional[torch.Tensor]]) -> None:
        """p.grad ← the merge of each param's worker stack [K, *p.shape] (params in param_groups
        order; None for a param without one). All stacks are checked before any grad is set."""
        params = [(p, g.get("iso", True)) for g in self.param_groups for p in g["params"]]
        deltas = list(deltas)
        if len(deltas) != len(params):
            raise ValueError(f"MergeLoCo: {len(deltas)} delta stacks for {len(params)} params")
        idx = [i for i, d in enumerate(deltas) if d is not None]
        check_stacks([deltas[i] for i in idx], "MergeLoCo")
        for i in idx:
            p, d = params[i][0], deltas[i]
            if tuple(d.shape[1:]) != tuple(p.shape) or d.device != p.device:
                raise ValueError(
                    f"MergeLoCo: stack {i} has shape {tuple(d.shape)} on {d.device}; param {i} needs "
                    f"[K, {', '.join(map(str, p.shape))}] on {p.device}"
                )
        merged = {i for i in idx if params[i][1]}
        out = merge_groups(
            {i: deltas[i] for i in idx}, merged, self.merge, self.merge_options, self.merged_steps, self.method
        )
        for i, m in out.items():
            params[i][0].grad = m.to(params[i][0].dtype)
        self.merged_steps += 1

    def step(
        self, closure: Optional[Callable[[], float]] = None, *, deltas: Optional[Sequence] = None
    ) -> Optional[float]:
        """One outer step: with `deltas`, set_deltas(deltas) first; else from the grads set_deltas left."""
        if deltas is not None:
            self.set_deltas(deltas)
        return super().step(closure)
