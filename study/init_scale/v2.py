"""Study v2's summary and tables, for summarize.py.

Study v2 records ("study": "v2" in the JSONL) are summarized per (init, vocab, K, H, rounds) cell:
every method's final loss per seed, the paired gaps to DiLoCo at released and tuned outer lrs, and the
divergence measurements averaged over rounds (summarize_v2, markdown_v2), with the (cell, seed) points
and correlations between DiLoCo's divergence and the gap (gap_points, correlations). v1 runs join the
v2 cells as GPT-2-init byte-level runs without divergence measurements (the loop is deterministic: a
v2 run that repeats a v1 configuration gives the same loss, checked in summary_v2, whose result is
what study/init_scale/summary_v2.json holds). The figures are v2_plots.py's.
"""

from __future__ import annotations

import statistics
from collections import defaultdict


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


def summary_v2(recs: list[dict]) -> tuple[dict, list[dict]]:
    """The v2 summary (what summary_v2.json holds) of the runs `common.records.load` read, and the v2 runs."""
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
