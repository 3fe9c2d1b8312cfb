"""IsoLoCo: the DiLoCo outer optimizer with an Iso-C flatten before Nesterov momentum.

A drop-in for `torch.optim.SGD(lr, momentum, nesterov=True)`: write the averaged pseudo-gradient
(global − local) into `p.grad`, call `step()`. Per param with a grad Δ (reference.isoloco_step_ref):

    M = iso(Δ) for 2-D params of iso groups, else Δ; then the Nesterov step of reference.nesterov_ref on M

The 2-D grads are packed into one [B, m, n] buffer per shape and flattened (`outer.bucket_flatten`),
and one fused `nesterov_outer_` call per (device, lr, momentum) applies the update. State is SGD's; checks,
buffers and state handling are the shared core (outer/core.py); DTensor params step in
distributed/dtensor.py, over a process group in distributed/process_group.py. docs/drop-in.md ("The outer
optimizer") has the contract.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Optional

import torch

from .. import distributed
from .._validate import is_dtensor
from ..distributed import dtensor, process_group
from ..distributed.agree import construct_together, describe, listed, optimizer_settings
from ..distributed.checkpoint import refuse_rank_state
from ..outer.core import BucketPlan, Entry, bucket_flatten, check_group, collect, nesterov_rows, prepare_nesterov
from ..outer.nd import as_matrix, warn_nd_params
from ..outer.sgd_state import (
    SGD_KEYS,
    SGDArgs,
    check_param_dtypes,
    load_sgd_state,
    refuse_foreign_state,
    sgd_keywords,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim.optimizer import ParamsT

__all__ = ["IsoLoCo", "sgd_keywords"]


def _name(gi: int, pi: int, p: torch.Tensor) -> str:
    return f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"


class IsoLoCo(torch.optim.Optimizer):
    """Iso-C + Nesterov outer optimizer: a drop-in for `torch.optim.SGD(lr, momentum, nesterov=True)`.

    Write the averaged pseudo-gradient Δ (global − local) into each `p.grad` and call `step()`: 2-D
    grads are replaced by their Iso-C flatten, then every param takes the Nesterov step. torch.optim.SGD's
    other keywords (dampening, weight_decay, nesterov, maximize, foreach, differentiable, fused) are taken
    in SGD's positions, so `partial(torch.optim.SGD, ...)` becomes `partial(IsoLoCo, ...)` unchanged; they
    are accepted at the values that mean IsoLoCo's update and refused with a ValueError otherwise
    (`sgd_keywords`).

    Args:
        params: parameters or param groups (groups may set their own lr, momentum, iso).
        lr: outer learning rate (released IsoLoCo config: 1.8).
        momentum: Nesterov momentum μ (released IsoLoCo config: 0.8).
        iso: flatten 2-D pseudo-gradients with Iso-C; False gives SGD(nesterov=True).
        iso_nd: also flatten pseudo-gradients with 3 or more dims (convolution kernels), each as the
            matrix dim 0 × the rest, as Muon-style optimizers do. False (default): they get
            DiLoCo's plain update, as 1-D ones do, and the constructor says so once
            (`nd.NDParamWarning`). Refused (ValueError) for N-D DTensor params.
        method: flatten method ("auto", "svd", "eigh", "polar", "polar_tf32x3", "gram", "fast", "polar_bf16";
            see `iso_merge_`);
            kept on the optimizer, not in the state dict.
        process_group: a torch.distributed group whose ranks all hold the same, ALREADY AVERAGED
            grads (torchft, OpenDiLoCo, or after `average_`): the flatten work is split across its
            ranks and the results all-gathered. None (default): this process flattens everything.
            Grads not yet averaged (each rank its own pseudo-gradient) belong to `ShardedIsoLoCo`.
        dtensor_route: for DTensor params on a 1-D mesh, how a sharded matrix is flattened:
            "auto" (default: by bytes per rank), "gram", "owner" or "gather"; also settable as
            `opt.dtensor_route` (checked when set).

    Differs from torch.optim.SGD in one accepted value: `momentum=0` with `nesterov=True`, which SGD
    refuses at construction, is the plain step θ ← θ − lr·M with no momentum buffer made or touched (SGD's
    own rule when μ is set to 0 between steps): the "outer SGD lr 1, μ 0" plain averaging the study tunes
    DiLoCo against (its best μ was often 0).

    Raises:
        ValueError: an argument it cannot honour (named); nothing is built.
        TypeError: an argument of the wrong type (named).

    Examples:
        >>> model = torch.nn.Linear(16, 8)
        >>> outer = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8)  # was SGD(lr=0.7, momentum=0.9, nesterov=True)
        >>> for p in model.parameters():
        ...     p.grad = torch.randn_like(p)  # the pseudo-gradient: mean over workers of global − local
        >>> outer.step(); outer.zero_grad()
    """

    #: What the step does with the grads it is given: Iso-C of the (mean) pseudo-gradient. MergeLoCo sets its own.
    merge = "iso_c"

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
        dtensor_route: str = "auto",
        iso_nd: bool = False,
    ) -> None:
        sgd = SGDArgs(lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, differentiable, fused)
        if process_group is None:  # read twice: for the DTensor mesh, then by torch.optim.Optimizer (a group's own
            params = listed(params)  # params are read inside the agreement, where a failure reaches every rank)
        build = lambda: self._build(params, sgd, iso, method, process_group, dtensor_route, iso_nd)  # noqa: E731
        construct_together(f"{type(self).__name__}()", process_group, params, build, self._settings)

    def _build(self, params, sgd: SGDArgs, iso, method, process_group, dtensor_route, iso_nd) -> None:
        who = type(self).__name__  # errors name the optimizer that raised (MergeLoCo is one)
        defaults = sgd.defaults(who, iso, method)
        if not isinstance(iso_nd, bool):
            raise ValueError(f"{who}: iso_nd must be a bool, got {iso_nd!r}")
        self.method = method
        self.iso_nd = iso_nd
        self.dtensor_route = dtensor_route
        # Set when p.grad is already averaged and equal on every rank of this group (torchft,
        # OpenDiLoCo): each rank flattens only its share of the matrices (sharded_iso_merge_).
        self.process_group = process_group
        self._plan: Optional[BucketPlan] = None  # bucket buffers, reused while the grads' shapes hold
        self._state_loaded = False  # set by load_state_dict: over a process group, checked replicated once
        super().__init__(params, defaults)
        if not iso_nd:  # N-D params get the plain update: said once, at the user's line
            named = [
                (_name(gi, pi, p), p)
                for gi, g in enumerate(self.param_groups)
                if g["iso"]
                for pi, p in enumerate(g["params"])
            ]
            hint = "pass iso_nd=True to flatten each as the matrix dim 0 × the rest, or iso=False in their param group"
            warn_nd_params(who, named, hint)

    @property
    def process_group(self):
        return self._process_group

    @process_group.setter
    def process_group(self, group: Optional[ProcessGroup]) -> None:
        self._process_group = group
        self._group_dropped = False

    @property
    def dtensor_route(self) -> str:
        """How DTensor matrices on a 1-D mesh are flattened: "auto", "gram", "owner" or "gather"."""
        return self._dtensor_route

    @dtensor_route.setter
    def dtensor_route(self, route: str) -> None:
        if not isinstance(route, str) or route not in dtensor.ROUTES:
            raise ValueError(f"{type(self).__name__}: dtensor_route must be one of {dtensor.ROUTES}, got {route!r}")
        self._dtensor_route = route

    # -- copies: deepcopy and pickle keep `method`, rebuild the plan, drop the process group --

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["method"] = self.method
        state["dtensor_route"] = self.dtensor_route
        state["iso_nd"] = self.iso_nd
        state["group_dropped"] = self._process_group is not None or getattr(self, "_group_dropped", False)
        return state

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict calls this too, with only "state" and "param_groups": then the
        # optimizer keeps its method and process group.
        state = dict(state)
        copied = "method" in state
        method = state.pop("method", None)
        route = state.pop("dtensor_route", "auto")
        iso_nd = state.pop("iso_nd", False)
        dropped = state.pop("group_dropped", False)
        super().__setstate__(state)
        self._plan = None  # rebuilt on the next step
        if copied:
            self.method = method
            self.dtensor_route = route
            self.iso_nd = iso_nd
            self._process_group = None  # a process group cannot be copied or pickled
            self._group_dropped = dropped

    def _group(self):
        if self._process_group is None and self._group_dropped:
            raise RuntimeError(
                "IsoLoCo.step: this optimizer is a copy (deepcopy/pickle) of one that had a "
                "process_group, which cannot be copied and was dropped; set opt.process_group to "
                "the group again (or to None to flatten everything on this process)"
            )
        return self._process_group

    def _settings(self, grads=None) -> dict[str, str]:
        """What every rank of the process group (or of the DTensor params' mesh) must share: each
        group's hyper-parameters, the method, the params, and at a step the grads; compared at
        construction and every step."""
        out = optimizer_settings(self, method=self.method, iso_nd=self.iso_nd)
        out["params (shapes, dtypes)"] = repr(describe([p for g in self.param_groups for p in g["params"]]))
        if grads is not None:
            out["grads (shapes, dtypes)"] = repr(describe(grads))
        return out

    def add_param_group(self, param_group: dict) -> None:
        where = f"{type(self).__name__}: param group {len(self.param_groups)}"
        settings = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        sgd_keywords(where, **{k: settings[k] for k in SGD_KEYS if k in settings})
        check_group(settings, where)
        super().add_param_group(param_group)
        try:
            check_param_dtypes(self.param_groups[-1]["params"], where)
            dtensor.check_params(self)  # DTensor params (FSDP2 / TP): refused here if unsupported
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # -- state dict ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an IsoLoCo or a torch.optim.SGD state dict (SGD's must be nesterov, no dampening,
        no weight decay, not differentiable); checked first, so a refused dict changes nothing
        (`sgd_keywords`, `outer.load_sgd_state`).

        Raises:
            ValueError: a setting IsoLoCo cannot honour, or groups, params or momentum buffers that do
                not match this optimizer's (named).
            TypeError: a field of the wrong type (named).

        Examples:
            >>> w = torch.nn.Parameter(torch.randn(4, 3))
            >>> sgd = torch.optim.SGD([w], lr=0.7, momentum=0.9, nesterov=True)
            >>> IsoLoCo([w]).load_state_dict(sgd.state_dict())  # an SGD checkpoint loads
        """
        refuse_rank_state(state_dict, f"{type(self).__name__}.load_state_dict")  # one rank's is not the whole
        refuse_foreign_state(state_dict, f"{type(self).__name__}.load_state_dict")  # the inner AdamW's, say
        info = state_dict.get("merge") if isinstance(state_dict, dict) else None
        if type(self) is IsoLoCo and isinstance(info, dict) and info.get("merge", "iso_c") != "iso_c":
            warnings.warn(
                f"IsoLoCo.load_state_dict: the checkpoint was written by merge={info['merge']!r}; IsoLoCo continues "
                "as Iso-C of the mean (the momentum loads as saved)",
                UserWarning,
                stacklevel=2,
            )
        dtensor.check_loaded_state(
            self, state_dict, f"{type(self).__name__}.load_state_dict"
        )  # aliasing, DTensor layout
        saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        for gi, g in enumerate(saved if isinstance(saved, (list, tuple)) else []):
            if isinstance(g, dict):
                sgd_keywords(
                    f"{type(self).__name__}.load_state_dict: param group {gi}", **{k: g[k] for k in SGD_KEYS if k in g}
                )
        load_sgd_state(self, state_dict, f"{type(self).__name__}.load_state_dict", super().load_state_dict)
        self._plan = None
        self._state_loaded = True  # over a process group, the next step agrees on the loaded momentum

    # -- the step --------------------------------------------------------------------------------

    def _collect_grads(self) -> list[Entry]:
        """Every param with a grad, all checked (`outer.collect`)."""
        return collect(self, type(self).__name__)

    def _iso_updates(self, entries, ag=None) -> dict[int, torch.Tensor]:
        """Iso-C of every 2-D grad in an iso group, batched by shape (`outer.bucket_flatten`, the
        buffers kept for the next step): entry index → result view. Over a process group (`ag`:
        the step's Agreement) the packing runs under `ag.attempt` and the flatten is split across
        the ranks by `sharded_iso_merge_` inside that agreement. With iso_nd, N-D grads go as
        matrices (dim 0 × the rest) and the results are reshaped back."""
        if self.merge != "iso_c":  # MergeLoCo: the grads hold another merge's result, already the update
            return {}
        nd = self.iso_nd
        chosen = [k for k, e in enumerate(entries) if e.iso or (nd and e.group["iso"] and e.g.ndim > 2 and e.g.numel())]
        mats = [entries[k].g if entries[k].g.ndim == 2 else as_matrix(entries[k].g) for k in chosen]  # checked
        if ag is None:
            names = [f"{type(self).__name__}: {entries[k].name}" for k in chosen]
            self._plan, views = bucket_flatten(mats, self.method, names, self._plan)
        elif not mats:
            return {}
        else:
            buffers = ag.attempt(self._pack, mats) or []
            distributed.sharded_iso_merge_(buffers, self._process_group, method=self.method, agreement=ag)
            views = ag.attempt(lambda: self._plan.views()) or []
        return {k: v.reshape(entries[k].g.shape) for k, v in zip(chosen, views)}

    def _pack(self, mats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The matrices packed into the bucket plan's buffers (a new plan when the shapes changed)."""
        if self._plan is None or not self._plan.matches(mats):
            self._plan = BucketPlan(mats)
        return self._plan.pack(mats)

    def _uses_dtensor(self) -> bool:
        """Whether the params are DTensors (FSDP2 / TP: all or none, `dtensor.check_params`)."""
        return any(is_dtensor(p) for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def _update(self, failed: Optional[BaseException] = None) -> None:
        """failed: what the closure raised (only passed over a process group or with DTensor
        params, where the other ranks must learn of it before anyone writes)."""
        if self._uses_dtensor():  # -- DTensor params: the sharded step lives in dtensor.py --
            return dtensor.step_(self, failed)
        group = self._group()
        if group is not None:  # -- over a process group: distributed/process_group.py --
            return process_group.step_(self, group, failed)
        entries = self._collect_grads()
        if entries:
            self._prepare_nesterov(entries, self._iso_updates(entries))()

    def _prepare_nesterov(self, entries: list[Entry], iso: dict[int, torch.Tensor]) -> Callable[[], None]:
        """The Nesterov update, checked and ready to write (`outer.prepare_nesterov`)."""
        return prepare_nesterov(self, nesterov_rows(entries, iso, f"{type(self).__name__}: "))

    def state_dict(self) -> dict:
        """torch.optim.SGD's state dict: param_groups hold SGD's keys plus `iso` (numbers and bools
        only), per-param state only `momentum_buffer`; `method` and `iso_nd` stay on the optimizer.
        `torch.optim.SGD(nesterov=True).load_state_dict` takes it. Raises nothing.

        Examples:
            >>> w = torch.nn.Parameter(torch.randn(4, 3)); w.grad = torch.randn(4, 3)
            >>> opt = IsoLoCo([w]); opt.step()
            >>> sgd = torch.optim.SGD([w], lr=1.8, momentum=0.8, nesterov=True)
            >>> sgd.load_state_dict(opt.state_dict())
            >>> list(opt.state_dict()["state"][0])
            ['momentum_buffer']
        """
        return super().state_dict()

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One outer step from the `.grad` of each param (params without a grad are skipped): Iso-C
        of the 2-D grads of iso groups, then Nesterov. closure: re-evaluates the model and returns
        the loss, as for torch.optim.SGD. All or nothing: on an error no param or buffer changes.

        Raises:
            ValueError: a grad with NaN/Inf, of the wrong shape or device (named); a group setting
                it cannot honour.
            ResultOverflowError: an update does not fit the param's dtype.
            DistributedStepError: over a process group or a device mesh, on every rank together.

        Examples:
            >>> w = torch.nn.Parameter(torch.randn(8, 4)); w.grad = torch.randn(8, 4)
            >>> opt = IsoLoCo([w], lr=1.8, momentum=0.8)
            >>> opt.step() is None
            True
        """
        loss, failed = None, None
        if closure is not None:
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as e:  # noqa: BLE001
                if self._process_group is None and not self._uses_dtensor():
                    raise
                failed = e  # over a process group or a device mesh: every rank must fail together
        self._update(failed)
        return loss
