"""Summarize study/results/*.jsonl: per-cell table (markdown), study/summary.json and PNGs.

    python study/summarize.py            # prints the markdown tables used in README.md

For each cell (K, H) and method, each outer lr is scored by its mean final held-out loss over the
seeds; the best lr per method is reported with its mean, its seed-to-seed spread (sample std and
min..max) and the paired difference IsoLoCo − DiLoCo (same seed = same init and data), whose
mean and spread say whether the gap is larger than the noise.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(folder: Path) -> tuple[list[dict], dict]:
    """Unique runs, and how many repeats of a run were found and whether each matched exactly
    (a run repeated by two processes must give bit-identical losses: the loop is deterministic)."""
    recs, seen, dup = [], {}, {"repeats": 0, "identical": 0}
    for f in sorted(folder.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            k = (r["seed"], r["workers"], r["inner_steps"], r["mode"], r["outer_lr"])
            if k in seen:
                dup["repeats"] += 1
                dup["identical"] += seen[k]["heldout_loss"] == r["heldout_loss"]
                continue
            seen[k] = r
            recs.append(r)
    return recs, dup


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else float("nan")


def summarize(recs: list[dict]) -> dict:
    by = defaultdict(dict)  # (K, H, mode, lr) -> {seed: final}
    for r in recs:
        by[(r["workers"], r["inner_steps"], r["mode"], r["outer_lr"])][r["seed"]] = r["final_loss"]
    cells = sorted({(k[0], k[1]) for k in by}, key=lambda c: (c[1], c[0]))
    out = []
    for K, H in cells:
        methods = {}
        for mode in ("ddp", "diloco", "isoloco", "isoloco-sgd"):
            grid = {k[3]: v for k, v in by.items() if k[:3] == (K, H, mode)}
            if not grid:
                continue
            scored = {}
            for lr, seeds in grid.items():
                vals = [v for v in seeds.values()]
                ok = [v for v in vals if v is not None]
                scored[lr] = {
                    "seeds": sorted(seeds),
                    "finals": [seeds[s] for s in sorted(seeds)],
                    "mean": statistics.fmean(ok) if len(ok) == len(vals) and ok else None,
                    "std": _std(ok) if len(ok) == len(vals) else None,
                    "diverged": len(vals) - len(ok),
                }
            # lrs are ranked on the seeds every grid point has (≥ 2), so an extra seed run at one
            # point, or a lone lucky seed, cannot decide; diverged points never win
            multi = [set(x["seeds"]) for x in scored.values() if len(x["seeds"]) >= 2]
            common = set.intersection(*multi) if multi else set()
            finite = {lr: s for lr, s in scored.items()
                      if s["mean"] is not None and common and common <= set(s["seeds"])}
            rank = lambda lr: statistics.fmean(finite[lr]["finals"][finite[lr]["seeds"].index(x)] for x in common)
            best = min(finite, key=rank) if finite else None
            methods[mode] = {"grid": {str(lr): s for lr, s in scored.items()}, "best_lr": best,
                             "best": finite.get(best), "ranked": [str(x) for x in sorted(finite, key=lambda v: -1 if v is None else v)],
                             "ranked_on_seeds": sorted(common)}
        cell = {"workers": K, "inner_steps": H, "methods": methods}
        released = (methods.get("diloco", {}).get("grid", {}).get("0.7"),
                    methods.get("isoloco", {}).get("grid", {}).get("1.8"))
        best = (methods.get("diloco", {}).get("best"), methods.get("isoloco", {}).get("best"))
        for name, (d, i) in (("paired_released", released), ("paired_best", best)):
            if d and i:
                common = sorted(set(d["seeds"]) & set(i["seeds"]))
                diffs = [i["finals"][i["seeds"].index(s)] - d["finals"][d["seeds"].index(s)] for s in common]
                if any(x is None for x in diffs):
                    continue
                cell[name] = {"seeds": common, "diffs": diffs,
                              "mean": statistics.fmean(diffs) if diffs else None, "std": _std(diffs)}
        out.append(cell)
    return {"cells": out}


def _f(x, nd=4):
    return "—" if x is None or x != x else f"{x:.{nd}f}"


def _paired(p) -> str:
    if not p or p["mean"] is None:
        return "—"
    return f"{p['mean']:+.3f} ({', '.join(f'{x:+.3f}' for x in p['diffs'])})"


def _ms(e) -> str:
    return "—" if not e or e["mean"] is None else f"{e['mean']:.3f} ± {_f(e['std'], 3)}"


def markdown(summary: dict) -> str:
    lines = [
        "Released outer configs (DiLoCo lr 0.7 μ 0.9, IsoLoCo lr 1.8 μ 0.8); mean ± std over seeds:",
        "",
        "| K | H | seeds | DDP | DiLoCo | IsoLoCo | IsoLoCo − DiLoCo, paired (per seed) | Iso-C μ=0 lr 1.0 / 3.0 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in summary["cells"]:
        m = c["methods"]
        g = lambda mode, lr: m.get(mode, {}).get("grid", {}).get(lr)
        d, i = g("diloco", "0.7"), g("isoloco", "1.8")
        seeds = len(c["paired_released"]["seeds"]) if "paired_released" in c else "—"
        lines.append(f"| {c['workers']} | {c['inner_steps']} | {seeds} | {_ms(g('ddp', 'None'))} | {_ms(d)} | "
                     f"{_ms(i)} | {_paired(c.get('paired_released'))} | "
                     f"{_ms(g('isoloco-sgd', '1.0'))} / {_ms(g('isoloco-sgd', '3.0'))} |")
    lines += [
        "",
        "Each method at its best outer lr of its grid (ranked on the seeds all its grid points share):",
        "",
        "| K | H | DiLoCo best lr | DiLoCo | IsoLoCo best lr | IsoLoCo | IsoLoCo − DiLoCo, paired (per seed) |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in summary["cells"]:
        d, i = c["methods"].get("diloco", {}), c["methods"].get("isoloco", {})
        grids = lambda e: "/".join(e.get("ranked", [])) if e else ""
        lines.append(f"| {c['workers']} | {c['inner_steps']} | {d.get('best_lr')} of {grids(d)} | "
                     f"{_ms(d.get('best'))} | {i.get('best_lr')} of {grids(i)} | {_ms(i.get('best'))} | "
                     f"{_paired(c.get('paired_best'))} |")
    lines += ["", "Every run (final held-out loss, nats/byte; `div` = diverged):", "",
              "| K | H | method | outer lr | mean | std | per seed (seed order) |", "|---|---|---|---|---|---|---|"]
    for c in summary["cells"]:
        for mode, e in c["methods"].items():
            for lr, s in sorted(e["grid"].items(), key=lambda t: -1 if t[0] == "None" else float(t[0])):
                per = ", ".join("div" if v is None else f"{v:.4f}" for v in s["finals"])
                lines.append(f"| {c['workers']} | {c['inner_steps']} | {mode} | {'-' if lr == 'None' else lr} | "
                             f"{_f(s['mean'])} | {_f(s['std'], 3)} | {per} |")
    return "\n".join(lines)


def plots(summary: dict, recs: list[dict], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    colors = {"ddp": "k", "diloco": "tab:blue", "isoloco": "tab:red", "isoloco-sgd": "tab:green"}
    for ax, H, xs_key, title in ((axes[0], 30, "workers", "final loss vs K (H = 30)"),
                                 (axes[1], None, "inner_steps", "final loss vs H (K = 4)")):
        cells = [c for c in summary["cells"] if (c["inner_steps"] == H if H else c["workers"] == 4)]
        for mode, col in colors.items():
            pts = [(c[xs_key], c["methods"][mode]["best"]) for c in cells
                   if mode in c["methods"] and c["methods"][mode]["best"]]
            if pts:
                x = [p[0] for p in pts]
                ax.errorbar(x, [p[1]["mean"] for p in pts],
                            yerr=[0 if p[1]["std"] != p[1]["std"] else p[1]["std"] for p in pts],
                            marker="o", capsize=3, color=col, label=mode)
        ax.set_xlabel(xs_key.replace("_", " "))
        ax.set_ylabel("final held-out loss (nats/byte), best outer lr")
        ax.set_title(title)
        xs = sorted({c[xs_key] for c in cells})
        ax.set_xticks(xs, [str(v) for v in xs])
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    cell = next((c for c in summary["cells"] if (c["workers"], c["inner_steps"]) == (4, 30)), None)
    if cell:
        for mode, col in colors.items():
            e = cell["methods"].get(mode)
            if not e or e["best"] is None:
                continue
            for r in recs:
                if (r["workers"], r["inner_steps"], r["mode"], r["outer_lr"]) == (4, 30, mode, e["best_lr"]):
                    ax.plot(r["tokens"][1:], r["heldout_loss"][1:], color=col, alpha=0.7,
                            label=mode if r["seed"] == min(e["best"]["seeds"]) else None)
        ax.set_xlabel("training tokens (all workers)")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title("K = 4, H = 30, every seed, best outer lr")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "study.png", dpi=110)
    plt.close(fig)


def main() -> None:
    recs, dup = load(HERE / "results")
    s = summarize(recs)
    s["runs"] = len(recs)
    s["repeated_runs"] = dup
    s["cpu_s_total"] = sum(r.get("cpu_s", 0.0) for r in recs)
    s["wall_s_total"] = sum(r["wall_s"] for r in recs)
    (HERE / "summary.json").write_text(json.dumps(s, indent=1))
    plots(s, recs, HERE)
    print(markdown(s))
    print(f"\n{len(recs)} runs, {s['cpu_s_total'] / 60:.1f} CPU-min, {s['wall_s_total'] / 60:.1f} run-wall-min; "
          f"{dup['repeats']} runs repeated by a second process, {dup['identical']} of them bit-identical")


if __name__ == "__main__":
    main()
