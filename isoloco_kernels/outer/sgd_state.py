"""SGD-shaped settings and state of the outer optimizers (`IsoLoCo`, `ShardedIsoLoCo`, the DTensor step).

What makes a group, a constructor call and a state dict look like torch.optim.SGD's (DESIGN.md,
"Drop-in means SGD-shaped"): SGD's keys at IsoLoCo's values (`SGD_KEYS`), SGD's keywords
(`sgd_keywords`), constructor defaults (`outer_defaults`), the SGD-shaped part of the three optimizers'
constructor calls (`SGDArgs`; each optimizer writes SGD's signature out), and the state dict: checked
before anything loads (`check_state_dict`), loaded with torch's rule plus a warning when a checkpoint
changes `iso` and float32 momentum restored for half params (`load_sgd_state`). The group checks every
step runs (`check_hyper`, `check_group`) are core.py's.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .._validate import (
    SUPPORTED_DTYPES,
    check_all_finite,
    check_writable,
    compute_dtype,
    is_dtensor,
    local,
    overflow_limit,
)
from ..flatten.registry import check_method
from .core import check_group, check_hyper

__all__ = [
    "SGDArgs",
    "SGD_KEYS",
    "check_group",
    "check_hyper",
    "check_param_dtypes",
    "check_state_dict",
    "is_dtensor",
    "load_sgd_state",
    "refuse_foreign_state",
    "local",
    "outer_defaults",
    "sgd_keywords",
]

#: SGD's group keys at the values that make SGD(nesterov=True) the update IsoLoCo applies.
SGD_KEYS = dict(
    dampening=0, weight_decay=0, nesterov=True, maximize=False, foreach=None, differentiable=False, fused=None
)


def outer_defaults(
    where: str, lr: Any, momentum: Any, iso: Any, method: str, sgd: Callable[[], dict] = lambda: SGD_KEYS
) -> dict:
    """An outer optimizer's constructor arguments, checked (lr and momentum, then `sgd()`: SGD's
    other keys, then the method, then iso): the defaults dict to hand to torch.optim.Optimizer."""
    check_hyper(lr, momentum, where)
    keys = sgd()
    try:
        check_method(method)
    except (TypeError, ValueError) as e:  # the same error, in the name of the optimizer that was given it
        raise type(e)(f"{where}: {e}") from None
    if not isinstance(iso, bool):
        raise ValueError(f"{where}: iso must be a bool, got {iso!r}")
    return dict(lr=lr, momentum=momentum, iso=iso, **keys)


# -- the constructor: torch.optim.SGD's signature, IsoLoCo's defaults, in one place -------------


@dataclass(frozen=True)
class SGDArgs:
    """The SGD-shaped part of an outer optimizer's constructor call, as the caller gave it (unchecked):
    `defaults()` checks it, so a constructor can run the checks where its errors belong (inside a
    distributed agreement, say)."""

    lr: float | torch.Tensor = 1.8  # the released IsoLoCo config
    momentum: float | torch.Tensor = 0.8
    dampening: float = 0
    weight_decay: float = 0
    nesterov: bool = True
    maximize: bool = False
    foreach: Optional[bool] = None
    differentiable: bool = False
    fused: Optional[bool] = None

    def defaults(self, where: str, iso: Any, method: str) -> dict:
        """The checked defaults dict for torch.optim.Optimizer (`outer_defaults` + `sgd_keywords`)."""
        keys = {k: v for k, v in asdict(self).items() if k not in ("lr", "momentum")}
        return outer_defaults(where, self.lr, self.momentum, iso, method, lambda: sgd_keywords(where, **keys))


def _flag(value, key: str, where: str, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise TypeError(f"{where}: {key} must be a bool{' or None' if allow_none else ''}, got {value!r}")


def sgd_keywords(
    where: str,
    dampening=0,
    weight_decay=0,
    nesterov=True,
    maximize=False,
    foreach=None,
    differentiable=False,
    fused=None,
) -> dict:
    """torch.optim.SGD's keywords, checked against what IsoLoCo does: the group entries to store.

    Honoured with SGD's meaning: nesterov=True, dampening=0, weight_decay=0, maximize=False (the
    update SGD(nesterov=True) applies), foreach/fused None, False or True (how SGD runs its loop;
    IsoLoCo always batches its update, so they change nothing and are kept in the group as given).
    Anything else raises a ValueError that says what to use instead (a TypeError for a wrong type)."""
    for key, v in (("dampening", dampening), ("weight_decay", weight_decay)):
        if isinstance(v, bool) or not isinstance(v, (numbers.Real, torch.Tensor)):
            raise TypeError(f"{where}: {key} must be a real number, got {v!r}")
    _flag(nesterov, "nesterov", where)
    _flag(maximize, "maximize", where)
    _flag(differentiable, "differentiable", where)
    _flag(foreach, "foreach", where, allow_none=True)
    _flag(fused, "fused", where, allow_none=True)
    if not nesterov:
        raise ValueError(
            f"{where}: nesterov=False, but IsoLoCo's momentum is Nesterov's (DiLoCo's outer step); "
            "pass nesterov=True or leave it out (for heavy-ball momentum without Iso-C use torch.optim.SGD)"
        )
    if float(dampening) != 0:
        raise ValueError(
            f"{where}: dampening={float(dampening)!r}, but Nesterov momentum has no dampening "
            "(torch.optim.SGD refuses it too); use dampening=0"
        )
    if float(weight_decay) != 0:
        raise ValueError(
            f"{where}: weight_decay={float(weight_decay)!r}, but IsoLoCo's outer step has no weight "
            "decay; use weight_decay=0 and decay the weights in the inner optimizer (e.g. AdamW's weight_decay)"
        )
    if maximize:
        raise ValueError(
            f"{where}: maximize=True is not supported; use maximize=False and write the pseudo-gradient "
            "(global − local) into p.grad, negated if the objective is to be maximized"
        )
    if differentiable:
        raise ValueError(
            f"{where}: differentiable=True is not supported: the Iso-C flatten and the update run in "
            "place outside autograd; use differentiable=False"
        )
    if foreach and fused:
        raise ValueError(
            f"{where}: foreach=True and fused=True cannot be set together (as for torch.optim.SGD); "
            "set one of them, or neither"
        )
    return {**SGD_KEYS, "foreach": foreach, "fused": fused}


def check_param_dtypes(params: Sequence[torch.Tensor], where: str) -> None:
    for i, p in enumerate(params):
        if p.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{where}: param {i} has dtype {p.dtype}; IsoLoCo supports {SUPPORTED_DTYPES}")


# -- SGD-shaped state -----------------------------------------------------------------------------


#: Group keys that only other optimizers' state dicts carry (Adam/AdamW, RMSprop, Adagrad, ...).
_FOREIGN_GROUP_KEYS = ("betas", "eps", "amsgrad", "alpha", "centered", "lr_decay", "initial_accumulator_value", "rho")


def refuse_foreign_state(state_dict: Any, where: str) -> None:
    """ValueError for a state dict that is not SGD-shaped (per-param state other than momentum_buffer, or
    another optimizer's group keys): most often the inner optimizer's checkpoint loaded by mistake."""
    if not isinstance(state_dict, dict):
        return
    groups = state_dict.get("param_groups")
    keys = (
        sorted({k for g in groups if isinstance(g, dict) for k in g if k in _FOREIGN_GROUP_KEYS})
        if isinstance(groups, (list, tuple))
        else []
    )
    states = state_dict.get("state")
    extra = (
        sorted({k for st in states.values() if isinstance(st, dict) for k in st if k != "momentum_buffer"})
        if isinstance(states, dict)
        else []
    )
    if keys or extra:
        found = ", ".join([f"group key '{k}'" for k in keys] + [f"per-param state '{k}'" for k in extra])
        raise ValueError(
            f"{where}: this is not an SGD-shaped state dict ({found}: another optimizer's, e.g. the inner AdamW's); "
            "the outer optimizers load their own or torch.optim.SGD(nesterov=True)'s, whose per-param state is "
            "only 'momentum_buffer'"
        )


def check_state_dict(opt: torch.optim.Optimizer, state_dict: Any, where: str) -> None:
    """Everything a (torch.optim.SGD or IsoLoCo) state dict must hold for `opt` to load it and
    step, checked before anything is loaded: the 'state' and 'param_groups' entries, each group's
    settings and param count, and each momentum_buffer (a finite floating tensor shaped like its
    param, with its own memory)."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"{where}: expected a dict, got {type(state_dict).__name__}")
    refuse_foreign_state(state_dict, where)
    for key, kind in (("state", dict), ("param_groups", (list, tuple))):
        if key not in state_dict:
            raise ValueError(f"{where}: the state dict has no '{key}' entry")
        if not isinstance(state_dict[key], kind):
            raise TypeError(
                f"{where}: '{key}' must be a {getattr(kind, '__name__', 'list')}, got {type(state_dict[key]).__name__}"
            )
    saved = state_dict["param_groups"]
    if len(saved) != len(opt.param_groups):
        raise ValueError(
            f"{where}: the state dict has {len(saved)} param groups, this optimizer {len(opt.param_groups)}"
        )
    params, ids = [], []
    for gi, (g, mine) in enumerate(zip(saved, opt.param_groups)):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError(f"{where}: param group {gi} is not a dict with a 'params' entry")
        check_group({k: v for k, v in g.items() if k != "params"}, f"{where}: param group {gi}")
        if len(g["params"]) != len(mine["params"]):
            raise ValueError(
                f"{where}: param group {gi} has {len(g['params'])} params in the state dict, {len(mine['params'])} here"
            )
        params += mine["params"]
        ids += list(g["params"])
    held: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for pid, p in zip(ids, params):
        if pid not in state_dict["state"]:
            continue
        entry = state_dict["state"][pid]
        if not isinstance(entry, dict):
            raise TypeError(f"{where}: state of param {pid} must be a dict, got {type(entry).__name__}")
        if "momentum_buffer" not in entry or entry["momentum_buffer"] is None:
            continue
        b = entry["momentum_buffer"]
        name = f"{where}: param {pid} (shape {tuple(p.shape)}) momentum_buffer"
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(b).__name__} {b!r:.40}")
        if local(b).device.type == "meta":
            raise ValueError(f"{name} is a meta tensor (it holds no data to load)")
        if b.dtype not in SUPPORTED_DTYPES or tuple(b.shape) != tuple(p.shape):
            raise ValueError(
                f"{name} has shape {tuple(b.shape)}, dtype {b.dtype}; want {tuple(p.shape)}, one of {SUPPORTED_DTYPES}"
            )
        held.append((local(b), local(p), name))
    check_all_finite([b for b, _, _ in held], [n for _, _, n in held])
    for b, p, name in held:  # loaded in p's compute dtype: a value beyond it would load as Inf
        want = compute_dtype(p.dtype)
        if b.numel() and torch.finfo(b.dtype).max > torch.finfo(want).max:
            top = float(b.detach().abs().max())
            if top >= overflow_limit(want):
                raise ValueError(
                    f"{name} holds {top:.4g}, beyond the {want} it is kept in for this param "
                    "(it would load as Inf); nothing was loaded"
                )
    # buffers loaded as they are (same dtype and device) are written in place by later steps
    kept = [(b, n) for b, p, n in held if b.dtype == p.dtype == compute_dtype(p.dtype) and b.device == p.device]
    with torch.no_grad():
        check_writable([b for b, _ in kept], [n for _, n in kept])


def load_sgd_state(opt: torch.optim.Optimizer, state_dict: dict, where: str, load: Callable[[dict], None]) -> None:
    """Load an IsoLoCo or torch.optim.SGD state dict with `load` (torch.optim.Optimizer's), all
    checked first (`check_state_dict`): on a refused dict nothing changes. Groups without `iso`
    (SGD's) keep this optimizer's setting."""
    check_state_dict(opt, state_dict, where)
    iso_now = [g["iso"] for g in opt.param_groups]
    for gi, (g, iso) in enumerate(zip(state_dict["param_groups"], iso_now)):
        if "iso" in g and g["iso"] != iso:
            warnings.warn(
                f"{where}: param group {gi}: the state dict sets iso={g['iso']} over this optimizer's "
                f"iso={iso}, so it now steps {'with' if g['iso'] else 'without'} Iso-C (a checkpoint carries "
                "each group's lr, momentum and iso, as torch's optimizers restore their hyper-parameters); set "
                f"opt.param_groups[{gi}]['iso'] = {iso} after loading to keep this optimizer's",
                UserWarning,
                stacklevel=3,
            )
    load(state_dict)
    for g, iso in zip(opt.param_groups, iso_now):
        g.setdefault("iso", iso)
        for k, v in SGD_KEYS.items():
            g.setdefault(k, v)
    _restore_half_momentum(opt, state_dict)


def _restore_half_momentum(opt: torch.optim.Optimizer, state_dict: dict) -> None:
    """After torch's load_state_dict (which casts every floating state tensor to its param's
    dtype): half and bfloat16 params get float32 momentum again, converted from the saved tensor
    itself so nothing is lost to rounding."""
    for g, sg in zip(opt.param_groups, state_dict["param_groups"]):
        for p, pid in zip(g["params"], sg["params"]):
            want = compute_dtype(p.dtype)
            src = state_dict["state"].get(pid, {}).get("momentum_buffer")
            if isinstance(src, torch.Tensor) and want != p.dtype:
                opt.state[p]["momentum_buffer"] = src.detach().to(device=p.device, dtype=want, copy=True)
