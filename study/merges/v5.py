"""Study v5's tables and plot: part B, the paper's merges against a tuned DiLoCo at the v1/v2 cell.

Every merge is a study method (run_study.VARIANTS: "tsv", "iso_cts", "ties", "dare" with IsoLoCo's
Nesterov outer step at μ 0.8, "<merge>-sgd" and "isoloco-sgd" with outer SGD), tuned over its outer lr
by v3's rule (seed-0 pick on the selection split, seeds 1 and 2 of the pick, test split reported,
study/common/grids.py `best_config`). Each row's gap to DiLoCo (mean: tuned over lr and μ in v3) is paired per
seed with a 95 % Student-t interval; "edge" marks a pick on its grid's edge; the outer step's seconds
per round come from the pick's records (the cost a user pays, on the 2-core CPU the study ran on).

    python study/summarize.py     # prints this table among the others, writes study/merges/study_v5_merges.png
"""

from __future__ import annotations

import statistics

from study.common.grids import BASE
from study.common.stats import fmt, markdown_table, paired_gap

# (method, outer step, study mode) in the table's order; mean/Nesterov is DiLoCo itself (the baseline)
ROWS = (
    ("mean (DiLoCo)", "Nesterov / SGD, tuned μ", "diloco"),
    ("Iso-C (IsoLoCo)", "Nesterov μ 0.8", "isoloco"),
    ("Iso-CTS", "Nesterov μ 0.8", "iso_cts"),
    ("TSV-M", "Nesterov μ 0.8", "tsv"),
    ("TIES", "Nesterov μ 0.8", "ties"),
    ("DARE", "Nesterov μ 0.8", "dare"),
    ("Iso-C", "SGD", "isoloco-sgd"),
    ("Iso-CTS", "SGD", "iso_cts-sgd"),
    ("TSV-M", "SGD", "tsv-sgd"),
    ("TIES", "SGD", "ties-sgd"),
    ("DARE", "SGD", "dare-sgd"),
)


def base_row(v3_summary: dict) -> dict | None:
    """The v3 summary's row of the v1/v2 cell (K 4, H 30, 4 × 64 bytes, the tiny model)."""
    for row in v3_summary.values():
        cell = row["cell"]
        if all(cell.get(k) == v for k, v in BASE.items()) and cell.get("rounds") == 10:
            return row
    return None


def _outer_s_per_round(recs: list[dict], mode: str, best: dict) -> float | None:
    xs = [
        r["outer_step_s"] / r["rounds"]
        for r in recs
        if r.get("mode") == mode
        and r.get("outer_lr") == best["lr"]
        and r.get("outer_momentum") == best["momentum"]
        and r.get("outer_step_s") is not None
        and r.get("v3", {}).get("batch") == BASE["batch"]
        and r.get("v3", {}).get("model") == BASE["model"]
        and r.get("workers") == BASE["workers"]
        and r.get("rounds") == 10  # the merges' cell, as _base_row's: not study v6's 300-round runs
        and r.get("inner_steps") == BASE["inner_steps"]
    ]
    return statistics.fmean(xs) if xs else None


def summarize_merges(v3_summary: dict, recs: list[dict], paired_ci) -> list[dict]:
    """One row per (method, outer step) that has a grid in the base cell."""
    row = base_row(v3_summary)
    if row is None or row.get("diloco") is None:
        return []
    out = []
    for name, outer, mode in ROWS:
        best = row.get(mode)
        if best is None:
            continue
        test = [v for v in best["test"].values() if v is not None]
        out.append(
            {
                "method": name,
                "outer": outer,
                "mode": mode,
                "lr": best["lr"],
                "momentum": best["momentum"],
                "edge": best["edge"],
                "seeds": sorted(best["test"]),
                "test_mean": statistics.fmean(test) if test else None,
                "gap": None if mode == "diloco" else paired_gap(best, row["diloco"], paired_ci),
                "outer_s_per_round": _outer_s_per_round(recs, mode, best),
            }
        )
    return out


def markdown_merges(rows: list[dict]) -> str:
    header = ["merge", "outer step", "pick (lr @ μ)", "test loss (mean of seeds)", "− DiLoCo tuned [95 % t]"]
    out = []
    for r in rows:
        g = r["gap"]
        gap = "—" if g is None else f"{fmt(g['mean'])} [{fmt(g['t_lo'])}, {fmt(g['t_hi'])}]"
        if g is not None and g["t_hi"] < 0:
            gap = f"**{gap}**"
        pick = f"{r['lr']:g} @ {r['momentum']:g}" + (" (edge)" if r["edge"] else "")
        sec = "—" if r["outer_s_per_round"] is None else f"{r['outer_s_per_round']:.3f}"
        out.append([r["method"], r["outer"], pick, f"{fmt(r['test_mean'], '.3f')} ({len(r['seeds'])})", gap, sec])
    return markdown_table(header + ["outer step s / round"], out)


def plot_merges(rows: list[dict], path) -> None:
    """The gaps with their intervals, Nesterov and SGD side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["gap"] is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    labels = [f"{r['method']}\n{r['outer'].split(' ')[0]}" for r in rows]
    means = [r["gap"]["mean"] for r in rows]
    err = [[m - r["gap"]["t_lo"] for m, r in zip(means, rows)], [r["gap"]["t_hi"] - m for m, r in zip(means, rows)]]
    colors = ["tab:blue" if "Nesterov" in r["outer"] else "tab:orange" for r in rows]
    ax.bar(range(len(rows)), means, yerr=err, color=colors, capsize=3)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("test loss − DiLoCo tuned (nats/byte)")
    ax.set_title("Study v5 part B: the paper's merges at K 4, H 30 (3 paired seeds, 95 % t)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
