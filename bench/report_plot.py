"""The plot of one benchmark run beside its markdown page (bench/report.py): flatten time and error per
bucket set, the Nesterov update's bandwidth against the copy ceiling, the whole outer step's time."""

from __future__ import annotations

from bench.report_data import find, run_title


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
                c = find(cs, set=s, impl=impl)
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
    fig.suptitle(run_title(run))
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)


def _grouped_bars(ax, cs, key: str, color, ylabel: str, title: str) -> None:
    """One group of bars per bucket set (ordered by size), one bar per impl, height c[key]; the
    sets label the x axis."""
    sets = sorted({c["set"] for c in cs}, key=lambda s: find(cs, set=s)["n_params"])
    impls = list(dict.fromkeys(c["impl"] for c in cs))
    w = 0.8 / len(impls)
    for k, impl in enumerate(impls):
        pts = [(j, find(cs, set=s, impl=impl)) for j, s in enumerate(sets)]
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
