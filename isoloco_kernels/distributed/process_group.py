"""`IsoLoCo.step` over a process group whose ranks hold the same, already averaged grads
(`IsoLoCo(process_group=...)`: torchft, OpenDiLoCo), beside dtensor.py's step for DTensor params.

Every rank checks its grads, the ranks agree (failures, hyper-parameters, the grads' shapes), the
grads are checked to be equal on every rank (`check_averaged`: per-grad scaled norm and sum, one small
all-gather; grads not yet averaged belong to ShardedIsoLoCo), `sharded_iso_merge_` splits the flatten over the group (agreeing around it), and the ranks agree
once more before any rank writes: a failure on one rank raises DistributedStepError on every rank
with nothing changed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .agree import Agreement, DistributedStepError, all_gather_single, comm_device, group_info

__all__ = ["check_averaged", "step_"]

#: How far a grad's norm or sum may differ between ranks (relative) and still count as averaged:
#: all-reduce results are equal on every rank, or differ in their last bits.
AVERAGED_RTOL = 1e-4


def step_(opt, group, failed: Optional[BaseException] = None) -> None:
    """One IsoLoCo outer step over `group` (IsoLoCo.step calls this). All-or-nothing.

    failed: what the closure raised on this rank; it reaches every rank as a DistributedStepError."""
    ag = Agreement("IsoLoCo.step", group)
    entries = ag.attempt(_checked, opt, failed) or []
    ag.settle(settings=ag.attempt(opt._settings, [e.g for e in entries]))
    if not entries:
        return
    check_averaged([e.g for e in entries], [e.name for e in entries], group)
    iso = opt._iso_updates(entries)  # sharded_iso_merge_ agrees around the flatten itself
    apply = ag.attempt(opt._prepare_nesterov, entries, iso)
    ag.settle()
    apply()


def _checked(opt, failed):
    if failed is not None:
        raise failed
    return opt._collect_grads()


def check_averaged(grads: list, names: list, group) -> None:
    """Refuse grads that differ between the ranks of `group`, on every rank alike (each rank sees
    every rank's numbers): IsoLoCo(process_group=...) expects grads already averaged. Compares each
    grad's norm and sum (`_stats`: float64, scaled by a power of two near its largest entry so that
    neither overflows; one all-gather of 3 numbers per grad); equal tensors pass, tensors that
    differ in their last bits too, and different pseudo-gradients of different workers do not in
    practice."""
    _, world = group_info(group)
    if world == 1 or not grads:
        return
    device = comm_device(group)
    mine = torch.empty(3 * len(grads), dtype=torch.float64, device=device)  # made where comm_device says
    mine.view(len(grads), 3).copy_(torch.stack([_stats(g).to(device) for g in grads]))
    every = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)
    all_gather_single(every, mine, group=group)
    rows = every.view(world, len(grads), 3).cpu().tolist()
    for i, name in enumerate(names):
        exps = [int(rows[r][i][0]) for r in range(world)]
        top = max(exps)
        # every rank's sum and norm at the common scale 2^top (exact rescaling by powers of two)
        sums = [math.ldexp(rows[r][i][1], exps[r] - top) for r in range(world)]
        norms = [math.sqrt(math.ldexp(rows[r][i][2], 2 * (exps[r] - top))) for r in range(world)]
        scale = max(norms) * math.sqrt(max(grads[i].numel(), 1))
        if max(norms) - min(norms) > AVERAGED_RTOL * max(norms) or max(sums) - min(sums) > AVERAGED_RTOL * scale:
            by_rank = ", ".join(f"rank {r}: norm {norms[r]:.6g}·2^{top}" for r in range(world))
            raise DistributedStepError(
                f"IsoLoCo.step over a process group: {name}: the grad differs between ranks ({by_rank}); "
                "IsoLoCo(process_group=...) expects grads ALREADY AVERAGED, equal on every rank (as torchft and "
                "OpenDiLoCo write them). Average them first (isoloco_kernels.average_), or hand each rank's own "
                "pseudo-gradient to ShardedIsoLoCo, which averages them itself; nothing was changed"
            )


#: Elements per float64 slice in `_stats` (128 MiB): never a float64 copy of a whole grad.
_STATS_CHUNK = 1 << 24


def _stats(g: torch.Tensor) -> torch.Tensor:
    """[e, Σ x·2^-e, Σ (x·2^-e)²] of a finite grad as float64, 2^e ≥ its largest magnitude (a
    power of two, so the scaling is exact and neither sum overflows), in float64 slices."""
    g = g.detach().reshape(-1)
    one = torch.ones((), dtype=torch.float64, device=g.device)
    amax = g.abs().max().to(torch.float64) if g.numel() else 0 * one
    _, e = torch.frexp(amax)
    inv = torch.ldexp(one, -e)
    s1 = torch.zeros((), dtype=torch.float64, device=g.device)
    s2 = torch.zeros((), dtype=torch.float64, device=g.device)
    for part in g.split(_STATS_CHUNK):
        x = part.to(torch.float64) * inv  # never in place: a float64 part is the grad itself
        s1 += x.sum()
        s2 += x.square().sum()
    return torch.stack([e.to(torch.float64), s1, s2])
