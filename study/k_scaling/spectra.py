"""Study v7, part C: why the gain grows with K — the spectrum of the workers' mean Δ against K.

Averaging K pseudo-gradients shrinks the merged step (‖mean Δ‖ / mean ‖Δ_k‖ → 1/√K for orthogonal Δ_k) and, the
field says, collapses its spectrum onto a few directions. Iso-C hands the Nesterov step every direction at σ̄; the
norm-preserving merge (`norm_mean`) hands it the mean's own spectrum at the workers' mean norm. This diagnostic runs
v3's 10-round base cell (H 30, 4 × 64 bytes, AdamW inner, seed 0) at K 4, 8, 16 and 32, each method at its v3 pick
there (K 8: the 16 × 64 cell's), and records every round, for the mean Δ of each 2-D parameter (σ from a float64 SVD, r = min(m, n)):

    erank_frac     exp(entropy of σ² / Σσ²) / r: the effective rank as a fraction of the full rank
    top_over_mean  σ₁ / σ̄
    top1_energy    Σσ² over the top ⌈r / 100⌉ directions / Σσ²: the energy in the top 1 % of directions
    iso_norm       ‖Iso-C(mean Δ)‖_F / ‖mean Δ‖_F = σ̄ √r / √Σσ² (≤ 1: Iso-C never lengthens the step in Frobenius
                   norm; it lengthens every direction but the top few)

(each the median over the model's 2-D parameters), and the whole model's shrinkage ‖mean Δ‖ / mean_k ‖Δ_k‖ (the
loop's divergence meter). What each merge hands the Nesterov step follows from these: the mean its own spectrum;
norm_mean the same spectrum scaled by 1 / shrinkage; Iso-C a flat one (erank_frac 1, σ₁/σ̄ 1, top1_energy ⌈r/100⌉/r).

    nice python -m study.k_scaling.spectra run        # ≈ 15 CPU-minutes; records results/spectra/v7_spectra.jsonl
    python study/summarize.py                         # summary_v7_spectra.json and the plot beside this file
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from study.common.stats import markdown_table

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "spectra" / "v7_spectra.jsonl"
KS = (4, 8, 16, 32)
ROUNDS = 10
#: each method's v3 pick in the 10-round base cell at that K (cells/summary_v3.json): K -> mode -> (lr, μ)
PICKS_FROM = HERE.parent / "cells" / "summary_v3.json"


def spectral_stats(d: torch.Tensor) -> dict:
    """The stats above for one matrix (None where the matrix is zero)."""
    s = torch.linalg.svdvals(d.detach().double())
    e = s.pow(2)
    total = float(e.sum())
    if total == 0.0:
        return {"erank_frac": None, "top_over_mean": None, "top1_energy": None, "iso_norm": None}
    r = s.numel()
    p = e / total
    p = p[p > 0]
    top = math.ceil(r / 100)
    return {
        "erank_frac": math.exp(float(-(p * p.log()).sum())) / r,
        "top_over_mean": float(s[0] / s.mean()),
        "top1_energy": float(e[:top].sum()) / total,
        "iso_norm": float(s.mean()) * math.sqrt(r) / math.sqrt(total),
    }


def medians(stats: list[dict]) -> dict:
    return {k: statistics.median(x[k] for x in stats if x[k] is not None) for k in stats[0]} if stats else {}


def picks(K: int) -> dict:
    """mode -> (lr, μ) of DiLoCo's and IsoLoCo's v3 picks in the 10-round base cell at K (v3 ran K 8 only at larger
    batches: its 16 × 64 cell's picks)."""
    s = json.loads(PICKS_FROM.read_text())
    batch = "16×64" if K == 8 else "4×64"
    cell = s[f"K {K}, H 30, R {ROUNDS}, batch {batch}, adamw 0.003"]
    return {m: (cell[m]["lr"], cell[m]["momentum"]) for m in ("diloco", "isoloco")}


def run(K: int, mode: str, lr: float, mu: float) -> dict:
    from isoloco_kernels.train import Setup, TrainConfig, load_corpus, run_mode

    rounds: dict = {}

    def capture(r: int, names, mean_delta) -> None:
        rounds[r] = medians([spectral_stats(d) for d in mean_delta if d.ndim == 2])

    cfg = TrainConfig(
        workers=K,
        inner_steps=30,
        rounds=ROUNDS,
        seed=0,
        eval_windows=64,
        eval_every=ROUNDS,
        divergence=True,
        outer_lr={mode: lr},
        outer_momentum={mode: mu},
    )
    out = run_mode(mode, Setup(cfg, load_corpus()), capture=capture)
    for d in out["divergence"]:
        rounds[d["round"]]["shrinkage"] = d["shrinkage"]["all"]
    return {"workers": K, "mode": mode, "outer_lr": lr, "outer_momentum": mu, "rounds": ROUNDS, "seed": 0,
            "per_round": [{"round": r, **v} for r, v in sorted(rounds.items())]}  # fmt: skip


def summarize_spectra(recs: list[dict]) -> list[dict]:
    """Per K and method: each stat's mean over the rounds."""
    rows = []
    for r in sorted(recs, key=lambda r: (r["workers"], r["mode"])):
        keys = [k for k in r["per_round"][0] if k != "round"]
        rows.append(
            {
                "workers": r["workers"],
                "mode": r["mode"],
                **{k: statistics.fmean(x[k] for x in r["per_round"] if x.get(k) is not None) for k in keys},
            }  # fmt: skip
        )
    return rows


def markdown_spectra(rows: list[dict]) -> str:
    header = ["K", "trajectory", "erank / r", "σ₁ / σ̄", "top-1 % energy", "‖Iso-C‖ / ‖mean‖", "shrinkage"]
    cells = ("erank_frac", ".3f"), ("top_over_mean", ".2f"), ("top1_energy", ".3f"), ("iso_norm", ".3f")
    out = [[r["workers"], r["mode"], *(format(r[k], f) for k, f in cells), f"{r['shrinkage']:.3f}"] for r in rows]
    return markdown_table(header, out)


def plot_spectra(rows: list[dict], gaps: dict, path: Path) -> None:
    """Left: IsoLoCo − DiLoCo against K (10 rounds: v3's cells; fixed compute: v6/v7 where run). Right: the mean
    Δ's effective rank and the step's shrinkage against K (DiLoCo's trajectory)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, pts in gaps.items():
        pts = sorted((k, g) for k, g in pts.items() if g)
        if pts:
            ks = [k for k, _ in pts]
            m = [g["mean"] for _, g in pts]
            err = [[g["mean"] - g["t_lo"] for _, g in pts], [g["t_hi"] - g["mean"] for _, g in pts]]
            a.errorbar(ks, m, yerr=err, marker="o", capsize=3, label=name)
    a.axhline(0, color="k", lw=0.6)
    a.set_xscale("log", base=2)
    a.set_xlabel("workers K")
    a.set_ylabel("IsoLoCo − DiLoCo, test loss")
    a.legend(fontsize=8)
    for mode, style in (("diloco", "-"), ("isoloco", "--")):
        pts = [r for r in rows if r["mode"] == mode]
        if pts:
            ks = [r["workers"] for r in pts]
            b.plot(ks, [r["erank_frac"] for r in pts], "o" + style, color="C0", label=f"erank / r ({mode})")
            b.plot(ks, [r["shrinkage"] for r in pts], "s" + style, color="C1", label=f"shrinkage ({mode})")
            b.plot(ks, [r["top1_energy"] for r in pts], "^" + style, color="C2", label=f"top-1 % energy ({mode})")
    b.set_xscale("log", base=2)
    b.set_xlabel("workers K")
    b.set_title("the mean Δ, mean over 10 rounds")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("run",))
    p.add_argument("--K", default=",".join(map(str, KS)))
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["workers"], r["mode"]) for r in map(json.loads, OUT.read_text().splitlines())} if OUT.exists() else set()
    for K in (int(k) for k in a.K.split(",")):
        for mode, (lr, mu) in picks(K).items():
            if (K, mode) in done:
                continue
            rec = run(K, mode, lr, mu)
            with OUT.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"K {K} {mode}: {rec['per_round'][-1]}", flush=True)


if __name__ == "__main__":
    main()
