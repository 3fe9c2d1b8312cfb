"""What a benchmark run measured: its JSON read into cases, the project's targets checked against them.

The first phase of bench/report.py (bench/report_plot.py draws, bench/report.py writes the tables and the
page). A run is pytest-benchmark's JSON with, per case, the extra_info written by bench/test_bench_*.py and,
under "isoloco", the ceilings measured in the same run (bench/conftest.py).
"""

from __future__ import annotations

import json
import math
import os


def _flatten_target(device: str, set_name: str, ratio: float, err: float, text: str) -> tuple:
    """A flatten target: `auto` at least `ratio`× the per-matrix svd loop on `set_name`, error ≤ `err`."""
    return (
        device,
        "flatten_speedup",
        dict(set=set_name, impl="auto", base="svd-loop", ratio=ratio, err=err, text=text),
    )


# The targets the project set itself; each is checked against what a run measured, never assumed.
TARGETS = [
    # (device, what, description)
    _flatten_target(
        "cpu", "llama-tiny", 2.0, 1e-4, "CPU: auto ≥ 2× the per-matrix svd loop on llama-tiny, error ≤ 1e-4"
    ),
    _flatten_target(
        "cuda", "llama-178m", 100.0, 1e-3, "GPU: auto ≥ 100× the per-matrix svd loop on llama-178m, error ≤ 1e-3"
    ),
    (
        "cpu",
        "nesterov_speedup",
        dict(impl="fused", base="sgd-foreach", ratio=1.0, text="CPU: fused Nesterov ≥ 1.0× SGD(foreach), largest set"),
    ),
    (
        "cuda",
        "nesterov_copy",
        dict(
            impl="fused+bounds", frac=0.9, text="GPU: fused Nesterov given bounds ≥ 90 % of copy bandwidth, largest set"
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


def fmt_t(s) -> str:
    if s is None:
        return "–"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def fmt(x, spec=".2g", pct=False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{100 * x:.0f} %" if pct else format(x, spec)


def find(cases, **kw):
    for c in cases:
        if all(c.get(k) == v for k, v in kw.items()):
            return c
    return None


def largest_set(cases, kind, device):
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
            a = find(cases, kind="flatten", device=device, set=t["set"], impl=t["impl"], dtype="fp32")
            b = find(cases, kind="flatten", device=device, set=t["set"], impl=t["base"], dtype="fp32")
            if not (a and b):
                rows.append((t["text"], "not measured in this run", "–"))
                continue
            r = b["median_s"] / a["median_s"]
            ok = r >= t["ratio"] and a["err_rel_fro"] <= t["err"]
            rows.append(
                (
                    t["text"],
                    f"{r:.2f}× ({fmt_t(a['median_s'])} vs {fmt_t(b['median_s'])}), error {a['err_rel_fro']:.2g}",
                    "met" if ok else "NOT met",
                )
            )
        elif what == "nesterov_speedup":
            s = largest_set(cases, "nesterov", device)
            a = find(cases, kind="nesterov", device=device, set=s, impl=t["impl"])
            b = find(cases, kind="nesterov", device=device, set=s, impl=t["base"])
            if not (a and b):
                rows.append((t["text"], "not measured in this run", "–"))
                continue
            r = b["median_s"] / a["median_s"]
            rows.append(
                (
                    t["text"],
                    f"{r:.2f}× on {s} ({fmt_t(a['median_s'])} vs {fmt_t(b['median_s'])})",
                    "met" if r >= t["ratio"] else "NOT met",
                )
            )
        elif what == "nesterov_copy":
            s = largest_set(cases, "nesterov", device)
            a = find(cases, kind="nesterov", device=device, set=s, impl=t["impl"])
            if not a:
                rows.append((t["text"], "not measured in this run", "–"))
                continue
            f = a["frac_copy"]
            rows.append(
                (t["text"], f"{100 * f:.0f} % on {s} ({a['GBps']:.0f} GB/s)", "met" if f >= t["frac"] else "NOT met")
            )
    return rows


def run_title(run) -> str:
    return os.path.splitext(os.path.basename(run["path"]))[0]


#: The order the roofline table lists the kinds of case in (others after, by name).
KINDS = ("flatten", "captured", "fast_route", "merge", "nesterov", "outer_step", "step_phases", "distributed")


def case_label(c: dict) -> str:
    """What sets a case apart within its kind, set and device: the impl, and the merge, K or world size."""
    label = c.get("impl", "?")
    if c.get("method") and c["method"] != label:
        label = f"{c['method']} {label}"
    if c.get("K"):
        label += f" K{c['K']}"
    if c.get("world"):
        label += f" ×{c['world']} rank{'s' if c['world'] != 1 else ''}"
    return label


def roofline_cases(run) -> list[dict]:
    """Every case of the run, in the roofline table's order (kind, device, set, label)."""
    rank = {k: i for i, k in enumerate(KINDS)}
    return sorted(
        run["cases"],
        key=lambda c: (
            rank.get(c["kind"], len(KINDS)),
            c["kind"],
            c.get("device", ""),
            c.get("set", ""),
            case_label(c),
        ),
    )


def missing_roofline(run) -> list[str]:
    """The names of the benchmarks in a run (pytest-benchmark's JSON, read or as loaded) whose
    extra_info holds no roofline fraction ("frac_roofline"): every case should report one."""
    return [
        b.get("fullname", b.get("name", "?"))
        for b in run.get("benchmarks", [])
        if not isinstance(b.get("extra_info", {}).get("frac_roofline"), (int, float))
    ]
