"""Render the benchmark JSON files into plots and one markdown page.

    python bench/report.py                      every bench/results/*.json → <name>.png + README.md
    python bench/report.py RUN.json --table     also print a short table of RUN.json to stdout
    python bench/report.py RUN.json --no-write  print only

The JSON files come from `pytest bench/ --benchmark-only --benchmark-json bench/results/<name>.json`;
besides pytest-benchmark's timings each holds the ceilings measured in the same run (key "isoloco")
and, per case, the extra_info written by bench/test_bench_*.py. Every speed ratio below divides two
medians of the same run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# The targets the project set itself; each is checked against what a run measured, never assumed.
TARGETS = [
    # (device, what, description)
    (
        "cpu",
        "flatten_speedup",
        dict(
            set="llama-tiny",
            impl="auto",
            base="svd-loop",
            ratio=2.0,
            err=1e-4,
            text="CPU: auto ≥ 2× the per-matrix svd loop on llama-tiny, error ≤ 1e-4",
        ),
    ),
    (
        "cuda",
        "flatten_speedup",
        dict(
            set="llama-178m",
            impl="auto",
            base="svd-loop",
            ratio=100.0,
            err=1e-3,
            text="GPU: auto ≥ 100× the per-matrix svd loop on llama-178m, error ≤ 1e-3",
        ),
    ),
    (
        "cpu",
        "nesterov_speedup",
        dict(impl="fused", base="sgd-foreach", ratio=1.0, text="CPU: fused Nesterov ≥ 1.0× SGD(foreach), largest set"),
    ),
    (
        "cuda",
        "nesterov_copy",
        dict(impl="fused", frac=0.9, text="GPU: fused Nesterov ≥ 90 % of copy bandwidth, largest set"),
    ),
    (
        "cuda",
        "nesterov_speedup",
        dict(
            impl="fused+scales",
            base="scale+sgd-foreach",
            ratio=1.3,
            text="GPU: fused Nesterov with scales ≥ 1.3× scale-then-SGD(foreach), largest set",
        ),
    ),
]


def load(path: str) -> dict:
    with open(path) as f:
        run = json.load(f)
    cases = []
    for b in run.get("benchmarks", []):
        x = dict(b.get("extra_info", {}))
        if "kind" not in x:
            continue
        x["median_s"] = b["stats"]["median"]
        x["rounds"] = b["stats"]["rounds"]
        x["iqr_s"] = b["stats"].get("iqr")
        cases.append(x)
    run["cases"] = cases
    run["path"] = path
    return run


def _fmt_t(s) -> str:
    if s is None:
        return "–"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _fmt(x, spec=".2g", pct=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:.0f} %" if pct else format(x, spec)


def _find(cases, **kw):
    for c in cases:
        if all(c.get(k) == v for k, v in kw.items()):
            return c
    return None


def _largest_set(cases, kind, device):
    sets = [c for c in cases if c["kind"] == kind and c["device"] == device]
    return max(sets, key=lambda c: c.get("n_params", 0))["set"] if sets else None


def check_targets(run) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for every target whose device this run measured."""
    cases = run["cases"]
    devices = {c["device"] for c in cases}
    rows = []
    for device, what, t in TARGETS:
        if device not in devices:
            continue
        if what == "flatten_speedup":
            a = _find(cases, kind="flatten", device=device, set=t["set"], impl=t["impl"], dtype="fp32")
            b = _find(cases, kind="flatten", device=device, set=t["set"], impl=t["base"], dtype="fp32")
            if not (a and b):
                rows.append((t["text"], "not measured in this run", "–"))
                continue
            r = b["median_s"] / a["median_s"]
            ok = r >= t["ratio"] and a["err_rel_fro"] <= t["err"]
            rows.append(
                (
                    t["text"],
                    f"{r:.2f}× ({_fmt_t(a['median_s'])} vs {_fmt_t(b['median_s'])}), error {a['err_rel_fro']:.2g}",
                    "met" if ok else "NOT met",
                )
            )
        elif what == "nesterov_speedup":
            s = _largest_set(cases, "nesterov", device)
            a = _find(cases, kind="nesterov", device=device, set=s, impl=t["impl"])
            b = _find(cases, kind="nesterov", device=device, set=s, impl=t["base"])
            if not (a and b):
                rows.append((t["text"], "not measured in this run", "–"))
                continue
            r = b["median_s"] / a["median_s"]
            rows.append(
                (
                    t["text"],
                    f"{r:.2f}× on {s} ({_fmt_t(a['median_s'])} vs {_fmt_t(b['median_s'])})",
                    "met" if r >= t["ratio"] else "NOT met",
                )
            )
        elif what == "nesterov_copy":
            s = _largest_set(cases, "nesterov", device)
            a = _find(cases, kind="nesterov", device=device, set=s, impl=t["impl"])
            if not a:
                rows.append((t["text"], "not measured in this run", "–"))
                continue
            f = a["frac_copy"]
            rows.append(
                (t["text"], f"{100 * f:.0f} % on {s} ({a['GBps']:.0f} GB/s)", "met" if f >= t["frac"] else "NOT met")
            )
    return rows


def _md_table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out


def _title(run) -> str:
    return os.path.splitext(os.path.basename(run["path"]))[0]


def _mode(iso: dict) -> str:
    """ ", quick run (sets …)" / ", full run"; empty for files written before the modes existed."""
    mode = iso.get("mode")
    if mode is None:
        return ""
    if mode == "full":
        return ", full run"
    return f", quick run (sets {', '.join(iso.get('bench_sets', []))}; `--bench-full` for all)"


def markdown(run) -> list[str]:
    cases, iso = run["cases"], run.get("isoloco", {})
    mi, ci = run.get("machine_info", {}), run.get("commit_info", {})
    lines = [f"## {_title(run)}", ""]
    lines.append(
        f"Run {run.get('datetime', '?')[:19]} UTC, commit {ci.get('id', '?')[:10]}"
        f"{' (uncommitted changes)' if ci.get('dirty') else ''}; torch {mi.get('torch', '?')}, "
        f"triton {mi.get('triton', '–')}, {mi.get('torch_threads', '?')} CPU threads"
        f"{', GPU ' + mi['cuda_device'] if 'cuda_device' in mi else ''}; "
        f"{iso.get('bench_seconds', '?')} s timed per case"
        f"{_mode(iso)}."
    )
    lines.append("")
    for dev, c in iso.get("ceilings", {}).items():
        mm = ", ".join(f"{k} {v:.3g} TFLOP/s (n={c['matmul_n'][k]})" for k, v in c["matmul_TFLOPs"].items())
        lines.append(
            f"Ceilings, {dev} ({c['device']}): copy {c['copy_GBps']:.3g} GB/s "
            f"({c.get('copy_kind', 'copy')}, {c['copy_bytes'] / 2**30:.2g} GiB moved); matmul {mm}."
        )
    lines.append("")
    notes = sorted({f"{c['set']} on {c['device']}: {c['set_note']}" for c in cases if c.get("set_note")})
    for n in notes:
        lines.append(f"- {n}")
    if notes:
        lines.append("")

    tg = check_targets(run)
    if tg:
        lines += ["### Targets", ""] + _md_table(["target", "measured", "verdict"], tg) + [""]

    fl = [c for c in cases if c["kind"] == "flatten"]
    if fl:
        lines += [
            "### Iso-C flatten of every 2-D weight",
            "",
            "× svd-loop: the per-matrix torch.linalg.svd loop's median over this one's (same run). "
            "Error: relative Frobenius vs reference.py (float64) on the sample given in the JSON. "
            "% roofline: max(modelled flops / matmul ceiling, compulsory bytes / copy bandwidth) "
            "over the median (models: bench/harness.py). Fallbacks: matrices polar sent on "
            "(to gram) / matrices gram sent to the SVD, out of all flattened, in the untimed call.",
            "",
        ]
        rows = []
        for c in sorted(fl, key=lambda c: (c["device"], c.get("n_elements", 0), c["dtype"], c["median_s"])):
            base = _find(fl, device=c["device"], set=c["set"], impl="svd-loop", dtype="fp32")
            ratio = base["median_s"] / c["median_s"] if base else None
            backend = ",".join(sorted(set(c.get("resolved", [])))) if c["impl"] == "auto" else ""
            mem = c.get("peak_extra_bytes")
            rows.append(
                (
                    c["device"],
                    c["set"],
                    c["dtype"],
                    c["impl"] + (f" → {backend}" if backend else ""),
                    _fmt_t(c["median_s"]),
                    _fmt(ratio, ".3g"),
                    _fmt(c.get("err_rel_fro"), ".2g"),
                    _fmt(c.get("TFLOPs"), ".3g"),
                    _fmt(c.get("GBps"), ".3g"),
                    _fmt(c.get("frac_roofline"), pct=True),
                    "–" if mem is None else f"{mem / 2**20:.0f}",
                    _fallbacks(c),
                    c["rounds"],
                )
            )
        lines += _md_table(
            [
                "device",
                "set",
                "dtype",
                "impl",
                "median",
                "× svd-loop",
                "error",
                "TFLOP/s",
                "GB/s",
                "% roofline",
                "peak extra MiB",
                "fallbacks",
                "rounds",
            ],
            rows,
        ) + [""]

    ne = [c for c in cases if c["kind"] == "nesterov"]
    if ne:
        lines += [
            "### Nesterov update (fp32, whole model)",
            "",
            "GB/s counts compulsory bytes only (read p, buf, u; write p, buf); % copy is that over the copy ceiling.",
            "",
        ]
        rows = []
        for c in sorted(ne, key=lambda c: (c["device"], c["n_params"], c["median_s"])):
            sg = _find(ne, device=c["device"], set=c["set"], impl="sgd-foreach")
            ss = _find(ne, device=c["device"], set=c["set"], impl="scale+sgd-foreach")
            rows.append(
                (
                    c["device"],
                    c["set"],
                    c["impl"],
                    _fmt_t(c["median_s"]),
                    _fmt(c["GBps"], ".3g"),
                    _fmt(c["frac_copy"], pct=True),
                    _fmt(sg["median_s"] / c["median_s"] if sg else None, ".3g"),
                    _fmt(ss["median_s"] / c["median_s"] if ss else None, ".3g"),
                    _fmt(c["err_rel_fro"], ".2g"),
                    c["rounds"],
                )
            )
        lines += _md_table(
            [
                "device",
                "set",
                "impl",
                "median",
                "GB/s",
                "% copy",
                "× sgd-foreach",
                "× scale+sgd-foreach",
                "error",
                "rounds",
            ],
            rows,
        ) + [""]

    os_ = [c for c in cases if c["kind"] == "outer_step"]
    if os_:
        lines += ["### Whole outer step (Iso-C + Nesterov, fp32)", ""]
        rows = []
        for c in sorted(os_, key=lambda c: (c["device"], c["n_params"], c["median_s"])):
            base = _find(os_, device=c["device"], set=c["set"], impl="svd-loop+sgd")
            sg = _find(os_, device=c["device"], set=c["set"], impl="sgd-foreach")
            rows.append(
                (
                    c["device"],
                    c["set"],
                    c["impl"],
                    _fmt_t(c["median_s"]),
                    _fmt(base["median_s"] / c["median_s"] if base else None, ".3g"),
                    _fmt(c["median_s"] / sg["median_s"] if sg else None, ".3g"),
                    _fmt(c["err_rel_fro"], ".2g"),
                    c["rounds"],
                )
            )
        lines += _md_table(
            ["device", "set", "impl", "median", "× svd-loop+sgd", "time / DiLoCo step", "error", "rounds"], rows
        ) + [""]
    return lines


def _fallbacks(c) -> str:
    """ "p / g" from the case's polar_fallbacks / gram_fallbacks strings ("–" where not recorded)."""
    parts = []
    for key in ("polar_fallbacks", "gram_fallbacks"):
        v = c.get(key)
        parts.append(v.split(" matrices")[0].replace(" of ", "/") if v else "–")
    return "–" if parts == ["–", "–"] else " · ".join(parts)


def plot(run, out_png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = run["cases"]
    fl = [c for c in cases if c["kind"] == "flatten"]
    ne = [c for c in cases if c["kind"] == "nesterov"]
    ou = [c for c in cases if c["kind"] == "outer_step"]
    names = list(dict.fromkeys(c["impl"] for c in cases))
    color = {n: f"C{i % 10}" for i, n in enumerate(names)}
    groups = sorted({(c["device"], c["dtype"]) for c in fl})
    ncol = max(len(groups), 1) + (1 if ne else 0)
    fig, axes = plt.subplots(2, ncol, figsize=(6.5 * ncol, 8.5), squeeze=False)
    for col, (dev, dt) in enumerate(groups):
        cs = [c for c in fl if c["device"] == dev and c["dtype"] == dt]
        sets = sorted({c["set"] for c in cs}, key=lambda s: min(c.get("n_elements", 0) for c in cs if c["set"] == s))
        impls = [i for i in dict.fromkeys(c["impl"] for c in cs)]
        w = 0.8 / max(len(impls), 1)
        for k, impl in enumerate(impls):
            xs, ts, es = [], [], []
            for j, s in enumerate(sets):
                c = _find(cs, set=s, impl=impl)
                if c:
                    xs.append(j + (k - (len(impls) - 1) / 2) * w)
                    ts.append(c["median_s"])
                    es.append(max(c["err_rel_fro"], 1e-17))
            axes[0][col].bar(xs, ts, w, label=impl, color=color[impl])
            axes[1][col].bar(xs, es, w, label=impl, color=color[impl])
        errs = [max(c["err_rel_fro"], 1e-17) for c in cs if c["err_rel_fro"] == c["err_rel_fro"]]
        if errs:
            axes[1][col].set_ylim(min(errs) / 4, max(errs) * 4)
        for j, s in enumerate(sets):
            roof = [c["roofline_s"] for c in cs if c["set"] == s and c.get("flops")]
            if roof:
                axes[0][col].hlines(
                    min(roof),
                    j - 0.45,
                    j + 0.45,
                    colors="k",
                    linestyles="--",
                    label="roofline (best modelled)" if j == 0 else None,
                )
        for r, (ylabel, title) in enumerate(
            [("median time [s]", "flatten time"), ("rel. Frobenius error", "error vs reference.py")]
        ):
            ax = axes[r][col]
            ax.set_yscale("log")
            ax.set_xticks(range(len(sets)))
            ax.set_xticklabels(sets)
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} — {dev} {dt}")
            ax.grid(axis="y", alpha=0.3)
        axes[0][col].legend(fontsize=7)
    if ne:
        col = ncol - 1
        for r, dev in enumerate(sorted({c["device"] for c in ne})[:2]):
            ax = axes[r][col]
            cs = [c for c in ne if c["device"] == dev]
            ceil = run.get("isoloco", {}).get("ceilings", {}).get(dev, {}).get("copy_GBps")
            if ceil:
                ax.axhline(ceil, color="k", ls="--", label="copy ceiling")
            _grouped_bars(ax, cs, "GBps", color, "GB/s (compulsory bytes)", f"Nesterov update — {dev}")
        if len({c["device"] for c in ne}) < 2:
            _outer_panel(axes[1][col], ou, color)
    fig.suptitle(_title(run))
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)


def _grouped_bars(ax, cs, key: str, color, ylabel: str, title: str) -> None:
    """One group of bars per bucket set (ordered by size), one bar per impl, height c[key]; the
    sets label the x axis."""
    sets = sorted({c["set"] for c in cs}, key=lambda s: _find(cs, set=s)["n_params"])
    impls = list(dict.fromkeys(c["impl"] for c in cs))
    w = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        pts = [(j, _find(cs, set=s, impl=impl)) for j, s in enumerate(sets)]
        pts = [(j, c) for j, c in pts if c]
        ax.bar(
            [j + (k - (len(impls) - 1) / 2) * w for j, _ in pts],
            [c[key] for _, c in pts],
            w,
            label=impl,
            color=color[impl],
        )
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def _outer_panel(ax, cases, color) -> None:
    """Whole outer step time per set and impl (first device only)."""
    if not cases:
        ax.axis("off")
        return
    dev = sorted({c["device"] for c in cases})[0]
    cs = [c for c in cases if c["device"] == dev]
    _grouped_bars(ax, cs, "median_s", color, "median time [s]", f"whole outer step — {dev}")
    ax.set_yscale("log")


def short_table(run) -> str:
    """A few lines for a terminal: the targets and the best impl per flatten group."""
    out = []
    for t, m, v in check_targets(run):
        out.append(f"{v:8s} {t}: {m}")
    fl = [c for c in run["cases"] if c["kind"] == "flatten"]
    groups = defaultdict(list)
    for c in fl:
        groups[(c["device"], c["set"], c["dtype"])].append(c)
    for (dev, s, dt), cs in sorted(groups.items()):
        base = _find(cs, impl="svd-loop")
        row = ", ".join(
            f"{c['impl']} {_fmt_t(c['median_s'])}"
            + (f" ({base['median_s'] / c['median_s']:.3g}×)" if base else "")
            + f" err {c['err_rel_fro']:.1g}"
            for c in sorted(cs, key=lambda c: c["median_s"])
        )
        out.append(f"flatten {dev} {s} {dt}: {row}")
    for c in sorted(
        (c for c in run["cases"] if c["kind"] == "nesterov"), key=lambda c: (c["device"], c["n_params"], c["median_s"])
    ):
        out.append(
            f"nesterov {c['device']} {c['set']} {c['impl']}: {_fmt_t(c['median_s'])}, "
            f"{c['GBps']:.3g} GB/s ({100 * c['frac_copy']:.0f} % copy)"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="benchmark JSON files (default: bench/results/*.json)")
    ap.add_argument("--table", action="store_true", help="print a short table of each file")
    ap.add_argument("--no-write", action="store_true", help="write no PNG / markdown")
    ap.add_argument("--out", default=os.path.join(RESULTS, "README.md"), help="markdown file to write")
    args = ap.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(RESULTS, "*.json")), reverse=True)
    if not files:
        print("no benchmark JSON files found", file=sys.stderr)
        return 1
    runs = [load(f) for f in files]
    if args.table:
        for r in runs:
            print(f"== {_title(r)}")
            print(short_table(r))
    if args.no_write:
        return 0
    lines = [
        "# Benchmark results",
        "",
        "Rendered by `python bench/report.py` from the pytest-benchmark JSON files in this folder "
        "(`pytest bench/ --benchmark-only --bench-full --benchmark-json bench/results/<name>.json`). "
        "How cases are timed, what the ceilings are and how flops/bytes are counted: the docstring "
        "of `bench/harness.py`; the bucket sets: `bench/shapes.py`. Ratios divide medians of the "
        "same run.",
        "",
    ]
    for r in runs:
        png = os.path.splitext(r["path"])[0] + ".png"
        plot(r, png)
        lines += markdown(r)
        lines += [f"![{_title(r)}]({os.path.relpath(png, os.path.dirname(os.path.abspath(args.out)))})", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out} and {len(runs)} plot(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
