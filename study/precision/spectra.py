"""Study v4's spectra (run_study.py --spectra): the averaged Δ of a run in chosen rounds, and every flatten
measured on it against reference.py (its relative error and its flatness, flattens.error_and_flatness)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def capture_rounds(into: dict, rounds: set):
    """A run_mode capture callback keeping a float32 copy of the averaged Δ of the 2-D parameters in
    these (1-based) rounds: into[round] = {name: Δ}."""

    def capture(r: int, names, mean_delta) -> None:
        if r in rounds:
            into[r] = {n: d.detach().to("cpu", torch.float32).clone() for n, d in zip(names, mean_delta) if d.ndim == 2}

    return capture


def write_spectra(path: Path, key: tuple, captured: dict, methods: list[str], rounds: int) -> None:
    """One line per captured round: per matrix its shape, σ₁/σ_min and σ₁/σ̄, and per method its
    relative Frobenius error against reference.py and its flatness (flattens.error_and_flatness)."""
    from study.precision import flattens

    path.parent.mkdir(parents=True, exist_ok=True)
    for rnd, deltas in sorted(captured.items()):
        mats = {}
        for name, d in deltas.items():
            s = torch.linalg.svdvals(d.to(torch.float64))
            mats[name] = {
                "shape": list(d.shape),
                "cond": float(s[0] / s[-1]) if s[-1] > 0 else None,
                "top_over_mean": float(s[0] / s.mean()) if s.mean() > 0 else None,
                "methods": {m: list(flattens.error_and_flatness(m, d)) for m in methods},
            }
        line = {"key": repr(key), "round": rnd, "rounds": rounds, "matrices": mats}
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
