"""`IsoLoCo.step` over a process group whose ranks hold the same, already averaged grads
(`IsoLoCo(process_group=...)`: torchft, OpenDiLoCo), beside dtensor.py's step for DTensor params.

Every rank checks its grads, the ranks agree (failures, hyper-parameters, the grads' shapes),
`sharded_iso_merge_` splits the flatten over the group (agreeing around it), and the ranks agree
once more before any rank writes: a failure on one rank raises DistributedStepError on every rank
with nothing changed.
"""

from __future__ import annotations

from typing import Optional

from .agree import Agreement

__all__ = ["step_"]


def step_(opt, group, failed: Optional[BaseException] = None) -> None:
    """One IsoLoCo outer step over `group` (IsoLoCo.step calls this). All-or-nothing.

    failed: what the closure raised on this rank; it reaches every rank as a DistributedStepError."""
    ag = Agreement("IsoLoCo.step", group)
    entries = ag.attempt(_checked, opt, failed) or []
    ag.settle(settings=ag.attempt(opt._settings, [e.g for e in entries]))
    if not entries:
        return
    iso = opt._iso_updates(entries)  # sharded_iso_merge_ agrees around the flatten itself
    apply = ag.attempt(opt._prepare_nesterov, entries, iso)
    ag.settle()
    apply()


def _checked(opt, failed):
    if failed is not None:
        raise failed
    return opt._collect_grads()
