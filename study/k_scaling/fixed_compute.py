"""Study v6, part C: K at fixed compute. Part A's token budget (the horizon cell: K 4, H 30, 300 rounds, ≈ 19.7
tokens per parameter) split over K workers for fewer rounds (K × rounds = 1,200), each method tuned in that cell by
v3's rule (study/common/grids.py `best_config`: seed-0 pick on the selection split, seeds 1 and 2 of the pick),
IsoLoCo − DiLoCo on the test split at the end, paired per seed with a 95 % Student-t interval, beside the same K's
gap after 10 rounds (v3's fixed-rounds cells). summarize.py writes the table into horizon/summary_v6.json
("fixed_compute") and the plot beside this file.

    python study/summarize.py     # prints this table among the others, writes study/k_scaling/study_v6_fixed_compute.png
"""

from __future__ import annotations

from study.common.grids import cell_picks
from study.common.stats import interval_text, markdown_table, paired_t
from study.horizon.v6 import HORIZON, TINY_PARAMS

#: K -> outer rounds at part A's token budget (K × rounds = 1,200 worker-rounds of H 30 × 4 × 64 tokens)
FIXED_COMPUTE = {2: 600, 4: 300, 8: 150, 16: 75}


def _final_gap(a: dict, b: dict) -> dict | None:
    """a − b on the test split at the runs' last round, paired over the seeds both picks have."""
    return paired_t(*({s: r["final_test_loss"] for s, r in x["runs"].items()} for x in (a, b)))


def summarize_fixed_compute(recs: list[dict], base: tuple = HORIZON) -> list[dict]:
    """Part C: per K, IsoLoCo − DiLoCo at the end of part A's token budget (each method tuned in that cell), beside
    the same K's gap after 10 rounds (v3's fixed-rounds cells, more tokens at larger K). Rows only for the K with
    both picks at fixed compute."""
    rows = []
    for K, rounds in sorted(FIXED_COMPUTE.items()):
        cell = (K, base[1], rounds, *base[3:])
        picks = cell_picks(recs, cell)
        if "diloco" not in picks or "isoloco" not in picks:
            continue
        short = cell_picks(recs, (K, base[1], 10, *base[3:]))
        row = {
            "workers": K,
            "rounds": rounds,
            "tokens_per_param": K * base[1] * rounds * base[5] * base[6] / TINY_PARAMS,
            "picks": {m: {k: v for k, v in p.items() if k != "runs"} for m, p in picks.items()},
            "gap": _final_gap(picks["isoloco"], picks["diloco"]),
            "gap_10_rounds": _final_gap(short["isoloco"], short["diloco"]) if len(short) >= 2 else None,
        }
        if "ddp" in picks:
            row["to_ddp"] = {m: _final_gap(picks[m], picks["ddp"]) for m in ("diloco", "isoloco")}
        rows.append(row)
    return rows


def markdown_fixed_compute(rows: list[dict]) -> str:
    header = ["K", "rounds (tokens/param)", "DiLoCo pick", "IsoLoCo pick", "IsoLoCo − DiLoCo at fixed compute"]
    out = []
    for r in rows:
        d, i = r["picks"]["diloco"], r["picks"]["isoloco"]
        out.append([r["workers"], f"{r['rounds']} ({r['tokens_per_param']:.1f})", f"{d['lr']} @ {d['momentum']}",
                    f"{i['lr']} @ {i['momentum']}", interval_text(r["gap"]), interval_text(r["gap_10_rounds"])])  # fmt: skip
    return markdown_table(header + ["after 10 rounds"], out)


def plot_fixed_compute(rows: list[dict], path) -> None:
    """IsoLoCo − DiLoCo against K: at part A's token budget (fewer rounds at larger K) and after 10 rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["gap"]]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label, colour in (
        ("gap", "fixed compute (≈ 19.7 tokens/param)", "C0"),
        ("gap_10_rounds", "10 rounds", "C1"),
    ):
        pts = [(r["workers"], r[key]) for r in rows if r.get(key)]
        if not pts:
            continue
        ks = [k for k, _ in pts]
        mean = [g["mean"] for _, g in pts]
        err = [[g["mean"] - g["t_lo"] for _, g in pts], [g["t_hi"] - g["mean"] for _, g in pts]]
        ax.errorbar(ks, mean, yerr=err, marker="o", capsize=3, color=colour, label=f"{label}, 95 % t")
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["workers"] for r in rows], [str(r["workers"]) for r in rows])
    ax.set_xlabel("workers K")
    ax.set_ylabel("IsoLoCo − DiLoCo, test loss (nats/byte)")
    ax.set_title("Study v6 C: K at fixed compute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
