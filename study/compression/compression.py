"""Compressed exchange: does IsoLoCo's gain over DiLoCo survive 8-, 4- and 2-bit pseudo-gradients?

The runs are study v3 records whose settings carry "compress" (a compress.parse spec: format, block, β and, where
set, the error feedback's placement); the uncompressed runs of the same cell are the v3 grid's (study/common/grids.py
`grids`). In each (spec, method) the config is v3's rule (`best_config`: the lowest mean selection loss over the
seeds every config has), so a spec run at one lr takes that lr and a retuned spec (the 2-bit cells, three lrs)
takes its best. Reported on the test split, paired per seed, with 95 % Student-t intervals:

    vs 32-bit      the method's compressed test loss − its own uncompressed pick's
    Iso − DiLoCo   IsoLoCo − DiLoCo at the same spec
    EF             with error feedback − without, at the same format and block (each at its own pick)

and the bytes one worker sends per round (both legs, scales included; the record's bytes_per_worker_per_round),
in all over the run, against test loss: study_compress.png, one panel per cell and one curve per method through
its Pareto front.

    python study/summarize.py     # prints this table among the others, writes study/compression/summary_compress.json
                                  # and the plot
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from study.common.grids import best_config, grids, record_cell
from study.common.stats import fmt, paired_t

METHODS = ("diloco", "isoloco")
UNCOMPRESSED = "fp32"  # the uncompressed route's row: a ring all-reduce in float32
OFF_SCALE = 0.3  # nats above the method's own fp32: a pick that costs more is counted, not drawn


def compressed_grids(recs: list[dict]) -> dict:
    """cell -> spec -> method -> (outer lr, μ) -> seed -> record, for the v3 records with a "compress" setting."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(dict))))
    for r in recs:
        spec = (r.get("v3") or {}).get("compress")
        if r.get("study") != "v3" or spec is None or r["v3"].get("outer_schedule", "constant") != "constant":
            continue
        if r["mode"] in METHODS:
            out[record_cell(r)][spec][r["mode"]][(r.get("outer_lr"), r.get("outer_momentum"))].setdefault(r["seed"], r)
    return out


def _split(spec: str) -> tuple[str, str]:
    """("int2:128", "0.95") of "int2:128:0.95[:rounding[:placement]]": the format and block, and the rest (the
    error feedback and what follows it; "none" when off)."""
    parts = spec.split(":")
    head = ":".join(parts[:2])
    rest = ":".join(parts[2:]) or "none"
    return head, rest


def _paired(a: dict | None, b: dict | None) -> dict | None:
    """a − b on the test split over the seeds both picks have, with its 95 % t interval."""
    return paired_t(a["test"], b["test"]) if a and b else None


def _pick(grid: dict) -> dict | None:
    """v3's best config of one method's grid, with the bytes one worker sends per round (from its records)."""
    b = best_config(grid)
    if b is None:
        return None
    runs = grid[(b["lr"], b["momentum"])]
    sent = {r.get("bytes_per_worker_per_round") for r in runs.values()} - {None}
    fp32 = {r.get("allreduce_fp32_bytes_per_worker_per_round") for r in runs.values()} - {None}
    b["bytes_per_round"] = sent.pop() if len(sent) == 1 else None
    b["allreduce_fp32_bytes_per_round"] = fp32.pop() if len(fp32) == 1 else None
    b["rounds"] = next(iter(runs.values()))["rounds"]
    tests = [v for v in b["test"].values() if v is not None]
    b["test_mean"] = statistics.fmean(tests) if tests else None
    return b


def summarize_compress(recs: list[dict]) -> dict:
    """{cell label: {"rows": {spec: {method: pick, "iso_minus_diloco": gap, "<method>_vs_32bit": gap}},
    "ef": {format:block: {method: with − without}}}} for every cell with compressed runs."""
    from study.common.grids import cell_label

    plain = grids(recs)
    out = {}
    for cell, specs in sorted(compressed_grids(recs).items(), key=lambda kv: str(kv[0])):
        rows: dict = {}
        base = {m: _pick(plain.get(cell, {}).get(m, {})) for m in METHODS}
        fp32_bytes = None
        for spec, methods in specs.items():
            rows[spec] = {m: _pick(methods.get(m, {})) for m in METHODS}
            fp32_bytes = fp32_bytes or next(
                (p["allreduce_fp32_bytes_per_round"] for p in rows[spec].values() if p), None
            )
        for p in base.values():
            if p is not None and p.get("bytes_per_round") is None:  # uncompressed v3 records predate the bytes
                p["bytes_per_round"] = fp32_bytes
        rows[UNCOMPRESSED] = base
        for row in rows.values():
            row["iso_minus_diloco"] = _paired(row.get("isoloco"), row.get("diloco"))
            for m in METHODS:
                row[f"{m}_vs_32bit"] = _paired(row.get(m), base.get(m))
        ef: dict = defaultdict(dict)
        for spec, row in rows.items():
            head, rest = _split(spec)
            off = rows.get(f"{head}:none")
            if spec == UNCOMPRESSED or rest == "none" or off is None:
                continue
            for m in METHODS:
                ef[f"{head} {rest}"][m] = _paired(row.get(m), off.get(m))
        out[cell_label(cell)] = {"rows": rows, "ef": dict(ef), "fp32_bytes_per_round": fp32_bytes}
    return out


def _order(spec: str) -> tuple:
    """Table order: 32-bit first, then by bits (8, 4, 2), error feedback off before on."""
    if spec == UNCOMPRESSED:
        return (0,)
    head, rest = _split(spec)
    bits = {"int8": 8, "fp8": 8, "int4": 4, "fp4": 4, "stat4": 4, "int2": 2, "stat2": 2}.get(head.split(":")[0], 0)
    return (1, -bits, head, rest != "none", rest)


def _iv(g: dict | None) -> str:
    if not g:
        return "—"
    return f"{fmt(g['mean'])} [{fmt(g['t_lo'])}, {fmt(g['t_hi'])}]"


def markdown_compress(s: dict) -> str:
    lines = []
    for label, c in s.items():
        fp32 = c["fp32_bytes_per_round"]
        lines += [
            f"{label}: test loss (mean of the seeds), paired differences with 95 % t intervals.",
            "",
            "| spec | bytes/round vs fp32 | DiLoCo (lr @ μ) | vs 32-bit | IsoLoCo (lr @ μ) | vs 32-bit | IsoLoCo − DiLoCo |",
            "|---|---|---|---|---|---|---|",
        ]
        for spec in sorted(c["rows"], key=_order):
            row = c["rows"][spec]
            sent = next((p["bytes_per_round"] for m in METHODS if (p := row.get(m))), None)
            ratio = "—" if not sent or not fp32 else f"{sent / fp32:.3f}"
            cells = []
            for m in METHODS:
                p = row.get(m)
                edge = ", edge" if p and p["edge"] and len(p["grid"]) > 1 else ""  # a lone lr is no tuned grid
                cells.append("—" if not p else f"{fmt(p['test_mean'], '.4f')} ({p['lr']} @ {p['momentum']}{edge})")
                cells.append("" if spec == UNCOMPRESSED else _iv(row.get(f"{m}_vs_32bit")))
            lines.append(f"| {spec} | {ratio} | {' | '.join(cells)} | {_iv(row.get('iso_minus_diloco'))} |")
        if c["ef"]:
            lines += ["", "| error feedback (with − without) | DiLoCo | IsoLoCo |", "|---|---|---|"]
            for what, g in sorted(c["ef"].items()):
                lines.append(f"| {what} | {_iv(g.get('diloco'))} | {_iv(g.get('isoloco'))} |")
        lines.append("")
    return "\n".join(lines).rstrip()


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both bytes and loss (fewer or equal bytes and lower loss), by bytes."""
    front, best = [], float("inf")
    for x, y in sorted(points, key=lambda p: (p[0], p[1])):
        if y < best:
            front.append((x, y))
            best = y
    return front


def plot_compress(s: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not s:
        return
    fig, axes = plt.subplots(1, len(s), figsize=(7.5 * len(s), 4.5), squeeze=False)
    for ax, (label, c) in zip(axes[0], sorted(s.items(), key=lambda kv: _cell_order(kv[0]))):
        _plot_cell(ax, label, c)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cell_order(label: str) -> tuple:
    """Panels by K then rounds ("K 4, … R 10" before "K 16, … R 75"), not by the label's text."""
    fields = dict(f.split(" ", 1) for f in label.split(", ") if " " in f)
    return int(fields.get("K", 0)), int(fields.get("R", 0)), label


def _plot_cell(ax, label: str, c: dict) -> None:
    """One cell's panel: every (spec, method) pick at its MiB over the run and its test loss, each method's Pareto
    front drawn and named. A pick more than OFF_SCALE above its own method's fp32 is left out of the panel and its
    front (so it cannot stretch the axis) and counted in the title."""
    off, shown = 0, []
    for color, m in zip(("C1", "C0"), METHODS):
        own = c["rows"].get(UNCOMPRESSED, {}).get(m)
        top = own["test_mean"] + OFF_SCALE if own and own["test_mean"] is not None else None
        pts = {}
        for spec, row in c["rows"].items():
            p = row.get(m)
            if not p or not p.get("bytes_per_round") or p["test_mean"] is None:
                continue
            x, y = p["bytes_per_round"] * p["rounds"] / 2**20, p["test_mean"]
            if top is not None and y > top:
                off += 1
                continue
            pts[(x, y)] = spec
            shown.append(y)
            ef = spec != UNCOMPRESSED and _split(spec)[1] != "none"
            ax.scatter([x], [y], color=color, marker="o", s=22, facecolors=color if ef else "none")
        front = pareto(list(pts))
        ax.plot([p[0] for p in front], [p[1] for p in front], color=color, label=f"{m} (Pareto front)")
        for x, y in front:
            ax.annotate(pts[(x, y)], (x, y), fontsize=7, color=color, xytext=(4, -10 if m == "isoloco" else 5),
                        textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("MiB sent per worker over the run (both legs, scales included)")
    ax.set_ylabel("test loss (nats/byte), mean of the seeds")
    note = f"; {off} off the scale (> its method's fp32 + {OFF_SCALE})" if off else ""
    ax.set_title(f"Compressed exchange: {label}\nfilled: with error feedback; open: without{note}", fontsize=9)
    ax.legend()
