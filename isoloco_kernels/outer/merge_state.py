"""The "merge" entry of the MergeLoCo and ShardedIsoLoCo state dicts: which merge wrote a checkpoint, with which
options, after how many merged steps (DARE offsets its seed by it), so a resumed run continues bit for bit and a
checkpoint of another merge loads with a warning naming both."""

from __future__ import annotations

import numbers
import warnings
from typing import Optional

from .sgd_state import refuse_foreign_state

__all__ = ["check_merge_entry", "merge_entry"]


def merge_entry(merge: str, options: dict, steps: int) -> dict:
    """The "merge" entry of a MergeLoCo / ShardedIsoLoCo state dict: which merge wrote it, with which
    options, after how many merged steps (DARE offsets its seed by it)."""
    return {"merge": merge, "options": dict(options), "steps": int(steps)}


def check_merge_entry(opt, state_dict: dict, where: str) -> Optional[dict]:
    """The state dict's "merge" entry, checked (None when it has none: an SGD / IsoLoCo checkpoint); a
    checkpoint written by another merge or other options loads with a warning naming both, as a change
    of `iso` does. Raises ValueError on a malformed entry (before anything loads)."""
    refuse_foreign_state(state_dict, where)  # another optimizer's dict is refused before any warning about it
    info = state_dict.get("merge") if isinstance(state_dict, dict) else None
    if info is None:
        if opt.merge == "dare":
            warnings.warn(
                f"{where}: the state dict has no 'merge' entry (it was not written by MergeLoCo or "
                f"ShardedIsoLoCo(merge=...)): DARE's drops continue from this optimizer's step count "
                f"{opt.merged_steps}, not the checkpoint's",
                UserWarning,
                stacklevel=3,
            )
        return None
    steps = info.get("steps") if isinstance(info, dict) else None
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("merge"), str)
        or not isinstance(info.get("options"), dict)
        or isinstance(steps, bool)
        or not isinstance(steps, numbers.Integral)
        or steps < 0
    ):
        raise ValueError(
            f"{where}: the 'merge' entry must be {{'merge': str, 'options': dict, 'steps': int >= 0}}, got {info!r}"
        )
    if not _same_merge(info["merge"], info["options"], opt.merge, opt.merge_options):
        warnings.warn(
            f"{where}: the checkpoint was written by merge={info['merge']!r} with options {info['options']}; "
            f"this optimizer continues as merge={opt.merge!r} with options {opt.merge_options} (the momentum "
            "and the step count load as saved)",
            UserWarning,
            stacklevel=3,
        )
    return info


def _same_merge(a: str, a_opts: dict, b: str, b_opts: dict) -> bool:
    """The same merge with the same options once each side's defaults are filled in (DARE's seed=0 written out
    is its default); options that do not resolve count as different."""
    from ..merges.options import resolve_options

    if a != b:
        return False
    try:
        return resolve_options(a, dict(a_opts)) == resolve_options(b, dict(b_opts))
    except (TypeError, ValueError):
        return False
