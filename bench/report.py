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

    fl, ne, os_ = ([c for c in cases if c["kind"] == k] for k in ("flatten", "nesterov", "outer_step"))

    def base(group, impl, **kw):
        """The case of `impl` beside c (same device and set, and `kw`) in `group`, or None."""
        return lambda c: find(group, device=c["device"], set=c["set"], impl=impl, **kw)

    fl_base = base(fl, "svd-loop", dtype="fp32")
    lines += _section(
        "Iso-C flatten of every 2-D weight",
        "× svd-loop: the per-matrix torch.linalg.svd loop's median over this one's (same run). "
        "Error: relative Frobenius vs reference.py (float64) on the sample given in the JSON. "
        "% roofline: max(modelled flops / matmul ceiling, compulsory bytes / copy bandwidth) "
        "over the median (models: bench/harness.py). Fallbacks: matrices polar sent on "
        "(to gram) / matrices gram sent to the SVD, out of all flattened, in the untimed call.",
        sorted(fl, key=lambda c: (c["device"], c.get("n_elements", 0), c["dtype"], c["median_s"])),
        [
            ("device", lambda c: c["device"]),
            ("set", lambda c: c["set"]),
            ("dtype", lambda c: c["dtype"]),
            ("impl", _flatten_impl),
            ("median", lambda c: fmt_t(c["median_s"])),
            ("× svd-loop", lambda c: _ratio(fl_base(c), c)),
            ("error", lambda c: fmt(c.get("err_rel_fro"), ".2g")),
            ("TFLOP/s", lambda c: fmt(c.get("TFLOPs"), ".3g")),
            ("GB/s", lambda c: fmt(c.get("GBps"), ".3g")),
            ("% roofline", lambda c: fmt(c.get("frac_roofline"), pct=True)),
            (
                "peak extra MiB",
                lambda c: "–" if c.get("peak_extra_bytes") is None else f"{c['peak_extra_bytes'] / 2**20:.0f}",
            ),
            ("fallbacks", _fallbacks),
            ("rounds", lambda c: c["rounds"]),
        ],
    )
    sgd = base(ne, "sgd-foreach")
    lines += _section(
        "Nesterov update (fp32, whole model)",
        "GB/s counts compulsory bytes only (read p, buf, u; write p, buf); % copy is that over the copy ceiling.",
        sorted(ne, key=lambda c: (c["device"], c["n_params"], c["median_s"])),
        [
            *_WHAT_AND_WHEN,
            ("GB/s", lambda c: fmt(c["GBps"], ".3g")),
            ("% copy", lambda c: fmt(c["frac_copy"], pct=True)),
            ("× sgd-foreach", lambda c: _ratio(sgd(c), c)),
            *_ERROR_AND_ROUNDS,
        ],
    )
    svd, diloco = base(os_, "svd-loop+sgd"), base(os_, "sgd-foreach")
    lines += _section(
        "Whole outer step (Iso-C + Nesterov, fp32)",
        None,
        sorted(os_, key=lambda c: (c["device"], c["n_params"], c["median_s"])),
        [
            *_WHAT_AND_WHEN,
            ("× svd-loop+sgd", lambda c: _ratio(svd(c), c)),
            ("time / DiLoCo step", lambda c: _ratio(c, diloco(c))),
            *_ERROR_AND_ROUNDS,
        ],
    )
    return lines + _section(
        "Roofline of every case",
        "Achieved TFLOP/s and GB/s of the modelled work (each suite's model: bench/harness.py and the "
        "suite's docstring) and their fractions of the ceilings above: % matmul and % copy are each "
        "bound alone over the median, % roofline the larger bound over the median ('–': not modelled "
        "or not recorded).",
        roofline_cases(run),
        [
            ("kind", lambda c: c["kind"]),
            ("device", lambda c: c.get("device", "?")),
            ("set", lambda c: c.get("set", "?")),
            ("case", case_label),
            ("dtype", lambda c: c.get("dtype", "–")),
            ("median", lambda c: fmt_t(c["median_s"])),
            ("TFLOP/s", lambda c: fmt(c.get("TFLOPs"), ".3g")),
            ("GB/s", lambda c: fmt(c.get("GBps"), ".3g")),
            ("% matmul", lambda c: fmt(c.get("frac_matmul"), pct=True)),
            ("% copy", lambda c: fmt(c.get("frac_copy"), pct=True)),
            ("% roofline", lambda c: fmt(c.get("frac_roofline"), pct=True)),
        ],
    )


def _section(title: str, note: str | None, cases: list, columns) -> list[str]:
    """`### title`, its note and a table of `cases` in the order given, one row each, one column per
    (header, the cell of a case) in `columns`; nothing when there are no cases."""
    if not cases:
        return []
    rows = [tuple(cell(c) for _, cell in columns) for c in cases]
    return [f"### {title}", "", *([note, ""] if note else []), *_md_table([h for h, _ in columns], rows), ""]


def _ratio(num, den) -> str:
    """num's median over den's (either None: "–")."""
    return fmt(num["median_s"] / den["median_s"] if num and den else None, ".3g")


def _flatten_impl(c) -> str:
    """The impl, and for "auto" the methods it resolved to."""
    backend = ",".join(sorted(set(c.get("resolved", [])))) if c["impl"] == "auto" else ""
    return c["impl"] + (f" → {backend}" if backend else "")


#: The first and last columns of the Nesterov and outer-step tables.
_WHAT_AND_WHEN = [
    ("device", lambda c: c["device"]),
    ("set", lambda c: c["set"]),
    ("impl", lambda c: c["impl"]),
    ("median", lambda c: fmt_t(c["median_s"])),
]
_ERROR_AND_ROUNDS = [("error", lambda c: fmt(c["err_rel_fro"], ".2g")), ("rounds", lambda c: c["rounds"])]


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
