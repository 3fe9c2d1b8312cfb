"""`ShardedIsoLoCo`: the IsoLoCo outer step over a process group, each tensor stepped by one rank.

    reduce-scatter Δ_k → each rank receives mean(Δ) of the tensors it owns (plan.py)
    owner:  M = iso(mean Δ) (2-D, iso on) or mean Δ; reference.nesterov_ref's step on M
    all-gather θ        → every rank holds the whole updated θ

The bytes of one all-reduce; each Iso-C runs once in the group; momentum lives on the owner.
All-or-nothing across ranks (agree.py). docs/distributed.md has the contract.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from .._validate import amaxes, check_amax_finite, is_dtensor
from ..merges import merge_groups
from ..merges.options import resolve_options
from ..outer import core as outer
from ..outer import sgd_state
from ..outer.core import BucketPlan
from ..outer.nd import warn_nd_params
from ..outer.sgd_state import SGDArgs
from . import checkpoint, compressed, pipeline
from .agree import Agreement, check_on_comm_device, comm_device, group_info, optimizer_settings
from .merge import PLAN_MISMATCH
from .merge_route import exchange_workers, merge_buffers, merged_updates
from .pipeline import (
    CHUNK_BYTES,
    broadcast_into,
    check_chunk_bytes,
    flat_view,
    gather_segment_buffers,
    reduce_scatter_buffers,
    reduce_scatter_mean,
    reduce_to_owner,
    reduce_to_owner_buffers,
    scatter_into,
)
from .plan import owned_views, plan_shards

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim.optimizer import ParamsT

    from ..compress import Compression

__all__ = ["ShardedIsoLoCo"]


class ShardedIsoLoCo(torch.optim.Optimizer):
    """IsoLoCo's outer step for DiLoCo over a process group, each tensor's work done by one rank.

    Grads NOT yet averaged: on every rank set p.data to the global weights (equal on all ranks) and
    p.grad to this rank's own pseudo-gradient θ − θ_k, then `step()` (for grads already averaged use
    `IsoLoCo(process_group=...)`). The step averages them itself (reduce-scatter); each rank applies
    M = iso(mean Δ) (2-D params, iso on) or mean Δ, then Nesterov (reference.nesterov_ref), to the
    params it owns; an all-gather gives every rank the new θ: the replicated IsoLoCo step on the mean.
    `merge` ("iso_c" default, "mean", "tsv", "iso_cts", "ties", "dare"; `merge_options`) takes the paper's
    other merges instead: each owner receives every rank's Δ of its own tensors (merge_route.py). `compress`
    (a `compress.Compression` or its string, "int4:128:0.95") sends each Δ and the update compressed,
    with error feedback residuals kept per rank (compressed.py, docs/compression.md).

    Momentum lives with the owner: state_dict() is per rank, consolidated_state_dict() the whole model's
    (checkpoint.py; a copy keeps all but the process group). Arguments: IsoLoCo's, in SGD's positions;
    half-precision params keep float32 momentum, and their means are summed in float32, rounded once.

    Bad input on any rank (missing grad, wrong shape or dtype, NaN/Inf, a failed flatten or merge) makes
    every rank raise DistributedStepError with nothing changed anywhere; so does a setting that differs
    between ranks (hyper-parameters, method, merge, compress, chunk_bytes, solo_above, the plan), named.
    Params live on the group's communication device (`agree.comm_device`); groups are fixed at
    construction. `process_group`: None is the default group; `chunk_bytes`: one communication chunk.

    Raises:
        ValueError: an argument it cannot honour (as IsoLoCo), or params off the communication device.
        DistributedStepError: on every rank, when any rank's arguments or settings are refused or differ.
        RuntimeError: torch.distributed is not initialized.

    Examples:
        >>> # on every rank, after torch.distributed.init_process_group(...)
        >>> model = torch.nn.Linear(8, 4)
        >>> outer = ShardedIsoLoCo(model.parameters(), lr=1.8, momentum=0.8)
        >>> for p in model.parameters():
        ...     p.grad = torch.randn_like(p)  # this rank's own pseudo-gradient, global − local
        >>> outer.step(); outer.zero_grad()
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
        iso: bool = True,
        method: str = "auto",
        process_group: Optional[ProcessGroup] = None,
        chunk_bytes: int = CHUNK_BYTES,
        solo_above: Optional[float] = 1.0,
        merge: str = "iso_c",
        merge_options: Optional[dict] = None,
        compress: Optional[Compression | str] = None,
    ) -> None:
        sgd = SGDArgs(lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, differentiable, fused)
        self.process_group = process_group
        self.rank, self.world_size = group_info(process_group)
        self._built = False
        self.merge, self.merge_options, self.merged_steps = merge, dict(merge_options or {}), 0
        # Every rank constructs or none does (never a hang at step one): a rank whose arguments are
        # refused raises its error after the agreement, the others DistributedStepError naming it;
        # settings that differ between ranks raise DistributedStepError everywhere, naming them.
        ag = Agreement("ShardedIsoLoCo()", process_group, alone=self.world_size == 1, mismatch=PLAN_MISMATCH)
        ag.attempt(self._build, params, sgd, iso, method, chunk_bytes, solo_above, compress)
        ag.settle(settings=ag.attempt(self._settings), own_error=True)
        self._built = True

    def _build(self, params, sgd: SGDArgs, iso, method, chunk_bytes, solo_above, compress) -> None:
        try:
            resolve_options(self.merge, self.merge_options)  # an unknown merge or option, by name
        except (TypeError, ValueError) as e:
            raise type(e)(f"ShardedIsoLoCo: {e}") from None
        compressed.attach(self, compress, "ShardedIsoLoCo")
        defaults = sgd.defaults("ShardedIsoLoCo", iso, method)
        check_chunk_bytes(chunk_bytes, "ShardedIsoLoCo: chunk_bytes")
        super().__init__(params, defaults)
        for k, g in enumerate(self.param_groups):
            where = f"ShardedIsoLoCo: param group {k}"
            sgd_state.sgd_keywords(where, **{key: g[key] for key in sgd_state.SGD_KEYS})
            outer.check_group(g, where)
        self._buckets: Optional[BucketPlan] = None  # batched Iso-C of my matrices, reused across steps
        self.method, self.chunk_bytes, self.solo_above = method, chunk_bytes, solo_above
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._index = {p: i for i, p in enumerate(self._params)}
        self._group_of = [k for k, g in enumerate(self.param_groups) for _ in g["params"]]
        sgd_state.check_param_dtypes(self._params, "ShardedIsoLoCo")
        for i, p in enumerate(self._params):
            if is_dtensor(p):
                raise TypeError(
                    f"ShardedIsoLoCo: param {i} (shape {tuple(p.shape)}, placements {tuple(p.placements)}) is a "
                    "DTensor (FSDP2 / tensor parallel); ShardedIsoLoCo steps whole tensors replicated on every "
                    "rank. Use IsoLoCo(model.parameters()), which steps DTensor params over their device mesh"
                )
        iso_params = [
            (f"param {i} (shape {tuple(p.shape)})", p)
            for i, p in enumerate(self._params)
            if self.param_groups[self._group_of[i]]["iso"]
        ]
        hint = "IsoLoCo(iso_nd=True) flattens them as matrices; iso=False in their param group silences this"
        warn_nd_params("ShardedIsoLoCo", iso_params, hint)  # at the user's line
        if self.world_size > 1:  # the collectives carry the params' own memory (broadcasts)
            check_on_comm_device(
                self._params, [f"ShardedIsoLoCo: param {i}" for i in range(len(self._params))], self.process_group
            )
        for i, p in enumerate(self._params):
            if p.device != self._params[0].device:
                raise ValueError(
                    f"ShardedIsoLoCo: param {i} is on {p.device}, param 0 on {self._params[0].device}; "
                    "one device per rank"
                )
        self.plan = plan_shards(
            [p.shape for p in self._params],
            self.world_size,
            dtypes=[p.dtype for p in self._params],
            iso=[self.param_groups[k]["iso"] and p.ndim == 2 for k, p in zip(self._group_of, self._params)],
            solo_above=solo_above,
        )
        self._data_device = self._params[0].device if self._params else torch.device("cpu")

    def _settings(self) -> dict[str, str]:
        """What every rank must share for the step to run the same collectives and write the same
        values: each group's hyper-parameters, the method, the chunk size and the shard plan."""
        plan = {"shard plan (shapes, dtypes, iso, solo_above)": f"{self.plan.fingerprint:#x}"}
        plan.update({f"param {i} (shape, dtype)": f"{tuple(p.shape)} {p.dtype}" for i, p in enumerate(self._params)})
        merge = {"merge": self.merge, "merge_options": repr(sorted(self.merge_options.items()))}
        merge["compress"] = repr(self.compress)
        return optimizer_settings(
            self, method=self.method, chunk_bytes=self.chunk_bytes, solo_above=self.solo_above, **plan, **merge
        )

    def add_param_group(self, param_group: dict) -> None:
        """Only while constructing: the shard plan is fixed then, so a group added later is refused."""
        if self._built:
            raise ValueError(
                "ShardedIsoLoCo.add_param_group: the shard plan (which rank steps which param and holds its momentum) "
                "is fixed at construction; pass every param group to ShardedIsoLoCo(...), or build a new one (on every "
                "rank) for the new params"
            )
        super().add_param_group(param_group)

    @property
    def mine(self) -> list[int]:
        """Indices (over all param groups, in order) of the params this rank steps."""
        return self.plan.owned(self.rank)

    def _name(self, gi: int, pi: int, p: torch.Tensor) -> str:
        return f"param {self._index[p]} (shape {tuple(p.shape)}) on rank {self.rank}"

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Average every rank's pseudo-gradients (reduce-scatter), Iso-C + Nesterov by each param's owner,
        all-gather the new params; returns the closure's loss (None without one).

        Raises:
            DistributedStepError: on every rank, for bad input, a failing closure or flatten on any rank.

        Examples:
            >>> outer = ShardedIsoLoCo([torch.nn.Parameter(torch.randn(6, 4))])
            >>> outer.param_groups[0]["params"][0].grad = torch.randn(6, 4)
            >>> outer.step() is None
            True
        """
        if self.process_group is checkpoint.DROPPED:  # a copy must be given its process group first
            raise RuntimeError(
                "ShardedIsoLoCo.step: this optimizer is a copy (deepcopy / pickle), and a process group cannot be "
                "copied; set opt.process_group to the group it steps over (None: the default group) first"
            )
        if self.compress is not None:  # each rank's Δ compressed, to its owners (compressed.py)
            return compressed.sharded_step(self, closure)
        ag = Agreement("ShardedIsoLoCo.step", self.process_group)
        loss = None
        if closure is not None:  # a closure that raises on one rank must still reach the agreement
            with torch.enable_grad():
                loss = ag.attempt(closure)
        grads = ag.attempt(self._check)
        bufs = ag.attempt(self._buffers)  # every collective's buffer, before the ranks agree
        # Agree before the first collective: bad input, or settings that differ between ranks (lr,
        # method, chunk_bytes, … changed on one rank since construction), or a buffer one rank
        # could not allocate, stop every rank here.
        ag.settle(settings=ag.attempt(self._settings))
        # From here every rank runs every collective whatever happens locally: the local work
        # between them runs under `ag.attempt`, so a failure reaches the next agreement.
        if self._per_worker:  # every worker's Δ to its owner, merged there (merge_route.py)
            flat = ag.attempt(lambda: [flat_view(g) for g in grads]) or [None] * len(self._params)
            segments, stacks = exchange_workers(
                self.plan, lambda i: flat[i], self.rank, self.process_group, bufs or {}, ag.attempt, self._data_device
            )
            means = ag.attempt(merged_updates, self, stacks, merge_groups) or {}
        else:
            segments, means = self._reduce(grads or [], bufs or {}, ag.attempt)
        write = ag.attempt(self._compute, means)
        ag.settle()
        ag.attempt(write)
        self._all_gather_params(segments, bufs or {}, ag.attempt)
        if self.world_size > 1:
            ag.settle(written=True)  # a failure while writing or gathering reaches every rank
        self.merged_steps += 1
        return loss

    @property
    def _per_worker(self) -> bool:
        return self.merge not in ("iso_c", "mean")

    def _buffers(self) -> dict:
        """The buffers of the step's collectives (`pipeline.reduce_scatter_buffers`,
        `reduce_to_owner_buffers`, `gather_segment_buffers`, and a flat copy for a non-contiguous
        solo param), made before the ranks first agree: an allocation that fails on one rank
        fails every rank there instead of leaving the others in a collective."""
        if self._per_worker:
            return merge_buffers(
                self.plan, self.rank, comm_device(self.process_group) if self.world_size > 1 else self._data_device
            )
        if self.world_size == 1:
            return {}
        plan, rank, group, cb = self.plan, self.rank, self.process_group, self.chunk_bytes
        out: dict = {}
        for dt in plan.sharded_dtypes:
            out[("reduce", dt)] = reduce_scatter_buffers(plan, dt, group, cb)
            out[("gather", dt)] = gather_segment_buffers(plan, dt, group, cb)
        for i in sorted(plan.solo):
            p = self._params[i]
            out[("solo", i)] = reduce_to_owner_buffers(p.numel(), p.dtype, plan.owners[i], rank, group, cb)
            if not p.is_contiguous():
                out[("flat", i)] = pipeline.comm_buffer(p.numel(), p.dtype, comm_device(group), False)
        return out

    def _check(self) -> list[torch.Tensor]:
        """Every rank's pseudo-gradients, checked (every param needs one: all are reduced and
        written), with the held momentum (`outer.collect`)."""

        # the params are checked where they are updated (the owned ones, `_compute`), not here
        where, name = "ShardedIsoLoCo.step", f"param {{i}} (shape {{shape}}) on rank {self.rank}"
        entries = outer.collect(self, where, name, require_grads=True, check_params=False)
        return [e.g for e in entries]

    def _reduce(self, grads, bufs: dict, attempt) -> tuple[dict, dict[int, torch.Tensor]]:
        """Mean pseudo-gradient of each param this rank owns: segments by reduce-scatter, solo
        tensors by a reduce to their owner (every rank's checks passed: the ranks agreed first).
        Returns (my segment per dtype, param index → mean). Local work under `attempt`."""
        plan, rank = self.plan, self.rank
        flat = attempt(lambda: [flat_view(g) for g in grads]) or [None] * len(self._params)
        segments, means = {}, {}
        for dt in plan.sharded_dtypes:
            if self.world_size > 1:
                own = reduce_scatter_mean(
                    plan,
                    dt,
                    lambda i: flat[i],
                    rank,
                    self.process_group,
                    self.chunk_bytes,
                    bufs[("reduce", dt)],
                    attempt,
                )
            else:
                own = self._own_single(dt, flat)
            segments[dt] = own
            means.update(attempt(owned_views, plan, dt, own, rank) or {})
        for i in sorted(plan.solo):
            p = self._params[i]
            mean = reduce_to_owner(
                flat[i],
                p.numel(),
                p.dtype,
                plan.owners[i],
                rank,
                self.process_group,
                self.chunk_bytes,
                bufs.get(("solo", i)),
                attempt,
            )
            if mean is not None:
                means[i] = mean.view(p.shape)
        return segments, means

    def _compute(self, means: dict[int, torch.Tensor]):
        """Iso-C and the Nesterov update of my params, everything that can fail before the ranks
        agree; returns the function that writes them."""
        idx = sorted(means)
        mine = [means[i] for i in idx]
        amax = amaxes(mine)  # one pass: the check, and the Nesterov bound of the plain updates
        check_amax_finite(mine, amax, [f"mean pseudo-gradient of param {i}" for i in idx])
        updates = dict(means)
        updates.update(self._iso_updates(means))
        return outer.prepare_nesterov(
            self,
            [
                (
                    self._params[i],
                    updates[i],
                    self.param_groups[self._group_of[i]]["lr"],
                    self.param_groups[self._group_of[i]]["momentum"],
                    f"param {i} (shape {tuple(self._params[i].shape)}) on rank {self.rank}",
                    (None, None, a if updates[i] is means[i] else None),
                )
                for i, a in zip(idx, amax)
            ],
        )

    def _all_gather_params(self, segments: dict, bufs: dict, attempt) -> None:
        """Every rank gets every updated param: segments all-gathered, solo tensors broadcast
        (local work under `attempt`)."""
        plan, rank = self.plan, self.rank
        for dt, own in segments.items():
            attempt(self._params_into_segment, dt, own)
            if self.world_size > 1:
                scatter_into(
                    plan,
                    dt,
                    own,
                    [p.data for p in self._params],
                    rank,
                    self.process_group,
                    self.chunk_bytes,
                    bufs.get(("gather", dt)),
                    attempt,
                )
        for i in sorted(plan.solo):
            broadcast_into(
                self._params[i].data,
                plan.owners[i],
                self.process_group,
                self.chunk_bytes,
                bufs.get(("flat", i)),
                attempt,
            )

    def _params_into_segment(self, dtype, own: torch.Tensor) -> None:
        """My updated params into my segment, which the all-gather sends."""
        for i, v in owned_views(self.plan, dtype, own, self.rank).items():
            v.copy_(self._params[i])

    def _iso_updates(self, means: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Iso-C of my 2-D mean pseudo-gradients in iso groups, batched by shape as IsoLoCo does
        (`outer.bucket_flatten`, the buffers kept for the next step): param index → result view."""
        if self.merge != "iso_c":  # "mean", or a merge that already ran (`_merged`)
            return {}
        idx = [
            i
            for i in sorted(means)
            if means[i].ndim == 2 and means[i].numel() and self.param_groups[self._group_of[i]]["iso"]
        ]
        names = [f"ShardedIsoLoCo: {self._name(0, 0, self._params[i])}" for i in idx]
        self._buckets, views = outer.bucket_flatten(
            [means[i] for i in idx], self.method, names, self._buckets
        )  # checked
        return dict(zip(idx, views))

    def _own_single(self, dtype, flat) -> torch.Tensor:
        """World size 1: my segment is just my grads, copied (the grads stay untouched)."""
        per_rank, seg = self.plan.layout(dtype)
        own = torch.empty(seg, dtype=dtype, device=self._data_device)
        for i, off in per_rank[0]:
            own[off : off + self.plan.numel(i)].copy_(flat[i])
        return own

    def __getstate__(self) -> dict:  # deepcopy / pickle: every setting and state but the process group
        return checkpoint.copy_state(self, super().__getstate__())

    def __setstate__(self, state: dict) -> None:
        checkpoint.restore_copy(self, state, super().__setstate__)

    def state_dict(self) -> dict:
        """SGD's state dict of this rank's momentum (only the owner keeps a param's), plus "sharding" (the plan's
        fingerprint, rank, world size), "merge" (the merge, its options, the step count) and with `compress` its
        "compress" entry (the spec, this rank's residuals) entries: it loads back into the same rank of the same
        plan and spec; for another world size or IsoLoCo, `consolidated_state_dict()` (no residuals). Raises nothing.

        Examples:
            >>> outer = ShardedIsoLoCo([torch.nn.Parameter(torch.randn(6, 4))])
            >>> sorted(outer.state_dict())
            ['merge', 'param_groups', 'sharding', 'state']
        """
        return checkpoint.rank_state_dict(self, super().state_dict())

    def consolidated_state_dict(self) -> dict:
        """The whole model's state (every param's momentum, gathered from its owner), on every rank: it loads
        into ShardedIsoLoCo at any world size, IsoLoCo or SGD (distributed/checkpoint.py). A collective."""
        return checkpoint.consolidated_state_dict(self)

    def load_state_dict(self, state_dict) -> None:
        """This rank's own `state_dict()`, or a whole state (`consolidated_state_dict()`, IsoLoCo's, SGD's) of
        which this rank keeps what it owns; checked first, a refused state loads nothing.

        Raises:
            ValueError: another rank's or plan's state, or buffers unlike their params (TypeError: not a dict).

        Examples:
            >>> outer = ShardedIsoLoCo([torch.nn.Parameter(torch.randn(6, 4))])
            >>> outer.load_state_dict(outer.state_dict())
        """
        checkpoint.load_state(self, state_dict, super().load_state_dict)
