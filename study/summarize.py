"""Summarize study/results/*.jsonl for study v2: tables (markdown), study/summary_v2.json and PNGs.

    python study/summarize.py            # prints the markdown tables used in README.md's v2 section

Study v2 records ("study": "v2" in the JSONL) are summarized per (init, vocab, K, H, rounds) cell:
every method's final loss per seed, the paired gaps to DiLoCo at released and tuned outer lrs, and the
divergence measurements averaged over rounds (markdown_v2; study_v2.png, study_v2_gap.png,
study_v2_grid.png). v1 runs join the v2 cells as GPT-2-init byte-level runs without divergence
measurements (the loop is deterministic: a v2 run that repeats a v1 configuration gives the same loss,
checked below).

Study v1 is frozen into its results: its tables are in study/README.md, its numbers in
study/summary.json and its figure in study/study.png, all written by the v1 pipeline of this file,
which git history keeps.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def read_jsonl(path: Path) -> list[dict]:
    """The run records of one results file. ValueError naming the file and line for a line that is
    not a JSON object (a run cut off while it was written: delete that line and rerun the job)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{i}: not a JSON record ({e.msg}); a run cut off while it was written? "
                "delete the line and run the job again"
            ) from None
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{i}: a {type(r).__name__}, not a run record (a JSON object)")
        out.append(r)
    return out


def run_key(r: dict) -> tuple:
    """What makes a run the run it is: its config (records from before the selection / test split
    lack eval_split: they were scored on 64 windows over the whole held-out text), and study v3's
    regime settings and outer momentum ("v3")."""
    v3 = r.get("v3")
    return (
        r["seed"],
        r["workers"],
        r["inner_steps"],
        r["mode"],
        r["outer_lr"],
        r.get("study", "v1"),
        r.get("init", "gpt2"),
        r.get("vocab", 256),
        r["rounds"],
        r.get("eval_split", "whole"),
        r.get("eval_windows", 64),
        None if v3 is None else tuple(sorted(v3.items())),
    )


def load(folder: Path) -> list[dict]:
    """The runs of every results file in folder, each once (a run two processes both executed is
    kept as first read)."""
    recs, seen = [], set()
    for f in sorted(folder.glob("*.jsonl")):
        for r in read_jsonl(f):
            k = run_key(r)
            if k not in seen:
                seen.add(k)
                recs.append(r)
    return recs


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def _f(x, nd=4):
    return "—" if x is None or x != x else f"{x:.{nd}f}"


def _ms(e) -> str:
    return "—" if not e or e["mean"] is None else f"{e['mean']:.3f} ± {_f(e['std'], 3)}"


V2_ORDER = ("ddp", "avg", "diloco", "isoloco-sgd", "isoloco", "isoloco-noemb", "isoloco-noemb-dl")
V2_DEFAULT_LR = {
    "ddp": None,
    "avg": 1.0,
    "diloco": 0.7,
    "isoloco-sgd": 3.0,
    "isoloco": 1.8,
    "isoloco-noemb": 1.8,
    "isoloco-noemb-dl": 1.8,
}


def _v2_name(mode: str, lr) -> str:
    """The method's name in the v2 tables: the mode at its default lr, "mode@lr" at any other."""
    return mode if lr == V2_DEFAULT_LR.get(mode) else f"{mode}@{lr}"


V2_GROUPS = ("all", "embedding", "head", "middle")


def _round_mean(r: dict, what: str, group: str, rounds=None):
    ds = r.get("divergence") or []
    if rounds is not None:
        ds = [d for d in ds if d["round"] in rounds]
    xs = [d[what][group] for d in ds if d[what].get(group) is not None]
    return statistics.fmean(xs) if xs else None


def _spec_mean(r: dict, key: str, rounds=None):
    ds = r.get("divergence") or []
    if rounds is not None:
        ds = [d for d in ds if d["round"] in rounds]
    xs = [d["spectrum_median"][key] for d in ds if d.get("spectrum_median", {}).get(key) is not None]
    return statistics.fmean(xs) if xs else None


def v2_view(recs: list[dict]) -> list[dict]:
    """v2 runs, plus v1 runs as GPT-2-init byte-level runs (no divergence) where v2 has no repeat."""
    out: dict[tuple, dict] = {}
    for r in recs:
        if r.get("study", "v1") == "v1":
            r = dict(r, init="gpt2", vocab=256, from_v1=True)
        k = (r["seed"], r["workers"], r["inner_steps"], r["rounds"], r["mode"], r["outer_lr"], r["init"], r["vocab"])
        if k not in out or (out[k].get("from_v1") and not r.get("from_v1")):
            out[k] = r
    return list(out.values())


def _cell_key(r: dict) -> tuple:
    return (r["init"], r["vocab"], r["workers"], r["inner_steps"], r["rounds"])


def paired_bootstrap_ci(a, b, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of the paired differences a_i − b_i and its percentile-bootstrap
    interval at `level`. Pair i is one seed of both methods (same init and data), so the pairs are
    resampled together, with replacement, n_boot times, and the interval is the (1 − level)/2 and
    (1 + level)/2 quantiles of the resampled means. Deterministic for a given seed. With fewer than
    two pairs there is no interval: lo and hi are NaN. With few pairs (3 seeds) the percentile
    interval is too narrow (it cannot be wider than the pairs' range); read it with the pairs."""
    import random

    if len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError(f"level must be in (0, 1) and n_boot ≥ 1, got {level}, {n_boot}")
    d = [x - y for x, y in zip(a, b)]
    if not d:
        raise ValueError("no pairs")
    mean = statistics.fmean(d)
    if len(d) < 2:
        return mean, float("nan"), float("nan")
    rng, n = random.Random(seed), len(d)
    boots = sorted(statistics.fmean(rng.choices(d, k=n)) for _ in range(n_boot))
    q = lambda p: boots[min(n_boot - 1, max(0, round(p * (n_boot - 1))))]
    return mean, q((1 - level) / 2), q((1 + level) / 2)


def _paired_diffs(a: dict, b: dict) -> dict | None:
    """a − b per common seed (final losses), with mean and std; None without a common seed."""
    common = sorted(set(a) & set(b))
    diffs = [
        a[x]["final_loss"] - b[x]["final_loss"]
        for x in common
        if a[x]["final_loss"] is not None and b[x]["final_loss"] is not None
    ]
    if not diffs:
        return None
    return {"seeds": common, "diffs": diffs, "mean": statistics.fmean(diffs), "std": _std(diffs)}


def _best_lr(methods: dict, mode: str):
    """The outer lr of `mode` with the lowest mean final loss over the seeds every lr of its grid
    shares (at least one), whether it sits on the edge of the grid, and the grid."""
    lrs = sorted(lr for m, lr in methods if m == mode)
    if not lrs:
        return None, False, []
    shared = set.intersection(*(set(methods[(mode, lr)]) for lr in lrs))
    if not shared or len(lrs) == 1:
        return (lrs[0] if len(lrs) == 1 else None), len(lrs) > 1, lrs
    score = {lr: statistics.fmean(methods[(mode, lr)][x]["final_loss"] or float("inf") for x in shared) for lr in lrs}
    best = min(lrs, key=lambda lr: score[lr])
    return best, best in (lrs[0], lrs[-1]), lrs


def summarize_v2(recs: list[dict]) -> dict:
    """Per (init, vocab, K, H, rounds) cell: per method {seeds, finals, mean, std, divergence
    means}; paired gaps to DiLoCo at its released lr, and tuned (each method at its best lr)."""
    cells = defaultdict(lambda: defaultdict(dict))
    for r in recs:
        cells[_cell_key(r)][(r["mode"], r["outer_lr"])][r["seed"]] = r
    out = []
    for (init, vocab, K, H, R), methods in sorted(
        cells.items(), key=lambda t: (t[0][2], t[0][3], t[0][4], t[0][1], t[0][0])
    ):
        cell = {"init": init, "vocab": vocab, "workers": K, "inner_steps": H, "rounds": R, "methods": {}}
        for (mode, lr), seeds in sorted(methods.items(), key=lambda t: (V2_ORDER.index(t[0][0]), t[0][1] or 0)):
            finals = [seeds[x]["final_loss"] for x in sorted(seeds)]
            ok = [v for v in finals if v is not None]
            e = {
                "outer_lr": lr,
                "seeds": sorted(seeds),
                "finals": finals,
                "mean": statistics.fmean(ok) if ok and len(ok) == len(finals) else None,
                "std": _std(ok) if len(ok) == len(finals) else None,
            }
            runs = [seeds[x] for x in sorted(seeds) if seeds[x].get("divergence")]
            if mode != "ddp" and runs:
                e["divergence"] = {
                    f"{what}_{g}": statistics.fmean(v for v in (_round_mean(r, what, g) for r in runs) if v is not None)
                    for what in ("cosine", "shrinkage")
                    for g in V2_GROUPS
                    if any(_round_mean(r, what, g) is not None for r in runs)
                }
                for key in ("erank_over_r0", "top_over_mean"):
                    vals = [v for v in (_spec_mean(r, key) for r in runs) if v is not None]
                    if vals:
                        e["divergence"][key] = statistics.fmean(vals)
                # the first round alone: before any outer step has acted
                r1 = [v for v in (_round_mean(r, "shrinkage", "all", {1}) for r in runs) if v is not None]
                if r1:
                    e["divergence"]["shrinkage_all_round1"] = statistics.fmean(r1)
            cell["methods"][_v2_name(mode, lr)] = e
        dil = methods.get(("diloco", V2_DEFAULT_LR["diloco"]))  # released-config gaps are to DiLoCo 0.7
        for mode, lr in methods:
            if (mode, lr) != ("diloco", V2_DEFAULT_LR["diloco"]) and dil:
                g = _paired_diffs(methods[(mode, lr)], dil)
                if g:
                    cell["methods"][_v2_name(mode, lr)]["minus_diloco"] = g
        tuned = {}
        for mode in ("diloco", "isoloco", "isoloco-sgd"):
            best, edge, grid = _best_lr(methods, mode)
            if best is not None:
                tuned[mode] = {"lr": best, "edge": edge, "grid": grid}
        # a tuned gap only where some grid has more than one lr; else it would repeat the released one
        grids = {m: len(t["grid"]) for m, t in tuned.items()}
        if "diloco" in tuned and "isoloco" in tuned and grids["diloco"] + grids["isoloco"] > 2:
            g = _paired_diffs(methods[("isoloco", tuned["isoloco"]["lr"])], methods[("diloco", tuned["diloco"]["lr"])])
            if g:
                tuned["isoloco_minus_diloco"] = g
        if "isoloco-sgd" in tuned and grids.get("diloco", 0) > 1:  # the seed paper's claim against a tuned DiLoCo
            g = _paired_diffs(
                methods[("isoloco-sgd", tuned["isoloco-sgd"]["lr"])], methods[("diloco", tuned["diloco"]["lr"])]
            )
            if g:
                tuned["sgd_minus_diloco"] = g
        cell["tuned"] = tuned
        out.append(cell)
    return {"cells": out}


def _gap_text(g) -> str:
    if not g:
        return "—"
    return f"{g['mean']:+.3f} ({', '.join(f'{x:+.3f}' for x in g['diffs'])})"


def markdown_v2(v2: dict) -> str:
    if not v2["cells"]:
        return "(no study v2 runs yet)"
    lines = [
        "Per cell (R = rounds, so inner steps per worker = H·R): mean final held-out loss (nats/byte) of each "
        "method at its released outer lr; gaps paired per seed (per-seed values in brackets); 'tuned' = each "
        "method at the best lr of its grid in that cell (lr; * = the best lr is on the grid's edge; Iso-C SGD "
        "has one lr, 3.0).",
        "",
        "| init | vocab | K | H | R | DDP | avg | DiLoCo | Iso-C SGD | IsoLoCo | IsoLoCo − DiLoCo | "
        "Iso-C SGD − DiLoCo | tuned: IsoLoCo − DiLoCo (lrs) | tuned: Iso-C SGD − DiLoCo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in v2["cells"]:
        m = c["methods"]
        cellv = lambda k: "—" if k not in m else f"{_ms(m[k])} [{len(m[k]['seeds'])}]"
        t = c.get("tuned", {})
        tg = t.get("isoloco_minus_diloco")
        tuned = (
            "—"
            if not tg
            else (
                f"{_gap_text(tg)} ({t['diloco']['lr']}{'*' if t['diloco']['edge'] else ''} / "
                f"{t['isoloco']['lr']}{'*' if t['isoloco']['edge'] else ''})"
            )
        )
        sg = t.get("sgd_minus_diloco")
        sgd = "—" if not sg else f"{_gap_text(sg)} ({t['diloco']['lr']})"
        lines.append(
            f"| {c['init']} | {c['vocab']} | {c['workers']} | {c['inner_steps']} | {c['rounds']} | "
            f"{cellv('ddp')} | {cellv('avg')} | {cellv('diloco')} | {cellv('isoloco-sgd')} | {cellv('isoloco')} | "
            f"{_gap_text(m.get('isoloco', {}).get('minus_diloco'))} | "
            f"{_gap_text(m.get('isoloco-sgd', {}).get('minus_diloco'))} | {tuned} | {sgd} |"
        )
    lines += [
        "",
        "Every run (final held-out loss, nats/byte, mean ± std over seeds; '− DiLoCo' paired per seed "
        "against DiLoCo at lr 0.7):",
        "",
        "| init | vocab | K | H | R | method | lr | seeds | final | per seed | − DiLoCo (per seed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in v2["cells"]:
        for mode, e in c["methods"].items():
            per = ", ".join("div" if v is None else f"{v:.4f}" for v in e["finals"])
            lines.append(
                f"| {c['init']} | {c['vocab']} | {c['workers']} | {c['inner_steps']} | {c['rounds']} | {mode} | "
                f"{'-' if e['outer_lr'] is None else e['outer_lr']} | {len(e['seeds'])} | {_ms(e)} | {per} | "
                f"{_gap_text(e.get('minus_diloco'))} |"
            )
    lines += [
        "",
        "Divergence, averaged over the rounds and seeds of each run (cosine: mean pairwise cosine of the "
        "workers' Δ_k; shrinkage: ‖mean Δ_k‖ / mean ‖Δ_k‖; spectrum of the averaged Δ: median over matrices "
        "of effective rank / min(m, n) and of σ₁/σ̄):",
        "",
        "| init | vocab | K | H | R | method | cosine all / emb / head / middle | shrinkage all / emb / head / middle "
        "| shrinkage round 1 | erank / r₀ | σ₁/σ̄ |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in v2["cells"]:
        for mode, e in c["methods"].items():
            d = e.get("divergence")
            if not d:
                continue
            f = lambda k, nd=3: _f(d.get(k), nd)
            lines.append(
                f"| {c['init']} | {c['vocab']} | {c['workers']} | {c['inner_steps']} | {c['rounds']} | {mode} | "
                + " / ".join(f("cosine_" + g) for g in V2_GROUPS)
                + " | "
                + " / ".join(f("shrinkage_" + g) for g in V2_GROUPS)
                + " | "
                + f"{f('shrinkage_all_round1')} | {f('erank_over_r0')} | {f('top_over_mean', 2)} |"
            )
    return "\n".join(lines)


def gap_points(v2: dict, recs: list[dict]) -> list[tuple]:
    """(cell, DiLoCo shrinkage, DiLoCo cosine, DiLoCo σ₁/σ̄ over the second half of its rounds,
    IsoLoCo − DiLoCo) per (cell, seed) with both released-config runs and divergence records."""
    pts = []
    for c in v2["cells"]:
        d, i = c["methods"].get("diloco"), c["methods"].get("isoloco")
        if not d or not i:
            continue
        runs = {
            (r["mode"], r["outer_lr"], r["seed"]): r
            for r in recs
            if r.get("divergence") and _cell_key(r) == _cell_key(c)
        }
        for seed in sorted(set(d["seeds"]) & set(i["seeds"])):
            rd = runs.get(("diloco", V2_DEFAULT_LR["diloco"], seed))
            ri = runs.get(("isoloco", V2_DEFAULT_LR["isoloco"], seed))
            if rd and ri and rd["final_loss"] is not None and ri["final_loss"] is not None:
                pts.append(
                    (
                        c,
                        _round_mean(rd, "shrinkage", "all"),
                        _round_mean(rd, "cosine", "all"),
                        _spec_mean(rd, "top_over_mean", set(range(len(rd["heldout_loss"]) // 2 + 1, 10**6))),
                        ri["final_loss"] - rd["final_loss"],
                    )
                )
    return pts


def correlations(pts: list[tuple]) -> dict:
    """Pearson r between each DiLoCo divergence measure and the gap, over the (cell, seed) points."""
    out = {"points": len(pts)}
    for j, name in ((0, "shrinkage"), (1, "cosine"), (2, "top_over_mean_late")):
        xy = [(p[1 + j], p[4]) for p in pts if p[1 + j] is not None]
        if len(xy) > 2:
            out[name] = statistics.correlation([x for x, _ in xy], [y for _, y in xy])
    return out


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


def summary_v2(recs: list[dict]) -> tuple[dict, list[dict]]:
    """The v2 summary (what summary_v2.json holds) of the runs `load` read, and the v2 runs."""
    # v1 and v2 were scored on the 64 windows over the whole held-out text of their loop; runs scored
    # on the selection / test splits (records with "eval_split") are not mixed into their tables
    recs = [r for r in recs if "eval_split" not in r]
    v2 = summarize_v2(v2_view(recs))
    v1_recs = [r for r in recs if r.get("study", "v1") == "v1"]
    v2_recs = [r for r in recs if r.get("study") == "v2"]
    v2["runs"] = len(v2_recs)
    v2["cpu_s_total"] = sum(r.get("cpu_s", 0.0) for r in v2_recs)
    # v2 gpt2/bytes runs repeat v1 configurations: the loop is deterministic, so they must agree
    v1_final = {
        (r["seed"], r["workers"], r["inner_steps"], r["rounds"], r["mode"], r["outer_lr"]): r["final_loss"]
        for r in v1_recs
    }
    same = [
        (v1_final[k], r["final_loss"])
        for r in v2_recs
        if r["init"] == "gpt2" and r["vocab"] == 256
        for k in [(r["seed"], r["workers"], r["inner_steps"], r["rounds"], r["mode"], r["outer_lr"])]
        if k in v1_final
    ]
    v2["v1_repeats"] = {"runs": len(same), "identical": sum(a == b for a, b in same)}
    pts = gap_points(v2, v2_recs)
    v2["gap_correlations"] = correlations(pts)
    # the same at one budget (300 inner steps per worker: the init, K and vocabulary cells)
    v2["gap_correlations_300_steps"] = correlations([p for p in pts if p[0]["inner_steps"] * p[0]["rounds"] == 300])
    return v2, v2_recs


def main() -> None:
    recs = load(HERE / "results")
    v2, v2_recs = summary_v2(recs)
    (HERE / "summary_v2.json").write_text(json.dumps(v2, indent=1))
    plots_v2(v2, v2_recs, HERE)
    plot_grid(v2, HERE)
    print("<!-- v2 -->\n" + markdown_v2(v2))
    for what, key in (
        ("all cells", "gap_correlations"),
        ("cells of 300 inner steps per worker", "gap_correlations_300_steps"),
    ):
        cor = v2[key]
        print(
            f"\nPearson r over {cor['points']} (cell, seed) points ({what}) between DiLoCo's divergence and "
            f"IsoLoCo − DiLoCo (released configs): shrinkage {cor.get('shrinkage', float('nan')):+.2f}, cosine "
            f"{cor.get('cosine', float('nan')):+.2f}, σ₁/σ̄ of mean Δ (second half of the rounds) "
            f"{cor.get('top_over_mean_late', float('nan')):+.2f}"
        )
    print(
        f"\n{len(v2_recs)} v2 runs, {v2['cpu_s_total'] / 60:.1f} CPU-min; {v2['v1_repeats']['runs']} v2 runs repeat a "
        f"v1 configuration, {v2['v1_repeats']['identical']} of them with a bit-identical final loss"
    )
    v3_recs = [r for r in recs if r.get("study") == "v3"]
    if v3_recs:
        from v3 import markdown_by_question, markdown_grids, plot_v3, summarize_v3  # study/ is on sys.path

        v3 = summarize_v3(v3_recs, paired_bootstrap_ci)
        (HERE / "summary_v3.json").write_text(json.dumps(v3, indent=1))
        plot_v3(v3, HERE / "study_v3.png")
        print("\n<!-- v3 -->\n" + markdown_by_question(v3) + "\n\n" + markdown_grids(v3))
        print(f"\n{len(v3_recs)} v3 runs, {sum(r.get('cpu_s', 0.0) for r in v3_recs) / 60:.1f} CPU-min")
        from v5 import markdown_merges, plot_merges, summarize_merges  # study v5 part B: the paper's merges

        merges = summarize_merges(v3, v3_recs, paired_bootstrap_ci)
        if merges:
            (HERE / "summary_v5_merges.json").write_text(json.dumps(merges, indent=1))
            plot_merges(merges, HERE / "study_v5_merges.png")
            print("\n<!-- v5 merges -->\n" + markdown_merges(merges))
    v4_recs = [r for r in recs if r.get("study") == "v4"]
    if v4_recs:
        from v4 import markdown_v4, markdown_verdict, plot_v4, summarize_v4, verdict  # study/ is on sys.path

        spectra_file = HERE / "results" / "spectra" / "v4_spectra.jsonl"
        spectra = read_jsonl(spectra_file) if spectra_file.exists() else []
        v4 = summarize_v4(recs, spectra)
        v = verdict(v4)
        (HERE / "summary_v4.json").write_text(json.dumps({"cells": v4, "verdict": v}, indent=1))
        plot_v4(v4, HERE / "study_v4.png")
        print("\n<!-- v4 -->\n" + markdown_v4(v4) + "\n\n" + markdown_verdict(v, v4))
        print(f"\n{len(v4_recs)} v4 runs, {sum(r.get('cpu_s', 0.0) for r in v4_recs) / 60:.1f} CPU-min")


if __name__ == "__main__":
    main()
