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

import numbers
from typing import Any, Callable, Optional

import torch

from . import dtensor  # DTensor (FSDP2 / TP) params
from ._validate import SUPPORTED_DTYPES, ResultOverflowError, check_all_finite, check_writable, compute_dtype
from .buckets import BucketPlan
from .flatten import check_method
from .nesterov import prepare_outer_update
from .ops import iso_merge_unchecked_

__all__ = ["IsoLoCo"]

# SGD's group keys, at the values that make SGD(nesterov=True) the update IsoLoCo applies.
_SGD_KEYS = dict(
    dampening=0, weight_decay=0, nesterov=True, maximize=False, foreach=None, differentiable=False, fused=None
)


def _number(v: Any, key: str, where: str) -> float:
    """v as a float; TypeError naming `key` for anything that is not a real number."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"{where}: a Tensor {key} must have one element, got shape {tuple(v.shape)}")
        return float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: '{key}' must be a real number, got {type(v).__name__} {v!r}")
    return float(v)


def _check_hyper(lr: Any, momentum: Any, where: str) -> None:
    if not 0.0 <= _number(lr, "lr", where) < float("inf"):
        raise ValueError(f"{where}: invalid learning rate: {lr} ('lr' must be a finite number >= 0)")
    if not 0.0 <= _number(momentum, "momentum", where) < float("inf"):
        raise ValueError(f"{where}: invalid momentum value: {momentum} ('momentum' must be a finite number >= 0)")


def check_state_dict(opt: torch.optim.Optimizer, state_dict: Any, where: str) -> None:
    """Everything a (torch.optim.SGD or IsoLoCo) state dict must hold for `opt` to load it and
    step, checked before anything is loaded: the 'state' and 'param_groups' entries, each group's
    settings (lr, momentum as numbers; SGD's other knobs at IsoLoCo's values) and param count, and
    each momentum_buffer (a finite floating tensor shaped like its param, with its own memory)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
    for key, kind in (("state", dict), ("param_groups", (list, tuple))):
        if key not in state_dict:
            raise ValueError(f"{where}: the state dict has no '{key}' entry")
        if not isinstance(state_dict[key], kind):
            raise TypeError(f"{where}: '{key}' must be a {getattr(kind, '__name__', 'list')}, got "
                            f"{type(state_dict[key]).__name__}")
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise ValueError(
            f"{where}: the state dict has {len(saved)} param groups, this optimizer {len(opt.param_groups)}"
        )
    params, ids = [], []
    for gi, (g, mine) in enumerate(zip(saved, opt.param_groups)):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"{where}: param group {gi} is not a dict with a 'params' entry")
        _check_group({k: v for k, v in g.items() if k != "params"}, f"{where}: param group {gi}")
        if len(g["params"]) != len(mine["params"]):
            raise ValueError(
                f"{where}: param group {gi} has {len(g['params'])} params in the state dict, "
                f"{len(mine['params'])} here"
            )
        params += mine["params"]
        ids += list(g["params"])
    held: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for pid, p in zip(ids, params):
        entry = state_dict["state"].get(pid)
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise TypeError(f"{where}: state of param {pid} must be a dict, got {type(entry).__name__}")
        if "momentum_buffer" not in entry or entry["momentum_buffer"] is None:
            continue
        b = entry["momentum_buffer"]
        name = f"{where}: param {pid} (shape {tuple(p.shape)}) momentum_buffer"
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(b).__name__} {b!r:.40}")
        if b.dtype not in SUPPORTED_DTYPES or tuple(b.shape) != tuple(p.shape):
            raise ValueError(f"{name} has shape {tuple(b.shape)}, dtype {b.dtype}; want {tuple(p.shape)}, "
                             f"one of {SUPPORTED_DTYPES}")
        held.append((dtensor.local(b), dtensor.local(p), name))  # DTensors: their local shards (dtensor.py)
    check_all_finite([b for b, _, _ in held], [n for _, _, n in held])
    # buffers loaded as they are (same dtype and device) are written in place by later steps
    kept = [(b, n) for b, p, n in held if b.dtype == p.dtype == compute_dtype(p.dtype) and b.device == p.device]
    with torch.no_grad():
        check_writable([b for b, _ in kept], [n for _, n in kept])



def _check_group(group: dict, where: str) -> None:
    """A group IsoLoCo can run: valid lr/momentum and SGD's other knobs at their IsoLoCo values."""
    for key in ("lr", "momentum"):
        if key not in group:
            raise ValueError(f"{where}: the group has no '{key}'")
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

    @property
    def process_group(self):
        return self._process_group

    @process_group.setter
    def process_group(self, group) -> None:
        self._process_group = group
        self._group_dropped = False

    # -- copies: deepcopy and pickle keep `method`, rebuild the plan, drop the process group --

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["method"] = self.method
        state["group_dropped"] = self._process_group is not None or getattr(self, "_group_dropped", False)
        return state

    def __setstate__(self, state: dict) -> None:
        # torch's load_state_dict calls this too, with only "state" and "param_groups": then the
        # optimizer keeps its method and process group.
        state = dict(state)
        copied = "method" in state
        method = state.pop("method", None)
        dropped = state.pop("group_dropped", False)
        super().__setstate__(state)
        self._plan = None  # rebuilt on the next step
        if copied:
            self.method = method
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
        refused dict nothing changes (see `check_state_dict`)."""
        check_state_dict(self, state_dict, "IsoLoCo.load_state_dict")
        saved = state_dict["param_groups"]
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
        held = [(n, b) for n, b in held if b is not None]
        for n, b in held:
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"{n.replace(') grad', ') momentum_buffer')} must be a tensor, got {type(b).__name__}")
        check_all_finite([b for _, b in held], [n.replace(") grad", ") momentum_buffer") for n, _ in held])
        # everything the step writes: params and held momentum buffers, checked before any write
        written = [e[2] for e in entries] + [b for _, b in held]
        check_writable(written, [n[: -len(" grad")] for n in names]
                       + [n.replace(") grad", ") momentum_buffer") for n, _ in held])
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
        if self._process_group is None:
            try:
                iso_merge_unchecked_(buffers, self.method)  # grads were checked in _gather
            except ResultOverflowError as e:  # name the param, not the internal bucket
                b = self._plan.buckets[e.bucket]
                gi, pi, p = entries[chosen[b.members[e.matrix]]][:3]
                raise ResultOverflowError(
                    f"IsoLoCo: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}): "
                    f"the Iso-C result of its grad does not fit {b.dtype}; nothing was changed"
                ) from None
        else:
            from .distributed import sharded_iso_merge_  # torch.distributed only when asked for

            sharded_iso_merge_(buffers, self._process_group, method=self.method)
        return dict(zip(chosen, self._plan.views()))

    @torch.no_grad()
    def _update(self, failed: Optional[BaseException] = None) -> None:
        """failed: what the closure raised (only passed over a process group, where the other
        ranks must learn of it before anyone writes)."""
        if dtensor.uses_dtensor(self):  # -- DTensor params: the sharded step lives in dtensor.py --
            return dtensor.step_(self)
        group = self._group()
        if group is None:
            entries = self._gather()
            if entries:
                self._prepare_update(entries, self._iso_updates(entries))()
            return
        # Over a process group every rank must fail together: agree after the checks (and on the
        # shapes), sharded_iso_merge_ agrees around the flatten, and once more before writing.
        from ._agree import agree, comm_device, describe, error_text, fingerprint

        error, entries = None, []
        try:
            if failed is not None:
                raise failed
            entries = self._gather()
        except Exception as e:  # noqa: BLE001 — any failure must reach the other ranks
            error = error_text(e)
        device = comm_device(group, entries[0][2].device if entries else None)
        fp = fingerprint((describe([e[3] for e in entries]), [bool(e[4]["iso"]) for e in entries]))
        agree(error, group, device, "IsoLoCo.step", fp)
        if not entries:
            return
        iso = self._iso_updates(entries)
        apply = None
        try:
            apply = self._prepare_update(entries, iso)
        except Exception as e:  # noqa: BLE001
            error = error_text(e)
        agree(error, group, device, "IsoLoCo.step")
        apply()

    def _prepare_update(self, entries, iso) -> Callable[[], None]:
        """Everything but the writes of the Nesterov update: momentum buffers made or checked, one
        fused op call per (device, lr, momentum), each checked for overflow
        (`nesterov.prepare_outer_update`). Returns the function that writes; new buffers join the
        state only after it ran, so a failure cannot leave half-made state behind."""
        calls: dict[tuple, tuple[list, list, list, list]] = {}
        fresh: list[tuple[torch.Tensor, torch.Tensor]] = []
        for k, (gi, pi, p, g, group) in enumerate(entries):
            where = f"IsoLoCo: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)})"
            buf = self.state[p].get("momentum_buffer") if p in self.state else None
            if buf is None:
                buf = torch.zeros_like(p, dtype=compute_dtype(p.dtype), memory_format=torch.preserve_format)
                fresh.append((p, buf))
            elif buf.shape != p.shape or buf.device != p.device or buf.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"{where}: momentum_buffer has shape {tuple(buf.shape)}, dtype {buf.dtype} on {buf.device}"
                )
            key = (p.device, float(group["lr"]), float(group["momentum"]))
            ps, bs, us, names = calls.setdefault(key, ([], [], [], []))
            ps.append(p)
            bs.append(buf)
            us.append(iso.get(k, g))
            names.append(where)
        applies = [
            prepare_outer_update(ps, bs, us, lr, momentum, names)
            for (_, lr, momentum), (ps, bs, us, names) in calls.items()
        ]

        def apply() -> None:
            for fn in applies:
                fn()
            for p, buf in fresh:
                self.state[p]["momentum_buffer"] = buf

        return apply

    def step(self, closure: Optional[Callable[[], float]] = None):
        """One outer step from the `.grad` of each param (params without a grad are skipped).
        closure: re-evaluates the model and returns the loss, as for torch.optim.SGD."""
        loss, failed = None, None
        if closure is not None:
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as e:  # noqa: BLE001
                if self._process_group is None or dtensor.uses_dtensor(self):
                    raise
                failed = e  # over a process group: every rank must fail together
        self._update(failed)
        return loss
