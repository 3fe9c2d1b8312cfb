"""Study v5, part A's mechanism: learning curves and pseudo-gradient spectra of the cells that separate
"tokens", "sequence" and "capacity" (seed 0, each method at its tuned config in that cell).

For each cell and method (DiLoCo, IsoLoCo) one run scores the held-out selection split after every round (the
learning curve, so the gap per round), and in rounds 1, 5 and 10 records of every 2-D averaged Δ:
  eff_rank    exp(entropy of σ_i / Σσ): how many directions carry the update (Roy & Vetterli's effective rank)
  flat        σ̄ / σ₁, the mean singular value over the largest: 1 for a flat spectrum, what Iso-C makes of any Δ
  iso_move    ‖iso(Δ) − Δ·s̄/σ̄_F‖ / ‖Δ‖-scale: how far Iso-C moves Δ (0 when Δ is already flat), as
              1 − ⟨Δ, iso(Δ)⟩ / (‖Δ‖_F ‖iso(Δ)‖_F), one minus the cosine between them
Records go to study/capacity/results/mechanism/v5_mechanism.jsonl (not a run-record folder: the v3 grids do not read
it).

    python study/capacity/v5_mechanism.py           # every cell not yet recorded (~8 CPU-min a 16 × 128 run)
    python study/capacity/v5_mechanism.py --report  # the table docs/study.md shows, and study_v5_mechanism.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "mechanism" / "v5_mechanism.jsonl"
ROUNDS_SEEN = (1, 5, 10)
# cell -> (batch, seq_len, model, DiLoCo (lr, μ), IsoLoCo (lr, μ)): each method's v3/v5 seed-0 pick in the cell
CELLS = {
    "16x128 tiny (no gain)": (16, 128, "tiny", (1.0, 0.5), (3.2, 0.8)),
    "16x128 tiny-wide": (16, 128, "tiny-wide", (0.7, 0.5), (3.2, 0.8)),
    "32x64 tiny": (32, 64, "tiny", (0.7, 0.5), (3.2, 0.8)),
}


def spectrum_stats(d: torch.Tensor) -> dict:
    """r (the short side), eff_rank and iso_move over the directions above reference.py's rank cut,
    flat = s̄ / σ₁ with s̄ over all r singular values (Iso-C's)."""
    from isoloco_kernels.reference import rank_tol

    r = min(d.shape)
    s_all = torch.linalg.svdvals(d.double())
    if s_all.numel() == 0 or float(s_all[0]) == 0:
        return {"r": r, "eff_rank": 0.0, "flat": 0.0, "iso_move": 0.0}
    s = s_all[s_all > rank_tol(*d.shape, d.dtype) * s_all[0]]
    p = s / s.sum()
    iso_cos = float(s.sum() / (s.norm() * math.sqrt(s.numel())))  # ⟨Δ, s̄·UVᵀ⟩ / (‖Δ‖ ‖s̄·UVᵀ‖)
    return {
        "r": r,
        "eff_rank": float(torch.exp(-(p * p.log()).sum())),
        "flat": float(s_all.mean() / s_all[0]),
        "iso_move": 1.0 - iso_cos,
    }


def run(cell: str, mode: str) -> dict:
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    batch, seq, model, dil, iso = CELLS[cell]
    lr, mu = dil if mode == "diloco" else iso
    cfg = TrainConfig(
        workers=4,
        inner_steps=30,
        rounds=10,
        seed=0,
        init="gpt2",
        vocab=256,
        eval_windows=1024,
        batch=batch,
        seq_len=seq,
        inner_lr=3e-3,
        inner="adamw",
        model=model,
        eval_every=1,
        divergence=False,
        outer_lr={mode: lr},
        outer_momentum={mode: mu},
    )
    seen: dict = {}

    def capture(r, names, deltas):
        if r in ROUNDS_SEEN:
            seen[r] = {n: spectrum_stats(d) for n, d in zip(names, deltas) if d.ndim == 2}

    t0 = time.process_time()
    res = run_mode(mode, Setup(cfg, load_corpus()), capture=capture)
    return {
        "cell": cell,
        "mode": mode,
        "outer_lr": lr,
        "outer_momentum": mu,
        "heldout_loss": res["heldout_loss"],
        "tokens": res["tokens"],
        "spectra": {str(r): v for r, v in sorted(seen.items())},
        "cpu_s": time.process_time() - t0,
    }


def done() -> set:
    if not OUT.exists():
        return set()
    return {(r["cell"], r["mode"]) for r in map(json.loads, OUT.read_text().splitlines()) if r}


def report() -> str:
    recs = {(r["cell"], r["mode"]): r for r in map(json.loads, OUT.read_text().splitlines())}
    lines = [
        "| cell | IsoLoCo − DiLoCo after rounds 1 / 5 / 10 (selection split, seed 0) | DiLoCo's Δ: effective rank / r, "
        "rounds 1 → 10 | σ̄/σ₁, rounds 1 → 10 | 1 − cos(Δ, iso(Δ)), rounds 1 → 10 |",
        "|---|---|---|---|---|",
    ]
    for cell in CELLS:
        d, i = recs.get((cell, "diloco")), recs.get((cell, "isoloco"))
        if d is None or i is None:
            continue
        gap = [i["heldout_loss"][k] - d["heldout_loss"][k] for k in (1, 5, 10)]

        def mean_stat(rec, r, key):  # the mean over the model's 2-D matrices (eff_rank as a share of r)
            vals = rec["spectra"][str(r)].values()
            return sum(v[key] / (v["r"] if key == "eff_rank" else 1) for v in vals) / len(vals)

        er = " → ".join(f"{mean_stat(d, r, 'eff_rank'):.2f}" for r in (1, 10))
        fl = " → ".join(f"{mean_stat(d, r, 'flat'):.3f}" for r in (1, 10))
        mv = " → ".join(f"{mean_stat(d, r, 'iso_move'):.3f}" for r in (1, 10))
        lines.append(f"| {cell} | {gap[0]:+.3f} / {gap[1]:+.3f} / {gap[2]:+.3f} | {er} | {fl} | {mv} |")
    return "\n".join(lines)


def plot(path) -> None:
    """Per cell, IsoLoCo − DiLoCo on the selection split after every round (seed 0), and DiLoCo's Δ
    effective rank / r in the rounds recorded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = {(r["cell"], r["mode"]): r for r in map(json.loads, OUT.read_text().splitlines())}
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for cell in CELLS:
        d, i = recs.get((cell, "diloco")), recs.get((cell, "isoloco"))
        if d is None or i is None:
            continue
        gap = [b - a for a, b in zip(d["heldout_loss"][1:], i["heldout_loss"][1:])]
        a1.plot(range(1, len(gap) + 1), gap, marker="o", ms=3, label=cell)
        rounds = sorted(int(r) for r in d["spectra"])
        er = [statistics.fmean(v["eff_rank"] / v["r"] for v in d["spectra"][str(r)].values()) for r in rounds]
        a2.plot(rounds, er, marker="s", ms=3, label=cell)
    a1.axhline(0, color="k", lw=0.8)
    a1.set_xlabel("round")
    a1.set_ylabel("IsoLoCo − DiLoCo (selection split)")
    a2.set_xlabel("round")
    a2.set_ylabel("DiLoCo's Δ: effective rank / r (mean)")
    a1.legend(fontsize=7)
    fig.suptitle("Study v5 part A: learning-curve gap and pseudo-gradient spectra (seed 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    if a.report:
        print(report())
        plot(HERE / "study_v5_mechanism.png")
        return 0
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    for cell in CELLS:
        for mode in ("diloco", "isoloco"):
            if (cell, mode) in done() or (HERE.parent / "STOP").exists():  # the runner's STOP (run_study.py)
                continue
            rec = run(cell, mode)
            with OUT.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"{cell} {mode}: final {rec['heldout_loss'][-1]:.4f} ({rec['cpu_s']:.0f} CPU-s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
