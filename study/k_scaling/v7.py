"""Study v7, part A: K at fixed compute against the strongest DiLoCo, with a step-size control.

Study v6's token budget (≈ 19.7 tokens per parameter: the base cell, tiny preset, H 30, 4 × 64 bytes, AdamW inner)
split over K workers — K 8 × 150, K 16 × 75, K 32 × 38 rounds — and at each K four methods, each tuned there:

    diloco     the mean, outer Nesterov; lr × μ, constant, warm-up + cosine, or a momentum warm-up
    norm_mean  the mean direction rescaled to the workers' mean norm (merges `norm_mean`), outer Nesterov
    isoloco    Iso-C of the mean, outer Nesterov; lr (μ 0.8, 0.9 at the pick's lr), constant or warm-up + cosine
    ddp        the inner AdamW lr × {1, 1.5, 2} at that K's global batch

A config is (mode, outer lr, μ, schedule, inner lr). The selection rule: a seed-0 screen; seed 1 for each method's
three best by seed 0; the pick is the config with the lowest mean selection loss over seeds 0 and 1 (a diverged run
is +inf); seeds 0–4 run at the pick and are scored on the test split; the gaps are paired over seeds with a 95 %
Student-t interval. `jobs` prints the runs a stage needs, in the plan's format (k_scaling/v7a_plan.sh); `--stage
next` gives each method's next runs, whichever stage it has reached, so that one method's runs in flight do not hold
up another's (k_scaling/stages.sh runs it until it is empty):

    python -m study.k_scaling.v7 jobs --K 8 --stage next     # or one stage: edges, then seed1, then final
    python study/summarize.py                                # the table, study/k_scaling/summary_v7.json
"""

from __future__ import annotations

import argparse
import ast
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from study.common.stats import interval_text, paired_t

#: K -> outer rounds at v6's token budget (K × rounds ≈ 1,200 worker-rounds of H 30 × 4 × 64 bytes)
ROUNDS = {8: 150, 16: 75, 32: 38}
H, BATCH, SEQ, INNER_LR = 30, 4, 64, 3e-3
TINY_PARAMS = 467_584
METHODS = ("ddp", "diloco", "norm_mean", "isoloco")
FINAL_SEEDS = (0, 1, 2, 3, 4)
#: the seeds a gap needs before the pages quote or plot it: over 2 a t interval (1 degree of freedom, t 12.7) spans
#: so much that it would read as "level" whatever the runs say, and seeds 0–1 are the ones the picks were chosen on
MIN_SEEDS = 3
V7_FILE = "v7_fixed_compute.jsonl"


#: part B, workers or rounds: K 16's rounds at K 4, a quarter of its tokens (k_scaling/v7b_plan.sh)
B_K, B_ROUNDS = 4, 75


def tokens_per_param(K: int, rounds: int | None = None) -> float:
    return K * H * (rounds or ROUNDS[K]) * BATCH * SEQ / TINY_PARAMS


def in_cell(r: dict, K: int, rounds: int | None = None, inner: str = "adamw") -> bool:
    """A run of v7's cell at K: v3's settings of the base cell, v6's token budget (or `rounds`), uncompressed (the
    DDP runs may move the inner lr; the others run at the base cell's), with `inner` steps (part D: Muon)."""
    v3 = r.get("v3") or {}
    return (
        r.get("study") == "v3"
        and r.get("workers") == K
        and r.get("inner_steps") == H
        and r.get("rounds") == (rounds or ROUNDS.get(K))
        and r.get("vocab", 256) == 256
        and r.get("init", "gpt2") == "gpt2"
        and r.get("eval_split") == "halves"
        and (v3.get("batch"), v3.get("seq_len"), v3.get("inner"), v3.get("model")) == (BATCH, SEQ, inner, "tiny")
        and not {"compress", "drop", "faulty", "merge_clip"} & set(v3)
        and r.get("mode") in METHODS
        and (r["mode"] == "ddp" or v3.get("inner_lr") == INNER_LR)
    )


def config_of(r: dict) -> tuple:
    """(mode, outer lr, μ as the run named it (None: the mode's default), schedule, inner lr)."""
    v3 = r["v3"]
    return (r["mode"], r.get("outer_lr"), v3.get("mu"), v3.get("outer_schedule", "constant"), v3["inner_lr"])


def configs(recs: list[dict], K: int, rounds: int | None = None, inner: str = "adamw") -> dict:
    """method -> config -> seed -> record, for the runs of v7's cell at K (a repeated run keeps the first)."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for r in recs:
        if in_cell(r, K, rounds, inner):
            out[r["mode"]][config_of(r)].setdefault(r["seed"], r)
    return out


def _score(runs: dict, seeds) -> float | None:
    """The mean selection loss over `seeds` (None unless every one ran; a diverged run is +inf)."""
    if not all(s in runs for s in seeds):
        return None
    return statistics.fmean(float("inf") if runs[s]["final_loss"] is None else runs[s]["final_loss"] for s in seeds)


def ranked(cfgs: dict, seeds=(0,)) -> list[tuple]:
    """The configs that ran every one of `seeds`, best (lowest mean selection loss) first; ties by the config."""
    scored = [(sc, c) for c, runs in cfgs.items() if (sc := _score(runs, seeds)) is not None]
    return [c for _, c in sorted(scored, key=lambda x: (x[0], repr(x[1])))]


def pick(cfgs: dict) -> tuple | None:
    """The pick: the best by the mean of seeds 0 and 1 among the configs that ran both (None if none has)."""
    best = ranked(cfgs, (0, 1))
    return best[0] if best else None


def job_line(cfg: tuple, seeds) -> str:
    """One line of the plan's job list: schedule, inner lr, the runner's --lrs item, the seeds."""
    mode, lr, mu, schedule, inner_lr = cfg
    item = f"{mode}=" + ("-" if lr is None else f"{lr:g}") + ("" if mu is None else f"@{mu:g}")
    return f"{schedule} {inner_lr:g} {item} {','.join(map(str, seeds))}"


#: DDP's inner lrs, the base cell's × {1, 1.5, 2} (literals: a config compares equal to its records')
DDP_INNER_LRS = (3e-3, 4.5e-3, 6e-3)
#: the outer lrs the study's grids use: DiLoCo's and norm_mean's steps of √2, IsoLoCo's of 4/3
LADDER = (0.12, 0.17, 0.25, 0.35, 0.5, 0.7, 1.0, 1.35, 1.4, 1.8, 2.0, 2.4, 2.8, 3.2, 4.2, 5.6, 7.5)


def past_edge(cfgs: dict) -> list[tuple]:
    """The points past the edge of the seed-0 best's lr line (the configs that differ from it only in the outer lr)
    when the best sits at that line's lowest or highest lr: a step of the line's ratio there, snapped to the nearest
    LADDER lr beyond the edge; both neighbours (a step of √2 each way) when it is alone on its line. Empty when the
    best is interior or at the ladder's end. DDP walks its own grid, the inner lr × {1, 1.5, 2}: the next one up
    when its best is the highest it ran. Run until it is empty (stages.sh), the walk ends where the best is interior,
    whichever runner gets there."""
    best = ranked(cfgs)[:1]
    if not best:
        return []
    if best[0][0] == "ddp":  # its walk stays on its grid: the next inner lr up when the best is the highest run
        inner_lr, ran = best[0][4], max(c[4] for c in cfgs)
        up = [x for x in DDP_INNER_LRS if x > inner_lr * (1 + 1e-9)]  # a computed 1.5× may be a bit off
        return [("ddp", None, None, "constant", up[0])] if math.isclose(inner_lr, ran) and up else []
    mode, lr, mu, schedule, inner_lr = best[0]
    line = sorted(c[1] for c in cfgs if (c[0], c[2], c[3], c[4]) == (mode, mu, schedule, inner_lr))
    steps = []
    if lr == line[0]:
        steps.append((lr / (line[1] / line[0] if len(line) > 1 else 2**0.5), [x for x in LADDER if x < lr]))
    if lr == line[-1]:
        steps.append((lr * (line[-1] / line[-2] if len(line) > 1 else 2**0.5), [x for x in LADDER if x > lr]))
    return [
        (mode, min(beyond, key=lambda x: abs(math.log(x / new))), mu, schedule, inner_lr)
        for new, beyond in steps
        if beyond
    ]


def _todo(cfgs: dict, stage: str, top: int) -> list[tuple]:
    """One method's (config, seeds) a stage still needs, claims not yet left out (see `jobs`)."""
    if stage == "edges":
        return [(e, (0,)) for e in past_edge(cfgs)]
    if stage == "seed1":
        return [(c, (1,)) for c in ranked(cfgs)[:top] if 1 not in cfgs[c]]
    if stage == "final":
        p = pick(cfgs)
        return [] if p is None else [(p, tuple(s for s in FINAL_SEEDS if s not in cfgs[p]))]
    raise ValueError(f"stage must be edges, seed1 or final, got {stage!r}")


def _lines(todo: list[tuple], claimed, first: bool = False) -> list[str]:
    """The job lines of `todo`, the (config, seed)s in `claimed` left out; `first`: only each config's first seed."""
    todo = [(c, tuple(x for x in seeds if (c, x) not in claimed)) for c, seeds in todo]
    return [job_line(c, seeds[:1] if first else seeds) for c, seeds in todo if seeds]


def jobs(recs: list[dict], K: int, stage: str, top: int = 3, inner: str = "adamw", claimed=frozenset()) -> list[str]:
    """The runs a stage still needs: "edges", seed 0 one point past the edge of each method's seed-0 best (see
    `past_edge`); "seed1", seed 1 of each method's `top` best seed-0 configs; "final", the seeds 0–4 of each
    method's pick. A (config, seed) in `claimed` (another runner's, in flight) is left out."""
    return [
        x for _, cfgs in sorted(configs(recs, K, inner=inner).items()) for x in _lines(_todo(cfgs, stage, top), claimed)
    ]


def next_jobs(recs: list[dict], K: int, top: int = 3, inner: str = "adamw", claimed=frozenset()) -> list[str]:
    """Each method's next runs, whichever stage it has reached: its edges, then its seed-1 three, then its final
    seeds, as `jobs` gives them, with the runs in `claimed` (another runner's, in flight) left out. A method waits
    (has none) while one of its seed-0 runs is in flight, which its edges and its three best are chosen from, and
    goes on to its final only once its seed-1 runs have finished; the others do not wait for it. A final gives one
    seed at a time (its lowest free one), so the methods' finals advance seed by seed together and a runner stopped
    part way leaves every method on about the same seeds, not some methods done and others not begun."""
    out = []
    for mode, cfgs in sorted(configs(recs, K, inner=inner).items()):
        flying = {seed for c, seed in claimed if c[0] == mode}
        if 0 in flying:
            continue
        todo = _todo(cfgs, "edges", top) or _todo(cfgs, "seed1", top)
        final = not todo
        if final and 1 not in flying:
            todo = _todo(cfgs, "final", top)
        out += _lines(todo, claimed, first=final)
    return out


def label(cfg: tuple) -> str:
    mode, lr, mu, schedule, inner_lr = cfg
    if mode == "ddp":
        return f"inner lr {inner_lr:g}"
    return f"{lr:g} @ {'default' if mu is None else f'{mu:g}'}" + ("" if schedule == "constant" else f", {schedule}")


GAPS = (("isoloco", "diloco"), ("isoloco", "norm_mean"), ("norm_mean", "diloco"))


def summarize_v7(recs: list[dict], inner: str = "adamw") -> list[dict]:
    """Per K with any run: each method's screen (every config: seeds, mean selection, mean test), its pick, and the
    paired gaps on the test split at the end between the picks, and each pick against DDP's; `inner` "muon" for
    part D's cell."""
    rows = []
    for K in sorted(ROUNDS):
        cfgs = configs(recs, K, inner=inner)
        if not cfgs:
            continue
        row: dict = {"workers": K, "rounds": ROUNDS[K], "tokens_per_param": tokens_per_param(K), "inner": inner}
        row["methods"] = {}
        picks = {}
        for mode in METHODS:
            if mode not in cfgs:
                continue
            p = pick(cfgs[mode])
            screen = {
                label(c): {
                    "seeds": sorted(runs),
                    "selection_seed0": _score(runs, (0,)),
                    "selection_seeds01": _score(runs, (0, 1)),
                    "test_mean": statistics.fmean(
                        runs[s]["final_test_loss"] for s in runs if runs[s]["final_test_loss"] is not None
                    )
                    if any(runs[s]["final_test_loss"] is not None for s in runs)
                    else None,
                }
                for c, runs in sorted(cfgs[mode].items(), key=lambda kv: repr(kv[0]))
            }
            row["methods"][mode] = {"pick": None if p is None else label(p), "screen": screen}
            if p is not None:
                picks[mode] = {s: r["final_test_loss"] for s, r in cfgs[mode][p].items()}
                row["methods"][mode]["test"] = picks[mode]
        row["gaps"] = {f"{a} - {b}": paired_t(picks[a], picks[b]) for a, b in GAPS if a in picks and b in picks}
        if "ddp" in picks:
            row["to_ddp"] = {m: paired_t(picks[m], picks["ddp"]) for m in METHODS[1:] if m in picks}
        row["cpu_s"] = sum(r.get("cpu_s", 0.0) for cs in cfgs.values() for runs in cs.values() for r in runs.values())
        rows.append(row)
    return rows


def summarize_v7b(recs: list[dict]) -> dict | None:
    """Part B: every config of K 4 × 75 rounds with its test losses per seed, IsoLoCo − each DiLoCo config and each
    method − DDP, paired over their common seeds on the test split at the end (None before any run)."""
    cfgs = {c: runs for by_cfg in configs(recs, B_K, B_ROUNDS).values() for c, runs in by_cfg.items()}
    if not cfgs:
        return None
    test = {label(c) if c[0] == "ddp" else f"{c[0]} {label(c)}": {s: r["final_test_loss"] for s, r in runs.items()}
            for c, runs in sorted(cfgs.items(), key=lambda kv: repr(kv[0]))}  # fmt: skip
    iso = [k for k in test if k.startswith("isoloco ")]
    dil = [k for k in test if k.startswith("diloco ")]
    ddp = [k for k in test if k.startswith("inner lr ")]
    return {
        "workers": B_K,
        "rounds": B_ROUNDS,
        "tokens_per_param": tokens_per_param(B_K, B_ROUNDS),
        "test": test,
        "gaps": {f"{a} - {b}": paired_t(test[a], test[b]) for a in iso for b in dil},
        "to_ddp": {f"{a} - ddp": paired_t(test[a], test[d]) for a in iso + dil for d in ddp},
        "cpu_s": sum(r.get("cpu_s", 0.0) for runs in cfgs.values() for r in runs.values()),
    }


def curves(recs: list[dict], K: int, rounds: int | None = None) -> dict:
    """label -> (rounds scored, mean test loss over the seeds) for each method's config in the cell at K (`rounds`:
    part B's), the pick where one stands (seeds 0–1) else the seed-0 best: the trajectory behind the final gaps."""
    out = {}
    for mode, cfgs in sorted(configs(recs, K, rounds).items()):
        best = pick(cfgs) or next(iter(ranked(cfgs)), None)
        runs = [r for r in cfgs.get(best, {}).values() if r.get("test_loss") and r.get("final_loss") is not None]
        if not runs:
            continue
        per_round = K * H * BATCH * SEQ
        x = [t / per_round for t in runs[0]["tokens"]]
        n = min(len(r["test_loss"]) for r in runs)
        y = [statistics.fmean(r["test_loss"][i] for r in runs) for i in range(n)]
        name = f"{mode} {label(best)}"
        out[f"{name} ({len(runs)} seed{'s' * (len(runs) > 1)})"] = (x[:n], y)
    return out


COLOURS = {"ddp": "C0", "diloco": "C1", "isoloco": "C2", "norm_mean": "C3"}


def plot_curves(recs: list[dict], path) -> None:
    """Test loss against the outer round for each method's pick: K 16 × 75 rounds (part A) beside K 4 for the same
    75 rounds (part B). No plot before either has a run."""
    panels = [
        (f"K 16 × {ROUNDS[16]} rounds", curves(recs, 16)),
        (f"K 4 × {B_ROUNDS} rounds", curves(recs, B_K, B_ROUNDS)),
    ]
    panels = [(t, c) for t, c in panels if c]
    if not panels:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, cs) in zip(axes[0], panels):
        for name, (x, y) in cs.items():
            colour = COLOURS[name.split()[0]]  # a method keeps its colour in both panels
            ax.plot(x[1:], y[1:], label=name, color=colour)  # round 0 (the init's loss) is off the scale
        ax.set_title(title)
        ax.set_xlabel("outer round")
        ax.set_ylabel("test loss (nats/byte)")
        ax.legend(fontsize=7)
    fig.suptitle("Study v7: each method's pick over the rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_v7b(b: dict) -> str:
    lines = [
        f"K {b['workers']} × {b['rounds']} rounds ({b['tokens_per_param']:.1f} tokens per parameter), "
        f"{b['cpu_s'] / 3600:.1f} CPU-hours:",
        "",
        "| gap (test, at the end) | mean [95 % t] |",
        "|---|---|",
    ]
    lines += [f"| {k} | {interval_text(g)} |" for k, g in {**b["gaps"], **b["to_ddp"]}.items()]
    return "\n".join(lines + [""])


def markdown_v7(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        lines += [
            f"K {row['workers']} × {row['rounds']} rounds ({row['tokens_per_param']:.1f} tokens per parameter"
            f"{', Muon inner' if row.get('inner') == 'muon' else ''}), {row['cpu_s'] / 3600:.1f} CPU-hours:",
            "",
            "| method | pick (seeds 0–1) | configs screened | seeds at the pick |",
            "|---|---|---|---|",
        ]
        for mode, m in row["methods"].items():
            seeds = sorted(m.get("test", {}))
            seeds_text = ",".join(map(str, seeds)) or "—"
            lines.append(f"| {mode} | {m['pick'] or '—'} | {len(m['screen'])} | {seeds_text} |")
        lines += ["", "| gap (test, at the end) | mean [95 % t] |", "|---|---|"]
        lines += [f"| {k} | {interval_text(g)} |" for k, g in row["gaps"].items()]
        lines += [f"| {m} - ddp | {interval_text(g)} |" for m, g in (row.get("to_ddp") or {}).items()]
        lines.append("")
    return "\n".join(lines)


def in_flight(K: int, inner: str = "adamw", folder=None) -> dict:
    """claim name -> the claimed run's record fields (None for a claim without a key), for the claims
    (study/.claims) of runs of v7's cell at K with `inner` steps that have not finished: another runner's run in
    flight, or the stale claim of a killed one. A claim without a key (older runners) counts when its name has the
    cell's K and H."""
    from study.common.records import record_of_key
    from study.run_study import claim_name, finished

    folder = Path(folder or Path(__file__).resolve().parents[1])
    done = {claim_name(k) for k in finished(folder)}
    busy = {}
    for c in sorted((folder / ".claims").glob("*")):
        if c.name in done:
            continue
        text = c.read_text().strip()
        if text == "":
            if c.name.split("_")[1:3] == [str(K), str(H)]:
                busy[c.name] = None
        elif in_cell(r := record_of_key(ast.literal_eval(text)), K, inner=inner):
            busy[c.name] = r
    return busy


#: the seeds whose runs in flight a stage waits for, the ones it is chosen from (its own runs are left out of its
#: jobs while claimed, so two runners share a stage's runs)
STAGE_WAITS = {"edges": (0,), "seed1": (0,), "final": (0, 1)}


def wait_for_stage(K: int, inner: str = "adamw", seeds=(0,), limit_s: float = 4 * 3600.0, poll_s: float = 30.0,
                   folder=None) -> dict:  # fmt: skip
    """Block while a run of v7's cell at K with one of `seeds` is in flight: a stage is chosen from finished runs,
    not from part of them. Past `limit_s` (a stale claim: delete it) it says so and goes on. Returns the runs still
    in flight (any seed)."""
    t0 = time.time()
    while True:
        busy = in_flight(K, inner, folder)
        waiting = [n for n, r in busy.items() if (int(n.split("_")[0]) if r is None else r["seed"]) in seeds]
        if not waiting:
            return busy
        if time.time() - t0 > limit_s:
            print(f"gave up waiting for {waiting} after {limit_s:.0f} s: stale claims?", file=sys.stderr, flush=True)
            return busy
        print(
            f"waiting for {len(waiting)} run(s) of K {K} ({inner}), seeds {seeds}, in flight",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(poll_s)


def wait_for_next(K: int, inner: str = "adamw", limit_s: float = 4 * 3600.0, poll_s: float = 30.0, folder=None,
                  load=None) -> list[str]:  # fmt: skip
    """`next_jobs` for the cell's finished runs, polling while it is empty and runs are in flight (another method's
    result may give this runner work); empty once nothing is in flight or when study/STOP exists. Past `limit_s` it
    raises TimeoutError (a stale claim: delete it), so that the runner stops with an error, not as if done. A claim
    without a key holds every method back, as it may be any of them."""
    from study.common import records

    folder = Path(folder or Path(__file__).resolve().parents[1])
    t0 = time.time()
    while not (folder / "STOP").exists():
        busy = in_flight(K, inner, folder)
        if None not in busy.values():
            claimed = {(config_of(r), r["seed"]) for r in busy.values()}
            lines = next_jobs((load or records.load)(), K, inner=inner, claimed=claimed)
            if lines or not busy:
                return lines
        if time.time() - t0 > limit_s:
            raise TimeoutError(f"gave up waiting for {sorted(busy)} after {limit_s:.0f} s: stale claims?")
        print(f"no run free for K {K} ({inner}) while {len(busy)} run(s) are in flight: waiting", file=sys.stderr,
              flush=True)  # fmt: skip
        time.sleep(poll_s)
    return []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("jobs",))
    p.add_argument("--K", type=int, required=True, choices=sorted(ROUNDS))
    p.add_argument("--stage", required=True, choices=("next", "edges", "seed1", "final"),
                   help="next: each method's next runs, whatever stage it is at (the plans' choice)")  # fmt: skip
    p.add_argument("--inner", default="adamw", choices=("adamw", "muon"), help="part D: muon")
    p.add_argument("--no-wait", action="store_true", help="do not wait for the stage's jobs in flight")
    a = p.parse_args()
    from study.common.records import load

    if a.stage == "next":
        try:
            lines = next_jobs(load(), a.K, inner=a.inner) if a.no_wait else wait_for_next(a.K, a.inner)
        except TimeoutError as e:
            sys.exit(str(e))
    else:
        busy = {} if a.no_wait else wait_for_stage(a.K, a.inner, STAGE_WAITS[a.stage])
        claimed = {(config_of(r), r["seed"]) for r in busy.values() if r is not None}
        lines = jobs(load(), a.K, a.stage, inner=a.inner, claimed=claimed)
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
