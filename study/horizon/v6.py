"""Study v6, part A: the horizon. IsoLoCo against a DiLoCo tuned over lr and μ at ~20 tokens per parameter.

The base cell (tiny preset, K 4, H 30, 4 × 64 bytes, AdamW inner) trained for 300 outer rounds (9,000 inner
steps per worker, ≈ 19.7 tokens per parameter), both held-out splits scored every 10 rounds. Each method is
tuned at that horizon by v3's rule (study/common/grids.py `best_config`: seed-0 pick on the selection split at the last
round, seeds 1 and 2 of the pick, the test split reported). The table gives IsoLoCo − DiLoCo on the test
split at rounds 10, 30, 100 and the end, paired per seed, with a 95 % Student-t interval, and each method's
gap to DDP at the same tokens; the plot draws the gap against the rounds (per seed and the mean).

    python study/summarize.py     # prints this table among the others, writes study/horizon/study_v6_horizon.png
"""

from __future__ import annotations

from study.common.grids import cell_picks, grids, record_cell
from study.common.stats import interval_text, paired_t

#: The horizon cell: v3's cell keys (K, H, rounds, vocab, init) and settings (batch, seq_len, inner, inner_lr, model).
HORIZON = (4, 30, 300, 256, "gpt2", 4, 64, "adamw", 3e-3, "tiny")
CHECKPOINTS = (10, 30, 100, 300)
TOKENS_PER_ROUND = 4 * 30 * 4 * 64  # K × H × batch × seq_len
TINY_PARAMS = 467_584


def test_at_round(r: dict, rnd: int) -> float | None:
    """The test-split loss a run recorded after round `rnd` (None if it was not scored then)."""
    for tokens, loss in zip(r["tokens"], r["test_loss"]):
        if tokens == rnd * TOKENS_PER_ROUND:
            return loss
    return None


def _gap(a: dict, b: dict, rnd: int) -> dict | None:
    """a − b on the test split after round rnd, paired over the seeds both have."""
    g = paired_t(*({s: test_at_round(r, rnd) for s, r in x["runs"].items()} for x in (a, b)))
    return None if g is None else {"round": rnd, **g}


def summarize_v6(recs: list[dict], cell: tuple = HORIZON) -> dict:
    """The horizon's picks, IsoLoCo − DiLoCo at each checkpoint round, each method's gap to DDP at the end."""
    picks = cell_picks(recs, cell)
    out: dict = {
        "rounds": cell[2],
        "tokens_per_param": cell[2] * TOKENS_PER_ROUND / TINY_PARAMS,
        "picks": {m: {k: v for k, v in p.items() if k != "runs"} for m, p in picks.items()},
    }
    if "diloco" in picks and "isoloco" in picks:
        out["gap"] = [g for g in (_gap(picks["isoloco"], picks["diloco"], r) for r in CHECKPOINTS) if g]
        rounds = sorted({t // TOKENS_PER_ROUND for r in picks["isoloco"]["runs"].values() for t in r["tokens"]} - {0})
        out["curve"] = [g for g in (_gap(picks["isoloco"], picks["diloco"], r) for r in rounds) if g]
    if "ddp" in picks:
        out["to_ddp"] = {m: _gap(picks[m], picks["ddp"], cell[2]) for m in ("diloco", "isoloco") if m in picks}
    out["cpu_s"] = sum(
        r.get("cpu_s", 0.0)
        for cfgs in grids(recs).get(cell, {}).values()
        for runs in cfgs.values()
        for r in runs.values()
    )
    return out


def markdown_v6(s: dict) -> str:
    picks = s["picks"]
    lines = [
        f"Horizon: {s['rounds']} rounds, {s['tokens_per_param']:.1f} tokens per parameter (base cell, K 4, H 30).",
        "",
        "| method | pick (lr @ μ) | edge | test loss per seed |",
        "|---|---|---|---|",
    ]
    for m in ("ddp", "diloco", "isoloco"):
        if m in picks:
            p = picks[m]
            cfg = "—" if p["lr"] is None else f"{p['lr']} @ {p['momentum']}"
            tests = ", ".join(f"{v:.4f}" for _, v in sorted(p["test"].items()) if v is not None)
            lines.append(f"| {m} | {cfg} | {'yes' if p['edge'] else 'no'} | {tests} |")
    lines += ["", "| round | IsoLoCo − DiLoCo (test, mean [95 % t]) |", "|---|---|"]
    lines += [f"| {g['round']} | {interval_text(g)} |" for g in s.get("gap", [])]
    for m, g in (s.get("to_ddp") or {}).items():
        lines.append(f"\n{m} − DDP at the end: {interval_text(g)}")
    return "\n".join(lines)


def plot_v6(s: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = s.get("curve") or []
    if not curve:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [g["round"] for g in curve]
    for i in range(max(g["seeds"] for g in curve)):
        ys = [g["per_seed"][i] if i < len(g["per_seed"]) else float("nan") for g in curve]
        ax.plot(xs, ys, color="0.7", lw=0.8, label="per seed" if i == 0 else None)
    ax.plot(xs, [g["mean"] for g in curve], color="C0", lw=2, label="mean")
    ax.fill_between(xs, [g["t_lo"] for g in curve], [g["t_hi"] for g in curve], color="C0", alpha=0.2, label="95 % t")
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("outer round (30,720 tokens each)")
    ax.set_ylabel("IsoLoCo − DiLoCo, test loss (nats/byte)")
    ax.set_title(f"Study v6: the horizon ({s['tokens_per_param']:.1f} tokens/param at round {s['rounds']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- part B: outer schedules ---------------------------------------------------------------------------------------

SHORT = (4, 30, 10, 256, "gpt2", 4, 64, "adamw", 3e-3, "tiny")  # v3's base cell at 10 rounds


def _schedule_runs(recs: list[dict], cell: tuple, schedule: str, mode: str, lr, mu, eval_every=None) -> dict:
    """seed -> record of `mode` at (lr, μ) in `cell` under `schedule` ("constant": no outer_schedule setting),
    scored every `eval_every` rounds if given (the first record of a seed)."""
    out: dict = {}
    for r in recs:
        v = r.get("v3") or {}
        if r.get("study") != "v3" or "compress" in v or record_cell(r) != cell or r["mode"] != mode:
            continue
        if v.get("outer_schedule", "constant") != schedule or (r.get("outer_lr"), r.get("outer_momentum")) != (lr, mu):
            continue
        if eval_every is None or v.get("eval_every") == eval_every:
            out.setdefault(r["seed"], r)
    return out


def _seed0_under(recs: list[dict], cell: tuple, schedule: str):
    """Seed 0's DiLoCo and IsoLoCo records in `cell` under `schedule`, uncompressed, at any lr and μ."""
    for r in recs:
        v = r.get("v3") or {}
        if r.get("study") == "v3" and r["seed"] == 0 and "compress" not in v and record_cell(r) == cell:
            if v.get("outer_schedule", "constant") == schedule and r["mode"] in ("diloco", "isoloco"):
                yield r


def _seed0_selection(recs: list[dict], cell: tuple, schedule: str) -> dict:
    """method -> {"lr @ μ": seed 0's selection-split loss at the last round} for every config run under `schedule`."""
    out: dict = {}
    for r in _seed0_under(recs, cell, schedule):
        out.setdefault(r["mode"], {})[f"{r['outer_lr']} @ {r['outer_momentum']}"] = r["final_loss"]
    return {m: dict(sorted(v.items())) for m, v in sorted(out.items())}


def _retuned(recs: list[dict], cell: tuple, schedule: str, rounds: int) -> dict:
    """Each method's best config under `schedule` by seed 0's selection loss (not its constant-lr pick), and
    IsoLoCo − DiLoCo between those configs over the seeds both have."""
    best: dict = {}
    for r in _seed0_under(recs, cell, schedule):
        if r["mode"] not in best or r["final_loss"] < best[r["mode"]]["final_loss"]:
            best[r["mode"]] = r
    out: dict = {"picks": {m: f"{r['outer_lr']} @ {r['outer_momentum']}" for m, r in sorted(best.items())}}
    if len(best) == 2:
        runs = {m: _schedule_runs(recs, cell, schedule, m, r["outer_lr"], r["outer_momentum"]) for m, r in best.items()}
        out["iso_minus_diloco"] = _pair(runs["isoloco"], runs["diloco"], rounds)
    return out


def _pair(a: dict, b: dict, rnd: int) -> dict | None:
    return _gap({"runs": a}, {"runs": b}, rnd)


def summarize_schedules(recs: list[dict], cell: tuple = HORIZON, short: tuple = SHORT) -> dict:
    """Part B: each method at its horizon pick under each outer schedule against the same config at a constant
    schedule (test split at the last round, paired per seed, 95 % t), IsoLoCo − DiLoCo under each schedule; and
    at 10 rounds, scored every round, IsoLoCo − DiLoCo after round 1 and round 10, constant and warmed up."""
    picks = cell_picks(recs, cell)
    out: dict = {"horizon": {}, "short": {}}
    rounds = cell[2]
    for sched in ("warmup", "warmup-cosine", "momentum-warmup"):
        row: dict = {}
        runs = {}
        for m in ("diloco", "isoloco"):
            if m not in picks:
                continue
            p = picks[m]
            runs[m] = _schedule_runs(recs, cell, sched, m, p["lr"], p["momentum"])
            if runs[m]:
                row[m] = {"vs_constant": _pair(runs[m], p["runs"], rounds), "seeds": sorted(runs[m])}
        if runs.get("diloco") and runs.get("isoloco"):
            row["iso_minus_diloco"] = _pair(runs["isoloco"], runs["diloco"], rounds)
        tried = _seed0_selection(recs, cell, sched)
        if any(len(v) > 1 for v in tried.values()):  # lrs besides the pick were run under this schedule
            row["seed0_selection"] = tried
            row["retuned"] = _retuned(recs, cell, sched, rounds)
        if row:
            out["horizon"][sched] = row
    short_picks = cell_picks(recs, short)
    cfg = {m: (p["lr"], p["momentum"]) for m, p in short_picks.items()}
    if "isoloco" in cfg and "diloco" in cfg:
        dil = _schedule_runs(recs, short, "constant", "diloco", *cfg["diloco"], eval_every=1)
        iso = {
            s: _schedule_runs(recs, short, s, "isoloco", *cfg["isoloco"], eval_every=1) for s in ("constant", "warmup")
        }
        for sched, runs in iso.items():
            if runs and dil:
                out["short"][sched] = {f"round_{r}": _pair(runs, dil, r) for r in (1, 2, 5, short[2])}
        if iso["constant"] and iso["warmup"]:  # the warm-up against no warm-up, IsoLoCo alone
            out["short"]["warmup_vs_constant"] = {
                f"round_{r}": _pair(iso["warmup"], iso["constant"], r) for r in (1, 2, 5, short[2])
            }
    return out


def markdown_schedules(s: dict) -> str:
    lines = [
        "| schedule (300 rounds) | DiLoCo − its constant | IsoLoCo − its constant | IsoLoCo − DiLoCo |",
        "|---|---|---|---|",
    ]
    for sched, row in s["horizon"].items():
        d, i = row.get("diloco") or {}, row.get("isoloco") or {}
        lines.append(
            f"| {sched} | {interval_text(d.get('vs_constant'))} | {interval_text(i.get('vs_constant'))} | "
            f"{interval_text(row.get('iso_minus_diloco'))} |"
        )
    for sched, row in s["horizon"].items():
        for m, losses in (row.get("seed0_selection") or {}).items():
            tried = ", ".join(f"{cfg}: {loss:.4f}" for cfg, loss in losses.items())
            lines.append(f"\n{m} under {sched}, seed 0, selection split at the end: {tried}")
        if row.get("retuned"):
            picks = ", ".join(f"{m} {cfg}" for m, cfg in row["retuned"]["picks"].items())
            lines.append(
                f"IsoLoCo − DiLoCo at the picks under {sched} ({picks}): {interval_text(row['retuned'].get('iso_minus_diloco'))}"
            )
    if s["short"]:
        lines += ["", "| IsoLoCo − DiLoCo at 10 rounds | after round 1 | 2 | 5 | 10 |", "|---|---|---|---|---|"]
        for sched, g in s["short"].items():
            cells = " | ".join(interval_text(g.get(f"round_{r}")) for r in (1, 2, 5, 10))
            name = (
                "IsoLoCo warmup − IsoLoCo constant"
                if sched == "warmup_vs_constant"
                else f"IsoLoCo {sched} (DiLoCo constant)"
            )
            lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)
