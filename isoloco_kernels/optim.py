"""IsoLoCo: the DiLoCo outer optimizer with an Iso-C flatten before Nesterov momentum.

A drop-in for the `torch.optim.SGD(lr, momentum, nesterov=True)` that DiLoCo loops use as their
outer optimizer: write the averaged pseudo-gradient (global − local) into `p.grad`, call `step()`.
Per step, for each parameter with a gradient Δ:

    M   = iso(Δ) for 2-D params of groups with iso=True, else Δ     (Iso-C, see reference.py)
    buf ← μ·buf + M                                                 (buf = M on the first step)
    p   ← p − lr·(M + μ·buf)

With iso=False this is exactly SGD(lr, momentum, nesterov=True).

How: the 2-D gradients are packed into one [B, m, n] buffer per shape (a matrix and its transpose
share one; buckets.py), flattened bucket by bucket with the `iso_flatten_` op, and the fused multi-tensor
op `torch.ops.isoloco.nesterov_outer_` reads the results straight from the buffers — one call per
(device, lr, momentum). The buffers are kept between steps (extra memory: the size of the 2-D
gradients in the compute dtype) and rebuilt only when the set of parameters with gradients or
their shapes/dtypes/devices change.

SGD-shaped state (so DiLoCo frameworks that ship, load or compare `state_dict()`s keep working):
param groups hold only numbers, bools and None — SGD's keys (lr, momentum, dampening=0,
weight_decay=0, nesterov=True, maximize=False, foreach, differentiable, fused) plus `iso` — and the
per-parameter state is `{"momentum_buffer": tensor}`. SGD checkpoints load into IsoLoCo and back.
The flatten `method` is not part of the state: it lives on the optimizer (`opt.method`), so pass
the same `method=` when re-creating the optimizer. Momentum buffers of float16/bfloat16 params
are kept in float32 (SGD's would be in the param dtype; loading either way converts).

All-or-nothing: every gradient is checked before anything is written; a NaN/Inf raises ValueError
naming the parameter (group, index, shape) and leaves params and momentum buffers untouched.
Parameters may live on several devices (CPU and CUDA) in one optimizer.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import dtensor  # DTensor (FSDP2 / TP) params
from ._validate import SUPPORTED_DTYPES, check_all_finite, compute_dtype
from .buckets import BucketPlan
from .flatten import check_method
from .ops import flatten_buckets_

__all__ = ["IsoLoCo"]

# SGD's group keys, at the values that make SGD(nesterov=True) the update IsoLoCo applies.
_SGD_KEYS = dict(
    dampening=0, weight_decay=0, nesterov=True, maximize=False, foreach=None, differentiable=False, fused=None
)


def _check_hyper(lr: Any, momentum: Any, where: str) -> None:
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: a Tensor lr must have one element, got shape {tuple(lr.shape)}")
    if not 0.0 <= lr < float("inf"):
        raise ValueError(f"{where}: invalid learning rate: {lr}")
    if not 0.0 <= momentum < float("inf"):
        raise ValueError(f"{where}: invalid momentum value: {momentum}")


def _check_group(group: dict, where: str) -> None:
    """A group IsoLoCo can run: valid lr/momentum and SGD's other knobs at their IsoLoCo values."""
    _check_hyper(group["lr"], group["momentum"], where)
    for key, want in (("dampening", 0), ("weight_decay", 0), ("nesterov", True), ("maximize", False)):
        if key in group and group[key] != want:
            raise ValueError(
                f"{where}: {key}={group[key]!r}, but IsoLoCo applies Nesterov momentum without "
                f"dampening, weight decay or maximize ({key} must be {want!r})"
            )
    if not isinstance(group.get("iso", True), bool):
        raise ValueError(f"{where}: iso must be a bool, got {group['iso']!r}")


class IsoLoCo(torch.optim.Optimizer):
    """Iso-C + Nesterov outer optimizer (see the module docstring).

    Args:
        params: parameters or param groups (groups may set their own lr, momentum, iso).
        lr: outer learning rate (released IsoLoCo config: 1.8).
        momentum: Nesterov momentum μ (released IsoLoCo config: 0.8).
        iso: flatten 2-D pseudo-gradients with Iso-C; False gives SGD(nesterov=True).
        method: flatten backend ("auto", "svd", "eigh", "polar", "polar_bf16"; see `iso_merge_`);
            kept on the optimizer, not in the state dict.
        process_group: a torch.distributed group whose ranks all hold the same, already averaged
            grads (torchft, OpenDiLoCo): the flatten work is split across its ranks and the
            results all-gathered. None (default): this process flattens everything.
    """

    def __init__(
        self,
        params,
        lr: float = 1.8,
        momentum: float = 0.8,
        *,
        iso: bool = True,
        method: str = "auto",
        process_group=None,
    ):
        _check_hyper(lr, momentum, "IsoLoCo")
        check_method(method)
        if not isinstance(iso, bool):
            raise ValueError(f"IsoLoCo: iso must be a bool, got {iso!r}")
        self.method = method
        # Set when p.grad is already averaged and equal on every rank of this group (torchft,
        # OpenDiLoCo): each rank flattens only its share of the matrices (sharded_iso_merge_).
        self.process_group = process_group
        self._plan: Optional[BucketPlan] = None  # bucket buffers, reused while the grads' shapes hold
        super().__init__(params, dict(lr=lr, momentum=momentum, iso=iso, **_SGD_KEYS))

    def add_param_group(self, param_group: dict) -> None:
        where = f"IsoLoCo: param group {len(self.param_groups)}"
        _check_group({**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}, where)
        super().add_param_group(param_group)
        for i, p in enumerate(self.param_groups[-1]["params"]):
            if p.dtype not in SUPPORTED_DTYPES:
                self.param_groups.pop()
                raise TypeError(
                    f"{where}: param {i} has dtype {p.dtype}; IsoLoCo supports {SUPPORTED_DTYPES}"
                )
        # -- DTensor params (FSDP2 / tensor parallel): refused here if unsupported; see dtensor.py --
        try:
            dtensor.check_params(self)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise

    # -- state dict ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an IsoLoCo or a torch.optim.SGD state dict (SGD's must be nesterov, no dampening,
        no weight decay). Groups without `iso` keep this optimizer's setting. Checked first: on a
        refused dict nothing changes."""
        saved = state_dict["param_groups"]
        for gi, g in enumerate(saved):
            settings = {**self.defaults, **{k: v for k, v in g.items() if k != "params"}}
            _check_group(settings, f"IsoLoCo.load_state_dict: param group {gi}")
        iso_now = [g["iso"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, iso in zip(self.param_groups, iso_now):
            g.setdefault("iso", iso)
            for k, v in _SGD_KEYS.items():
                g.setdefault(k, v)
        # torch casts every floating state tensor to its param's dtype; half params keep float32
        # buffers here, converted from the saved tensor itself so nothing is lost to rounding.
        for g, sg in zip(self.param_groups, saved):
            for p, pid in zip(g["params"], sg["params"]):
                want = compute_dtype(p.dtype)
                src = state_dict["state"].get(pid, {}).get("momentum_buffer")
                if isinstance(src, torch.Tensor) and want != p.dtype:
                    self.state[p]["momentum_buffer"] = src.detach().to(device=p.device, dtype=want, copy=True)
        self._plan = None

    # -- the step --------------------------------------------------------------------------------

    def _gather(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor, dict]]:
        """(group index, param index, param, grad, group) for every param with a grad; checked."""
        entries = []
        for gi, group in enumerate(self.param_groups):
            _check_group(group, f"IsoLoCo.step: param group {gi}")
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                where = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
                if g.is_sparse:
                    raise RuntimeError(f"IsoLoCo: {where} has a sparse grad; IsoLoCo needs dense grads")
                if g.shape != p.shape or g.device != p.device:
                    raise ValueError(
                        f"IsoLoCo: {where}: grad has shape {tuple(g.shape)} on {g.device}, "
                        f"param is on {p.device}"
                    )
                if g.dtype not in SUPPORTED_DTYPES:
                    raise TypeError(f"IsoLoCo: {where}: grad dtype {g.dtype} is not supported")
                entries.append((gi, pi, p, g, group))
        names = [
            f"IsoLoCo: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) grad"
            for gi, pi, p, _, _ in entries
        ]
        check_all_finite([e[3] for e in entries], names)
        # a NaN/Inf momentum buffer (a corrupted checkpoint, say) would poison the params just the same
        held = [(n, self.state[e[2]].get("momentum_buffer")) for n, e in zip(names, entries) if e[2] in self.state]
        held = [(n, b) for n, b in held if isinstance(b, torch.Tensor)]
        check_all_finite([b for _, b in held], [n.replace(") grad", ") momentum_buffer") for n, _ in held])
        return entries

    def _iso_updates(self, entries) -> dict[int, torch.Tensor]:
        """Iso-C of every 2-D grad in an iso group, via the bucket buffers: entry index → result view."""
        chosen = [k for k, e in enumerate(entries) if e[4]["iso"] and e[3].ndim == 2 and e[3].numel()]
        if not chosen:
            return {}
        grads = [entries[k][3] for k in chosen]
        if self._plan is None or not self._plan.matches(grads):
            self._plan = BucketPlan(grads)
        buffers = self._plan.pack(grads)
        if self.process_group is None:
            flatten_buckets_(buffers, self.method)  # grads were checked in _gather
        else:
            from .distributed import sharded_iso_merge_  # torch.distributed only when asked for

            sharded_iso_merge_(buffers, self.process_group, method=self.method)
        return dict(zip(chosen, self._plan.views()))

    @torch.no_grad()
    def _update(self) -> None:
        if dtensor.uses_dtensor(self):  # -- DTensor params: the sharded step lives in dtensor.py --
            return dtensor.step_(self)
        entries = self._gather()
        if not entries:
            return
        iso = self._iso_updates(entries)
        # One fused op call per (device, lr, momentum). New buffers join the state only after the
        # update ran, so a failure cannot leave half-made state behind.
        calls: dict[tuple, tuple[list, list, list]] = {}
        fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, (_, _, p, g, group) in enumerate(entries):
            buf = self.state[p].get("momentum_buffer") if p in self.state else None
            if buf is None:
                buf = torch.zeros_like(p, dtype=compute_dtype(p.dtype), memory_format=torch.preserve_format)
                fresh.append((p, buf))
            elif buf.shape != p.shape or buf.device != p.device or buf.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"IsoLoCo: param_groups[{entries[k][0]}]['params'][{entries[k][1]}] "
                    f"(shape {tuple(p.shape)}): momentum_buffer has shape {tuple(buf.shape)}, "
                    f"dtype {buf.dtype} on {buf.device}"
                )
            key = (p.device, float(group["lr"]), float(group["momentum"]))
            ps, bs, us = calls.setdefault(key, ([], [], []))
            ps.append(p)
            bs.append(buf)
            us.append(iso.get(k, g))
        for (_, lr, momentum), (ps, bs, us) in calls.items():
            torch.ops.isoloco.nesterov_outer_(ps, bs, us, lr, momentum, None)
        for p, buf in fresh:
            self.state[p]["momentum_buffer"] = buf

    def step(self, closure: Optional[Callable[[], float]] = None):
        """One outer step from the `.grad` of each param (params without a grad are skipped).
        closure: re-evaluates the model and returns the loss, as for torch.optim.SGD."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss
