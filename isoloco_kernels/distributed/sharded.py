"""`ShardedIsoLoCo`: the IsoLoCo outer step over a process group, each tensor stepped by one rank.

One step, as it runs (`ShardedIsoLoCo.step`):

    checks         every rank's pseudo-gradients, its weight (and, with clip, its norm of each Δ)
    roll call      one small all-gather of every rank's weight, quorum and norms: a failure so far goes to the vote,
                   a round short of min_workers returns, unchanged, on every rank; the weights normalized, the caps
    clip, pack     this rank's Δ clipped to the caps, weighted (the mean route) or zeros (weight 0); compressed
    leg 1          each rank's Δ to the owner of each tensor (`plan.py`): the mean by reduce-scatter, every
                   worker's Δ by all-to-all (merges that need them), or every worker's compressed Δ by all-to-all
    owner          M = iso(mean Δ) (2-D, iso on), the (weighted) mean, or another merge; Nesterov (reference.nesterov_ref),
                   prepared: nothing written
    leg 2 (aside)  compressed: the owners' updates all-gathered, every rank's new θ computed aside
    the vote       the step's one agreement: every rank's failure, its settings and a checksum of its params
    writes         my momentum (and residuals), my params; full precision: leg 2, the new θ all-gathered in place

Each kind of exchange is one class with its two legs (`_MeanExchange`, `_WorkerExchange`, `_CompressedExchange`);
each holds the buffers its collectives use from construction on, so a rank whose local work fails anywhere in
a step still joins every collective (sending zeros) and then votes no: every rank raises DistributedStepError
and nothing was written on any rank. The bytes of one all-reduce; each Iso-C runs once in the group; momentum
lives on the owner. docs/distributed.md has the contract, docs/compression.md the compressed route's.

The compressed owner route's arithmetic (`encode_delta`, `owner_inputs`, `owner_step`, `apply_update`) and its
state-dict entry (`attach`, `state_entry`, `check_entry`, `load_entry`) live here too: MergeLoCo's one-process
simulation (optim/compressed.py) calls the same functions, so the two agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from .._validate import ResultOverflowError, amaxes, check_all_finite, check_amax_finite, compute_dtype, is_dtensor
from ..compress import Compression, Packed, bytes_of, compress, decompress_add_, parse, track
from ..compress.codec import mix32
from ..merges import merge_groups
from ..merges.norm import clip_cap, worker_norms_each
from ..merges.options import resolve_clip, resolve_options, resolve_weights
from ..outer import core as outer
from ..outer import sgd_state
from ..outer.core import BucketPlan
from ..outer.merge_state import check_merge_entry, merge_entry
from ..outer.nd import warn_nd_params
from ..outer.sgd_state import SGDArgs
from . import pipeline
from .agree import (
    Agreement,
    agree,
    all_gather_single,
    check_on_comm_device,
    comm_device,
    control_plane,
    error_text,
    gather_objects,
    group_info,
    optimizer_settings,
)
from .bits import checksums
from .checkpoint import DROPPED
from .errors import DistributedStepError
from .merge import PLAN_MISMATCH
from .pipeline import CHUNK_BYTES, check_chunk_bytes, reduce_dtype
from .plan import ShardPlan, plan_shards

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim.optimizer import ParamsT

__all__ = [
    "Round",
    "ShardedIsoLoCo",
    "apply_update",
    "attach",
    "check_entry",
    "encode_delta",
    "layout",
    "load_entry",
    "owner_inputs",
    "owner_step",
    "state_entry",
    "stream_spec",
    "update_sizes",
    "wire_bytes",
    "worker_wire_bytes",
]

_MEAN_MERGES = ("iso_c", "mean")  # merges that need only the mean of the workers' Δ


class ShardedIsoLoCo(torch.optim.Optimizer):
    """IsoLoCo's outer step for DiLoCo over a process group, each tensor's work done by one rank.

    Grads NOT yet averaged: on every rank set p.data to the global weights (equal on all ranks) and
    p.grad to this rank's own pseudo-gradient θ − θ_k, then `step()` (for grads already averaged use
    `IsoLoCo(process_group=...)`). The step averages them itself (reduce-scatter); each rank applies
    M = iso(mean Δ) (2-D params, iso on) or mean Δ, then Nesterov (reference.nesterov_ref), to the
    params it owns; an all-gather gives every rank the new θ: the replicated IsoLoCo step on the mean.
    `merge` ("iso_c" default, "mean", "tsv", "iso_cts", "ties", "dare"; `merge_options`) takes the paper's
    other merges instead: each owner receives every rank's Δ of its own tensors. `compress`
    (a `compress.Compression` or its string, "int4:128:0.95") sends each Δ and the update compressed,
    with error feedback residuals kept per rank (docs/compression.md).

    Ragged rounds: `step(weight=w)` with this rank's worker weight (tokens processed; 0: nothing to send) merges
    the ranks with weight > 0 under their normalized weights (docs/merges.md), every rank agreeing on every weight
    in the step's roll call; `min_workers` (default 1) is the quorum: a round with fewer ranks of weight > 0 is
    skipped on every rank with nothing changed, and `last_round.committed` says so (no exception: the next round
    goes on). `clip` (None, "median" or a cap > 0, as MergeLoCo's) scales each rank's Δ of each tensor to at most
    the cap before it is sent; `last_worker_norms` / `last_clip_caps` keep what it saw. docs/distributed.md.

    Momentum lives with the owner: state_dict() is per rank, consolidated_state_dict() the whole model's
    (a copy keeps all but the process group). Arguments: IsoLoCo's, in SGD's positions;
    half-precision params keep float32 momentum, and their means are summed in float32, rounded once.

    Bad input on any rank (missing grad, wrong shape or dtype, NaN/Inf, a failed flatten or merge) makes
    every rank raise DistributedStepError with nothing changed anywhere; so does a setting that differs
    between ranks (hyper-parameters, method, merge, compress, chunk_bytes, solo_above, the plan), named, and
    params that differ between ranks (the replicas must hold the same global weights), named.
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
        clip: Optional[str | float] = None,
        min_workers: int = 1,
    ) -> None:
        sgd = SGDArgs(lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, differentiable, fused)
        self.process_group = process_group
        self.rank, self.world_size = group_info(process_group)
        self._built = False
        self.merge, self.merge_options, self.merged_steps = merge, dict(merge_options or {}), 0
        self.last_round: Optional[Round] = None  # the last step's round: committed?, participants, weights
        self.last_worker_norms: dict[int, torch.Tensor] = {}  # with clip: the last committed step's norms
        self.last_clip_caps: dict[int, float] = {}
        # Every rank constructs or none does (never a hang at step one): a rank whose arguments are
        # refused, or that cannot make its exchange's buffers, raises its error after the agreement, the
        # others DistributedStepError naming it; settings that differ between ranks raise DistributedStepError
        # everywhere, naming them. The agreement also makes the control tensors every later vote uses.
        ag = Agreement("ShardedIsoLoCo()", process_group, alone=self.world_size == 1, mismatch=PLAN_MISMATCH)
        ag.attempt(self._build, params, sgd, iso, method, chunk_bytes, solo_above, compress, clip, min_workers)
        ag.settle(settings=ag.attempt(self._settings), own_error=True)
        self._built = True

    def _build(self, params, sgd: SGDArgs, iso, method, chunk_bytes, solo_above, compress, clip, min_workers) -> None:
        try:
            resolve_options(self.merge, self.merge_options)  # an unknown merge or option, by name
        except (TypeError, ValueError) as e:
            raise type(e)(f"ShardedIsoLoCo: {e}") from None
        self.clip = resolve_clip(clip, "ShardedIsoLoCo")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int):
            raise TypeError(f"ShardedIsoLoCo: min_workers must be an int (the quorum), got {min_workers!r}")
        if not 1 <= min_workers <= self.world_size:
            raise ValueError(
                f"ShardedIsoLoCo: min_workers={min_workers} must be in [1, {self.world_size}] (the world size): the "
                "number of ranks with weight > 0 a round needs to be applied"
            )
        self.min_workers = min_workers
        attach(self, compress, "ShardedIsoLoCo")
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
        if self.world_size > 1:  # the collectives carry the params' own memory (all-gathers, broadcasts)
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
        self._mine = self.plan.owned(self.rank)
        self._plan_text = f"{self.plan.fingerprint:#x}"
        self._exchange = self._new_exchange(chunk_bytes)
        device = comm_device(self.process_group) if self.world_size > 1 else self._data_device
        self._roll = _RollCall(self.world_size, device, len(self._params) if self.clip is not None else 0)

    def _new_exchange(self, chunk_bytes: int):
        """The exchange this optimizer's merge and compress call for, with its buffers made (on the group's
        communication device; the params' own device on one rank)."""
        device = comm_device(self.process_group) if self.world_size > 1 else self._data_device
        if self.compress is not None:
            return _CompressedExchange(self.plan, self.rank, device, self.compress, self._specs)
        kind = _MeanExchange if self.merge in _MEAN_MERGES else _WorkerExchange
        return kind(self.plan, self.rank, device, chunk_bytes)

    def _settings(self) -> dict[str, str]:
        """What every rank must share for the step to run the same collectives and write the same
        values: each group's hyper-parameters, the method, the chunk size and the shard plan."""
        plan = {"shard plan (shapes, dtypes, iso, solo_above)": self._plan_text}
        plan.update({f"param {i} (shape, dtype)": f"{tuple(p.shape)} {p.dtype}" for i, p in enumerate(self._params)})
        merge = {"merge": self.merge, "merge_options": repr(sorted(self.merge_options.items()))}
        merge["compress"] = repr(self.compress)
        merge.update(clip=repr(self.clip), min_workers=repr(self.min_workers))
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
        add_specs(self, "ShardedIsoLoCo")

    @property
    def mine(self) -> list[int]:
        """Indices (over all param groups, in order) of the params this rank steps."""
        return list(self._mine)

    # -- the step ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *, weight=None) -> Optional[float]:
        """Average every rank's pseudo-gradients (reduce-scatter), Iso-C + Nesterov by each param's owner,
        all-gather the new params; returns the closure's loss (None without one).

        weight: this rank's worker weight this round, a number ≥ 0 (the tokens it processed, say; 0: it has
            nothing to send, its Δ is not merged and it sends zeros), given on every rank or on none; None:
            equal weights, the step as without it. The owners merge the ranks with weight > 0 under their
            normalized weights (docs/merges.md's weighted forms; equal weights are the unweighted step bit for
            bit). Fewer than `min_workers` ranks with weight > 0: the round is skipped on every rank, nothing
            changed (params, momentum, step count), and `last_round.committed` is False. Every rank's grads are
            still read and checked, a weight-0 rank's too (zeros will do). With `compress=` the weights must be
            equal.

        After each step `last_round` says what the ranks agreed: (committed, participants, weights).

        Raises:
            DistributedStepError: on every rank, for bad input (a NaN, negative or non-number weight included),
                a failing closure or flatten on any rank, settings or params that differ between ranks, every
                weight 0, a weight given on some ranks only, unequal weights with compress=; nothing changed on
                any rank.

        Examples:
            >>> outer = ShardedIsoLoCo([torch.nn.Parameter(torch.randn(6, 4))])
            >>> outer.param_groups[0]["params"][0].grad = torch.randn(6, 4)
            >>> outer.step() is None
            True
        """
        if self.process_group is DROPPED:  # a copy must be given its process group first
            raise RuntimeError(
                "ShardedIsoLoCo.step: this optimizer is a copy (deepcopy / pickle), and a process group cannot be "
                "copied; set opt.process_group to the group it steps over (None: the default group) first"
            )
        # This rank's first failure is kept (torchft's report_error), its later local work skipped; every
        # collective still runs on every rank, and the vote before the first write tells every rank.
        ex, group, failure, loss, update, successor = self._exchange, self.process_group, None, None, None, None
        own = grads = norms = send = None
        try:
            if self.world_size > 1:  # the vote's control tensors, before the first collective (made by the
                self._control_plane()  # constructor on its thread: nothing to make then)
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            own = _own_weight(weight, self.rank)
            grads = self._checked_grads()
            norms = self._norms(grads)  # with clip: this rank's norm of each Δ, for the roll call
            successor = self._successor(ex)  # a changed chunk_bytes: the next exchange, used after this step
        except Exception as e:  # noqa: BLE001 — every rank learns of it at the vote
            failure = e
        # The roll call: every rank's weight (and norms), one all-gather before leg 1. Its verdicts are every
        # rank's alike: a failure before it goes straight to the vote, a refused round raises here and a round
        # short of the quorum returns here, on every rank, before any exchange.
        roll = self._roll_call(failure, own, norms)
        if roll is None:  # some rank failed: the vote raises on every rank, naming it
            self._vote(failure)
            raise DistributedStepError(f"ShardedIsoLoCo.step: a rank failed before the roll call; {_UNCHANGED}")
        if not roll.quorum:
            self.last_round = Round(False, roll.participants, roll.weights)
            return loss
        try:
            send = self._send_plan(roll)
            ex.pack(self, self._clipped(grads, send), send)
        except Exception as e:  # noqa: BLE001
            failure = e
        failure = ex.to_owners(group, failure)  # leg 1, on every rank
        try:
            if failure is None:
                update = self._owner_update(ex.inputs(self), send.weights)
        except Exception as e:  # noqa: BLE001
            failure = e
        failure = ex.aside(self, update, group, failure)  # what leg 2 needs before the vote (compressed: leg 2)
        self._vote(failure)
        ex.write(self, update, group)  # after the vote only: the writes (full precision: and leg 2)
        if successor is not None:
            self._exchange = successor
        self.merged_steps += 1
        self.last_round = Round(True, roll.participants, roll.weights)
        if send.caps is not None:  # what the clip saw, as MergeLoCo keeps it
            self.last_worker_norms, self.last_clip_caps = send.norms, send.caps
        return loss

    def _norms(self, grads) -> Optional[torch.Tensor]:
        """With clip: this rank's 2-norm of each Δ (`merges.worker_norms` of it as a stack of one worker), float64
        [params] on the CPU; None without clip."""
        if self.clip is None:
            return None
        if not grads:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(worker_norms_each([g.unsqueeze(0) for g in grads]))

    def _roll_call(self, failure, own: Optional[float], norms) -> Optional[_Roll]:
        """Every rank's weight, quorum and (with clip) norms (`_RollCall`: one all-gather; one rank: its own),
        and the verdicts every rank draws alike from them: None when a rank failed before it (the vote then
        names it), DistributedStepError for a round the ranks cannot run (min_workers differ between ranks, a
        weight on some ranks only, every weight 0, unequal weights with compress=), or the round, short of the
        quorum or not. Pure Python on the gathered numbers: nothing here can fail on one rank alone."""
        where = "ShardedIsoLoCo.step"
        if self.world_size == 1:
            rows = [(2 if failure is not None else int(own is not None), self.min_workers, own or 0.0)]
            every = None if norms is None else norms.view(1, -1)
        else:
            rows = self._roll.call(failure is not None, self.min_workers, own, norms, self.process_group)
            every = self._roll.norms()
        if any(state == 2 for state, _, _ in rows):
            return None
        quora = [q for _, q, _ in rows]
        if len(set(quora)) > 1:
            raise DistributedStepError(
                f"{where}: the ranks' min_workers differ ({_per_rank(quora)}); set it alike on every rank; {_UNCHANGED}"
            )
        given = [state == 1 for state, _, _ in rows]
        if any(given) and not all(given):
            on = [r for r, g in enumerate(given) if g]
            off = [r for r, g in enumerate(given) if not g]
            raise DistributedStepError(
                f"{where}: weight= was given on rank{'s' if len(on) > 1 else ''} {on} and not on "
                f"rank{'s' if len(off) > 1 else ''} {off}; pass each rank's weight on every rank, or on none "
                f"(equal weights); {_UNCHANGED}"
            )
        weights = [w for _, _, w in rows] if all(given) else None
        participants = self.world_size if weights is None else sum(w > 0 for w in weights)
        if participants == 0:
            raise DistributedStepError(
                f"{where}: every rank's weight is 0 ({self.world_size} ranks): there is nothing to merge; skip this "
                f"round's step, or give the ranks that delivered a positive weight; {_UNCHANGED}"
            )
        quorum = participants >= quora[0]
        if quorum and self.compress is not None and weights is not None and len(set(weights)) > 1:
            raise DistributedStepError(
                f"{where}: weights with compress= must be equal on every rank (or None), got {_per_rank(weights)}: "
                "the compressed exchange averages every worker's payload (as MergeLoCo(compress=) does), so a rank "
                f"can be neither weighted nor dropped there; {_UNCHANGED}"
            )
        return _Roll(quorum, participants, None if weights is None else tuple(weights), every)

    def _send_plan(self, roll: _Roll) -> _Send:
        """What this rank sends and the owners merge, from the round: the normalized weights (merges/options.py's
        `resolve_weights`, as MergeLoCo resolves them), this rank's factor on the mean route, and with clip every
        tensor's cap and this rank's scale (merges/norm.py's rule, on the norms every rank sent)."""
        norms = caps = scales = None
        active, omega = (None, None)
        if roll.weights is not None:
            active, omega = resolve_weights(list(roll.weights), self.world_size, "ShardedIsoLoCo.step")
        if self.clip is not None:
            norms = {i: roll.norms[:, i].clone() for i in range(len(self._params))}
            caps, scales = {}, {}
            for i, n in norms.items():
                caps[i] = clip_cap(n if active is None else n[active], self.clip)
                mine = float(n[self.rank])
                if mine > caps[i]:
                    scales[i] = caps[i] / mine
        me_active = active is None or self.rank in active
        me = self.rank if active is None else active.index(self.rank) if me_active else None
        factor = None if omega is None or me is None else float(omega[me])
        divisor = 1 if omega is not None else (self.world_size if active is None else len(active))
        return _Send(roll.weights, not me_active, factor, divisor, norms, caps, scales)

    def _clipped(self, grads, send: _Send):
        """The grads with this rank's Δ of each tensor above its cap scaled to it (merges/norm.py's arithmetic:
        in the compute dtype, rounded to the grad's dtype), the others as they are."""
        if not send.scales:
            return grads
        out = list(grads)
        for i, c in send.scales.items():
            g = grads[i]
            out[i] = (g.to(compute_dtype(g.dtype)) * c).to(g.dtype)
        return out

    def _checked_grads(self) -> list[torch.Tensor]:
        """Every rank's pseudo-gradients, checked (every param needs one: all are reduced and written), with
        the held momentum (`outer.collect`); the params still the plan's (shape, dtype) and every setting
        the exchange was built for (merge family, compress) unchanged."""
        ex = self._exchange
        if self.compress is not None:
            kind = _CompressedExchange
        else:
            kind = _MeanExchange if self.merge in _MEAN_MERGES else _WorkerExchange
        if type(ex) is not kind or getattr(ex, "spec", None) != self.compress:
            raise ValueError(
                f"ShardedIsoLoCo.step: merge={self.merge!r}, compress={self.compress!r}, but this optimizer's "
                "exchange and its buffers were built for other ones at construction; build a new ShardedIsoLoCo "
                "(on every rank) for another merge or compression"
            )
        if (self.clip is not None) != bool(self._roll.count) or not (
            isinstance(self.min_workers, int) and 1 <= self.min_workers <= self.world_size
        ):
            raise ValueError(
                f"ShardedIsoLoCo.step: clip={self.clip!r}, min_workers={self.min_workers!r}, but this optimizer was "
                f"built {'with' if self._roll.count else 'without'} a clip (its roll call carries the norms only then) "
                f"for a world of {self.world_size}; build a new ShardedIsoLoCo (on every rank) to switch the clip on or "
                "off, and keep min_workers in [1, world size]"
            )
        if self.clip is not None:  # a cap set since construction, checked as the constructor checks it
            resolve_clip(self.clip, "ShardedIsoLoCo.step")
        for i, p in enumerate(self._params):
            if tuple(p.shape) != self.plan.shapes[i] or p.dtype != self.plan.dtypes[i]:
                raise ValueError(
                    f"ShardedIsoLoCo.step: param {i} is now {tuple(p.shape)} {p.dtype}; the shard plan was made for "
                    f"{self.plan.shapes[i]} {self.plan.dtypes[i]} (a param's data was replaced by another shape)"
                )
        # the params are checked where they are updated (the owned ones, `_owner_update`), not here
        where, name = "ShardedIsoLoCo.step", f"param {{i}} (shape {{shape}}) on rank {self.rank}"
        entries = outer.collect(self, where, name, require_grads=True, check_params=False)
        return [e.g for e in entries]

    def _control_plane(self) -> None:
        """Every control tensor the vote uses, made now if this thread has none (`agree.control_plane`): a
        failure to make them is this rank's failure, which its vote reports."""
        failure = control_plane(self.process_group)
        if failure is not None:
            raise failure

    def _successor(self, ex):
        """The exchange for a chunk_bytes set since construction (checked, its buffers made before the first
        collective), or None. This step still runs on `ex`, as every other rank's does; the vote compares the
        chunk sizes, and only a step every rank commits hands over to the new one."""
        if self.compress is not None or self.chunk_bytes == ex.chunk_bytes:
            return None  # the compressed exchange moves whole segments: no chunks
        check_chunk_bytes(self.chunk_bytes, "ShardedIsoLoCo: chunk_bytes")
        return self._new_exchange(self.chunk_bytes)

    def _owner_update(self, inputs: dict[int, torch.Tensor], weights=None):
        """The owner's step on its own tensors, computed and checked, nothing written: full precision the
        function that writes (Iso-C or the merge, then the Nesterov update: `outer.prepare_nesterov`); with
        compress `owner_step`'s (buckets, momentum, update residuals, updates). weights: every rank's, for a
        merge of every worker's Δ (the mean route weighted its sum already; compress: equal)."""
        if self.compress is not None:
            groups = [self.param_groups[k] for k in self._group_of]
            return owner_step(self, self._params, groups, inputs, self._specs, self._buckets)
        if self.merge not in _MEAN_MERGES:  # every worker's Δ of my tensors: their merge
            merged = {i for i in inputs if self.param_groups[self._group_of[i]]["iso"]}
            out = merge_groups(inputs, merged, self.merge, self.merge_options, self.merged_steps, self.method, weights)
            inputs = {i: m.to(self._params[i].dtype) for i, m in out.items()}
        idx = sorted(inputs)
        mine = [inputs[i] for i in idx]
        amax = amaxes(mine)  # one pass: the check, and the Nesterov bound of the plain updates
        check_amax_finite(mine, amax, [f"mean pseudo-gradient of param {i}" for i in idx])
        updates = dict(inputs)
        if self.merge == "iso_c":  # Iso-C of my 2-D means in iso groups, batched by shape as IsoLoCo does
            iso = [
                i
                for i in idx
                if inputs[i].ndim == 2 and inputs[i].numel() and self.param_groups[self._group_of[i]]["iso"]
            ]
            names = [
                f"ShardedIsoLoCo: param {i} (shape {tuple(self._params[i].shape)}) on rank {self.rank}" for i in iso
            ]
            self._buckets, views = outer.bucket_flatten([inputs[i] for i in iso], self.method, names, self._buckets)
            updates.update(zip(iso, views))
        return outer.prepare_nesterov(
            self,
            [
                (
                    self._params[i],
                    updates[i],
                    self.param_groups[self._group_of[i]]["lr"],
                    self.param_groups[self._group_of[i]]["momentum"],
                    f"param {i} (shape {tuple(self._params[i].shape)}) on rank {self.rank}",
                    (None, None, a if updates[i] is inputs[i] else None),
                )
                for i, a in zip(idx, amax)
            ],
        )

    def _vote(self, failure: Optional[BaseException]) -> None:
        """The step's one agreement, before anything is written (torchft's should_commit): every rank sends
        whether it failed, a fingerprint of its settings and a checksum of its params; if any rank failed, or
        the settings or params differ, every rank raises DistributedStepError naming the ranks and their errors,
        the settings that differ or the first param that differs, with nothing written. One small all-gather;
        one rank alone has nothing to compare (its own failure still raises as the group's)."""
        if self.world_size == 1 and failure is None:
            return
        settings = replicas = None
        if failure is None and self.world_size > 1:
            try:
                settings, replicas = self._settings(), self._replicas()
            except Exception as e:  # noqa: BLE001
                failure = e
        agree(
            None if failure is None else error_text(failure),
            self.process_group,
            "ShardedIsoLoCo.step",
            settings=settings,
            replicas=replicas,
            mismatch=PLAN_MISMATCH,
        )

    def _replicas(self) -> tuple:
        """What the vote compares of the params (the global weights, equal on every rank): their names, a
        checksum of each param's bits (`bits.checksums`: one read of each param, one host sync), and
        what to do when they differ."""
        names = [f"param {i} (shape {tuple(p.shape)})" for i, p in enumerate(self._params)]
        return "params", names, checksums([p.detach() for p in self._params]), _REPLICA_HINT

    # -- copies and checkpoints ---------------------------------------------------------------------------

    def __getstate__(self) -> dict:  # deepcopy / pickle: every setting and state but the process group
        keep = ("defaults", "state", "param_groups")
        state = super().__getstate__()
        extra = {k: v for k, v in self.__dict__.items() if k not in keep and not k.startswith("_optimizer")}
        extra = {k: v for k, v in extra.items() if k not in ("process_group", "_outer_bounds")}
        return {**state, "sharded_copy": extra}

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict calls this with state and param_groups only: the optimizer keeps its own attributes
        state = dict(state)
        extra = state.pop("sharded_copy", None)
        super().__setstate__(state)
        if extra is not None:
            self.__dict__.update(extra)
            self.process_group = DROPPED

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
        sd = super().state_dict()
        sd["sharding"] = {"fingerprint": self.plan.fingerprint, "rank": self.rank, "world_size": self.world_size}
        sd["merge"] = merge_entry(self.merge, self.merge_options, self.merged_steps)
        if self.compress is not None:  # this worker's residuals and the owner's update residuals
            sd["compress"] = state_entry(self)
        return sd

    def consolidated_state_dict(self) -> dict:
        """The whole model's state (every param's momentum, gathered from its owner), on every rank: it loads
        into ShardedIsoLoCo at any world size, IsoLoCo or SGD. A collective: every rank of the group calls it.
        The buffers are allocated and the ranks agree before the first broadcast, so a failure on one rank
        (out of memory) raises DistributedStepError on every rank, never a hang. Nothing of the optimizer
        changes (docs/checkpoints.md)."""
        where = "ShardedIsoLoCo.consolidated_state_dict"
        ag = Agreement(where, self.process_group, alone=self.world_size == 1)
        mine = ag.attempt(torch.optim.Optimizer.state_dict, self)
        held = ag.attempt(
            lambda: {
                pid: (tuple(st["momentum_buffer"].shape), str(st["momentum_buffer"].dtype))
                for pid, st in mine["state"].items()
                if st.get("momentum_buffer") is not None
            }
        )
        ag.settle()  # every rank has its control plane and its shapes, before they are exchanged
        every = [held] if self.world_size == 1 else gather_objects(held, self.process_group)
        flats = ag.attempt(self._consolidation_buffers, mine, every) or {}
        ag.settle()
        if self.world_size > 1:
            for pid in sorted(flats):  # the same order on every rank: each param's owner sends, the others receive
                r, buf = flats[pid]
                pipeline.broadcast_from_owner(buf.view(-1), r, self.process_group, self.chunk_bytes)
        out = {"state": {pid: {"momentum_buffer": buf} for pid, (_, buf) in sorted(flats.items())}}
        out["param_groups"] = mine["param_groups"]
        out["merge"] = merge_entry(self.merge, self.merge_options, self.merged_steps)
        return out

    def _consolidation_buffers(self, mine: dict, every: list) -> dict:
        """pid → (owner, a contiguous buffer: a copy of my momentum, or one to receive another rank's into)."""
        dtypes = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
        flats = {}
        for r, h in enumerate(every):
            for pid, (shape, dtype) in h.items():
                if r == self.rank:
                    flats[pid] = (r, mine["state"][pid]["momentum_buffer"].detach().contiguous().clone())
                else:
                    flats[pid] = (r, torch.empty(shape, dtype=dtypes[dtype], device=self._data_device))
        return flats

    def load_state_dict(self, state_dict) -> None:
        """This rank's own `state_dict()`, or a whole state (`consolidated_state_dict()`, IsoLoCo's, SGD's) of
        which this rank keeps what it owns; checked first, a refused state loads nothing.

        Raises:
            ValueError: another rank's or plan's state, or buffers unlike their params (TypeError: not a dict).

        Examples:
            >>> outer = ShardedIsoLoCo([torch.nn.Parameter(torch.randn(6, 4))])
            >>> outer.load_state_dict(outer.state_dict())
        """
        where = "ShardedIsoLoCo.load_state_dict"
        info = check_merge_entry(self, state_dict, where)
        residuals = None  # a whole state holds no error-feedback residuals: they restart from zero
        if isinstance(state_dict, dict) and "sharding" not in state_dict:
            if state_dict.get("compress") is not None:  # a whole state with residuals: a compressed MergeLoCo's
                raise ValueError(
                    f"{where}: this state holds a compressed MergeLoCo's error-feedback residuals (its K workers', "
                    "simulated in one process); a ShardedIsoLoCo rank keeps only its own worker's and cannot take "
                    "them. To go on from its momentum alone, load it without its 'compress' entry (the residuals "
                    "then start from zero); nothing was loaded"
                )
            rest = {k: v for k, v in state_dict.items() if k not in ("merge", "compress")}
            sgd_state.check_state_dict(self, rest, where)  # every param's buffer, not only mine: one verdict
            rest["state"] = {pid: st for pid, st in rest["state"].items() if pid in set(self._mine)}
        else:
            rest = {k: v for k, v in self._rank_state(state_dict, where).items() if k not in ("merge", "compress")}
            residuals = check_entry(self, state_dict, where, self._params, self._mine)
        sgd_state.load_sgd_state(self, rest, where, super().load_state_dict)
        load_entry(self, residuals)
        if info is not None:
            self.merged_steps = int(info["steps"])

    def _rank_state(self, state_dict, where: str) -> dict:
        """One rank's state dict checked against this optimizer's rank and shard plan; returns it without
        its 'sharding' entry (what `sgd_state.load_sgd_state` loads)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
        info = state_dict.get("sharding")
        if info is None:
            raise ValueError(
                f"{where}: the state has no 'sharding' entry (it was not saved by "
                "ShardedIsoLoCo.state_dict()); per-rank momentum cannot be matched to this plan"
            )
        if info["world_size"] != self.world_size or info["fingerprint"] != self.plan.fingerprint:
            raise ValueError(
                f"{where}: the state was saved under a different shard plan "
                f"(world size {info['world_size']}, plan {info['fingerprint']:#x}); this optimizer has world "
                f"size {self.world_size}, plan {self.plan.fingerprint:#x}; it needs the same params (shapes, "
                "dtypes, order) and world size"
            )
        if info["rank"] != self.rank:
            raise ValueError(
                f"{where}: the state was saved by rank {info['rank']}, this is rank {self.rank}; load each rank's "
                "own state"
            )
        rest = {k: v for k, v in state_dict.items() if k != "sharding"}
        extra = sorted(set(rest.get("state", {})) - set(self._mine))
        if extra:
            raise ValueError(
                f"{where}: the state holds momentum for params {extra[:8]} that rank {self.rank} does not own"
            )
        return rest


_UNCHANGED = "nothing was changed on any rank"


class Round(NamedTuple):
    """What the ranks agreed on in one `ShardedIsoLoCo.step` (its `last_round`)."""

    committed: bool  #: the step was applied; False: fewer than min_workers ranks had weight > 0, nothing changed
    participants: int  #: the ranks with weight > 0 (every rank without weights)
    weights: Optional[tuple[float, ...]]  #: every rank's weight in rank order; None: step() without weights


class _Roll(NamedTuple):
    """The roll call's round: quorum met?, participants, every rank's weight (None: none given), and with clip
    every rank's norms ([world, params] float64, a view of the roll call's buffer)."""

    quorum: bool
    participants: int
    weights: Optional[tuple[float, ...]]
    norms: Optional[torch.Tensor]


class _Send(NamedTuple):
    """What this rank sends and the owners merge in one round (`ShardedIsoLoCo._send_plan`)."""

    weights: Optional[tuple[float, ...]]  # every rank's (None: equal), for the merges of every worker's Δ
    zero: bool  # this rank's weight is 0: it sends zeros
    factor: Optional[float]  # the mean route: this rank's normalized weight ω (None: unweighted)
    divisor: int  # the mean route: what the owner divides the sum by (world, the participants, or 1 under ω)
    norms: Optional[dict]  # with clip: {param index: every rank's norm (float64 [world], CPU)}
    caps: Optional[dict]  # with clip: {param index: its cap}
    scales: Optional[dict]  # with clip: {param index: this rank's scale cap / norm}, where the norm is above the cap


def _own_weight(weight, rank: int) -> Optional[float]:
    """This rank's weight= checked: None, or a finite number ≥ 0 as a float (a one-element tensor counts as its
    number). TypeError / ValueError naming it otherwise; a failure of this rank, which the vote reports."""
    if weight is None:
        return None
    what = f"ShardedIsoLoCo.step: weight= on rank {rank}"
    if isinstance(weight, torch.Tensor):
        if weight.numel() != 1 or weight.dtype == torch.bool or weight.is_complex():
            raise TypeError(f"{what} must be a number ≥ 0 (this rank's worker weight), got a tensor {weight!r}")
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(f"{what} must be a number ≥ 0 (this rank's worker weight), got {weight!r}")
    v = float(weight)
    if not math.isfinite(v):
        raise ValueError(f"{what} is {weight!r}; it must be finite")
    if v < 0:
        raise ValueError(f"{what} is {weight!r}; weights must be ≥ 0 (0: this rank has nothing to send)")
    return v


def _per_rank(values) -> str:
    return ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))


class _RollCall:
    """The step's roll call, before leg 1: one all-gather of each rank's row of int64 words — its state (0: no
    weight given, 1: a weight given, 2: failed so far), its min_workers, its weight and, with clip, its norm of
    each Δ (floats by their float64 bits: carried exactly). Its buffers are made with the optimizer (on the
    group's communication device, and a host copy of each off the CPU), so the call allocates nothing."""

    def __init__(self, world: int, device, norms: int):
        self.world, self.words, self.count = world, 3 + norms, norms
        if world == 1:
            return
        self.mine = pipeline.comm_buffer(self.words, torch.int64, device, True)
        self.every = pipeline.comm_buffer(world * self.words, torch.int64, device, True)
        cpu = torch.device(device).type == "cpu"
        self.host = self.mine if cpu else torch.zeros(self.words, dtype=torch.int64)
        self.host_every = self.every if cpu else torch.zeros(world * self.words, dtype=torch.int64)

    def call(self, failed: bool, quorum: int, weight: Optional[float], norms, group) -> list[tuple]:
        """Every rank's (state, min_workers, weight), in rank order; `norms()` then reads their norms."""
        h = self.host
        h.zero_()
        h[0] = 2 if failed else int(weight is not None)
        h[1] = 0 if failed else quorum  # a failed rank's own settings may be what failed: nothing of them is sent
        if not failed:
            f = h.view(torch.float64)
            f[2] = 0.0 if weight is None else weight
            if self.count and norms is not None and norms.numel() == self.count:
                f[3:].copy_(norms)
        if self.mine is not h:
            self.mine.copy_(h)
        all_gather_single(self.every, self.mine, group=group)
        if self.host_every is not self.every:
            self.host_every.copy_(self.every)
        rows = self.host_every.view(self.world, self.words)
        states = rows[:, :2].tolist()
        weights = rows.view(torch.float64)[:, 2].tolist()
        return [(s, q, w) for (s, q), w in zip(states, weights)]

    def norms(self) -> Optional[torch.Tensor]:
        """Every rank's norms from the last call: a [world, params] float64 view (None without clip)."""
        if not self.count:
            return None
        return self.host_every.view(self.world, self.words).view(torch.float64)[:, 3:]


_REPLICA_HINT = (
    "ShardedIsoLoCo steps replicas: every rank's params must be the same global weights when step() is called "
    "(only the grads differ: each rank's own pseudo-gradient). Restore the global weights on every rank before "
    "step() (p.data.copy_(global_p) after the inner steps), and start every rank from the same weights (the same "
    "seed, or broadcast them from rank 0 before training)"
)


# -- the exchanges --------------------------------------------------------------------------------------------
#
# Each holds, from construction on, every buffer its collectives use (`pipeline.comm_buffer`, on the group's
# communication device), so a rank whose local work failed joins every collective with them (sending zeros).
# The step calls, in order: pack (local), to_owners (leg 1), inputs (local), aside (before the vote), write
# (after it). Each method that runs collectives takes this rank's failure so far and returns it: once there is
# one, the local work between the collectives is skipped and the collectives still run.


def _chunks(total: int, per: int):
    for a in range(0, total, per):
        yield a, min(total, a + per)


def _global(group, r: int) -> int:
    return dist.get_global_rank(group, r) if group is not None else r


class _Segments:
    """One dtype's tensors laid end to end in each owner's segment (`ShardPlan.layout`): per rank its
    (tensor index, offset, numel), the padded segment length, and my own segment (a buffer)."""

    def __init__(self, plan: ShardPlan, dtype: torch.dtype, rank: int, own: torch.Tensor):
        per_rank, self.length = plan.layout(dtype)
        self.dtype, self.own = dtype, own
        self.per_rank = [[(i, off, plan.numel(i)) for i, off in entries] for entries in per_rank]
        self.mine = self.per_rank[rank]

    def pack(self, flats, a: int, b: int, send: torch.Tensor) -> None:
        """Elements [a, b) of every rank's segment into `send` (world pieces of b − a), from the flat tensors."""
        w = b - a
        send.zero_()
        for r, entries in enumerate(self.per_rank):
            for i, off, n in entries:
                lo, hi = max(a, off), min(b, off + n)
                if lo < hi:
                    send[r * w + lo - a : r * w + hi - a].copy_(flats[i][lo - off : hi - off])

    def unpack(self, got: torch.Tensor, a: int, b: int, dst: dict) -> None:
        """Every rank's elements [a, b) of its segment, all-gathered in `got`, into the flat tensors `dst`."""
        w = b - a
        for r, entries in enumerate(self.per_rank):
            for i, off, n in entries:
                lo, hi = max(a, off), min(b, off + n)
                if lo < hi:
                    dst[i][lo - off : hi - off].copy_(got[r * w + lo - a : r * w + hi - a])


class _ParamsBack:
    """Leg 2 of the full-precision exchanges, after the vote: every rank's params ← the owners' new params,
    in place. My params into my segments, the segments all-gathered in chunks of about chunk_bytes (at most
    two in flight), each rank's pieces copied into the params; solo params broadcast from their owner. It
    needs nothing it could fail to make: its buffers were made at construction, and the flat stand-ins of
    non-contiguous params before the vote (`aside`)."""

    def _init_back(self, plan: ShardPlan, rank: int, device, chunk_bytes: int) -> None:
        self.plan, self.rank, self.world, self.device = plan, rank, plan.world_size, device
        self.chunk_bytes = chunk_bytes
        self.solo = sorted(plan.solo)
        self.numel = [plan.numel(i) for i in range(len(plan.shapes))]
        self.segments: dict[torch.dtype, _Segments] = {}
        self._stand_ins: dict[int, torch.Tensor] = {}

    def _chunk(self, k: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Chunk buffer k % 3 (made at construction, `_chunk_buffers`) as `numel` elements of `dtype`."""
        return self._chunk_bufs[k % 3][: numel * dtype.itemsize].view(dtype)

    def _chunk_buffers(self, nbytes: int) -> None:
        self._chunk_bufs = [pipeline.comm_buffer(max(nbytes, 8), torch.uint8, self.device, False) for _ in range(3)]

    def _gather_per(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk_bytes // (self.world * dtype.itemsize))

    def _gather_bytes(self) -> int:
        out = 0
        for seg in self.segments.values():
            if seg.length:
                out = max(out, self.world * min(self._gather_per(seg.dtype), seg.length) * seg.dtype.itemsize)
        return out

    def aside(self, opt, update, group, failure):
        """Before the vote: a flat stand-in for each non-contiguous param leg 2 writes into (it receives
        through it). No collective."""
        self._stand_ins = {}
        if failure is None and self.world > 1:
            try:
                self._stand_ins = {
                    i: pipeline.comm_buffer(p.numel(), p.dtype, self.device, False)
                    for i, p in enumerate(opt._params)
                    if not p.is_contiguous()
                }
            except Exception as e:  # noqa: BLE001
                failure = e
        return failure

    def write(self, opt, write, group) -> None:
        """After the vote: my momentum and params (the prepared Nesterov update), then leg 2."""
        write()
        if self.world == 1:
            return
        params = opt._params
        dst = {i: self._stand_ins.get(i, p.data.view(-1) if p.is_contiguous() else None) for i, p in enumerate(params)}
        for seg in self.segments.values():
            for i, off, n in seg.mine:
                seg.own[off : off + n].view(params[i].shape).copy_(params[i])
            pending = []
            for k, (a, b) in enumerate(_chunks(seg.length, self._gather_per(seg.dtype))):
                got = self._chunk(k, seg.dtype, self.world * (b - a))
                work = pipeline.all_gather_single(got, seg.own[a:b], group=group, async_op=True)
                pending.append((work, got, a, b))
                if len(pending) > 2:
                    self._finish_gather(seg, pending.pop(0), dst)
            while pending:
                self._finish_gather(seg, pending.pop(0), dst)
        for i in self.solo:
            if self.plan.owners[i] == self.rank and i in self._stand_ins:
                self._stand_ins[i].view(params[i].shape).copy_(params[i])
            pipeline.broadcast_from_owner(dst[i], self.plan.owners[i], group, self.chunk_bytes)
        for i, flat in self._stand_ins.items():
            params[i].data.copy_(flat.view(params[i].shape))
        self._stand_ins = {}

    @staticmethod
    def _finish_gather(seg: _Segments, pending, dst) -> None:
        work, got, a, b = pending
        work.wait()
        seg.unpack(got, a, b, dst)


class _MeanExchange(_ParamsBack):
    """Full precision, merge "iso_c" or "mean": leg 1 reduce-scatters the workers' Δ in chunks into each owner's
    segment as their mean (summed in `reduce_dtype`, float32 for 2-byte dtypes, divided and rounded once; solo
    tensors: reduced to their owner in chunks); leg 2 all-gathers the new params (`_ParamsBack`).

    Buffers held: my segment per dtype (the mean, then my new params), the owner's copy of each solo tensor it
    owns, and six chunk buffers of about chunk_bytes / world (three to send and receive, three sums)."""

    def __init__(self, plan: ShardPlan, rank: int, device, chunk_bytes: int):
        self._init_back(plan, rank, device, chunk_bytes)
        self._flats: Optional[list] = None
        self._send: Optional[_Send] = None
        if self.world == 1:
            return
        send = out = 0
        for dt in plan.sharded_dtypes:
            seg = _Segments(plan, dt, rank, pipeline.comm_buffer(plan.layout(dt)[1], dt, device, False))
            self.segments[dt] = seg
            if seg.length:
                rdt, per = reduce_dtype(dt), self._reduce_per(dt)
                send = max(send, self.world * min(per, seg.length) * rdt.itemsize)
                out = max(out, min(per, seg.length) * rdt.itemsize)
        self.solo_out = {}
        for i in self.solo:
            dt, n = plan.dtypes[i], plan.numel(i)
            rdt = reduce_dtype(dt)
            send = max(send, min(max(1, chunk_bytes // rdt.itemsize), n) * rdt.itemsize)
            if plan.owners[i] == rank:
                self.solo_out[i] = pipeline.comm_buffer(n, dt, device, False)
        self._chunk_buffers(max(send, self._gather_bytes()))
        self._out_bufs = [pipeline.comm_buffer(max(out, 8), torch.uint8, device, False) for _ in range(3)]

    def _reduce_per(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk_bytes // (self.world * reduce_dtype(dtype).itemsize))

    def pack(self, opt, grads, send: _Send) -> None:
        """Each grad flat (a view; a copy where it is not contiguous), for the reduce-scatter's chunks, and what
        the round says this rank sends: its Δ, its Δ times its normalized weight ω (in the sum's dtype, as the
        one-process weighted mean multiplies), or −0.0 (weight 0: the sum's identity, sign of zero included)."""
        self._flats = [g.reshape(-1) for g in grads]
        self._send = send

    def _fill(self, fill, send: torch.Tensor) -> None:
        """One chunk of what this rank sends: `fill(send)` packs its Δ, then its weight applies."""
        if self._send.zero:
            send.fill_(-0.0)
            return
        fill(send)
        if self._send.factor is not None:
            send.mul_(self._send.factor)

    def _mean(self, total: torch.Tensor) -> torch.Tensor:
        """The received sum as the round's mean: divided by the world, by the participants, or (weighted: the
        ω sum to 1) as it is."""
        d = self.world if self._send is None else self._send.divisor
        return total if d == 1 else total.div_(d)

    def to_owners(self, group, failure):
        """Leg 1: the mean of every rank's Δ of each tensor on its owner (my segments, the solo tensors I own).
        A rank that failed sends zeros."""
        flats, self._flats = self._flats, None
        if self.world == 1:
            self._single = flats
            return failure
        for seg in self.segments.values():
            failure = self._reduce_scatter(seg, flats, group, failure)
        for i in self.solo:
            failure = self._reduce_to_owner(i, flats, group, failure)
        return failure

    def _reduce_scatter(self, seg: _Segments, flats, group, failure):
        rdt, pending = reduce_dtype(seg.dtype), []
        for k, (a, b) in enumerate(_chunks(seg.length, self._reduce_per(seg.dtype))):
            w = b - a
            send = self._chunk(k, rdt, self.world * w)
            out = self._out_bufs[k % 3][: w * rdt.itemsize].view(rdt)
            if failure is None:
                try:
                    self._fill(lambda buf: seg.pack(flats, a, b, buf), send)
                except Exception as e:  # noqa: BLE001
                    failure = e
            if failure is not None:
                send.zero_()
            pending.append((pipeline.reduce_scatter_single(out, send, group=group, async_op=True), out, a, b))
            if len(pending) > 2:
                failure = self._finish_mean(seg.own, pending.pop(0), failure)
        while pending:
            failure = self._finish_mean(seg.own, pending.pop(0), failure)
        return failure

    def _finish_mean(self, own: torch.Tensor, pending, failure):
        work, out, a, b = pending
        work.wait()
        if failure is None:
            try:
                own[a:b].copy_(self._mean(out))  # the sum's mean, rounded once to the tensors' dtype
            except Exception as e:  # noqa: BLE001
                failure = e
        return failure

    def _reduce_to_owner(self, i: int, flats, group, failure):
        """Solo tensor i's mean, on its owner (`solo_out`), in chunks through the chunk buffers (a reduce may
        use a non-root's input as scratch, so grads are never handed to it)."""
        dt, owner = self.plan.dtypes[i], self.plan.owners[i]
        rdt, dst, pending = reduce_dtype(dt), _global(group, owner), []
        for k, (a, b) in enumerate(_chunks(self.numel[i], max(1, self.chunk_bytes // rdt.itemsize))):
            buf = self._chunk(k, rdt, b - a)
            if failure is None:
                try:
                    self._fill(lambda dst: dst.copy_(flats[i][a:b]), buf)
                except Exception as e:  # noqa: BLE001
                    failure = e
            if failure is not None:
                buf.zero_()
            pending.append((dist.reduce(buf, dst=dst, group=group, async_op=True), buf, a, b))
            if len(pending) > 2:
                failure = self._finish_reduce(i, pending.pop(0), failure)
        while pending:
            failure = self._finish_reduce(i, pending.pop(0), failure)
        return failure

    def _finish_reduce(self, i: int, pending, failure):
        work, buf, a, b = pending
        work.wait()
        if failure is None and i in self.solo_out:
            try:
                self.solo_out[i][a:b].copy_(self._mean(buf))
            except Exception as e:  # noqa: BLE001
                failure = e
        return failure

    def inputs(self, opt) -> dict[int, torch.Tensor]:
        """The mean Δ of each tensor I own (views of my segments; one rank: copies of the grads)."""
        plan = self.plan
        if self.world == 1:
            flats, self._single = self._single, None
            return {
                i: flats[i].to(plan.dtypes[i], memory_format=torch.contiguous_format, copy=True).view(plan.shapes[i])
                for i in range(len(plan.shapes))
            }
        out = {
            i: seg.own[off : off + n].view(plan.shapes[i]) for seg in self.segments.values() for i, off, n in seg.mine
        }
        out.update({i: t.view(plan.shapes[i]) for i, t in self.solo_out.items()})
        return out


class _WorkerExchange(_ParamsBack):
    """Full precision, a merge that needs every worker's Δ (TSV-M, Iso-CTS, TIES, DARE): leg 1 all-to-alls each
    rank's Δ to the owner of each tensor, which receives the world's K copies of exactly its own tensors
    ([K, segment] per dtype; a solo tensor: gathered as [K, numel]); leg 2 all-gathers the new params.

    Bytes per rank: the all-to-all sends (K − 1)/K of this rank's Δ, the all-gather the same again: those of
    one all-reduce. Buffers held: per dtype the all-to-all's send and receive (each about the params' size)
    and my segment; per solo tensor a send copy, and on its owner the K rows; three all-gather chunks."""

    def __init__(self, plan: ShardPlan, rank: int, device, chunk_bytes: int):
        self._init_back(plan, rank, device, chunk_bytes)
        self.a2a: dict[torch.dtype, tuple] = {}
        self.solo_send, self.solo_rows = {}, {}
        self._flats: Optional[list] = None
        if self.world == 1:
            return
        for dt in plan.sharded_dtypes:
            n = plan.layout(dt)[1]
            self.segments[dt] = _Segments(plan, dt, rank, pipeline.comm_buffer(n, dt, device, True))
            self.a2a[dt] = (
                pipeline.comm_buffer(self.world * n, dt, device, True),  # padding travels as zeros
                pipeline.comm_buffer(self.world * n, dt, device, False),
            )
        for i in self.solo:
            dt, n = plan.dtypes[i], plan.numel(i)
            self.solo_send[i] = pipeline.comm_buffer(n, dt, device, True)
            if plan.owners[i] == rank:
                self.solo_rows[i] = [pipeline.comm_buffer(n, dt, device, False) for _ in range(self.world)]
        self._chunk_buffers(self._gather_bytes())

    def pack(self, opt, grads, send: _Send) -> None:
        """My Δ of every tensor into the all-to-all's send buffers (each owner's part) and the solo copies (weight
        0: zeros; the owners' merge drops the rank)."""
        if self.world == 1:
            self._flats = [g.reshape(-1) for g in grads]
            return
        if send.zero:
            for buf, _ in self.a2a.values():
                buf.zero_()
            for buf in self.solo_send.values():
                buf.zero_()
            return
        for dt, seg in self.segments.items():
            send = self.a2a[dt][0]
            for r, entries in enumerate(seg.per_rank):
                for i, off, n in entries:
                    send[r * seg.length + off : r * seg.length + off + n].copy_(grads[i].reshape(-1))
        for i, buf in self.solo_send.items():
            buf.view(self.plan.shapes[i]).copy_(grads[i])

    def to_owners(self, group, failure):
        """Leg 1: every worker's Δ of my tensors (a rank that failed sends zeros)."""
        if self.world == 1:
            return failure
        for send, recv in self.a2a.values():
            if failure is not None:
                send.zero_()
            dist.all_to_all_single(recv, send, group=group)
        for i in self.solo:
            if failure is not None:
                self.solo_send[i].zero_()
            rows = self.solo_rows.get(i)
            dist.gather(self.solo_send[i], rows, dst=_global(group, self.plan.owners[i]), group=group)
        return failure

    def inputs(self, opt) -> dict[int, torch.Tensor]:
        """Each of my tensors' [K, *shape] stack of the workers' Δ (views of the all-to-all's receive buffer)."""
        plan, K = self.plan, self.world
        if K == 1:
            flats, self._flats = self._flats, None
            return {i: flats[i].to(plan.dtypes[i]).reshape(1, *plan.shapes[i]) for i in range(len(plan.shapes))}
        out = {}
        for dt, seg in self.segments.items():
            got = self.a2a[dt][1].view(K, seg.length)
            for i, off, n in seg.mine:
                out[i] = got[:, off : off + n].reshape(K, *plan.shapes[i])
        for i, rows in self.solo_rows.items():
            out[i] = torch.stack(rows).reshape(K, *plan.shapes[i])
        return out


class _CompressedExchange:
    """`compress=`: each rank's Δ compressed, c_k = Q(Δ_k + e_k) (`encode_delta`), all-to-all'd as bytes to each
    owner (a solo tensor: gathered): a reduce-scatter cannot sum packed integers. The owner dequantizes and sums
    in float32 (`owner_inputs`), steps (`owner_step`) and compresses its update u; leg 2, before the vote, sends
    every owner's u to every rank (an all-to-all of each owner's own bytes; solo: broadcast), and every rank, the
    owner included, computes θ' = θ + deq(u) aside (`apply_update`), checked finite. After the vote: θ', the
    momentum and the residuals are written.

    Every payload travels at its exact size: each rank's part of each all-to-all is the bytes of the payloads
    it holds for that rank, back to back (`layout`), no padding, so the bytes on the wire are those
    `compress.exchange_bytes` reports at every world size (`wire_bytes`). A payload that lands off an 8-byte
    boundary is copied to aligned memory before it is decoded. Buffers held (uint8): leg 1's send (my payloads
    for every owner) and receive (every worker's payloads of my tensors), leg 2's send (my updates, one copy per
    rank) and receive (every owner's updates), per solo tensor a send, a broadcast and (on its owner) K receive
    buffers."""

    def __init__(self, plan: ShardPlan, rank: int, device, spec: Compression, specs: list):
        self.plan, self.rank, self.world, self.spec, self.specs = plan, rank, plan.world_size, spec, specs
        w = self.world
        self.sizes = s1, s2 = update_sizes(plan, specs)
        (out, self.split1), (back, self.split2) = layout(plan, s1), layout(plan, s2)
        self.at1 = {i: (o, off) for o, entries in enumerate(out) for i, off in entries}
        self.at2 = {i: (o, off) for o, entries in enumerate(back) for i, off in entries}
        self.start1 = [sum(self.split1[:r]) for r in range(w)]
        self.start2 = [sum(self.split2[:r]) for r in range(w)]
        mine1, mine2 = self.split1[rank], self.split2[rank]
        self.send = pipeline.comm_buffer(sum(self.split1), torch.uint8, device, True)
        self.recv = pipeline.comm_buffer(w * mine1, torch.uint8, device, False) if w > 1 else self.send
        self.own = pipeline.comm_buffer(w * mine2, torch.uint8, device, True)
        self.every = pipeline.comm_buffer(sum(self.split2), torch.uint8, device, False) if w > 1 else self.own
        solo = sorted(plan.solo)
        self.solo_send = {i: pipeline.comm_buffer(s1[i], torch.uint8, device, True) for i in solo}
        mine = [i for i in solo if plan.owners[i] == rank]
        self.parts = {i: [pipeline.comm_buffer(s1[i], torch.uint8, device, False) for _ in range(w)] for i in mine}
        self.solo_back = {i: pipeline.comm_buffer(s2[i], torch.uint8, device, True) for i in solo}
        self._residuals: dict = {}
        self._new: Optional[list] = None

    def _outgoing(self, i: int) -> torch.Tensor:
        """Where this rank's payload of tensor i goes on leg 1."""
        if i in self.solo_send:
            return self.solo_send[i]
        o, off = self.at1[i]
        return self.send.narrow(0, self.start1[o] + off, self.sizes[0][i])

    def _incoming(self, i: int, k: int) -> torch.Tensor:
        """Worker k's payload of tensor i (owned here), as received."""
        if i in self.parts:
            return self.parts[i][k]
        return self.recv.narrow(0, k * self.split1[self.rank] + self.at1[i][1], self.sizes[0][i])

    def _update(self, i: int, mine: bool) -> torch.Tensor:
        """Tensor i's update payload: its slot in my own updates (mine=True), or as every rank received it."""
        if i in self.solo_back:
            return self.solo_back[i]
        o, off = self.at2[i]
        return (
            self.own.narrow(0, off, self.sizes[1][i])
            if mine
            else self.every.narrow(0, self.start2[o] + off, self.sizes[1][i])
        )

    def pack(self, opt, grads, send: _Send) -> None:
        """This rank's payload of every tensor into leg 1's buffers; the new residuals kept aside (the round's
        weights are equal here: the roll call refuses others)."""
        self._residuals = {}
        for i, (p, g) in enumerate(zip(opt._params, grads)):
            packed, self._residuals[i] = encode_delta(
                self.specs[i],
                g.detach().to(p.dtype),
                opt._residuals.get(i),
                step=opt.merged_steps,
                index=i,
                worker=opt.rank,
                name=f"param {i} (shape {tuple(p.shape)}) on rank {opt.rank}",
            )
            self._outgoing(i).copy_(_wire(packed))

    def to_owners(self, group, failure):
        """Leg 1: every worker's payload of my tensors (a rank that failed sends zeros)."""
        if failure is not None:
            self.send.zero_()
            for buf in self.solo_send.values():
                buf.zero_()
        if self.world > 1:
            mine = self.split1[self.rank]
            dist.all_to_all_single(self.recv, self.send, [mine] * self.world, self.split1, group=group)
        for i in sorted(self.plan.solo):
            rows = self.parts.get(i)
            dist.gather(self.solo_send[i], rows, dst=_global(group, self.plan.owners[i]), group=group)
        return failure

    def inputs(self, opt) -> dict[int, torch.Tensor]:
        """What I merge: the mean (or the stack) of the workers' dequantized Δ of each tensor I own."""
        payloads = {
            i: [
                _payload(self.specs[i], "workers", opt._params[i], _aligned(self._incoming(i, k)))
                for k in range(self.world)
            ]
            for i in opt._mine
        }
        return owner_inputs(opt, opt._params, payloads, self.specs)

    def aside(self, opt, update, group, failure):
        """Leg 2, before the vote: my updates into my part (one copy for each rank), every owner's sent to every
        rank (solo: broadcast), and every param's θ' computed aside, checked finite (a rank that failed sends
        zeros and computes nothing)."""
        self._new = None
        mine = self.split2[self.rank]
        if failure is None:
            try:
                for i in opt._mine:
                    self._update(i, True).copy_(_wire(update[3][i]))
                if self.world > 1:
                    copies = self.own.view(self.world, mine)
                    copies[1:].copy_(copies[0].expand(self.world - 1, mine))
            except Exception as e:  # noqa: BLE001
                failure = e
        if failure is not None:
            self.own.zero_()
            for i in self.solo_back:
                if self.plan.owners[i] == self.rank:
                    self.solo_back[i].zero_()
        if self.world > 1:
            dist.all_to_all_single(self.every, self.own, self.split2, [mine] * self.world, group=group)
        for i in sorted(self.plan.solo):
            dist.broadcast(self.solo_back[i], src=_global(group, self.plan.owners[i]), group=group)
        if failure is None:
            try:
                new = [
                    apply_update(p, _payload(self.specs[i], "owner", p, _aligned(self._update(i, False))))
                    for i, p in enumerate(opt._params)
                ]
                check_all_finite(new, [f"param {i} after the step" for i in range(len(new))])
                self._new = new
            except Exception as e:  # noqa: BLE001
                failure = e
        return failure

    def write(self, opt, update, group) -> None:
        """After the vote: θ', my momentum and the residuals."""
        opt._buckets = update[0]
        new, self._new = self._new, None
        residuals, self._residuals = self._residuals, {}
        write(opt, opt._params, new, update[1], residuals, update[2])

    def __getstate__(self) -> dict:  # a copy's buffers are made anew (their contents are scratch)
        state = dict(self.__dict__)
        for k in ("send", "recv", "own", "every", "solo_send", "parts", "solo_back"):
            state.pop(k)
        state["device"] = self.send.device
        return state

    def __setstate__(self, state: dict) -> None:
        device = state.pop("device")
        self.__init__(state["plan"], state["rank"], device, state["spec"], state["specs"])


def _aligned(buf: torch.Tensor) -> torch.Tensor:
    """A received payload where its scales (or θ' in its dtype) can be read in place: itself when it starts on
    an 8-byte boundary, else an aligned copy (payloads travel back to back, unpadded)."""
    return buf if buf.storage_offset() % 8 == 0 else buf.clone()


def _remake(cls):
    """deepcopy / pickle of a full-precision exchange: everything but its buffers, made anew on the copy."""

    def getstate(self) -> dict:
        return {"args": (self.plan, self.rank, self.device, self.chunk_bytes)}

    def setstate(self, state: dict) -> None:
        self.__init__(*state["args"])

    cls.__getstate__, cls.__setstate__ = getstate, setstate
    return cls


_remake(_MeanExchange)
_remake(_WorkerExchange)


# -- the compressed route's arithmetic (MergeLoCo's one-process simulation calls the same functions) ----------
#
#     every rank   c_k = Q(Δ_k + e_k),  e_k ← β·(Δ_k + e_k − c_k)     each tensor whole (compress/); e_k kept by
#                                                                     the worker, in the residual dtype
#     owner        A = Σ_k deq(c_k) in float32 (ranks in order), mean = A / K rounded once to θ's dtype;
#                  M = iso(mean) (2-D, iso groups) or the mean, or another merge of the K dequantized Δ_k
#                  buf ← μ·buf + M;  s = −lr·(M + μ·buf)      float32 (float64 for float64 θ); μ = 0: s = −lr·M
#                  update="compressed": u = Q(s + e_u), e_u ← β·(s + e_u − u), e_u kept by the owner in
#                  float32 (or the spec's residual dtype); "full": u = θ + s rounded once to θ's dtype
#     every rank   θ ← θ + deq(u), summed in float32 and rounded once to θ's dtype ("full": θ ← u)
#
# What goes back is the step's change s, never θ in low precision. Stochastic rounding draws stream k + 1 for
# worker k's Δ and stream 0 for the owner's update (`stream_spec`), each seeded by (seed, step = the optimizer's
# step count, tensor = the param index, element). The spec's `feedback` says which legs keep a residual: a leg
# without one compresses with `spec.leg(...)` and keeps nothing.

#: The stochastic-rounding stream of the owner's update; worker k's Δ draws stream k + 1.
UPDATE_STREAM = 0


def attach(opt, compress, where: str) -> None:
    """Set opt.compress (a Compression, a spec string for `compress.parse`, or None) and its empty
    residuals: opt._residuals (this worker's, per param index) and opt._update_residuals (the owner's)."""
    if isinstance(compress, str):
        try:
            compress = parse(compress)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if compress is not None and not isinstance(compress, Compression):
        raise TypeError(
            f"{where}: compress must be a Compression, a spec string such as 'int4:128:0.95', or None; "
            f"got {type(compress).__name__}"
        )
    merge = getattr(opt, "merge", "iso_c")
    if compress is not None and compress.feedback == "ef21" and merge not in _MEAN_MERGES:
        raise ValueError(
            f"{where}: feedback='ef21' tracks the mean of the workers' Δ, which merge {merge!r} does not step on "
            f"(it merges every worker's Δ); use merge 'iso_c' or 'mean', or another feedback placement"
        )
    opt.compress, opt._residuals, opt._update_residuals, opt._specs = compress, {}, {}, []


def add_specs(opt, where: str) -> None:
    """Extend opt._specs (per param, in order: the spec it travels with, or None where the spec's `skip` rule keeps it
    in full precision — its Δ and θ' sent in its dtype, no residual) with the last param group's, when the group is
    added: the rule is applied once, to the names the params were given with (a group's `param_names`, from
    `model.named_parameters()`; a rule that names params needs them), and does not change when a state dict
    brings other names. Refused by name, the group taken back out: names that are not one str per param, a rule by
    name without names."""
    if opt.compress is None:
        return
    k = len(opt.param_groups) - 1
    group = opt.param_groups[k]
    params, names = group["params"], group.get("param_names")
    try:
        if names is not None and (len(names) != len(params) or not all(isinstance(n, str) for n in names)):
            raise ValueError(
                f"param group {k}'s param_names must be one str per param ({len(params)} params), got {names!r:.200}"
            )
        try:
            specs = [
                opt.compress.for_tensor(tuple(p.shape), None if names is None else names[j])
                for j, p in enumerate(params)
            ]
        except ValueError as e:
            raise ValueError(f"{e} (give the optimizer model.named_parameters() to name them)") from None
    except ValueError as e:
        opt.param_groups.pop()
        raise ValueError(f"{where}: {e}") from None
    opt._specs = [*opt._specs, *specs]


def stream_spec(spec: Compression, stream: int) -> Compression:
    """The spec whose seed draws stream `stream`'s rounding bits (nearest rounding draws none)."""
    return dataclasses.replace(spec, seed=mix32(spec.seed ^ mix32(stream)))


def encode_delta(spec, delta, residual, *, step: int, index: int, worker: int, name: str):
    """(payload, new residual) of worker `worker`'s Δ of param `index` (compress.compress, stream worker + 1), with
    the worker leg's spec (`spec.leg("workers")`: the new residual is None where that leg has no feedback).
    spec None (a param the skip rule keeps): the Δ itself, checked finite, and no residual."""
    if spec is None:
        check_all_finite([delta], [name])
        return delta.reshape(-1), None
    if spec.feedback == "ef21":  # the correction to this worker's tracked estimate; the new estimate
        return track(delta, residual, stream_spec(spec, worker + 1), step=step, tensor_id=index, name=name)
    leg = spec.leg("workers")
    return compress(delta, residual, stream_spec(leg, worker + 1), step=step, tensor_id=index, name=name)


def owner_inputs(opt, params, payloads: dict[int, list], specs) -> dict[int, torch.Tensor]:
    """What the owner merges, from every worker's payload (in worker order) of each of its tensors: the mean
    (merge "iso_c" or "mean": the sum in float32, float64 for float64 params, divided by K, rounded once to
    θ's dtype) or the [K, *shape] stack of each worker's dequantized Δ in θ's dtype (the other merges). Under
    feedback "ef21" a compressed tensor's is the owner's new estimate G' = β·G + sum / K, in the compute dtype
    (`owner_step` keeps it and merges it rounded to θ's dtype)."""
    stack = opt.merge not in _MEAN_MERGES
    out = {}
    for i, packs in payloads.items():
        p = params[i]
        cd = compute_dtype(p.dtype)
        if stack:
            rows = [_add(torch.zeros(p.numel(), dtype=cd, device=p.device), pk) for pk in packs]
            out[i] = torch.stack(rows).to(p.dtype).view(len(packs), *p.shape)
            continue
        acc = torch.zeros(p.numel(), dtype=cd, device=p.device)
        for pk in packs:
            _add(acc, pk)
        acc.div_(len(packs))
        if specs[i] is not None and specs[i].feedback == "ef21":
            held = opt._update_residuals.get(i)
            out[i] = (acc if held is None else acc.add_(held.reshape(-1).to(cd) * specs[i].ef_beta)).view(p.shape)
        else:
            out[i] = acc.to(p.dtype).view(p.shape)
    # every payload decodes to finite values (compress refuses the rest), so a non-finite result is an overflow
    # of the workers' sum (or of its rounding to θ's dtype): said as such, not as an Inf input
    for i in sorted(out):
        if not bool(torch.isfinite(out[i].to(params[i].dtype)).all()):
            tracked = not stack and specs[i] is not None and specs[i].feedback == "ef21"
            what = "owner's estimate β·G + mean" if tracked else ("stack" if stack else "mean")
            raise ResultOverflowError(
                f"the {what} of the workers' decompressed Δ of param {i} (shape "
                f"{tuple(params[i].shape)}) does not fit {params[i].dtype}: "
                f"{'a worker' if stack else 'their sum'} overflows near the dtype's largest values; nothing was changed",
                tensor=i,
            )
    return out


def _add(acc: torch.Tensor, payload) -> torch.Tensor:
    """acc += a worker's payload: decoded (a Packed), or the Δ of a param kept in full precision."""
    if isinstance(payload, Packed):
        return decompress_add_(acc, payload)
    return acc.add_(payload.reshape(-1).to(acc.dtype))


def owner_step(opt, params, groups, inputs: dict[int, torch.Tensor], specs, buckets=None):
    """The owner's step on its tensors: M (Iso-C of the mean in iso groups, the mean, or the merge of the
    stacks), Nesterov from the held momentum, and the update u of each (see above), with each param's spec
    (`add_specs`; None: kept in full precision, u = θ' as update="full" sends it). Reads opt's
    merge, merge_options, method, merged_steps, state and _update_residuals; writes nothing.
    Returns (buckets for the next Iso-C, {i: new momentum or None (μ = 0: untouched)}, {i: new update
    residual} (empty where the update leg has no feedback: `spec.leg("owner")`), {i: u: a Packed, or θ' in
    θ's dtype for update="full"})."""
    step = opt.merged_steps
    idx = sorted(inputs)
    # ef21: the owner's new estimate G' (owner_inputs made it in the compute dtype and checked it fits θ's dtype) is
    # kept as it is, and merged rounded to θ's dtype
    residuals = {i: inputs[i] for i in idx if specs[i] is not None and specs[i].feedback == "ef21"}
    if residuals:
        inputs = {**inputs, **{i: g.to(params[i].dtype) for i, g in residuals.items()}}
    if opt.merge in _MEAN_MERGES:
        m = dict(inputs)
        if opt.merge == "iso_c":
            iso = [i for i in idx if inputs[i].ndim == 2 and inputs[i].numel() and groups[i]["iso"]]
            names = [f"{type(opt).__name__}: param {i} (shape {tuple(params[i].shape)})" for i in iso]
            buckets, views = outer.bucket_flatten([inputs[i] for i in iso], opt.method, names, buckets)
            m.update(zip(iso, views))
    else:
        merged = {i for i in idx if groups[i]["iso"]}
        out = merge_groups(inputs, merged, opt.merge, opt.merge_options, step, opt.method)
        m = {i: t.to(params[i].dtype) for i, t in out.items()}
    bufs, updates, changes = {}, {}, {}
    # The Nesterov op on scratch from θ = 0, one call per (lr, μ): change = −lr·(M + μ·buf'), buf' = μ·buf + M
    # (a new buffer starts at zero: buf' = M exactly; μ = 0, torch.optim.SGD's rule: the held buffer is not
    # touched). The scratch params are known to be 0; the op reads the buffers and the updates once.
    calls: dict[tuple[float, float], list[int]] = {}
    for i in idx:
        calls.setdefault((float(groups[i]["lr"]), float(groups[i]["momentum"])), []).append(i)
    for (lr, mu), ids in calls.items():
        gs = [m[i].to(compute_dtype(params[i].dtype)) for i in ids]
        held = [
            opt.state[params[i]].get("momentum_buffer") if params[i] in opt.state and mu != 0 else None for i in ids
        ]
        bs = [torch.zeros_like(g) if h is None else h.to(g.dtype, copy=True) for g, h in zip(gs, held)]
        cs = [torch.zeros_like(g) for g in gs]
        nan = float("nan")
        try:
            torch.ops.isoloco.nesterov_outer_(cs, bs, gs, lr, mu, [0.0] * len(ids) + [nan] * (2 * len(ids)))
        except ResultOverflowError as e:
            i = ids[e.tensor] if e.tensor is not None else ids[0]
            name = f"the update of param {i} (shape {tuple(params[i].shape)})"
            raise ResultOverflowError(f"{name}: {str(e).split(': ', 2)[-1]}", tensor=i) from None
        for i, b, c in zip(ids, bs, cs):
            bufs[i], changes[i] = (None if mu == 0 else b), c
    for i in idx:
        p, change, spec = params[i], changes[i], specs[i] and specs[i].leg("owner")
        name = f"the update of param {i} (shape {tuple(p.shape)})"
        if spec is None or spec.update == "full":
            updates[i] = (p.detach().to(change.dtype) + change).to(p.dtype)
            check_all_finite([updates[i]], [name])
        else:
            e = opt._update_residuals.get(i) if spec.ef_beta is not None else None  # ef21 holds G there
            updates[i], e = compress(change, e, stream_spec(spec, UPDATE_STREAM), step=step, tensor_id=i, name=name)
            if e is not None:
                residuals[i] = e
    return buckets, bufs, residuals, updates


def apply_update(p: torch.Tensor, u) -> torch.Tensor:
    """θ' of param p from its update u, computed aside: θ + deq(u) summed in float32 (float64 for float64 θ)
    and rounded once to θ's dtype (`compress.decompress_add_`), or u itself (update="full": θ' already)."""
    if not isinstance(u, Packed):
        return u.view(p.shape)
    new = p.detach().reshape(-1).clone()
    return decompress_add_(new, u).view(p.shape)


def write(opt, params, new_params, bufs, residuals, update_residuals) -> None:
    """The step's writes, after the last agreement: θ', the momentum buffers, the residuals (of the legs with
    error feedback: a leg without one keeps none)."""
    for p, t in zip(params, new_params):
        p.copy_(t)
    for i, b in bufs.items():
        if b is None:
            continue
        held = opt.state[params[i]].get("momentum_buffer") if params[i] in opt.state else None
        if held is None:
            opt.state[params[i]]["momentum_buffer"] = b
        else:
            held.copy_(b)
    if opt.compress.ef_beta is not None:
        opt._residuals = {i: r for i, r in residuals.items() if r is not None}
        opt._update_residuals.update({i: r for i, r in update_residuals.items() if r is not None})


def _payload(spec, leg: str, p, buf: torch.Tensor):
    """A received payload of param p on leg `leg` ("workers": a Δ, "owner": an update): a Packed, or p's dtype
    values — a Δ or θ' of a param the skip rule keeps (spec None), θ' of update="full"."""
    if spec is None or (leg == "owner" and spec.update == "full"):
        return buf.view(p.dtype)
    return Packed.from_wire(buf, spec, p.numel())


def _wire(u) -> torch.Tensor:
    return u.wire() if isinstance(u, Packed) else u.detach().reshape(-1).view(torch.uint8)


# -- bytes on the wire ----------------------------------------------------------------------------------------


def layout(plan: ShardPlan, sizes) -> tuple[list[list[tuple[int, int]]], list[int]]:
    """([per rank: (tensor index, byte offset)], [bytes per rank]) of one leg: each rank's tensors (solo ones
    aside) in index order, each payload of sizes[i] bytes right after the one before (no padding)."""
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(plan.world_size)]
    fill = [0] * plan.world_size
    for i, o in enumerate(plan.owners):
        if i not in plan.solo:
            per_rank[o].append((i, fill[o]))
            fill[o] += sizes[i]
    return per_rank, fill


def update_sizes(plan: ShardPlan, specs) -> tuple[list[int], list[int]]:
    """Bytes of each tensor's payload on the all-to-all leg and on the all-gather leg, with each tensor's spec
    (`add_specs`; None: in its dtype both ways)."""
    out, back = [], []
    for i, (s, dt) in enumerate(zip(specs, plan.dtypes)):
        k, full = plan.numel(i), plan.numel(i) * torch.empty((), dtype=dt).element_size()
        out.append(full if s is None else bytes_of(s, k))
        back.append(full if s is None or s.update == "full" else bytes_of(s, k))
    return out, back


def wire_bytes(plan: ShardPlan, spec: Compression, names=None) -> dict[str, float]:
    """Bytes one rank puts on the wire per step in the compressed route, averaged over the ranks: 'all_to_all'
    (leg 1: every payload but the owner's own travels once to its owner, by all-to-all or, solo, gather) and
    'all_gather' (leg 2: every owner's updates to the W − 1 others, by all-to-all or, solo, broadcast), each
    (W − 1)/W of the payloads' bytes: `compress.exchange_bytes` summed over the tensors, at every world size (no
    padding); 'allreduce_fp32' (2·(W − 1)/W·4 bytes per entry) to compare. A param the spec's skip rule keeps
    (by shape, or by `names`, one per tensor) travels in its dtype both ways."""
    w = plan.world_size
    names = [None] * len(plan.shapes) if names is None else list(names)
    if len(names) != len(plan.shapes):
        raise ValueError(f"wire_bytes: {len(names)} names for {len(plan.shapes)} params (one per param)")
    try:
        out, back = update_sizes(plan, [spec.for_tensor(s, n) for s, n in zip(plan.shapes, names)])
    except ValueError as e:
        raise ValueError(f"wire_bytes: {e}") from None
    legs = {"all_to_all": (w - 1) / w * sum(out), "all_gather": (w - 1) / w * sum(back)}
    legs["allreduce_fp32"] = 2 * (w - 1) / w * 4 * sum(plan.numel(i) for i in range(len(plan.shapes)))
    return legs


def worker_wire_bytes(plan: ShardPlan) -> dict[str, int]:
    """Bytes one rank sends in a step of a merge that needs every worker's Δ, per route, padding included (the
    ring algorithms' counts): 'merge' (all-to-all + all-gather + solo gather/broadcast), 'allreduce'
    (2·(K − 1)/K of the params), 'allgather_deltas' (every worker's Δ to every rank: (K − 1) copies)."""
    world = plan.world_size
    size = {dt: torch.empty((), dtype=dt).element_size() for dt in set(plan.dtypes)}
    seg = sum(plan.layout(dt)[1] * size[dt] for dt in plan.sharded_dtypes)
    solo = sum(plan.numel(i) * size[plan.dtypes[i]] for i in plan.solo)
    total = sum(plan.numel(i) * size[plan.dtypes[i]] for i in range(len(plan.shapes)))
    return {
        "merge": 2 * (world - 1) * seg + 2 * solo * (world - 1) // world,
        "allreduce": 2 * total * (world - 1) // world,
        "allgather_deltas": total * (world - 1),
    }


# -- the residuals in state dicts (MergeLoCo's too) -----------------------------------------------------------


def spec_fields(spec: Compression) -> dict:
    """A spec as plain values (its residual dtype as a string), as state dicts keep it (feedback included;
    `check_entry` reads a state saved before that field existed as feedback "both", and one saved before
    `sigmas` and `skip` existed as their defaults, None and "none")."""
    out = dataclasses.asdict(spec)
    out["residual_dtype"] = None if spec.residual_dtype is None else str(spec.residual_dtype)
    return out


def state_entry(opt) -> dict:
    """The "compress" entry of a state dict: the spec's fields, this worker's residuals (param index →
    tensor; MergeLoCo: each param's [K, *shape]) and the owner's update residuals (param index → tensor)."""
    return {
        "spec": spec_fields(opt.compress),
        "residuals": dict(opt._residuals),
        "update_residuals": dict(opt._update_residuals),
    }


def _feedback_hint(spec: Compression, got, want: dict) -> str:
    """How to continue a state whose spec differs from this one in the feedback placement only ("" otherwise)."""
    if not isinstance(got, dict) or {k for k in want if got.get(k) != want[k]} != {"feedback"}:
        return ""
    fb = got["feedback"]
    try:
        text = dataclasses.replace(spec, feedback=fb).cli()
    except (TypeError, ValueError):
        return ""
    old = "; a state saved before Compression.feedback existed is 'both'" if fb == "both" else ""
    return (
        f" (its error feedback placement is feedback={fb!r}, this optimizer's {want['feedback']!r}: to continue it "
        f"pass feedback={fb!r} to Compression (as a string: {text!r}){old})"
    )


def check_entry(opt, state_dict, where: str, params, owned, stacked: bool = False):
    """The "compress" entry of `state_dict` checked against opt's spec and params: (residuals, update
    residuals) as copies on the params' devices, ready for `load_entry`; None when there is no entry (the
    residuals then restart from zero). `owned`: the params whose update residuals this optimizer keeps;
    `stacked`: the residuals are [K, *shape] (MergeLoCo's K workers, one K for all), else one worker's; a leg
    without error feedback (`spec.leg`) must hold none. Raises ValueError naming what differs (another spec,
    a residual of another shape or dtype, NaN/Inf), before anything is loaded."""
    entry = state_dict.get("compress") if isinstance(state_dict, dict) else None
    if entry is None:
        return None
    if opt.compress is None:
        raise ValueError(
            f"{where}: the state holds error-feedback residuals of compression {entry.get('spec')!r} but this "
            "optimizer has compress=None; build it with the same compress=, or drop the 'compress' entry"
        )
    want = spec_fields(opt.compress)
    got = entry.get("spec") if isinstance(entry, dict) else entry
    if isinstance(got, dict) and "feedback" not in got:  # saved before the field existed: both legs
        got = dict(got, feedback="both")
    if isinstance(got, dict):  # saved before `sigmas` and `skip` existed: their defaults then
        got = {"sigmas": None, "skip": "none", **got}
    if not isinstance(entry, dict) or got != want:
        raise ValueError(
            f"{where}: the state was saved with compression {got!r}; this optimizer has {want!r}: residuals of "
            "another format, block, β, rounding, update leg, seed, feedback placement, k or skip rule cannot "
            "continue here" + _feedback_hint(opt.compress, got, want)
        )
    kept = {i for i, s in enumerate(opt._specs) if s is not None}  # the params the skip rule keeps have none
    held = entry.get("residuals")
    first = next(iter(held.values()), None) if isinstance(held, dict) else None
    lead = (first.shape[0],) if stacked and isinstance(first, torch.Tensor) and first.ndim else ()
    out = []
    for key, leg, idx, shape_of, dtype_of in (
        ("residuals", "workers", [i for i in range(len(params)) if i in kept], lambda p: lead + tuple(p.shape), None),
        ("update_residuals", "owner", [i for i in owned if i in kept], lambda p: tuple(p.shape), compute_dtype),
    ):
        got = entry.get(key)
        if not opt.compress.keeps(leg) and got:  # feedback elsewhere: this leg keeps none
            raise ValueError(f"{where}: the 'compress' entry holds {key} but feedback={opt.compress.feedback!r}")
        if not isinstance(got, dict) or (got and set(got) != set(idx)):
            keys = sorted(got) if isinstance(got, dict) else got
            extra = sorted(set(got) - set(idx) - kept) if isinstance(got, dict) else []
            why = f" (params {extra} travel in full precision: skip={opt.compress.skip!r})" if extra else ""
            raise ValueError(f"{where}: the 'compress' entry's {key} must cover params {list(idx)}, got {keys}{why}")
        for i, t in got.items():
            p = params[i]
            dt = opt.compress.residual_dtype or (dtype_of(p.dtype) if dtype_of else p.dtype)
            if opt.compress.feedback == "ef21":  # both estimates in the compute dtype
                dt = compute_dtype(p.dtype)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape_of(p) or t.dtype != dt:
                what = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{where}: {key} of param {i} is {what}; expected {shape_of(p)} {dt}")
        check_all_finite([got[i] for i in sorted(got)], [f"{where}: {key} of param {i}" for i in sorted(got)])
        out.append({i: got[i].detach().to(params[i].device, copy=True) for i in sorted(got)})
    owned_kept = [i for i in owned if i in kept]
    if opt.compress.feedback == "ef21" and owned_kept and bool(out[0]) != bool(out[1]):
        raise ValueError(
            f"{where}: under feedback='ef21' the workers' estimates ('residuals') and the owner's ('update_residuals') "
            "are restored together: the owner's is the mean of the workers'; this state holds only "
            f"{'the workers' if out[0] else 'the owner'}'s. Load both, or drop the 'compress' entry to restart both"
        )
    return tuple(out)


def load_entry(opt, checked) -> None:
    """Install what `check_entry` returned (None: no residuals, the next step starts them from zero)."""
    opt._residuals, opt._update_residuals = checked if checked is not None else ({}, {})
