"""ShardedIsoLoCo checkpoints that move between world sizes.

A rank's `ShardedIsoLoCo.state_dict()` holds the momentum of the params that rank owns, tagged with a
"sharding" entry (plan fingerprint, rank, world size), so it loads back only into the same rank of the
same plan. `consolidated_state_dict` (a collective: every rank calls it) gathers every param's momentum
from its owner into one SGD-shaped state dict of the whole model, with no "sharding" entry; that whole
state loads into `ShardedIsoLoCo` at any world size (each rank keeps the momentum of what it owns there),
into single-process `IsoLoCo`, or into `torch.optim.SGD(nesterov=True)`. IsoLoCo refuses a per-rank state
(`refuse_rank_state`): loading one would silently drop every other rank's momentum. With `compress`, a
rank's state also holds its "compress" entry (the spec, this worker's error-feedback residuals, the update
residuals of the params it owns: compressed.py), refused under another spec; a whole state holds none (the
residuals of a loaded whole state restart from zero).
"""

from __future__ import annotations

import torch

from ..outer import sgd_state as outer
from ..outer.merge_state import check_merge_entry, merge_entry
from . import compressed
from .agree import Agreement, gather_objects
from .merge_route import check_sharded_state
from .pipeline import broadcast_from_owner

__all__ = ["consolidated_state_dict", "load_state", "rank_state_dict", "refuse_rank_state"]

_DTYPES = {str(d): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def refuse_rank_state(state_dict, where: str) -> None:
    """ValueError for one rank's ShardedIsoLoCo state where a whole one is expected."""
    info = state_dict.get("sharding") if isinstance(state_dict, dict) else None
    if info is not None:
        rank, world = (info.get("rank"), info.get("world_size")) if isinstance(info, dict) else ("?", "?")
        raise ValueError(
            f"{where}: this is one rank's ShardedIsoLoCo state (rank {rank} of {world}: the momentum of the params "
            "that rank owns, not of the others); call ShardedIsoLoCo.consolidated_state_dict() on every rank and "
            "save that whole state to load it here (docs/checkpoints.md)"
        )


def consolidated_state_dict(opt) -> dict:
    """Every param's momentum, from its owner to every rank: the whole model's SGD-shaped state dict (plus
    the "merge" entry). A collective: every rank of the optimizer's group calls it. The buffers are
    allocated and the ranks agree before the first broadcast, so a failure on one rank (out of memory)
    raises DistributedStepError on every rank, never a hang. Nothing of the optimizer changes."""
    where = "ShardedIsoLoCo.consolidated_state_dict"
    ag = Agreement(where, opt.process_group, alone=opt.world_size == 1)
    mine = ag.attempt(torch.optim.Optimizer.state_dict, opt)
    held = (
        None
        if mine is None
        else {
            pid: (tuple(st["momentum_buffer"].shape), str(st["momentum_buffer"].dtype))
            for pid, st in mine["state"].items()
            if st.get("momentum_buffer") is not None
        }
    )
    every = [held] if opt.world_size == 1 else gather_objects(held, opt.process_group)
    flats: dict = {}  # pid -> (owner, a contiguous buffer: a copy of mine, or one to receive into)

    def allocate() -> None:
        if any(h is None for h in every):
            return  # another rank failed above: settle says which
        for r, h in enumerate(every):
            for pid, (shape, dtype) in h.items():
                if r == opt.rank:
                    flats[pid] = (r, mine["state"][pid]["momentum_buffer"].detach().contiguous().clone())
                else:
                    flats[pid] = (r, torch.empty(shape, dtype=_DTYPES[dtype], device=opt._data_device))

    ag.attempt(allocate)
    ag.settle()
    if opt.world_size > 1:
        for pid in sorted(flats):  # the same order on every rank: each param's owner sends, the others receive
            r, buf = flats[pid]
            broadcast_from_owner(buf.view(-1), r, opt.process_group, opt.chunk_bytes)
    whole = {pid: {"momentum_buffer": buf} for pid, (_, buf) in sorted(flats.items())}
    out = {"state": whole, "param_groups": mine["param_groups"]}
    out["merge"] = merge_entry(opt.merge, opt.merge_options, opt.merged_steps)
    return out


def rank_state_dict(opt, sd: dict) -> dict:
    """This rank's torch state dict `sd` tagged with its plan ("sharding") and merge ("merge")."""
    sd["sharding"] = {"fingerprint": opt.plan.fingerprint, "rank": opt.rank, "world_size": opt.world_size}
    sd["merge"] = merge_entry(opt.merge, opt.merge_options, opt.merged_steps)
    if opt.compress is not None:  # this worker's residuals and the owner's update residuals
        sd["compress"] = compressed.state_entry(opt)
    return sd


def load_state(opt, state_dict, load) -> None:
    """`ShardedIsoLoCo.load_state_dict`: a per-rank state ("sharding": the same rank of the same plan) or a
    whole one (consolidated, IsoLoCo's or SGD's: every buffer checked against its param first, then only
    the momentum of the params this rank owns is kept); the merge entry's step count comes back with it.
    Everything is checked before torch's `load` runs, so a refused state changes nothing."""
    where = "ShardedIsoLoCo.load_state_dict"
    info = check_merge_entry(opt, state_dict, where)
    residuals = None  # a whole state holds no error-feedback residuals: they restart from zero
    if isinstance(state_dict, dict) and "sharding" not in state_dict:
        if state_dict.get("compress") is not None:  # a whole state with residuals: a compressed MergeLoCo's
            raise ValueError(
                f"{where}: this state holds a compressed MergeLoCo's error-feedback residuals (its K workers', "
                "simulated in one process); a ShardedIsoLoCo rank keeps only its own worker's and cannot take them. "
                "To go on from its momentum alone, load it without its 'compress' entry (the residuals then start "
                "from zero); nothing was loaded"
            )
        rest = {k: v for k, v in state_dict.items() if k not in ("merge", "compress")}
        outer.check_state_dict(opt, rest, where)  # every param's buffer, not only mine: one verdict on every rank
        rest["state"] = {pid: st for pid, st in rest["state"].items() if pid in set(opt.mine)}
    else:
        rest = {k: v for k, v in check_sharded_state(opt, state_dict, where).items() if k not in ("merge", "compress")}
        residuals = compressed.check_entry(opt, state_dict, where, opt._params, opt.mine)
    outer.load_sgd_state(opt, rest, where, load)
    compressed.load_entry(opt, residuals)
    if info is not None:
        opt.merged_steps = int(info["steps"])


# -- copies: deepcopy and pickle keep everything but the process group (which neither can copy) ---------------

#: The process group of a copy until the user sets one (None is a real value: the default group).
DROPPED = "dropped by a copy"
_TORCH_KEYS = ("defaults", "state", "param_groups")


def copy_state(opt, state: dict) -> dict:
    """torch's Optimizer state (defaults, state, param_groups) plus every other attribute of `opt` (the plan, the
    merge and its step count, the residuals, ...) but its process group, which a copy must be given again."""
    extra = {k: v for k, v in opt.__dict__.items() if k not in _TORCH_KEYS and not k.startswith("_optimizer")}
    extra = {k: v for k, v in extra.items() if k not in ("process_group", "_outer_bounds")}
    return {**state, "sharded_copy": extra}


def restore_copy(opt, state: dict, setstate) -> None:
    """The other half of `copy_state` (torch's load_state_dict calls it with state and param_groups only: then the
    optimizer keeps its own attributes)."""
    state = dict(state)
    extra = state.pop("sharded_copy", None)
    setstate(state)
    if extra is not None:
        opt.__dict__.update(extra)
        opt.process_group = DROPPED
