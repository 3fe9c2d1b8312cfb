"""Render the benchmark JSON files into plots and one markdown page.

    python bench/report.py                      every bench/results/*.json → <name>.png + README.md
    python bench/report.py RUN.json --table     also print a short table of RUN.json to stdout
    python bench/report.py RUN.json --no-write  print only

The JSON files come from `pytest bench/ --benchmark-only --benchmark-json bench/results/<name>.json`;
besides pytest-benchmark's timings each holds the ceilings measured in the same run (key "isoloco")
and, per case, the extra_info written by bench/test_bench_*.py. Every speed ratio below divides two
medians of the same run. Every case's roofline (achieved TFLOP/s and GB/s, fractions of the ceilings
of the same run) is one row of the page's last table, and with --table one entry of a "roofline" line.

Its phases, one module each: bench/report_data.py reads a run and checks the targets, bench/report_plot.py
draws its plot, this module writes the tables and the page and holds the command line.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:  # run as a script: the repository root, for `bench.`
    sys.path.insert(0, os.path.dirname(HERE))

from bench.report_data import (  # noqa: E402
    case_label,
    check_targets,
    find,
    fmt,
    fmt_t,
    load,
    roofline_cases,
    run_title,
)
from bench.report_plot import plot  # noqa: E402

RESULTS = os.path.join(HERE, "results")


def _md_table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out


def _mode(iso: dict) -> str:
    """ ", quick run (sets …)" / ", full run"; empty for files written before the modes existed."""
    mode = iso.get("mode")
    if mode is None:
        return ""
    if mode == "full":
        return ", full run"
    if mode == "dry-run":
        return (
            f", dry run (sets {', '.join(iso.get('bench_sets', []))}; one round per case: the numbers measure nothing)"
        )
    return f", quick run (sets {', '.join(iso.get('bench_sets', []))}; `--bench-full` for all)"


def markdown(run) -> list[str]:
    cases, iso = run["cases"], run.get("isoloco", {})
    mi, ci = run.get("machine_info", {}), run.get("commit_info", {})
    lines = [f"## {run_title(run)}", ""]
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
            base = find(fl, device=c["device"], set=c["set"], impl="svd-loop", dtype="fp32")
            ratio = base["median_s"] / c["median_s"] if base else None
            backend = ",".join(sorted(set(c.get("resolved", [])))) if c["impl"] == "auto" else ""
            mem = c.get("peak_extra_bytes")
            rows.append(
                (
                    c["device"],
                    c["set"],
                    c["dtype"],
                    c["impl"] + (f" → {backend}" if backend else ""),
                    fmt_t(c["median_s"]),
                    fmt(ratio, ".3g"),
                    fmt(c.get("err_rel_fro"), ".2g"),
                    fmt(c.get("TFLOPs"), ".3g"),
                    fmt(c.get("GBps"), ".3g"),
                    fmt(c.get("frac_roofline"), pct=True),
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
            sg = find(ne, device=c["device"], set=c["set"], impl="sgd-foreach")
            ss = find(ne, device=c["device"], set=c["set"], impl="scale+sgd-foreach")
            rows.append(
                (
                    c["device"],
                    c["set"],
                    c["impl"],
                    fmt_t(c["median_s"]),
                    fmt(c["GBps"], ".3g"),
                    fmt(c["frac_copy"], pct=True),
                    fmt(sg["median_s"] / c["median_s"] if sg else None, ".3g"),
                    fmt(ss["median_s"] / c["median_s"] if ss else None, ".3g"),
                    fmt(c["err_rel_fro"], ".2g"),
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
            base = find(os_, device=c["device"], set=c["set"], impl="svd-loop+sgd")
            sg = find(os_, device=c["device"], set=c["set"], impl="sgd-foreach")
            rows.append(
                (
                    c["device"],
                    c["set"],
                    c["impl"],
                    fmt_t(c["median_s"]),
                    fmt(base["median_s"] / c["median_s"] if base else None, ".3g"),
                    fmt(c["median_s"] / sg["median_s"] if sg else None, ".3g"),
                    fmt(c["err_rel_fro"], ".2g"),
                    c["rounds"],
                )
            )
        lines += _md_table(
            ["device", "set", "impl", "median", "× svd-loop+sgd", "time / DiLoCo step", "error", "rounds"], rows
        ) + [""]
    lines += _roofline_table(run)
    return lines


def _roofline_table(run) -> list[str]:
    """Every case's achieved rates and fractions of the ceilings measured in the same run."""
    if not run["cases"]:
        return []
    rows = [
        (
            c["kind"],
            c.get("device", "?"),
            c.get("set", "?"),
            case_label(c),
            c.get("dtype", "–"),
            fmt_t(c["median_s"]),
            fmt(c.get("TFLOPs"), ".3g"),
            fmt(c.get("GBps"), ".3g"),
            fmt(c.get("frac_matmul"), pct=True),
            fmt(c.get("frac_copy"), pct=True),
            fmt(c.get("frac_roofline"), pct=True),
        )
        for c in roofline_cases(run)
    ]
    head = ["kind", "device", "set", "case", "dtype", "median", "TFLOP/s", "GB/s", "% matmul", "% copy", "% roofline"]
    return [
        "### Roofline of every case",
        "",
        "Achieved TFLOP/s and GB/s of the modelled work (each suite's model: bench/harness.py and the "
        "suite's docstring) and their fractions of the ceilings above: % matmul and % copy are each "
        "bound alone over the median, % roofline the larger bound over the median ('–': not modelled "
        "or not recorded).",
        "",
        *_md_table(head, rows),
        "",
    ]


def _fallbacks(c) -> str:
    """ "p / g" from the case's polar_fallbacks / gram_fallbacks strings ("–" where not recorded)."""
    parts = []
    for key in ("polar_fallbacks", "gram_fallbacks"):
        v = c.get(key)
        parts.append(v.split(" matrices")[0].replace(" of ", "/") if v else "–")
    return "–" if parts == ["–", "–"] else " · ".join(parts)


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
        base = find(cs, impl="svd-loop")
        row = ", ".join(
            f"{c['impl']} {fmt_t(c['median_s'])}"
            + (f" ({base['median_s'] / c['median_s']:.3g}×)" if base else "")
            + f" err {c['err_rel_fro']:.1g}"
            for c in sorted(cs, key=lambda c: c["median_s"])
        )
        out.append(f"flatten {dev} {s} {dt}: {row}")
    for c in sorted(
        (c for c in run["cases"] if c["kind"] == "nesterov"), key=lambda c: (c["device"], c["n_params"], c["median_s"])
    ):
        out.append(
            f"nesterov {c['device']} {c['set']} {c['impl']}: {fmt_t(c['median_s'])}, "
            f"{c['GBps']:.3g} GB/s ({100 * c['frac_copy']:.0f} % copy)"
        )
    return "\n".join(out + _roofline_lines(run))


def _roofline_lines(run) -> list[str]:
    """One line per kind, device, set and dtype: every case's fraction of its roofline."""
    groups: dict[tuple, list[str]] = {}
    for c in roofline_cases(run):
        key = (c["kind"], c.get("device", "?"), c.get("set", "?"), c.get("dtype", "–"))
        groups.setdefault(key, []).append(f"{case_label(c)} {fmt(c.get('frac_roofline'), pct=True)}")
    return [f"roofline {' '.join(key)}: {', '.join(parts)}" for key, parts in groups.items()]


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
            print(f"== {run_title(r)}")
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
        lines += [f"![{run_title(r)}]({os.path.relpath(png, os.path.dirname(os.path.abspath(args.out)))})", ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out} and {len(runs)} plot(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
