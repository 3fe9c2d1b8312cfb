"""Saving and loading the averaged pseudo-gradients of chosen rounds (--save-pseudo-gradients DIR).

Layout: DIR/<run>/round_<r>.pt, one file per saved round, <run> the mode (plus the swept value in
a sweep). Each file is a dict

    round   the 1-based round (the Δ the r-th outer step consumed)
    mode    the training mode
    delta   {parameter name: averaged Δ = mean_k(θ − θ_k)}, on the CPU, in the saved dtype
    cond    {name: σ₁/σ_min of the float32 Δ before any down-cast} for the 2-D ones
    config  the run's TrainConfig as a dict

Load with `load_pseudo_gradients(DIR)`; bench/captured.py builds bucket sets from them.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from .divergence import spectrum

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_rounds(spec: str, rounds: int) -> list[int]:
    """'all', 'last', or a comma list of 1-based rounds ('first', 'mid', 'last' allowed)."""
    if spec == "all":
        return list(range(1, rounds + 1))
    names = {"first": 1, "mid": (rounds + 1) // 2, "last": rounds}
    out = set()
    for part in spec.split(","):
        part = part.strip()
        if part in names:
            out.add(names[part])
            continue
        try:
            r = int(part)
        except ValueError:
            raise ValueError(f"--save-rounds takes all, or a comma list of rounds/first/mid/last, got {spec!r}") from None
        if not 1 <= r <= rounds:
            raise ValueError(f"--save-rounds: round {r} is outside 1..{rounds} (the run has {rounds} rounds)")
        out.add(r)
    return sorted(out)


class PseudoGradientWriter:
    """The capture callback of one run: writes the chosen rounds under folder/run."""

    def __init__(self, folder: str | os.PathLike, run: str, rounds: Iterable[int], dtype: str,
                 mode: str, config: dict):
        if dtype not in SAVE_DTYPES:
            raise ValueError(f"save dtype must be one of {sorted(SAVE_DTYPES)}, got {dtype!r}")
        self.dir = Path(folder) / run
        self.rounds = set(rounds)
        self.dtype = SAVE_DTYPES[dtype]
        self.mode, self.config = mode, config
        self.written: list[Path] = []

    def __call__(self, rnd: int, names: Sequence[str], mean_delta: Sequence[torch.Tensor]) -> None:
        if rnd not in self.rounds:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        cond = {n: spectrum(d)["cond"] for n, d in zip(names, mean_delta) if d.ndim == 2}
        blob = {
            "round": rnd, "mode": self.mode, "config": self.config, "cond": cond,
            "delta": {n: d.detach().to("cpu", self.dtype, copy=True) for n, d in zip(names, mean_delta)},
        }
        path = self.dir / f"round_{rnd:03d}.pt"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save(blob, tmp)
        os.replace(tmp, path)
        self.written.append(path)


def load_pseudo_gradients(folder: str | os.PathLike) -> list[dict]:
    """Every saved round under folder (recursively), sorted by run and round; each dict as saved
    plus "run" (its folder relative to `folder`) and "path"."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"pseudo-gradient folder {root} does not exist")
    out = []
    for p in sorted(root.rglob("round_*.pt")):
        blob = torch.load(p, map_location="cpu", weights_only=True)
        blob["run"] = p.parent.relative_to(root).as_posix()
        blob["path"] = str(p)
        out.append(blob)
    return out
