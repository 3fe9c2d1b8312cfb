"""Workers as they really arrive: IsoLoCo against DiLoCo when a quarter of the workers miss every round, when one
worker is faulty (its Δ × 10), and when that worker is clipped to the median norm (the plan: arrival_plan.sh).

Each condition's runs are paired by seed with the same method's clean run (every worker delivering alike: the
same cell, lr and μ, from v3 at 10 rounds or v6/v7 at 75) and across methods. The table gives, per cell and
condition, IsoLoCo − DiLoCo on the test split at the end and each method's cost against its own clean run, with
95 % Student-t intervals.

    python study/summarize.py     # writes study/arrival/summary_arrival.json, prints the table
"""

from __future__ import annotations

from collections import defaultdict

from study.common.stats import interval_text, markdown_table, paired_t

RAGGED = ("drop", "faulty", "merge_clip")
METHODS = ("diloco", "isoloco")


def condition(r: dict) -> tuple:
    """(drop, faulty, merge_clip) of a run, None where unset."""
    v3 = r.get("v3") or {}
    return tuple(v3.get(k) for k in RAGGED)


def config(r: dict) -> tuple:
    """What pairs a ragged run with its clean one: cell, method, lr and every setting but the ragged ones."""
    v3 = r.get("v3") or {}
    rest = tuple(sorted((k, v) for k, v in v3.items() if k not in RAGGED))
    return (r["workers"], r["inner_steps"], r["rounds"], r["mode"], r["outer_lr"], rest)


def label(c: tuple) -> str:
    drop, faulty, clip = c
    parts = [f"drop {drop:g}" if drop else "", f"faulty ×{faulty:g}" if faulty else "", f"clip {clip}" if clip else ""]
    return ", ".join(p for p in parts if p) or "clean"


def summarize_arrival(recs: list[dict]) -> list[dict]:
    """One row per (K, rounds, condition) with both methods run: IsoLoCo − DiLoCo, and each method − its clean run."""
    v3 = [r for r in recs if r.get("study") == "v3" and r.get("mode") in METHODS and r.get("eval_split") == "halves"]
    clean = {(config(r), r["seed"]): r["final_test_loss"] for r in v3 if condition(r) == (None, None, None)}
    # (K, rounds, condition) -> mode -> (lr, μ) -> seed -> (test, clean)
    runs: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
    for r in v3:
        c = condition(r)
        if c != (None, None, None):
            cfg = (r["outer_lr"], r["v3"].get("mu"))
            runs[(r["workers"], r["rounds"], c)][r["mode"]][cfg][r["seed"]] = (
                r["final_test_loss"],
                clean.get((config(r), r["seed"])),
            )
    rows = []
    for (K, rounds, c), by_cfg in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], repr(kv[0][2]))):
        if not all(m in by_cfg for m in METHODS):
            continue
        # each method's config with the most seeds under this condition (the plan runs one)
        pick = {m: max(sorted(by_cfg[m].items(), key=repr), key=lambda kv: len(kv[1])) for m in METHODS}
        by_mode = {m: pick[m][1] for m in METHODS}
        test = {m: {s: v[0] for s, v in by_mode[m].items()} for m in METHODS}
        row = {
            "workers": K,
            "rounds": rounds,
            "condition": label(c),
            "config": {m: pick[m][0] for m in METHODS},
            "iso_minus_diloco": paired_t(test["isoloco"], test["diloco"]),
            "cost": {
                m: paired_t(test[m], {s: v[1] for s, v in by_mode[m].items() if v[1] is not None}) for m in METHODS
            },
        }
        rows.append(row)
    return rows


def markdown_arrival(rows: list[dict]) -> str:
    header = ["K × rounds", "condition", "IsoLoCo − DiLoCo", "DiLoCo − its clean run", "IsoLoCo − its clean run"]
    gaps = lambda r: [interval_text(g) for g in (r["iso_minus_diloco"], r["cost"]["diloco"], r["cost"]["isoloco"])]
    return markdown_table(header, [[f"{r['workers']} × {r['rounds']}", r["condition"], *gaps(r)] for r in rows])
