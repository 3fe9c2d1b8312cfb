"""MergeLoCo: the outer optimizer with any of the merges (the paper's five and norm_mean), for K workers in
one process.

IsoLoCo's outer step reads the *averaged* pseudo-gradient, which is all Iso-C needs. TSV-M, Iso-CTS,
TIES and DARE need every worker's own Δ_k: give them as `[K, *p.shape]` stacks, one per param, and
MergeLoCo merges them (merges.merge) and takes IsoLoCo's Nesterov step on the merge (momentum 0: plain
SGD, as the official code's merge optimizers run):

    M = merge(Δ_1..Δ_K)      (params of groups with iso=False: the mean)
    buf ← μ·buf + M;  θ ← θ − lr·(M + μ·buf)

`merge="iso_c"` is IsoLoCo on the mean, step for step; K = 1 is each merge's value for one worker. The
step reads only the stacks (never a param's own `.grad`), is all or nothing (a refused step changes no
param, buffer, `.grad` or step count) and its state dict is IsoLoCo's (SGD's) plus a "merge" entry (the
merge, its options and the step count DARE's draws follow), so a resumed run continues bit for bit. For
ranks that each hold their own worker's Δ, `ShardedIsoLoCo(merge=...)` runs the same merges over ranks.
`compress=` simulates each worker's compressed Δ (with its error-feedback residual) and the owners' compressed
update exactly as `ShardedIsoLoCo(compress=...)` over K ranks computes them (optim/compressed.py).
`clip=` shrinks each worker's Δ of each param to at most the workers' median norm (or a given cap) before the
merge and before any compression; the norms it saw stay readable in `last_worker_norms` / `last_clip_caps`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from .._validate import check_all_finite, is_dtensor
from ..distributed import sharded
from ..distributed.checkpoint import refuse_rank_state
from ..merges import check_stacks, clip_stacks, merge_groups
from ..merges.options import resolve_clip, resolve_options, resolve_weights
from ..outer.merge_state import check_merge_entry, merge_entry
from .compressed import simulated_step
from .isoloco import IsoLoCo

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

    from ..compress import Compression

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
        merge: "iso_c" (default), "mean", "norm_mean", "tsv", "iso_cts", "ties" or "dare" (merges.MERGES).
        merge_options: that merge's options (merges/options.py), e.g. {"sparsity": 0.2}. DARE's
            `seed` is offset by the step count, so every outer step draws new drops.
        method: the flatten behind iso_c and the polar factors of tsv / iso_cts (as `IsoLoCo`).
        compress: a `compress.Compression` (or its string, "int4:128:0.95"): each step simulates the K
            workers' compressed exchange bit for bit as `ShardedIsoLoCo(compress=...)` on K ranks runs it
            (docs/compression.md); every param then needs a stack, and `.grad` is left as it was.
        clip: None, "median" or a positive number: each step first scales each worker's Δ of each param to
            at most the cap (the 2-norm of the whole tensor; "median": the median of that param's worker
            norms over the workers with weight > 0), never up, before the merge and before any compression
            (merges.merge's `clip`). After each step `last_worker_norms` holds {param index: the K workers'
            norms before the clip (float64, CPU)} and `last_clip_caps` {param index: its cap}. A setting, like
            `method`: not in the state dict.
        process_group: must be None: MergeLoCo runs its K workers in one process. SGD's other keywords
            and IsoLoCo's `iso`, `iso_nd` and `dtensor_route` are taken as `IsoLoCo` takes them.

    Raises:
        ValueError, TypeError: an unknown merge or option, a process group, DTensor params (at
            construction); at `step`/`set_deltas`, stacks that do not match the params (shape,
            device, K < 1, NaN/Inf), named, with nothing changed.

    Examples:
        >>> w = torch.nn.Parameter(torch.zeros(8, 4))
        >>> opt = MergeLoCo([w], lr=1.0, momentum=0.0, merge="tsv")
        >>> deltas = torch.randn(4, 8, 4)         # K = 4 workers' global − local
        >>> opt.step(deltas=[deltas])
        >>> bool(torch.allclose(w, -merge([deltas], "tsv")[0]))
        True
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1.8,
        momentum: float | torch.Tensor = 0.8,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = True,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        merge: str = "iso_c",
        merge_options: Optional[dict] = None,
        iso: bool = True,
        method: str = "auto",
        process_group: None = None,
        dtensor_route: str = "auto",
        iso_nd: bool = False,
        compress: Optional[Compression | str] = None,
        clip: Optional[str | float] = None,
    ) -> None:
        opts = dict(merge_options or {})
        try:
            resolve_options(merge, opts)  # refuses an unknown merge or option by name
        except (TypeError, ValueError) as e:
            raise type(e)(f"MergeLoCo: {e}") from None
        if process_group is not None:
            raise ValueError("MergeLoCo runs its K workers in one process: process_group must be None")
        self.clip = resolve_clip(clip, "MergeLoCo")
        self.last_worker_norms: dict[int, torch.Tensor] = {}  # the last step's, when clip is set
        self.last_clip_caps: dict[int, float] = {}
        self.merge, self.merge_options, self.merged_steps = merge, opts, 0
        self._pending: Optional[tuple] = None  # (stacks, weights) set_deltas checked, for the next step
        sharded.attach(self, compress, "MergeLoCo")  # this process's K workers' residuals, once stepped
        super().__init__(
            params,
            lr,
            momentum,
            dampening,
            weight_decay,
            nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
            iso=iso,
            method=method,
            dtensor_route=dtensor_route,
            iso_nd=iso_nd,
        )
        if any(is_dtensor(p) for g in self.param_groups for p in g["params"]):
            raise ValueError("MergeLoCo: DTensor params are not supported (merge their full tensors, or use IsoLoCo)")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        sharded.add_specs(self, "MergeLoCo")  # with compress: the group's specs under the skip rule, by its names

    def _params(self) -> list[tuple[torch.Tensor, bool]]:
        return [(p, g.get("iso", True)) for g in self.param_groups for p in g["params"]]

    def _checked(self, deltas: Sequence[Optional[torch.Tensor]], where: str, weights=None) -> tuple:
        """(the stacks, one per param in param_groups order (None: that param is not stepped), the weights),
        all checked."""
        params = self._params()
        if isinstance(deltas, torch.Tensor) or not isinstance(deltas, Sequence):
            raise TypeError(f"{where}: deltas must be a list of [K, *p.shape] stacks (None for a param without one)")
        deltas = list(deltas)
        if len(deltas) != len(params):
            raise ValueError(f"{where}: {len(deltas)} delta stacks for {len(params)} params")
        idx = [i for i, d in enumerate(deltas) if d is not None]
        K = check_stacks([deltas[i] for i in idx], where, ids=idx)
        if idx:
            w = resolve_weights(weights, K, where)
            if self.compress is not None and (w.active is not None or w.omega is not None):
                raise ValueError(
                    f"{where}: weights with compress= must be equal (or None): the compressed exchange averages "
                    "every worker's payload, as ShardedIsoLoCo(compress=...) does; a worker that did not deliver "
                    "cannot be dropped there"
                )
        for i in idx:
            p, d = params[i][0], deltas[i]
            if tuple(d.shape[1:]) != tuple(p.shape) or d.device != p.device:
                raise ValueError(
                    f"{where}: stack {i} has shape {tuple(d.shape)} on {d.device}; param {i} needs "
                    f"[K, {', '.join(map(str, p.shape))}] on {p.device}"
                )
        try:  # one screen of every stack (one host sync per device and dtype) before anything is merged
            check_all_finite([deltas[i] for i in idx], [f"{where}: stack {i}" for i in idx])
        except ValueError:  # name the param and the worker: the first stack holding NaN/Inf, its first bad worker
            i = next(i for i in idx if not bool(torch.isfinite(deltas[i]).all()))
            k = int((~torch.isfinite(deltas[i].reshape(deltas[i].shape[0], -1))).any(1).nonzero()[0])
            what = "NaN" if bool(deltas[i][k].isnan().any()) else "Inf"
            raise ValueError(f"{where}: stack {i}: worker {k}'s Δ of param {i} contains {what}") from None
        return deltas, weights

    def set_deltas(self, deltas: Sequence[Optional[torch.Tensor]], weights=None) -> None:
        """Check each param's worker stack [K, *p.shape] (params in param_groups order; None for a param
        that this step leaves alone) and the workers' weights (as `step`), and keep them for the next
        `step()`. Nothing else changes."""
        self._pending = self._checked(deltas, "MergeLoCo.set_deltas", weights)

    def step(
        self, closure: Optional[Callable[[], float]] = None, *, deltas: Optional[Sequence] = None, weights=None
    ) -> Optional[float]:
        """One outer step on the merge of `deltas` (or of the stacks `set_deltas` kept): each param with a
        stack moves by the Nesterov step on its merge, every other param stays as it is. The params' own
        `.grad` is never read; after the step each stepped param's `.grad` holds what the merge handed the Nesterov step
        (the merge, or for iso_c the mean the step flattens, as IsoLoCo's `.grad`).

        closure: evaluated first, for its loss only (the update is the merge, whatever the closure does to
        `.grad`).
        weights: one weight ≥ 0 per worker, for every param (merges.merge's `weights`: e.g. the tokens each
        processed, 0 for a worker that did not deliver; a zero-weight worker's Δ must still be finite: zeros
        will do); with `set_deltas`, give them there. With compress= they must be equal.

        All or nothing: a step that fails (bad stacks or weights, a NaN or an overflow in the update, a
        closure that raises) changes no param, momentum buffer, `.grad` or step count.

        Raises:
            ValueError, TypeError: no stacks (neither `deltas=` nor `set_deltas`), or stacks that do not match
                the params; weights that are not K finite numbers ≥ 0 with one > 0 (named with their value); a
                merge or update that is not finite or does not fit (named).
        """
        where = "MergeLoCo.step"
        if deltas is not None:
            stacks, weights = self._checked(deltas, where, weights)
        elif self._pending is not None:
            if weights is not None:
                raise ValueError(
                    f"{where}: weights go with their deltas: pass them to set_deltas (or step(deltas=...))"
                )
            stacks, weights = self._pending
        else:
            raise ValueError(
                f"{where}: no worker deltas: pass step(deltas=[one [K, *p.shape] stack per param]) or call "
                "set_deltas first; MergeLoCo merges the K workers' pseudo-gradients and never steps from .grad "
                "(for one averaged pseudo-gradient in .grad use IsoLoCo)"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        seen = None
        if self.clip is not None:  # each worker's Δ clipped before the merge and before any compression
            stacks, seen = self._clipped(stacks, weights, where)
        if self.compress is not None:
            simulated_step(self, stacks)  # the compressed route, all or nothing (optim/compressed.py)
            self._pending = None
            self._keep_norms(seen)
            return loss
        params = self._params()
        idx = [i for i, d in enumerate(stacks) if d is not None]
        merged = merge_groups(
            {i: stacks[i] for i in idx},
            {i for i in idx if params[i][1]},
            self.merge,
            self.merge_options,
            self.merged_steps,
            self.method,
            weights,
        )
        saved = [p.grad for p, _ in params]
        try:
            for i, (p, _) in enumerate(params):
                p.grad = merged[i].to(p.dtype) if i in merged else None
            super().step(None)
        except BaseException:
            for (p, _), g in zip(params, saved):
                p.grad = g
            raise
        for i, (p, _) in enumerate(params):
            if i not in merged:
                p.grad = saved[i]  # not stepped: left as it was
        self.merged_steps += 1
        self._pending = None
        self._keep_norms(seen)
        return loss

    def _clipped(self, stacks: list, weights, where: str) -> tuple[list, tuple[dict, dict]]:
        """The stacks with every worker's Δ clipped (merges.clip_stacks; the median over the workers with
        weight > 0), and ({param index: worker norms}, {param index: cap}); nothing written."""
        idx = [i for i, d in enumerate(stacks) if d is not None]
        if not idx:
            return stacks, ({}, {})
        active = resolve_weights(weights, stacks[idx[0]].shape[0], where).active
        c = clip_stacks([stacks[i] for i in idx], self.clip, active)
        out = list(stacks)
        for i, s in zip(idx, c.stacks):
            out[i] = s
        return out, (dict(zip(idx, c.norms)), dict(zip(idx, c.caps)))

    def _keep_norms(self, seen) -> None:
        if seen is not None:  # a step that succeeded: what its clip saw
            self.last_worker_norms, self.last_clip_caps = seen

    # -- state: SGD's plus the merge, so a resumed run draws what the uninterrupted one would --------

    def state_dict(self) -> dict:
        """IsoLoCo's (SGD's) state dict plus a "merge" entry: {"merge", "options", "steps"}. Raises nothing."""
        sd = super().state_dict()
        sd["merge"] = merge_entry(self.merge, self.merge_options, self.merged_steps)
        if self.compress is not None:  # the K workers' residuals ([K, *shape] each) and the update residuals
            sd["compress"] = sharded.state_entry(self)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """A MergeLoCo, IsoLoCo or SGD state dict, checked first; the step count comes back with it (a
        checkpoint of another merge or options loads with a warning naming both)."""
        refuse_rank_state(state_dict, "MergeLoCo.load_state_dict")  # before its residuals are compared with ours
        info = check_merge_entry(self, state_dict, "MergeLoCo.load_state_dict")
        params = [p for p, _ in self._params()]
        held = sharded.check_entry(self, state_dict, "MergeLoCo.load_state_dict", params, range(len(params)), True)
        drop = ("merge", "compress")
        rest = {k: v for k, v in state_dict.items() if k not in drop} if isinstance(state_dict, dict) else state_dict
        super().load_state_dict(rest)
        sharded.load_entry(self, held)
        if info is not None:
            self.merged_steps = int(info["steps"])

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update(merge=self.merge, merge_options=dict(self.merge_options), merged_steps=self.merged_steps)
        state.update(clip=(self.clip, dict(self.last_worker_norms), dict(self.last_clip_caps)))
        state.update(compress=(self.compress, dict(self._residuals), dict(self._update_residuals), list(self._specs)))
        state["pending"] = self._pending
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        copied = "merge" in state
        merge, options = state.pop("merge", None), state.pop("merge_options", None)
        steps, pending = state.pop("merged_steps", None), state.pop("pending", None)
        packed = state.pop("compress", (None, {}, {}, []))
        clip = state.pop("clip", (None, {}, {}))
        super().__setstate__(state)
        if copied:  # deepcopy / pickle (torch's load_state_dict passes only "state" and "param_groups")
            self.merge, self.merge_options, self.merged_steps, self._pending = merge, options, steps, pending
            self.compress, self._residuals, self._update_residuals, self._specs = packed
            self.clip, self.last_worker_norms, self.last_clip_caps = clip
