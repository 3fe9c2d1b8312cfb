"""`IsoLoCo.step` over a process group whose ranks hold the same, already averaged grads
(`IsoLoCo(process_group=...)`: torchft, OpenDiLoCo), beside dtensor.py's step for DTensor params.

Every rank checks its grads and fingerprints their bits (`bits.bit_fingerprints`); the ranks agree
(failures, hyper-parameters, the grads' shapes, and the grads' bits: grads that are not
bit-identical on every rank are refused, naming the first that differs, as not yet averaged); after a `load_state_dict`
on any rank they agree once on the bits of every momentum buffer (a replicated optimizer's state
must be replicated); `sharded_iso_merge_` splits the flatten over the group inside the same
agreement, and the ranks agree once more before any rank writes. Everything between two
collectives runs under the step's `Agreement.attempt`: a failure on one rank raises
DistributedStepError on every rank with nothing changed.
"""

from __future__ import annotations

from typing import Optional

import torch

from .agree import Agreement, group_info
from .bits import bit_fingerprints

__all__ = ["AVERAGED", "REPLICATED", "check_averaged", "grad_bits", "momentum_bits", "step_"]

#: What the refusal of grads that differ between ranks adds: what the step expects instead.
AVERAGED = (
    "IsoLoCo(process_group=...) expects grads ALREADY AVERAGED, bit-identical on every rank (what an "
    "all-reduce gives every rank, as torchft and OpenDiLoCo write them). Average them first "
    "(isoloco_kernels.average_), or hand each rank's own pseudo-gradient to ShardedIsoLoCo, which averages "
    "them itself"
)
#: What the refusal of momentum buffers that differ between ranks adds.
REPLICATED = (
    "IsoLoCo(process_group=...) is replicated: every rank must hold the same momentum. Load the same state dict "
    "on every rank; ShardedIsoLoCo's per-rank state dicts each hold only that rank's buffers and load only into "
    "ShardedIsoLoCo"
)


def step_(opt, group, failed: Optional[BaseException] = None) -> None:
    """One IsoLoCo outer step over `group` (IsoLoCo.step calls this). All-or-nothing.

    failed: what the closure raised on this rank; it reaches every rank as a DistributedStepError."""
    ag = Agreement("IsoLoCo.step", group)
    entries = ag.attempt(_checked, opt, failed) or []
    settings = ag.attempt(opt._settings, [e.g for e in entries])
    grads = ag.attempt(grad_bits, [e.g for e in entries], [e.name for e in entries])
    loaded = ag.settle(settings=settings, replicas=grads, ask=getattr(opt, "_state_loaded", False))
    if loaded:  # once after a load on any rank: the momentum must be replicated too
        ag.settle(replicas=ag.attempt(momentum_bits, opt))
        opt._state_loaded = False
    if not entries:
        return
    iso = opt._iso_updates(entries, ag)  # every local part under ag.attempt; sharded_iso_merge_ joins ag
    apply = ag.attempt(opt._prepare_nesterov, entries, iso)
    ag.settle()
    apply()


def _checked(opt, failed):
    if failed is not None:
        raise failed
    return opt._collect_grads()


def grad_bits(grads: list, names: list) -> tuple:
    """The grads as the ranks compare them (`agree`'s replicas): a 64-bit fingerprint of each one's exact bits
    (`bits.bit_fingerprints`), named; refused with what the step expects (`AVERAGED`) when they differ."""
    return "grads", list(names), bit_fingerprints([g.detach() for g in grads]), AVERAGED


def check_averaged(grads: list, names: list, group) -> None:
    """Refuse grads that are not bit-identical on every rank of `group`, on every rank alike,
    naming the first grad that differs and the ranks holding each version (one agreement)."""
    _, world = group_info(group)
    if world == 1 or not grads:
        return
    Agreement("IsoLoCo.step over a process group", group).settle(replicas=grad_bits(grads, names))


def momentum_bits(opt) -> tuple:
    """The momentum buffers as the ranks compare them (`agree`'s replicas): each param's, by the bit
    fingerprint of its buffer (0 where it has none), named; refused with `REPLICATED` when they differ."""
    named = [
        (f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) momentum_buffer", p)
        for gi, g in enumerate(opt.param_groups)
        for pi, p in enumerate(g["params"])
    ]
    bufs = [opt.state[p].get("momentum_buffer") if p in opt.state else None for _, p in named]
    held = [i for i, b in enumerate(bufs) if isinstance(b, torch.Tensor)]
    prints = dict(zip(held, bit_fingerprints([bufs[i].detach() for i in held])))
    return "momentum buffers", [n for n, _ in named], [prints.get(i, 0) for i in range(len(named))], REPLICATED
