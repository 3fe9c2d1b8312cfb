"""`IsoLoCo.step` over a process group whose ranks hold the same, already averaged grads
(`IsoLoCo(process_group=...)`: torchft, OpenDiLoCo), beside dtensor.py's step for DTensor params.

Every rank checks its grads and fingerprints their bits (`bits.bit_fingerprints`); the ranks agree
(failures, hyper-parameters, the grads' shapes, and the grads' bits: grads that are not
bit-identical on every rank are refused, by name, as not yet averaged); after a `load_state_dict`
on any rank they agree once on the bits of every momentum buffer (a replicated optimizer's state
must be replicated); `sharded_iso_merge_` splits the flatten over the group inside the same
agreement, and the ranks agree once more before any rank writes. Everything between two
collectives runs under the step's `Agreement.attempt`: a failure on one rank raises
DistributedStepError on every rank with nothing changed.
"""

from __future__ import annotations

from typing import Optional

import torch

from .agree import Agreement, DistributedStepError, group_info
from .bits import bit_fingerprints

__all__ = ["AVERAGED", "check_averaged", "grad_bits", "momentum_bits", "step_"]

#: What the refusal of grads that differ between ranks adds: what the step expects instead.
AVERAGED = (
    "IsoLoCo(process_group=...) expects grads ALREADY AVERAGED, bit-identical on every rank (what an "
    "all-reduce gives every rank, as torchft and OpenDiLoCo write them). Average them first "
    "(isoloco_kernels.average_), or hand each rank's own pseudo-gradient to ShardedIsoLoCo, which averages "
    "them itself"
)
_GRAD_BITS = "grad bits"


def step_(opt, group, failed: Optional[BaseException] = None) -> None:
    """One IsoLoCo outer step over `group` (IsoLoCo.step calls this). All-or-nothing.

    failed: what the closure raised on this rank; it reaches every rank as a DistributedStepError."""
    ag = Agreement("IsoLoCo.step", group)
    entries = ag.attempt(_checked, opt, failed) or []
    settings = ag.attempt(_step_settings, opt, entries)
    loaded = _settle_averaged(ag, settings, ask=getattr(opt, "_state_loaded", False))
    if loaded:  # once after a load on any rank: the momentum must be replicated too
        _settle_replicated(ag, ag.attempt(momentum_bits, opt))
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


def _step_settings(opt, entries) -> dict[str, str]:
    """The step's settings (`IsoLoCo._settings`) and each grad's bits (`grad_bits`)."""
    return {**opt._settings([e.g for e in entries]), **grad_bits([e.g for e in entries], [e.name for e in entries])}


def grad_bits(grads: list, names: list) -> dict[str, str]:
    """name → the bit fingerprint of each grad, as the ranks compare it."""
    return {f"{n} {_GRAD_BITS}": f"{h:#018x}" for n, h in zip(names, bit_fingerprints([g.detach() for g in grads]))}


def _settle_averaged(ag: Agreement, settings, ask: bool = False) -> bool:
    """`ag.settle(settings=...)`; a refusal naming grads whose bits differ says what was expected."""
    try:
        return ag.settle(settings=settings, ask=ask)
    except DistributedStepError as e:
        if f" {_GRAD_BITS}: " in str(e):
            raise DistributedStepError(
                f"{e}. The grad differs between ranks: {AVERAGED}; nothing was changed"
            ) from None
        raise


def _settle_replicated(ag: Agreement, settings) -> None:
    """The agreement on the momentum buffers' bits; a refusal says what a replicated optimizer needs."""
    try:
        ag.settle(settings=settings)
    except DistributedStepError as e:
        raise DistributedStepError(
            f"{e}. IsoLoCo(process_group=...) is replicated: every rank must hold the same momentum (load the "
            "same state dict on every rank; ShardedIsoLoCo's per-rank state dicts each hold only that rank's "
            "buffers and load only into ShardedIsoLoCo); nothing was changed"
        ) from None


def check_averaged(grads: list, names: list, group) -> None:
    """Refuse grads that are not bit-identical on every rank of `group`, on every rank alike,
    naming each grad that differs and the ranks holding each version (one agreement)."""
    _, world = group_info(group)
    if world == 1 or not grads:
        return
    _settle_averaged(Agreement("IsoLoCo.step over a process group", group), grad_bits(grads, names))


def momentum_bits(opt) -> dict[str, str]:
    """name → the bit fingerprint of each param's momentum buffer ("none" where it has none)."""
    named = [
        (f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) momentum_buffer", p)
        for gi, g in enumerate(opt.param_groups)
        for pi, p in enumerate(g["params"])
    ]
    bufs = [opt.state[p].get("momentum_buffer") if p in opt.state else None for _, p in named]
    held = [i for i, b in enumerate(bufs) if isinstance(b, torch.Tensor)]
    prints = dict(zip(held, bit_fingerprints([bufs[i].detach() for i in held])))
    return {n: (f"{prints[i]:#018x}" if i in prints else "none") for i, (n, _) in enumerate(named)}
