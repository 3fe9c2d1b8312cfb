"""v3's tuning rule, which every question after it uses: a cell is one regime (K, H, rounds, vocabulary, init and
the v3 settings: batch, sequence length, inner optimizer and lr, model); in a cell each method has a grid of outer
(lr, μ) configs, and its best config is the one with the lowest mean *selection* loss over the seeds every config
of that method has (seed 0 at least, by the plans' order); its *test* losses are what the tables report. A best lr
on the edge of its grid (at its μ) is marked "edge": the optimum may lie beyond it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from study.common.records import plain
from study.common.stats import mean_of

CELL_KEYS = ("workers", "inner_steps", "rounds", "vocab", "init")
SETTING_KEYS = ("batch", "seq_len", "inner", "inner_lr", "model")
# v1/v2's regime; every other cell moves one knob away from it (the question it answers)
BASE = {"workers": 4, "inner_steps": 30, "vocab": 256, "init": "gpt2", "batch": 4, "seq_len": 64,
        "inner": "adamw", "inner_lr": 3e-3, "model": "tiny"}  # fmt: skip


def record_cell(r: dict) -> tuple:
    return tuple(r.get(k) for k in CELL_KEYS) + tuple(r["v3"].get(k) for k in SETTING_KEYS)


def cell_label(cell: tuple) -> str:
    K, H, R, vocab, init, batch, seq, inner, inner_lr, model = cell
    parts = [f"K {K}", f"H {H}", f"R {R}", f"batch {batch}×{seq}", f"{inner} {inner_lr:g}"]
    if vocab != 256:
        parts.append(f"BPE {vocab}")
    if model != "tiny":
        parts.append(model)
    if init != "gpt2":
        parts.append(f"init {init}")
    return ", ".join(parts)


def short_label(cell: dict) -> str:
    """What a cell moves away from BASE, in a few words ("v1/v2 cell" for BASE itself)."""
    words = {
        "workers": f"K {cell['workers']}",
        "inner_steps": f"H {cell['inner_steps']}",
        "batch": f"batch {cell['batch']}×{cell['seq_len']}",
        "seq_len": f"batch {cell['batch']}×{cell['seq_len']}",
        "inner_lr": f"AdamW lr {cell['inner_lr']:g}",
        "inner": cell["inner"].capitalize() + " inner",
        "model": f"model {cell['model']}",
        "init": f"init {cell['init']}",
        "vocab": f"BPE {cell['vocab']}",
    }
    moved = dict.fromkeys(words[k] for k, v in BASE.items() if cell.get(k) != v)  # ordered, no repeats
    return ", ".join(moved) or "v1/v2 cell"


def grids(recs: list[dict]) -> dict:
    """cell -> method -> (outer lr, μ) -> seed -> record (v3 records only, at a constant outer lr and μ and an
    uncompressed exchange: runs with an outer schedule (study v6 part B) or compression (study/compression/) are not
    grid points; a repeated run keeps the first)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in recs:
        if r.get("study") != "v3" or not plain(r):
            continue
        cfg = (r.get("outer_lr"), r.get("outer_momentum"))
        out[record_cell(r)][r["mode"]][cfg].setdefault(r["seed"], r)
    return out


def best_config(grid: dict) -> dict | None:
    """The config with the lowest mean selection loss over the seeds every config has (a diverged run
    counts as +inf). None for an empty grid."""
    if not grid:
        return None
    common = set.intersection(*(set(s) for s in grid.values()))
    if not common:
        return None
    inf = float("inf")
    score = {
        c: statistics.fmean(inf if runs[s]["final_loss"] is None else runs[s]["final_loss"] for s in common)
        for c, runs in grid.items()
    }
    cfg = min(score, key=score.get)
    lrs = sorted(lr for lr, mu in grid if mu == cfg[1] and lr is not None)
    edge = cfg[0] is not None and cfg[0] in (lrs[0], lrs[-1])  # a lone lr at its μ is an edge too
    runs = grid[cfg]
    return {
        "lr": cfg[0],
        "momentum": cfg[1],
        "edge": edge,
        "ranked_on_seeds": sorted(common),
        "selection": {s: runs[s]["final_loss"] for s in sorted(runs)},
        "test": {s: runs[s]["final_test_loss"] for s in sorted(runs)},
        "grid": {
            f"{lr}@{mu}": {
                "seeds": sorted(g),
                "selection": mean_of(g[s]["final_loss"] for s in g),
                "test": mean_of(g[s]["final_test_loss"] for s in g),
            }
            for (lr, mu), g in sorted(grid.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0] or 0))
        },
    }


def best_jobs(recs: list[dict], cell: tuple, modes, default_momentum: dict) -> list[tuple]:
    """(mode, outer lr, μ) of each mode's best config so far in `cell` (μ None where it is the mode's
    default, as the runner names it), for the modes that have a grid there."""
    grid = grids(recs).get(cell, {})
    out = []
    for mode in modes:
        b = best_config(grid.get(mode, {}))
        if b is not None:
            mu = None if b["momentum"] == default_momentum.get(mode) else b["momentum"]
            out.append((mode, b["lr"], mu))
    return out


def cell_picks(recs: list[dict], cell: tuple) -> dict:
    """method -> its best config in `cell` (best_config) and that config's records by seed, for DDP, DiLoCo and
    IsoLoCo."""
    grid = grids(recs).get(cell, {})
    out = {}
    for mode in ("ddp", "diloco", "isoloco"):
        best = best_config(grid.get(mode, {}))
        if best is not None:
            out[mode] = {**best, "runs": grid[mode][(best["lr"], best["momentum"])]}
    return out
