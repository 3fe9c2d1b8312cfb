"""Study v3's tables and plot: every method tuned on the selection split, reported on the test split.

A cell is one regime (K, H, rounds, vocabulary, init and the v3 settings: batch, sequence length,
inner optimizer and lr, model). In a cell each method has a grid of outer (lr, μ) configs; its best config
is v3's rule (study/common/grids.py `best_config`: the lowest mean *selection* loss over the seeds every
config of that method has); its *test* losses are what the tables report, and IsoLoCo − DiLoCo is paired per
seed (same init and data) with a percentile-bootstrap interval and a Student-t one (study/common/stats.py).
A best lr on the edge of its grid (at its μ) is marked "edge": the optimum may lie beyond it.

    python study/summarize.py        # writes study/cells/summary_v3.json and study_v3.png
"""

from __future__ import annotations

import statistics

from study.common.grids import BASE, CELL_KEYS, SETTING_KEYS, best_config, cell_label, grids, short_label
from study.common.stats import fmt, mean_of, paired_gap

ABLATIONS = {"isoloco-noemb": "IsoLoCo with the embedding and head unflattened"}  # run_study.VARIANTS


def summarize_v3(recs: list[dict], paired_ci) -> dict:
    """{cell label: {method: best config, "gap": IsoLoCo − DiLoCo on the test split}} for every v3 cell."""
    out = {}
    for cell, methods in sorted(grids(recs).items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        row: dict = {"cell": dict(zip(CELL_KEYS + SETTING_KEYS, cell))}
        for mode, grid in sorted(methods.items()):
            row[mode] = best_config(grid)
        # DiLoCo tuned over its lr only, at its released μ 0.9 (what v1/v2 tuned)
        released = {c: runs for c, runs in methods.get("diloco", {}).items() if c[1] == 0.9}
        row["diloco_mu0.9"] = best_config(released)
        for key, other in (("gap", "diloco"), ("gap_mu0.9", "diloco_mu0.9")):
            gap = paired_gap(row.get("isoloco"), row.get(other), paired_ci)
            if gap is not None:
                row[key] = gap
        for mode in ABLATIONS:  # what leaving matrices unflattened costs: the ablation − IsoLoCo, each tuned
            gap = paired_gap(row.get(mode), row.get("isoloco"), paired_ci)
            if gap is not None:
                row[f"gap_{mode}"] = gap
        out[cell_label(cell)] = row
    return out


QUESTIONS = [  # (title, the cell fields that question varies)
    ("(a) Bigger batches", ("batch", "seq_len")),
    ("(b) Another inner lr", ("inner_lr",)),
    ("(c) More workers", ("workers",)),
    ("(d) Longer rounds (H) at R = 10", ("inner_steps",)),
    ("(e) Muon inner steps (MuLoCo vs Muon-inner IsoLoCo)", ("inner",)),
    ("(f) A BPE-8192 vocabulary", ("vocab",)),
    ("(g) A wider model (d 256)", ("model",)),
    ("(h) PyTorch's default init (position table N(0, 0.02))", ("init",)),
]


def question_of(cell: dict) -> str | None:
    """The question a cell answers: the first whose fields differ from BASE ("base" for BASE itself;
    None for a cell that moves several knobs of different questions at once, e.g. K 8 at batch 16)."""
    moved = {k for k, v in BASE.items() if cell.get(k) != v}
    if not moved:
        return "base"
    for title, fields in QUESTIONS:
        if moved <= set(fields) | {"workers"} and moved & set(fields):
            return title
    return None


def markdown_by_question(s: dict) -> str:
    """One table per question, v1/v2's regime (tuned the v3 way) as each table's first row; then the
    ablations of a question's cells, one line each."""
    base = {k: r for k, r in s.items() if question_of(r["cell"]) == "base"}
    out = []
    for title, _ in QUESTIONS + [("Other cells", ())]:
        rows = {k: r for k, r in s.items() if (question_of(r["cell"]) or "Other cells") == title}
        if rows:
            out.append(f"**{title}**\n\n" + markdown_v3({**base, **rows}) + markdown_ablations(rows))
    return "\n\n".join(out)


def markdown_ablations(s: dict) -> str:
    lines = []
    for label, row in s.items():
        for mode, what in ABLATIONS.items():
            g, b = row.get(f"gap_{mode}"), row.get(mode)
            if g:
                lines.append(
                    f"- {label}: {what} (`{mode}`, best lr {b['lr']:g}{' (edge)' if b['edge'] else ''}) − IsoLoCo, "
                    f"test: {fmt(g['mean'])} (" + ", ".join(fmt(x) for x in g["per_seed"]) + f"); 95 % t "
                    f"[{fmt(g['t_lo'])}, {fmt(g['t_hi'])}]"
                )
    return "\n\n" + "\n".join(lines) if lines else ""


def markdown_v3(s: dict) -> str:
    lines = [
        "| cell | DDP (test) | DiLoCo best (lr @ μ) | DiLoCo (test) | IsoLoCo best (lr @ μ) | IsoLoCo (test) "
        "| IsoLoCo − DiLoCo, test (per seed) | 95 % CI: bootstrap; t | IsoLoCo − DiLoCo tuned at μ 0.9 only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in s.items():

        def best(mode):
            b = row.get(mode)
            if not b:
                return "—", "—"
            test = [v for v in b["test"].values() if v is not None]
            sd = f" ± {statistics.stdev(test):.3f}" if len(test) > 1 else ""
            where = f"{b['lr']:g} @ {b['momentum']:g}" + (" (edge)" if b["edge"] else "")
            return where, (f"{statistics.fmean(test):.3f}{sd} ({len(test)})" if test else "diverged")

        ddp = row.get("ddp")
        ddp_test = [v for v in ddp["test"].values() if v is not None] if ddp else []
        (dw, dt), (iw, it) = best("diloco"), best("isoloco")
        g, g09 = row.get("gap"), row.get("gap_mu0.9")
        gap = "—" if not g else f"{fmt(g['mean'])} (" + ", ".join(fmt(x) for x in g["per_seed"]) + ")"
        ci = "—" if not g else f"[{fmt(g['lo'])}, {fmt(g['hi'])}]; [{fmt(g['t_lo'])}, {fmt(g['t_hi'])}]"
        rel = "—" if not g09 else fmt(g09["mean"]) + (f" ({len(g09['seeds'])} seeds)" if len(g09["seeds"]) > 1 else "")
        lines.append(
            f"| {label} | {fmt(mean_of(ddp_test), '.3f')} | {dw} | {dt} | {iw} | {it} | {gap} | {ci} | {rel} |"
        )
    return "\n".join(lines)


def markdown_grids(s: dict) -> str:
    """Every config's mean selection / test loss, per cell and method (the tuning behind the table)."""
    lines = []
    for label, row in s.items():
        for mode in ("diloco", "isoloco", *ABLATIONS):
            b = row.get(mode)
            if not b:
                continue
            cells = ", ".join(
                f"{k.replace('@', ' @ ')}: {fmt(v['selection'], '.3f')} / {fmt(v['test'], '.3f')} ({len(v['seeds'])})"
                for k, v in b["grid"].items()
            )
            lines.append(f"- {label}, {mode} (lr @ μ: selection / test (seeds)): {cells}")
    return "\n".join(lines)


def plot_v3(s: dict, path) -> None:
    """IsoLoCo − DiLoCo (test split, each tuned) per cell: the t interval (thin), the bootstrap one
    (thick), the mean and the per-seed points; cells with one seed show the point alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(
        ((short_label(row["cell"]), row["gap"]) for row in s.values() if row.get("gap")), key=lambda r: r[1]["mean"]
    )
    fig, ax = plt.subplots(figsize=(7, 0.4 * max(len(rows), 2) + 1.4))
    for i, (_, g) in enumerate(rows):
        if g["lo"] == g["lo"]:  # not NaN: two seeds or more
            ax.plot([g["t_lo"], g["t_hi"]], [i, i], color="tab:blue", lw=1)
            ax.plot([g["lo"], g["hi"]], [i, i], color="tab:blue", lw=4, alpha=0.5)
        ax.plot(g["per_seed"], [i] * len(g["per_seed"]), "k.", ms=5)
        ax.plot([g["mean"]], [i], "o", color="tab:blue")
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_xlabel("IsoLoCo − DiLoCo, test split (nats/byte); each tuned on the selection split")
    ax.set_title("Study v3: the gap per regime (thin: 95 % t; thick: bootstrap; dots: seeds)", fontsize=9)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
