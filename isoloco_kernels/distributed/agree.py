"""Agree before writing: the one protocol every collective entry point uses.

Before a collective operation writes anything, every rank contributes (failed?, fingerprint) to
one small all-gather: `failed` says whether this rank's checks (or anything it computed so far)
raised, `fingerprint` hashes what the ranks must pass alike (shapes, dtypes, the plan). If any
rank failed or the fingerprints differ, every rank raises DistributedStepError naming the ranks
and their errors, and nothing was written on any rank. A rank that fails must still reach the
agreement (so callers catch its exception first); a rank that dies is caught by the process
group's timeout.

`agree` runs over a process group (one all-gather); `agree_on_mesh` over a DeviceMesh of any
number of dimensions (one all-reduce per dimension), for the DTensor step.
"""
from __future__ import annotations

import hashlib
from typing import Optional

import torch
import torch.distributed as dist

# torch 2.14 renamed the single-tensor collectives; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)

__all__ = ["DistributedStepError", "agree", "agree_on_mesh", "comm_device", "describe", "error_text", "fingerprint",
           "group_info"]


class DistributedStepError(RuntimeError):
    """A collective outer step failed on at least one rank; no rank changed any tensor."""


def group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def comm_device(group, device) -> torch.device:
    """Where small control tensors live: the CPU for gloo, else the data's device."""
    if dist.get_backend(group) == "gloo" or device is None:
        return torch.device("cpu")
    return torch.device(device)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def fingerprint(obj) -> int:
    """A 63-bit hash of a value's repr (shapes, dtype names, …): equal on ranks passing alike."""
    return int.from_bytes(hashlib.sha256(repr(obj).encode()).digest()[:8], "little") >> 1


def describe(tensors) -> tuple:
    """What the ranks must agree on for a list of tensors: shape and dtype of each, in order."""
    return tuple((tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in tensors)


def agree(error: Optional[str], group, device, what: str, fp: Optional[int] = None,
          mismatch: str = "the ranks passed different tensors") -> None:
    """Every rank learns whether any rank failed (and whether fingerprints match); all raise if so.

    One all-gather of (failed, fingerprint) per rank; the error texts are gathered only when
    something failed. fp=None: no fingerprint comparison.
    """
    _, world = group_info(group)
    mine = torch.tensor([int(error is not None), fp or 0], dtype=torch.int64, device=device)
    every = torch.empty(2 * world, dtype=torch.int64, device=device)
    _all_gather_single(every, mine, group=group)
    flags, prints = every.view(world, 2).cpu().unbind(1)
    failed = flags.nonzero().view(-1).tolist()
    if not failed and (fp is None or prints.unique().numel() == 1):
        return
    texts: list = [None] * world
    dist.all_gather_object(texts, error, group=group)
    if failed:
        head = f"{what} failed on {len(failed)} of {world} ranks"
        detail = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
    else:
        head = f"{what}: {mismatch}"
        detail = (
            "fingerprints " + ", ".join(f"rank {r}: {p:#x}" for r, p in enumerate(prints.tolist()))
            + "; every rank must pass the same tensor shapes and dtypes in the same order"
        )
    raise DistributedStepError(f"{head}, nothing was changed on any rank: {detail}")


def agree_on_mesh(error: Optional[str], mesh, what: str, fp: int = 0,
                  mismatch: str = "the ranks hold different sets of grads (shapes, placements or dtypes)") -> None:
    """`agree` over every rank of a DeviceMesh: one all-reduce per mesh dimension of a [2·size]
    int64 vector holding this rank's failure flag and fingerprint at its own slot (the sum over
    the dimensions fills every slot). Error texts travel only when something failed."""
    size = mesh.size()
    ranks = mesh.mesh.flatten().tolist()
    me = ranks.index(dist.get_rank())
    v = torch.zeros(2 * size, dtype=torch.int64)
    v[me], v[size + me] = int(error is not None), fp
    for d in range(mesh.ndim):
        dist.all_reduce(v, group=mesh.get_group(d))
    flags, prints = v[:size], v[size:]
    failed = flags.nonzero().view(-1).tolist()
    if not failed and prints.unique().numel() == 1:
        return
    texts = {me: error}
    for d in range(mesh.ndim):
        g = mesh.get_group(d)
        got = [None] * dist.get_world_size(g)
        dist.all_gather_object(got, texts, group=g)
        texts = {k: t for part in got for k, t in part.items()}
    if failed:
        head = f"{what} failed on {len(failed)} of {size} ranks"
        detail = "; ".join(f"rank {ranks[i]}: {texts.get(i)}" for i in failed)
    else:
        head = f"{what}: {mismatch}"
        detail = "every rank must set p.grad for the same params"
    raise DistributedStepError(f"{head}, nothing was changed on any rank: {detail}")
