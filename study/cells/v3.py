"""Study v3's tables and plot: every method tuned on the selection split, reported on the test split.

A cell is one regime (K, H, rounds, vocabulary, init and the v3 settings: batch, sequence length,
inner optimizer and lr, model). In a cell each method has a grid of outer (lr, μ) configs. A method's
best config is the one with the lowest mean *selection* loss over the seeds every config of that
method has (seed 0 at least, by the plan's order); its *test* losses are what the tables report, and
IsoLoCo − DiLoCo is paired per seed (same init and data) with a percentile-bootstrap interval. A best
lr on the edge of its grid (at its μ) is marked "edge": the optimum may lie beyond it.

    python study/summarize.py        # writes study/cells/summary_v3.json and study_v3.png
"""

from __future__ import annotations

import statistics
from collections import defaultdict

CELL_KEYS = ("workers", "inner_steps", "rounds", "vocab", "init")
ABLATIONS = {"isoloco-noemb": "IsoLoCo with the embedding and head unflattened"}  # run_study.VARIANTS
SETTING_KEYS = ("batch", "seq_len", "inner", "inner_lr", "model")


def _cell(r: dict) -> tuple:
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


def grids(recs: list[dict]) -> dict:
    """cell -> method -> (outer lr, μ) -> seed -> record (v3 records only, at a constant outer lr and μ and an
    uncompressed exchange: runs with an outer schedule (study v6 part B) or compression (study/compression/) are not
    grid points; a repeated run keeps the first)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in recs:
        if r.get("study") != "v3" or r["v3"].get("outer_schedule", "constant") != "constant" or "compress" in r["v3"]:
            continue
        cfg = (r.get("outer_lr"), r.get("outer_momentum"))
        out[_cell(r)][r["mode"]][cfg].setdefault(r["seed"], r)
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


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
                "selection": _mean(g[s]["final_loss"] for s in g),
                "test": _mean(g[s]["final_test_loss"] for s in g),
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
            gap = _paired_gap(row.get("isoloco"), row.get(other), paired_ci)
            if gap is not None:
                row[key] = gap
        for mode in ABLATIONS:  # what leaving matrices unflattened costs: the ablation − IsoLoCo, each tuned
            gap = _paired_gap(row.get(mode), row.get("isoloco"), paired_ci)
            if gap is not None:
                row[f"gap_{mode}"] = gap
        out[cell_label(cell)] = row
    return out


def _paired_gap(a: dict | None, b: dict | None, paired_ci) -> dict | None:
    """a − b on the test split over the seeds both have, with its bootstrap interval."""
    if not a or not b:
        return None
    seeds = sorted(s for s in set(a["test"]) & set(b["test"]) if a["test"][s] is not None and b["test"][s] is not None)
    if not seeds:
        return None
    x, y = [a["test"][s] for s in seeds], [b["test"][s] for s in seeds]
    mean, lo, hi = paired_ci(x, y)
    d = [u - v for u, v in zip(x, y)]
    t_lo, t_hi = t_interval(d)
    return {"seeds": seeds, "per_seed": d, "mean": mean, "lo": lo, "hi": hi, "t_lo": t_lo, "t_hi": t_hi}


# Student's t, 0.975 quantile, by degrees of freedom (1 … 9)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def t_interval(d: list[float]) -> tuple[float, float]:
    """The 95 % Student-t interval of the mean of the paired differences d (NaN below two pairs). With
    3 seeds it is wide where the percentile bootstrap is too narrow: the two bracket what the pairs say."""
    n = len(d)
    if n < 2:
        return float("nan"), float("nan")
    half = _T975[min(n - 2, len(_T975) - 1)] * statistics.stdev(d) / n**0.5  # beyond 9 df: 9 df's, a bit wide
    m = statistics.fmean(d)
    return m - half, m + half


def paired_t(a: dict, b: dict) -> dict | None:
    """a − b over the seeds both map to a number (None and NaN skipped), with its 95 % t interval (None: no pair)."""
    d = [a[s] - b[s] for s in sorted(set(a) & set(b)) if a[s] is not None and b[s] is not None]
    d = [x for x in d if x == x]
    if not d:
        return None
    lo, hi = t_interval(d)
    return {"seeds": len(d), "mean": statistics.fmean(d), "t_lo": lo, "t_hi": hi, "per_seed": d}


def _fmt(x, spec="+.3f"):
    return "—" if x is None or x != x else format(x, spec)


# v1/v2's regime; every other cell moves one knob away from it (the question it answers)
BASE = {"workers": 4, "inner_steps": 30, "vocab": 256, "init": "gpt2", "batch": 4, "seq_len": 64,
        "inner": "adamw", "inner_lr": 3e-3, "model": "tiny"}  # fmt: skip
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
                    f"test: {_fmt(g['mean'])} (" + ", ".join(_fmt(x) for x in g["per_seed"]) + f"); 95 % t "
                    f"[{_fmt(g['t_lo'])}, {_fmt(g['t_hi'])}]"
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
        gap = "—" if not g else f"{_fmt(g['mean'])} (" + ", ".join(_fmt(x) for x in g["per_seed"]) + ")"
        ci = "—" if not g else f"[{_fmt(g['lo'])}, {_fmt(g['hi'])}]; [{_fmt(g['t_lo'])}, {_fmt(g['t_hi'])}]"
        rel = "—" if not g09 else _fmt(g09["mean"]) + (f" ({len(g09['seeds'])} seeds)" if len(g09["seeds"]) > 1 else "")
        lines.append(f"| {label} | {_fmt(_mean(ddp_test), '.3f')} | {dw} | {dt} | {iw} | {it} | {gap} | {ci} | {rel} |")
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
                f"{k.replace('@', ' @ ')}: {_fmt(v['selection'], '.3f')} / {_fmt(v['test'], '.3f')} ({len(v['seeds'])})"
                for k, v in b["grid"].items()
            )
            lines.append(f"- {label}, {mode} (lr @ μ: selection / test (seeds)): {cells}")
    return "\n".join(lines)


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
