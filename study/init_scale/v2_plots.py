"""Study v2's figures, for summarize.py: study_v2.png (held-out curves and per-round shrinkage),
study_v2_gap.png (the gap against DiLoCo's divergence) and study_v2_grid.png (the gap over the grid),
drawn from the summary v2.py makes.
"""

from __future__ import annotations

from pathlib import Path

from study.init_scale.v2 import V2_DEFAULT_LR, _cell_key, gap_points


def plots_v2(v2: dict, recs: list[dict], folder: Path) -> None:
    """Left: held-out curves per init (DiLoCo, IsoLoCo, DDP, avg); right: per-round shrinkage."""
    if not v2["cells"]:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ddp": "k", "avg": "tab:gray", "diloco": "tab:blue", "isoloco-sgd": "tab:green", "isoloco": "tab:red"}
    # curves for the init and vocabulary cells (K 4 and 8, H 30, R 10) that have v2 runs
    cells = [
        c
        for c in v2["cells"]
        if c["inner_steps"] == 30
        and c["rounds"] == 10
        and c["workers"] in (4, 8)
        and any(r.get("divergence") and _cell_key(r) == _cell_key(c) for r in recs)
    ]
    fig, axes = plt.subplots(2, len(cells), figsize=(5.2 * len(cells), 7.5), squeeze=False)
    for j, c in enumerate(cells):
        runs = [
            r
            for r in recs
            if r.get("divergence") and _cell_key(r) == _cell_key(c) and r["outer_lr"] == V2_DEFAULT_LR[r["mode"]]
        ]
        title = f"init {c['init']}, vocab {c['vocab']}, K {c['workers']}, H {c['inner_steps']} (default lrs)"
        for r in runs:
            col = colors.get(r["mode"], "tab:purple")
            first = r["seed"] == min(x["seed"] for x in runs if x["mode"] == r["mode"])
            axes[0][j].plot(
                r["tokens"][1:], r["heldout_loss"][1:], color=col, alpha=0.7, label=r["mode"] if first else None
            )
            if r.get("divergence"):
                axes[1][j].plot(
                    [d["round"] for d in r["divergence"]],
                    [d["shrinkage"]["all"] for d in r["divergence"]],
                    color=col,
                    alpha=0.7,
                    marker=".",
                    label=r["mode"] if first else None,
                )
        axes[0][j].set_title(title)
        axes[0][j].set_xlabel("training tokens (all workers)")
        axes[0][j].set_ylabel("held-out loss (nats/byte)")
        axes[1][j].set_xlabel("round")
        axes[1][j].set_ylabel("shrinkage ‖mean Δ_k‖ / mean ‖Δ_k‖")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "study_v2.png", dpi=100)
    plt.close(fig)
    # the gap against the divergence: one point per (cell, seed)
    pts = gap_points(v2, recs)
    if pts:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        palette = plt.get_cmap("tab20").colors  # one color and marker per cell, one legend beside the panels
        markers = "osD^vPX"
        labels = []
        for ax, j, xl in (
            (axes[0], 0, "DiLoCo run: shrinkage, mean over rounds"),
            (axes[1], 1, "DiLoCo run: mean pairwise cosine, mean over rounds"),
            (axes[2], 2, "DiLoCo run: median σ₁/σ̄ of mean Δ, second half of the rounds"),
        ):
            for c, *vals in pts:
                lab = f"{c['init']}, vocab {c['vocab']}, K {c['workers']}, H {c['inner_steps']}, R {c['rounds']}"
                if lab not in labels:
                    labels.append(lab)
                i = labels.index(lab)
                ax.scatter(
                    vals[j],
                    vals[3],
                    label=lab,
                    color=palette[(2 * i) % 20 + (i // 10) % 2],
                    marker=markers[i % len(markers)],
                )
            ax.set_xlabel(xl)
            ax.set_ylabel("IsoLoCo − DiLoCo final loss (nats/byte), per seed")
            ax.axhline(0, color="k", lw=0.5)
            ax.grid(alpha=0.3)
        handles, shown = axes[0].get_legend_handles_labels()
        uniq = dict(zip(shown, handles))
        fig.legend(uniq.values(), uniq.keys(), fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
        fig.tight_layout()
        fig.savefig(folder / "study_v2_gap.png", dpi=100, bbox_inches="tight")
        plt.close(fig)


def plot_grid(v2: dict, folder: Path) -> None:
    """The whole grid: gaps against K (H 30, R 10) and against H (K 4, 1200 inner steps per
    worker), and per init/vocabulary cell; released configs and tuned, mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def gap(c, tuned: bool):
        g = c["tuned"].get("isoloco_minus_diloco") if tuned else c["methods"].get("isoloco", {}).get("minus_diloco")
        return (g["mean"], g["std"] if len(g["diffs"]) > 1 else 0.0) if g else None

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    series = (
        (
            axes[0],
            lambda c: c["init"] == "gpt2" and c["vocab"] == 256 and c["inner_steps"] == 30 and c["rounds"] == 10,
            "workers",
            "K (H 30, R 10, 300 inner steps per worker)",
            True,
        ),
        (
            axes[1],
            lambda c: (
                c["init"] == "gpt2"
                and c["vocab"] == 256
                and c["workers"] == 4
                and c["inner_steps"] * c["rounds"] == 1200
            ),
            "inner_steps",
            "H (K 4, 1200 inner steps per worker: R = 1200/H)",
            True,
        ),
    )
    for ax, keep, key, xl, logx in series:
        cs = sorted((c for c in v2["cells"] if keep(c)), key=lambda c: c[key])
        for tuned, col, lab in ((False, "tab:red", "released lrs"), (True, "tab:purple", "tuned lrs")):
            pts = [(c[key], gap(c, tuned)) for c in cs if gap(c, tuned)]
            if pts:
                ax.errorbar(
                    [x for x, _ in pts],
                    [g[0] for _, g in pts],
                    yerr=[g[1] for _, g in pts],
                    color=col,
                    marker="o",
                    capsize=3,
                    label=lab,
                )
        if key == "inner_steps":  # larger H at R ≥ 10 needs a larger budget: those cells, their own marker
            for c in v2["cells"]:
                steps = c["inner_steps"] * c["rounds"]
                if (c["init"], c["vocab"], c["workers"]) == ("gpt2", 256, 4) and c["rounds"] >= 10 and steps > 1200:
                    g = gap(c, False)
                    if g:
                        ax.errorbar(
                            [c["inner_steps"]],
                            [g[0]],
                            yerr=[g[1]],
                            color="tab:red",
                            marker="s",
                            mfc="white",
                            capsize=3,
                            ls="none",
                            label=f"H {c['inner_steps']}, {steps} steps (R {c['rounds']}), released lrs",
                        )
        if logx:
            ax.set_xscale("log", base=2 if key == "workers" else 10)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xlabel(xl)
        ax.set_ylabel("IsoLoCo − DiLoCo final loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    cs = [c for c in v2["cells"] if c["inner_steps"] == 30 and c["rounds"] == 10 and c["workers"] in (4, 8)]
    names = [f"{c['init']}\nvocab {c['vocab']}\nK {c['workers']}" for c in cs]
    for off, tuned, col, lab in ((-0.2, False, "tab:red", "released lrs"), (0.2, True, "tab:purple", "tuned lrs")):
        xs = [i + off for i, c in enumerate(cs) if gap(c, tuned)]
        gs = [gap(c, tuned) for c in cs if gap(c, tuned)]
        axes[2].bar(xs, [g[0] for g in gs], width=0.4, yerr=[g[1] for g in gs], color=col, capsize=3, label=lab)
    axes[2].set_xticks(range(len(cs)), names, fontsize=8)
    axes[2].axhline(0, color="k", lw=0.5)
    axes[2].set_ylabel("IsoLoCo − DiLoCo final loss (nats/byte)")
    axes[2].set_title("H 30, R 10: init and vocabulary")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "study_v2_grid.png", dpi=100)
    plt.close(fig)
