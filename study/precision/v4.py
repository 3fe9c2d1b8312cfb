"""Study v4's tables and plot: how exact must the flatten be for training?

In each cell (a v3 regime at its v3-tuned IsoLoCo outer lr and μ) IsoLoCo ran with several flatten methods
on the same seeds; each method's test loss is paired per seed with the exact "svd" run, the change
given with its 95 % Student-t interval. Beside it, what the method does to that cell's pseudo-gradients
(the seed-0 svd run's averaged Δ in its first, middle and last round, every 2-D matrix): the relative
Frobenius error against reference.py and the flatness (largest |σ_i(out)/s̄ − 1| outside reference.py's
rank cut), mean and max over matrices and rounds. v3's own IsoLoCo runs of the cell (method "auto",
exact on the CPU: eigh or svd by shape) join as a row: exact against exact, the floor of the pairing.

    python study/summarize.py        # writes study/precision/summary_v4.json and study_v4.png
"""

from __future__ import annotations

import ast
import statistics
from collections import defaultdict

from study.common.grids import CELL_KEYS, SETTING_KEYS, cell_label, short_label
from study.common.stats import mean_of, t_interval

ANCHOR = "svd"
# loosest first: what each method does to the flatten (flattens.py for the study-only ones)
ORDER = (
    "svd_noise3e-1",
    "svd_noise1e-1",
    "ns5",
    "pe_bf16",
    "polar_bf16",
    "fast",
    "polar_tf32x3",
    "polar",
    "auto",
    "svd_cut3e-2",
    "svd_cut1e-2",
    "svd_cut1e-3",
)
WHAT = {
    "svd": "exact: float64 SVD (the anchor)",
    "svd_noise3e-1": "exact + Gaussian noise, 30 % of its norm",
    "svd_noise1e-1": "exact + Gaussian noise, 10 % of its norm",
    "ns5": "Muon's NS5: 5 quintic steps (3.4445, −4.7750, 2.0315), bfloat16",
    "pe_bf16": "Polar Express, all 10 steps bfloat16, no checks",
    "polar_bf16": "Polar Express, 8 bfloat16 + 2 float32 steps, rank certificate",
    "fast": "Polar Express, 3 float32 + 7 bfloat16 steps, flat spectrum certified",
    "polar_tf32x3": "Polar Express, 10 steps 3xTF32 (emulated on the CPU)",
    "polar": "Polar Express, 10 float32 steps, residual-checked",
    "auto": "exact (eigh or svd by shape; v3's runs)",
    "svd_cut3e-2": "exact, σ < 3e-2·σ₁ zeroed before the mean",
    "svd_cut1e-2": "exact, σ < 1e-2·σ₁ zeroed before the mean",
    "svd_cut1e-3": "exact, σ < 1e-3·σ₁ zeroed before the mean",
}
BUDGET = 0.01  # a method is within the budget when |mean change| ≤ BUDGET and its t interval holds 0
CUT_PREFIX = "svd_cut"
NOISE_PREFIX = "svd_noise"  # diagnostics: what error the loss notices, not methods anyone would run


def _cell(r: dict) -> tuple:
    """v3's cell of a record; init and vocab as common.records.run_key reads them (the first v4 records lack them:
    GPT-2 init, bytes)."""
    defaults = {"init": "gpt2", "vocab": 256}
    return tuple(r.get(k, defaults.get(k)) for k in CELL_KEYS) + tuple(r["v3"].get(k) for k in SETTING_KEYS)


def _cell_of_key(key: tuple) -> tuple:
    """The cell of a run key (common.records.run_key) as `_cell` names it."""
    seed, K, H, mode, lr, study, init, vocab, rounds, split, windows, settings = key
    s = dict(settings)
    return (K, H, rounds, vocab, init) + tuple(s.get(k) for k in SETTING_KEYS)


def runs_by_cell(recs: list[dict]) -> dict:
    """cell -> (outer lr, μ) -> method -> seed -> record: study v4's runs, and v3's IsoLoCo runs at the
    same cell and config as method "auto"."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in recs:
        if r.get("study") == "v4" and r.get("mode") == "isoloco":
            out[_cell(r)][(r["outer_lr"], r["outer_momentum"])][r["iso_method"]].setdefault(r["seed"], r)
    for r in recs:
        if r.get("study") == "v3" and r.get("mode") == "isoloco":
            cfgs = out.get(_cell(r))
            cfg = (r["outer_lr"], r["outer_momentum"])
            if cfgs is not None and cfg in cfgs:
                cfgs[cfg]["auto"].setdefault(r["seed"], r)
    return out


def spectra_by_cell(lines: list[dict]) -> dict:
    """cell -> method -> {"error": [...], "flatness": [...]} over every matrix of every captured round."""
    out: dict = defaultdict(lambda: defaultdict(lambda: {"error": [], "flatness": []}))
    for line in lines:
        cell = _cell_of_key(ast.literal_eval(line["key"]))
        for mat in line["matrices"].values():
            for m, (err, flat) in mat["methods"].items():
                out[cell][m]["error"].append(err)
                out[cell][m]["flatness"].append(flat)
    return out


def _paired(a: dict, b: dict) -> dict | None:
    """a − b on the test split over the seeds both finished, with its t interval."""
    seeds = sorted(
        s for s in set(a) & set(b) if a[s]["final_test_loss"] is not None and b[s]["final_test_loss"] is not None
    )
    if not seeds:
        return None
    d = [a[s]["final_test_loss"] - b[s]["final_test_loss"] for s in seeds]
    lo, hi = t_interval(d)
    return {"seeds": seeds, "per_seed": d, "mean": statistics.fmean(d), "t_lo": lo, "t_hi": hi}


def summarize_v4(recs: list[dict], spectra: list[dict]) -> dict:
    """{cell label: {"cell", "config", "methods": {method: {test, change, error, flatness, fallbacks}}}}."""
    spec = spectra_by_cell(spectra)
    out = {}
    for cell, cfgs in sorted(runs_by_cell(recs).items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        for (lr, mu), methods in sorted(cfgs.items(), key=lambda kv: str(kv[0])):
            anchor = methods.get(ANCHOR, {})
            rows = {}
            for m in sorted(methods, key=lambda m: ORDER.index(m) if m in ORDER else -1):
                runs = methods[m]
                test = {s: r["final_test_loss"] for s, r in sorted(runs.items())}
                sp = spec.get(cell, {}).get(m)
                fb = [r["flatten_stats"] for r in runs.values() if r.get("flatten_stats")]
                rows[m] = {
                    "test": test,
                    "change": None if m == ANCHOR else _paired(runs, anchor),
                    "error": None if not sp else _quantiles(sp["error"]),
                    "flatness": None if not sp else _quantiles(sp["flatness"]),
                    "fallbacks": None
                    if not fb
                    else {"matrices": sum(f["matrices"] for f in fb), "recomputed": sum(f["recomputed"] for f in fb)},
                    "cpu_s": mean_of(r.get("cpu_s") for r in runs.values()),
                }
            label = cell_label(cell) + f", IsoLoCo {lr:g} @ {mu:g}"
            out[label] = {"cell": dict(zip(CELL_KEYS + SETTING_KEYS, cell)), "config": [lr, mu], "methods": rows}
    return out


def _quantiles(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def within_budget(change: dict | None) -> bool:
    return (
        change is not None
        and len(change["seeds"]) >= 2
        and abs(change["mean"]) <= BUDGET
        and change["t_lo"] <= 0 <= change["t_hi"]
    )


def verdict(s: dict) -> dict:
    """Per method: the cells it ran in (≥ 2 seeds paired with svd) and those where it is within the
    budget; "loosest": the first of ORDER (cuts aside) within it in every cell that ran at all;
    "loosest_method": the same among the methods one would run (the noise diagnostics aside too);
    "cut_gains": per rank cut the cells where its gain's t interval excludes 0."""
    cells = list(s)
    per = {}
    for m in ORDER:
        ran = [
            c
            for c in cells
            if (s[c]["methods"].get(m) or {}).get("change") and len(s[c]["methods"][m]["change"]["seeds"]) >= 2
        ]
        ok = [c for c in ran if within_budget(s[c]["methods"][m]["change"])]
        per[m] = {"ran": ran, "within": ok, "every_cell": bool(ran) and ran == ok and len(ran) == len(cells)}
    loosest = next((m for m in ORDER if not m.startswith(CUT_PREFIX) and per[m]["every_cell"]), None)
    real = (m for m in ORDER if not m.startswith((CUT_PREFIX, NOISE_PREFIX)) and per[m]["every_cell"])
    loosest_method = next(real, None)
    gains = {
        m: [c for c in per[m]["ran"] if s[c]["methods"][m]["change"]["t_hi"] < 0]
        for m in ORDER
        if m.startswith(CUT_PREFIX)
    }
    return {"per_method": per, "loosest": loosest, "loosest_method": loosest_method, "cut_gains": gains}


def _f(x, spec="+.3f"):
    return "—" if x is None or x != x else format(x, spec)


def markdown_v4(s: dict) -> str:
    lines = [
        "| cell | method | what it does | test loss (seeds) | change vs svd, test (per seed) | 95 % t | "
        "error vs exact: mean / max | flatness: mean / max | recomputed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in s.values():
        for m, e in row["methods"].items():
            test = [v for v in e["test"].values() if v is not None]
            sd = f" ± {statistics.stdev(test):.3f}" if len(test) > 1 else ""
            tl = f"{statistics.fmean(test):.3f}{sd} ({len(test)})" if test else "diverged"
            c = e["change"]
            ch = (
                "(anchor)"
                if m == ANCHOR
                else ("—" if not c else f"{_f(c['mean'])} (" + ", ".join(_f(x) for x in c["per_seed"]) + ")")
            )
            ci = "—" if not c else f"[{_f(c['t_lo'])}, {_f(c['t_hi'])}]"
            er = "—" if not e["error"] else f"{e['error']['mean']:.2g} / {e['error']['max']:.2g}"
            fl = "—" if not e["flatness"] else f"{e['flatness']['mean']:.2g} / {e['flatness']['max']:.2g}"
            fb = "—" if not e["fallbacks"] else f"{e['fallbacks']['recomputed']} of {e['fallbacks']['matrices']}"
            lines.append(
                f"| {short_label(row['cell'])} | `{m}` | {WHAT.get(m, '')} | {tl} | {ch} | {ci} | {er} | {fl} | {fb} |"
            )
    return "\n".join(lines)


def markdown_verdict(v: dict, s: dict) -> str:
    n = len(s)
    lines = [
        f"Within the budget (|mean change| ≤ {BUDGET} and the t interval holds 0), per method, of {n} cell(s) run:"
    ]
    for m, p in v["per_method"].items():
        if p["ran"]:
            missing = n - len(p["ran"])
            lines.append(
                f"- `{m}`: {len(p['within'])} of {len(p['ran'])} cells it ran in"
                + (f" ({missing} cell(s) not run)" if missing else "")
            )
    name = lambda m: f"`{m}`" if m else "none"  # noqa: E731
    lines.append(f"- loosest flatten within the budget in every cell: {name(v['loosest'])}")
    lines.append(f"- loosest method (the noise diagnostics aside) within it in every cell: {name(v['loosest_method'])}")
    for m, cells in v["cut_gains"].items():
        if v["per_method"][m]["ran"]:
            lines.append(f"- `{m}`: gain (t interval below 0) in {len(cells)} cell(s)")
    return "\n".join(lines)


def plot_v4(s: dict, path) -> None:
    """Left: each method's loss change vs svd per cell (t interval, mean, seeds), the ±0.01 budget shaded;
    right: the same means against the method's mean error on the cell's Δ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in ORDER if any(m in row["methods"] for row in s.values())]
    cells = list(s)
    colors = plt.get_cmap("tab10").colors
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * max(len(methods), 3) + 1.8))
    for j, label in enumerate(cells):
        row = s[label]
        name = short_label(row["cell"])
        off = (j - (len(cells) - 1) / 2) * 0.18
        first = True
        for i, m in enumerate(methods):
            c = (row["methods"].get(m) or {}).get("change")
            if not c:
                continue
            y = i + off
            if c["t_lo"] == c["t_lo"]:
                ax.plot([c["t_lo"], c["t_hi"]], [y, y], color=colors[j % 10], lw=1)
            ax.plot(c["per_seed"], [y] * len(c["per_seed"]), ".", color="k", ms=3)
            ax.plot([c["mean"]], [y], "o", color=colors[j % 10], ms=5, label=name if first else None)
            first = False
            err = row["methods"][m].get("error")
            if err:
                ax2.plot([err["mean"]], [c["mean"]], "o", color=colors[j % 10])
                ax2.annotate(m, (err["mean"], c["mean"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.axvspan(-BUDGET, BUDGET, color="tab:green", alpha=0.12)
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(range(len(methods)), methods, fontsize=8)
    ax.set_xlabel("IsoLoCo test loss: method − svd, paired per seed (nats/byte)")
    ax.set_title("Study v4: loss change per flatten (line: 95 % t; green: ±0.01)", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax2.set_xscale("log")
    ax2.axhspan(-BUDGET, BUDGET, color="tab:green", alpha=0.12)
    ax2.axhline(0, color="grey", lw=1)
    ax2.set_xlabel("relative error vs exact on the cell's Δ (mean over matrices, rounds 1 / mid / last)")
    ax2.set_ylabel("mean loss change vs svd")
    ax2.set_title("Loss change against what the flatten does", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
