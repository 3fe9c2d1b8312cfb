"""Tables and plots of training results (the dicts `run_mode` returns)."""

from __future__ import annotations

from typing import Sequence


def _fmt(x) -> str:
    return "diverged" if x is None else f"{x:.4f}"


def mode_table(runs: Sequence[dict]) -> str:
    """One row per mode: outer lr/μ, final held-out loss (nats/byte) on the selection and the test
    split, wall time."""
    rows = [("mode", "outer lr", "outer μ", "final held-out loss (selection)", "(test)", "wall s")]
    for r in runs:
        lr = "-" if "outer_lr" not in r else f"{r['outer_lr']:g}"
        mu = "-" if "outer_momentum" not in r else f"{r['outer_momentum']:g}"
        rows.append((r["mode"], lr, mu, _fmt(r["final_loss"]), _fmt(r.get("final_test_loss")), f"{r['wall_s']:.1f}"))
    return _render(rows)


#: DiLoCo's tuned outer config (lr, μ) in the study's 10-round base cells (H 30, 4 × 64 bytes, AdamW inner) at K
#: workers, from study/cells/summary_v3.json (tests/train checks they agree); its released config is lr 0.7, μ 0.9.
STUDY_DILOCO = {4: (0.7, 0.0), 16: (1.0, 0.0), 32: (1.4, 0.0)}


def outer_note(runs: Sequence[dict], workers: int) -> str | None:
    """A line under the table when DiLoCo ran at its released outer config (lr 0.7, μ 0.9): untuned, it widens the
    gap this table shows; the study's tuned config at the nearest K, and the flags that set it."""
    d = next((r for r in runs if r["mode"] == "diloco"), None)
    if d is None or (d.get("outer_lr"), d.get("outer_momentum")) != (0.7, 0.9):
        return None
    K = min(STUDY_DILOCO, key=lambda k: (abs(k - workers), k))
    lr, mu = STUDY_DILOCO[K]
    return (
        f"DiLoCo ran at its released outer config (lr 0.7, μ 0.9), untuned here; in the study's 10-round cells its "
        f"best μ was 0 or 0.5, never 0.9 (at K {K}: lr {lr:g}, μ {mu:g}; docs/study.md). Compare against that with "
        f"--outer-lr diloco={lr:g} --outer-momentum diloco={mu:g}."
    )


def sweep_table(param: str, values: Sequence, per_value: Sequence[Sequence[dict]]) -> str:
    """Final held-out loss per mode (rows) and swept value (columns)."""
    modes = [r["mode"] for r in per_value[0]]
    rows = [("mode",) + tuple(f"{param}={v}" for v in values)]
    for i, m in enumerate(modes):
        rows.append((m,) + tuple(_fmt(runs[i]["final_loss"]) for runs in per_value))
    return _render(rows)


def _render(rows) -> str:
    w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "  ".join(str(c).ljust(w[i]) if i == 0 else str(c).rjust(w[i]) for i, c in enumerate(r))
    return "\n".join([line(rows[0]), "  ".join("-" * x for x in w)] + [line(r) for r in rows[1:]])


def plot(path, runs_by_value: Sequence[Sequence[dict]], param: str | None = None, values=None) -> bool:
    """Held-out loss vs tokens (one panel per swept value) and, for a sweep, final loss vs value.

    Returns False (and writes nothing) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    n = len(runs_by_value)
    panels = n + (1 if param is not None and n > 1 else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4), squeeze=False)
    axes = axes[0]
    for i, runs in enumerate(runs_by_value):
        ax = axes[i]
        for r in runs:
            ax.plot(r["tokens"], r["heldout_loss"], marker=".", label=r["mode"])
        ax.set_xlabel("training tokens (all workers)")
        ax.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter())  # 200k, 400k, … not 200000
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.set_title(f"{param}={values[i]}" if param is not None else "held-out loss")
        # the first points (init ≈ ln 256) squash the interesting range
        finals = [x for r in runs for x in r["heldout_loss"][len(r["heldout_loss"]) // 3 :]]
        if finals:
            ax.set_ylim(min(finals) - 0.05, max(finals) + 0.1)
        ax.grid(alpha=0.3)
        ax.legend()
    if panels > n:
        ax = axes[-1]
        modes = [r["mode"] for r in runs_by_value[0]]
        for j, m in enumerate(modes):
            ys = [runs[j]["final_loss"] for runs in runs_by_value]
            ax.plot(values, [float("nan") if y is None else y for y in ys], marker="o", label=m)
        ax.set_xlabel(param)
        ax.set_ylabel("final held-out loss (nats/byte)")
        ax.set_title(f"final loss vs {param}")
        if param == "workers":
            ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
