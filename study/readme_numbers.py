"""The numbers on the README's first screen, generated from the committed result files they come from
(tests/package/test_readme.py checks that the README says exactly these).

    python study/readme_numbers.py                 # prints each README sentence and its source file
    python study/readme_numbers.py --run-example   # reruns examples/diloco_minimal.py at its default
                                                   # size and rewrites examples/diloco_minimal.json

Sources: bench/results/2026-12-04-NVIDIA-H200.json (the flatten on one H200), study/cells/summary_v3.json (the
study's tuned IsoLoCo − DiLoCo gaps after 10 rounds, and their picks), study/horizon/summary_v6.json (the gap at ~20
tokens per parameter with K 4 over 300 rounds, and its outer schedules), study/k_scaling/summary_v7.json (the same
tokens over more workers for fewer rounds, against the strongest baselines run so far), examples/diloco_minimal.json
(the minimal example's losses) and study/readme_run/results.json (the main job: the outer step's share of a round).
"advice" is the tuning text the README, docs/drop-in.md, docs/study.md and docs/training-loop.md carry verbatim.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from itertools import groupby
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from study.k_scaling.v7 import MIN_SEEDS  # noqa: E402  (the seeds a v7 gap needs before a page quotes it)

H200 = ROOT / "bench" / "results" / "2026-12-04-NVIDIA-H200.json"
STUDY = ROOT / "study" / "cells" / "summary_v3.json"
HORIZON = ROOT / "study" / "horizon" / "summary_v6.json"
K_SCALING = ROOT / "study" / "k_scaling" / "summary_v7.json"
EXAMPLE = ROOT / "examples" / "diloco_minimal.json"
MAIN_RUN = ROOT / "study" / "readme_run" / "results.json"
#: a cell counts as a gain when IsoLoCo's mean test loss is at least this much below tuned DiLoCo's and
#: the 95 % t interval of the paired gap lies below 0 (the seed-to-seed spread is 0.01–0.04)
GAIN = 0.05


def _time(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def speedup() -> str:
    """The flatten of llama-178m in float32 on the H200: `auto` against the per-matrix SVD loop."""
    run = json.loads(H200.read_text())
    cases = {
        b["extra_info"]["impl"]: b["extra_info"]
        for b in run["benchmarks"]
        if b["extra_info"].get("kind") == "flatten"
        and b["extra_info"]["set"] == "llama-178m"
        and b["extra_info"]["dtype"] == "fp32"
        and b["extra_info"]["device"] == "cuda"
    }
    ours, svd = cases["auto"], cases["svd-loop"]
    params = run["isoloco"]["sets"]["llama-178m"]["n_params"]
    return (
        f"**{svd['median_s'] / ours['median_s']:.1f}× faster** than the per-matrix SVD loop: Iso-C of every matrix of a "
        f"{params / 1e6:.0f}M-parameter Llama in {_time(ours['median_s'])} instead of {_time(svd['median_s'])} on one "
        f"H200 (fp32, relative error {ours['err_rel_fro']:.1e} against float64)."
    ).replace("e-06", "e-6")


def tokens_per_param(cell: dict) -> float:
    """Tokens a run of this v3 cell trained on (K × H × rounds × batch × seq_len) per model parameter."""
    from isoloco_kernels.train import TrainConfig

    params = TrainConfig(model=cell["model"], vocab=cell["vocab"], seq_len=cell["seq_len"]).n_params()
    return cell["workers"] * cell["inner_steps"] * cell["rounds"] * cell["batch"] * cell["seq_len"] / params


def study_gain() -> str:
    """The study v3 cells of 10 outer rounds: the range of IsoLoCo's gains over a tuned DiLoCo, the size of the
    rest, how DiLoCo was tuned there (over lr and μ, or over lr at one μ) and the tokens per parameter."""
    rows = [row for row in json.loads(STUDY.read_text()).values() if row.get("gap") and row["cell"]["rounds"] == 10]
    cells = [row["gap"] for row in rows]
    gains = [-g["mean"] for g in cells if g["t_hi"] < 0 and -g["mean"] >= GAIN]
    rest = [abs(g["mean"]) for g in cells if not (g["t_hi"] < 0 and -g["mean"] >= GAIN)]
    seeds = {len(g["seeds"]) for g in cells}
    assert len(seeds) == 1, f"{STUDY}: cells with different numbers of seeds {sorted(seeds)}"
    both = sum(len({k.split("@")[1] for k in row["diloco"]["grid"]}) > 1 for row in rows)
    tpp = [tokens_per_param(row["cell"]) for row in rows]
    return (
        f"**{min(gains):.2f}–{max(gains):.2f} nats/byte lower held-out loss** than a tuned DiLoCo (over lr and μ in "
        f"{both} cells, over lr at one μ in {len(rows) - both}) in {len(gains)} of {len(cells)} small-scale cells "
        f"after 10 outer rounds ({min(tpp):.1f}–{max(tpp):.0f} tokens per parameter; AdamW or Muon inner steps, "
        f"{seeds.pop()} paired seeds each, 95 % t intervals below 0); {max(rest):.3f} or less in the other {len(rest)}"
    )


def _iv(g: dict) -> str:
    return f"{g['mean']:+.3f} [{g['t_lo']:+.3f}, {g['t_hi']:+.3f}]".replace("-", "−")


def horizon() -> str:
    """Study v6 part A: IsoLoCo − DiLoCo at K 4 at the end of the long base-cell runs (each method tuned at that
    horizon), at round 10 of the same runs, the last round of IsoLoCo's first lead (intervals below 0 from the first
    scored round on) and the round where DiLoCo led most (its interval above 0); the verdict follows the end's
    interval."""
    s = json.loads(HORIZON.read_text())
    gap = {g["round"]: g for g in s["gap"]}
    end, early = gap[s["rounds"]], gap[10]
    if end["t_hi"] < 0 and -end["mean"] >= GAIN:
        verdict = "the gain holds"
    elif end["t_lo"] > 0:
        verdict = "DiLoCo is ahead"
    else:
        verdict = "the gain is gone"
    curve = sorted(s.get("curve", []), key=lambda g: g["round"])
    lead = next((i for i, g in enumerate(curve) if g["t_hi"] >= 0), len(curve))
    held = f", below 0 through round {curve[lead - 1]['round']}" if 0 < lead < len(curve) else ""
    # the round where DiLoCo led most, among those whose interval lies above 0 (none: no clause)
    behind = max((g for g in curve if g["t_lo"] > 0), key=lambda g: g["mean"], default=None)
    middle = f" and {_iv(behind)} at round {behind['round']}, where DiLoCo led most" if behind else ""
    return (
        f"**With K 4 at ~{s['tokens_per_param']:.0f} tokens per parameter and a constant outer lr {verdict}**: after "
        f"{s['rounds']} rounds (H 30, each method tuned at that horizon, {end['seeds']} paired seeds) IsoLoCo − DiLoCo "
        f"is {_iv(end)} at the end, {_iv(early)} at round 10 of the same runs{held}{middle}"
    )


#: how the sentences name an outer schedule (isoloco_kernels.train.config.OUTER_SCHEDULES)
SCHEDULES = {
    "constant": "constant",
    "warmup": "warm-up",
    "warmup-cosine": "warm-up + cosine",
    "momentum-warmup": "momentum warm-up",
}
#: the mode whose default μ a study run of this mode ran at when it named none (run_study.py VARIANTS)
_DEFAULT_OF = {"norm_mean": "isoloco"}


def _g(x) -> str:
    return f"{float(x):g}"


def _seeds(seeds) -> str:
    s = sorted(int(x) for x in seeds)
    if len(s) > 2 and s == list(range(s[0], s[-1] + 1)):
        return f"seeds {s[0]}–{s[-1]}"
    return ("seed " if len(s) == 1 else "seeds ") + ", ".join(map(str, s))


def _config(mode: str, label: str) -> tuple:
    """(lr, μ, schedule) of a v7 screen label ("0.7 @ 0.8", "1 @ 0.8, warmup-cosine", "3.2 @ default")."""
    from isoloco_kernels.train.config import OUTER_DEFAULTS

    head, _, schedule = label.partition(", ")
    lr, _, mu = head.partition(" @ ")
    mu = OUTER_DEFAULTS[_DEFAULT_OF.get(mode, mode)][1] if mu == "default" else float(mu)
    return float(lr), float(mu), schedule or "constant"


def _lr_mu(lr, mu, schedule: str = "constant") -> str:
    return f"{_g(lr)} @ {_g(mu)}" + ("" if schedule == "constant" else f", {SCHEDULES[schedule]}")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _serial(items: list[str]) -> str:
    """A list whose items say "and" themselves: "A", "A, and B", "A, B, and C"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])}, and {items[-1]}"


def _verdict(g: dict) -> str:
    """IsoLoCo − baseline: 'lead' (interval below 0), 'level' (it holds 0) or 'behind' (above 0)."""
    return "lead" if g["t_hi"] < 0 else "behind" if g["t_lo"] > 0 else "level"


def _rule(mode: str, m: dict) -> str:
    """The rule a v7 method's pick stands on so far."""
    screen = m["screen"]
    both = [lab for lab, c in screen.items() if c["selection_seeds01"] is not None]
    ran0 = [lab for lab, c in screen.items() if c["selection_seed0"] is not None]
    best0 = min(ran0, key=lambda lab: screen[lab]["selection_seed0"]) if ran0 else None
    if len(both) >= 2:
        return f"picked by the mean of seeds 0–1 over the {len(both)} configs run on seed 1"
    if m["pick"] is None or m["pick"] == best0:
        return "picked by seed 0"
    return f"picked by seed 0 of an earlier screen ({_lr_mu(*_config(mode, best0))}, now best on seed 0, awaits seed 1)"


def _mus(grid) -> str:
    """The μs of a grid of "lr@μ" keys: "μ 0" or "μ ∈ {0, 0.5}"."""
    mus = sorted({float(k.split("@")[1]) for k in grid})
    return f"μ {_g(mus[0])}" if len(mus) == 1 else "μ ∈ {" + ", ".join(map(_g, mus)) + "}"


def _schedules(configs) -> str:
    kinds = [SCHEDULES[k] for k in SCHEDULES if k in {c[2] for c in configs}]
    return "at a constant outer lr" if kinds == ["constant"] else f"with outer schedules {_and(kinds)}"


def _screen(configs, rule: str) -> dict:
    """A DiLoCo screen in parts the sentence can share between K: its size, its μs, its schedules, its pick's rule."""
    mu, n = _mus(f"{c[0]}@{c[1]}" for c in configs), len(configs)
    return {"n": f"{n} config{'s' * (n > 1)}", "mu": mu, "schedules": _schedules(configs), "rule": rule}


def _ddp_lrs(counts: list[tuple[int, int]]) -> str:
    """How DDP was tuned, from [(inner lrs run, K), ...]: "at one inner lr", "tuned over 3 inner lrs" (one K or
    the same at each), "at one inner lr at K 8, tuned over 3 at K 16 and 32" (neighbouring Ks with one count together)."""
    ns = {n for n, _ in counts}
    if len(ns) == 1:
        n = ns.pop()
        return "at one inner lr" if n == 1 else f"tuned over {n} inner lrs" + (" at each K" if len(counts) > 1 else "")
    parts = [
        ("at one inner lr" if n == 1 else f"tuned over {n}" + " inner lrs" * (i == 0)) + f" at {_ks(ks)}"
        for i, (n, ks) in enumerate(_grouped(counts))
    ]
    return ", ".join(parts)


#: how the sentence names IsoLoCo's standing against a control, by the interval of IsoLoCo − control
STANDING = {"lead": "ahead of", "level": "level with", "behind": "behind"}


def _ks(ks) -> str:
    """K 8, or K 8 and 16."""
    return "K " + _and([str(k) for k in ks])


def _grouped(items: list[tuple]) -> list[tuple]:
    """[(key, value), ...] -> [(key, [value, ...]), ...], neighbours with one key together (so the Ks stay in order)."""
    return [(key, [value for _, value in run]) for key, run in groupby(items, key=lambda item: item[0])]


def _tuning(screens: list[tuple[int, dict]]) -> str:
    """How a method was screened at each K, the schedules and the pick's rule said once for the Ks that share them:
    "K 4: 10 configs, μ ∈ {0, 0.5}, at a constant outer lr, picked by seed 0; K 8: 8 configs, μ 0.8, and K 16: …,
    each with outer schedules …, picked by …"."""
    parts = []
    for (schedules, rule), group in _grouped([((sc["schedules"], sc["rule"]), (K, sc)) for K, sc in screens]):
        each = [f"K {K}: {sc['n']}, {sc['mu']}" for K, sc in group]
        parts.append(_serial(each) + (", each " if len(each) > 1 else ", ") + f"{schedules}, {rule}")
    return "; ".join(parts)


def _standing(rows: list[tuple[int, dict]], whom: str) -> str:
    """IsoLoCo against a control at each K, the Ks with one verdict said together: "IsoLoCo is level with DDP (…)
    at K 8 (…) and K 16 (…)", "IsoLoCo is level with X (…) at K 8 (…) and K 16 (…), and ahead of it at K 32 (…)"
    (a comma between verdicts, as a verdict's Ks are joined by "and")."""
    parts = []
    for i, (v, group) in enumerate(_grouped([(_verdict(g), (K, g)) for K, g in rows])):
        at = _and([f"K {K} ({_iv(g)})" for K, g in group])
        parts.append(f"{STANDING[v]} {whom if i == 0 else 'it'} at {at}")
    return "IsoLoCo is " + _serial(parts)


def where() -> str:
    """Where the gain lives at v6's token budget: IsoLoCo − DiLoCo at K 4 × 300 rounds (horizon/summary_v6.json) and
    at each K of study v7 (k_scaling/summary_v7.json: K 8 × 150, K 16 × 75, K 32 × 38 rounds, whichever have picks run
    on MIN_SEEDS seeds or more), the seeds of each interval, how DiLoCo was tuned at each K so far (configs run, its
    μs and schedules, the pick's rule); the lead-in says whether the gain holds at every larger K, is closed (an
    interval holding 0) or reversed; then part B, and IsoLoCo against the norm-preserving merge and against DDP
    where they ran, the Ks that share a verdict said together."""
    v7 = [r for r in json.loads(K_SCALING.read_text())["fixed_compute"] if r["workers"] > 4]
    v6 = json.loads(HORIZON.read_text())
    k4 = next(r for r in v6["fixed_compute"] if r["workers"] == 4)
    done = sorted(
        (r for r in v7 if (r["gaps"].get("isoloco - diloco") or {}).get("seeds", 0) >= MIN_SEEDS),
        key=lambda r: r["workers"],
    )
    d4 = k4["picks"]["diloco"]
    gaps = [f"{_iv(k4['gap'])} with K 4 workers for {k4['rounds']} rounds"]
    seeds = [(4, _seeds(set(d4["test"]) & set(k4["picks"]["isoloco"]["test"])))]
    grid4 = [(*map(float, key.split("@")), "constant") for key in d4["grid"]]
    screens = [(4, _screen(grid4, f"picked by {_seeds(d4['ranked_on_seeds'])}"))]
    norm_mean, norm_screens, ddp, ddp_lrs = [], [], [], []
    for r in done:
        m, K = r["methods"], r["workers"]
        gaps.append(f"{_iv(r['gaps']['isoloco - diloco'])} with K {K} for {r['rounds']} rounds")
        seeds.append((K, _seeds(set(m["isoloco"]["test"]) & set(m["diloco"]["test"]))))
        screen = [_config("diloco", lab) for lab in m["diloco"]["screen"]]
        screens.append((K, _screen(screen, _rule("diloco", m["diloco"]))))
        nm = r["gaps"].get("isoloco - norm_mean")
        if nm and nm["seeds"] >= MIN_SEEDS:
            norm_mean.append((K, nm))
            cfgs = [_config("norm_mean", lab) for lab in m["norm_mean"]["screen"]]
            norm_screens.append((K, _screen(cfgs, _rule("norm_mean", m["norm_mean"]))))
        dd = (r.get("to_ddp") or {}).get("isoloco")
        if dd and dd["seeds"] >= MIN_SEEDS:
            ddp.append((K, dd))
            ddp_lrs.append((len(m["ddp"]["screen"]), K))
    verdicts = {r["workers"]: _verdict(r["gaps"]["isoloco - diloco"]) for r in done}
    few = _few_rounds(json.loads(K_SCALING.read_text()).get("workers_or_rounds"), k4)
    ks = lambda v: _ks([k for k, x in verdicts.items() if x == v])  # noqa: E731
    if not verdicts:
        lead = "Beyond K 4 the picks await their seeds"
    elif "behind" in verdicts.values():
        lead = f"A tuned DiLoCo is ahead at {ks('behind')}"
    elif "level" in verdicts.values():
        lead = f"The stronger baselines close the gap at {ks('level')}"
    elif _verdict(k4["gap"]) == "lead":
        lead = f"The gain holds at {ks('lead')} and at K 4"
    elif few and few[0] == "lead":
        lead = "The gain lives in runs of few outer rounds, and more workers fill them with tokens"
    else:
        lead = "The gain lives in more workers for fewer rounds"
    tpp = sorted({round(r["tokens_per_param"], 1) for r in [*done, k4]})
    at = f"{tpp[0]}" if len(tpp) == 1 else f"{tpp[0]}–{tpp[-1]}"
    by_seeds = _grouped([(s, K) for K, s in seeds])
    over = (
        f"each over {seeds[0][1]}"
        if len(by_seeds) == 1
        else "over " + _and([f"{s} at {_ks(group)}" for s, group in by_seeds])
    )
    out = (
        f"**{lead}**: at {at} tokens per parameter IsoLoCo − DiLoCo (held-out nats/byte, 95 % t) is {_and(gaps)}, "
        f"{over}, against a DiLoCo tuned at each K over lr × μ ({_tuning(screens)})"
    )
    controls = [few[1]] if few else []
    if norm_mean:
        whom = (
            "the norm-preserving merge (`norm_mean`, the mean's direction at the workers' mean norm, tuned over lr × "
            f"μ; {_tuning(norm_screens)})"
        )
        controls.append(_standing(norm_mean, whom))
    if ddp:
        controls.append(_standing(ddp, f"DDP ({_ddp_lrs(ddp_lrs)})"))
    return out + (f"; {'; '.join(controls)}." if controls else ".")


#: what study v7 part B's K 4 × 75 rounds says, by IsoLoCo − DiLoCo's interval there
ROUNDS_MEANING = {
    "lead": "the lead follows the rounds, not the workers",
    "level": "at as few rounds with fewer workers the lead is gone, so it follows the workers",
    "behind": "at as few rounds with fewer workers DiLoCo leads, so the gain follows the workers",
}


def _few_rounds(b: dict | None, k4: dict) -> tuple[str, str] | None:
    """Study v7 part B (K 4 for K 16's 75 rounds): (verdict, clause) of IsoLoCo − DiLoCo there, each method at its
    K 4 × 300 pick (IsoLoCo's μ 0.8 is its default there); None before 2 seeds of both have run."""
    iso, dil = (k4["picks"][m] for m in ("isoloco", "diloco"))
    dil_label = f"diloco {dil['lr']:g} @ {dil['momentum']:g}"
    iso_labels = {f"isoloco {iso['lr']:g} @ {mu}" for mu in (f"{iso['momentum']:g}", "default")}
    test = (b or {}).get("test", {})
    pair = [(i, dil_label) for i in sorted(iso_labels) if i in test and dil_label in test]
    if not pair:
        return None
    g = b["gaps"][" - ".join(pair[0])]
    if not g or g["seeds"] < 2:
        return None
    v = _verdict(g)
    seeds = set(test[pair[0][0]]) & set(test[dil_label])
    return v, (
        f"with K 4 for {b['rounds']} rounds ({b['tokens_per_param']:.1f} tokens per parameter, each method at its K 4 × 300 "
        f"pick) it is {_iv(g)} over {_seeds(seeds)}: {ROUNDS_MEANING[v]}"
    )


#: the study's base cell, the one the advice's picks come from: v3's settings (cells/summary_v3.json "cell")
BASE_CELL = {"inner_steps": 30, "batch": 4, "seq_len": 64, "inner": "adamw", "inner_lr": 0.003, "model": "tiny"}
BASE_CELL |= {"init": "gpt2", "vocab": 256}


def _effect(g: dict, whom: str) -> str:
    """What a schedule did to a method, by the interval of scheduled − constant."""
    v = _verdict(g)
    return {"lead": f"helped {whom}", "behind": f"cost {whom}", "level": f"left {whom} as it was"}[v] + f" ({_iv(g)})"


def advice() -> str:
    """Each method's outer lr @ μ against K, as the study picked them in its base cell (a table: after 10 rounds,
    v3; at v6's ~20 tokens per parameter, v6 at K 4 with its warm-up + cosine picks, v7 at K 8/16/32 where a pick
    has run), then how to schedule the outer lr over a long run, from v6 part B, and how to set that schedule."""
    rows = []
    for row in sorted(json.loads(STUDY.read_text()).values(), key=lambda r: r["cell"]["workers"]):
        c, d = row["cell"], row["diloco"]
        if c["rounds"] == 10 and all(c.get(k) == v for k, v in BASE_CELL.items()) and row.get("gap"):
            p = [_lr_mu(row[m]["lr"], row[m]["momentum"]) for m in ("isoloco", "diloco")]
            how = f"v3: {len(d['grid'])} configs, {_mus(d['grid'])}, {_seeds(d['ranked_on_seeds'])}"
            rows.append((f"{c['workers']} × 10 ({tokens_per_param(c):.2g})", *p, how))
    v6 = json.loads(HORIZON.read_text())
    tpp, R, d = f"{v6['tokens_per_param']:.1f}", v6["rounds"], v6["picks"]["diloco"]
    p = [_lr_mu(v6["picks"][m]["lr"], v6["picks"][m]["momentum"]) for m in ("isoloco", "diloco")]
    how = f"v6: {len(d['grid'])} configs, {_mus(d['grid'])}, {_seeds(d['ranked_on_seeds'])}"
    rows.append((f"4 × {R} ({tpp})", *p, how))
    cos = v6["schedules"]["horizon"]["warmup-cosine"]
    tuned = cos.get("retuned")
    if tuned and tuned["iso_minus_diloco"]["seeds"] >= 2:
        p = [_lr_mu(*tuned["picks"][m].split(" @ "), "warmup-cosine") for m in ("isoloco", "diloco")]
        rows.append((f"4 × {R} ({tpp})", *p, f"v6: {len(cos['seed0_selection']['diloco'])} peak lrs, seed 0"))
    for r in json.loads(K_SCALING.read_text())["fixed_compute"]:
        m = r["methods"]
        if r["workers"] > 4 and all(m.get(x, {}).get("pick") for x in ("isoloco", "diloco")):
            p = [_lr_mu(*_config(x, m[x]["pick"])) for x in ("isoloco", "diloco")]
            cfgs = [_config("diloco", lab) for lab in m["diloco"]["screen"]]
            sc = _screen(cfgs, _rule("diloco", m["diloco"]).replace("picked by ", ""))
            sc["schedules"] = "" if sc["schedules"].startswith("at a constant") else sc["schedules"]
            how = "v7: " + ", ".join(v for v in sc.values() if v)
            rows.append((f"{r['workers']} × {r['rounds']} ({r['tokens_per_param']:.1f})", *p, how))
    head = "| K × rounds (tokens per parameter) | IsoLoCo lr @ μ | DiLoCo lr @ μ | study: DiLoCo's screen, pick by |"
    table = [head, "|---|---|---|---|", *(f"| {' | '.join(r)} |" for r in rows)]
    from isoloco_kernels.train import TrainConfig

    b = BASE_CELL
    params = TrainConfig(model=b["model"], vocab=b["vocab"], seq_len=b["seq_len"]).n_params()
    inner = {"adamw": "AdamW", "muon": "Muon"}[b["inner"]]
    warm = v6["schedules"]["horizon"]["warmup"]["isoloco"]["vs_constant"]
    text = (
        f"Each method's outer lr @ μ as the study picked it on its base cell (a {params / 1e6:.2f}M-parameter byte-level "
        f"LM, {b['inner_steps']} {inner} steps of {b['batch']} × {b['seq_len']} bytes per worker and round; check at your "
        "scale):\n\n" + "\n".join(table) + "\n\n"
    )
    do = []
    if _verdict(warm) != "lead" and _verdict(cos["isoloco"]["vs_constant"]) == "lead":
        do.append("decay the outer lr (not just warm it up)")
    before = float(v6["picks"]["diloco"]["lr"])
    after = float(tuned["picks"]["diloco"].split(" @ ")[0]) if tuned else before
    retuned = bool(tuned) and tuned["iso_minus_diloco"]["seeds"] >= 2 and after != before
    if retuned:
        do.append("retune the peak lr for the schedule")
    text += f"Over a long run {' and '.join(do)}: " if do else "Outer-lr schedules over a long run: "
    text += (
        f"at K 4 × {R} rounds a warm-up alone {_effect(warm, 'IsoLoCo')}, a warm-up then cosine decay to 0.1× "
        f"{_effect(cos['isoloco']['vs_constant'], 'it')}"
    )
    if retuned:
        text += (
            f", and with DiLoCo's peak lr {'raised' if after > before else 'lowered'} from {_g(before)} to {_g(after)} "
            f"for it IsoLoCo − DiLoCo is {_iv(tuned['iso_minus_diloco'])}"
        )
    return text + (
        ". Set it with `--outer-schedule warmup-cosine` in the reference loop: a linear warm-up over the first "
        "W = max(2, round(0.05 * R)) of its R rounds, then a half cosine down to 0.1×. `IsoLoCo` reads its lr at every "
        "step, as SGD does, so torch's schedulers give it the same schedule: `SequentialLR(opt, [LinearLR(opt, 1 / W, "
        "total_iters=W - 1), CosineAnnealingLR(opt, T_max=R - W - 1, eta_min=0.1 * lr)], milestones=[W])` "
        "(`torch.optim.lr_scheduler`; `lr` the peak), stepped after each outer step."
    )


def example() -> str:
    """The minimal example's held-out losses at its default size (examples/diloco_minimal.json)."""
    ex = json.loads(EXAMPLE.read_text())
    loss = ex["held_out_loss"]
    return (
        f"held-out loss {loss['DiLoCo']:.3f} with DiLoCo's SGD, {loss['IsoLoCo']:.3f} with IsoLoCo "
        "(a toy: it shows the loop, not the gain's size)."
    )


def outer_share() -> str:
    """The outer step's share of a round's time in the main job (its results.json records it)."""
    run = json.loads(MAIN_RUN.read_text())
    iso, dil = run["modes"]["isoloco"], run["modes"]["diloco"]
    c = run["config"]
    return (
        f"In the main job (command 1: {run['params'] / 1e6:.2f}M parameters, K {c['workers']}, H {c['inner_steps']}, "
        f"{c['rounds']} rounds, {run['machine']['device'].upper()}, {run['machine']['cpu_threads']} threads) IsoLoCo's "
        f"outer step, flatten and Nesterov, took {100 * iso['outer_share']:.2f} % of the rounds' time "
        f"({iso['outer_step_s']:.2f} s of {iso['outer_step_s'] / iso['outer_share']:.0f} s); DiLoCo's SGD step "
        f"{100 * dil['outer_share']:.2f} %."
    )


SENTENCES = {"speedup": (speedup, H200), "study": (study_gain, STUDY), "horizon": (horizon, HORIZON)}
SENTENCES["where"] = (where, K_SCALING)
SENTENCES["advice"] = (advice, K_SCALING)
SENTENCES["example"] = (example, EXAMPLE)
SENTENCES["outer share"] = (outer_share, MAIN_RUN)


def run_example() -> dict:
    """examples/diloco_minimal.py's `train` at its default size for both outer optimizers."""
    spec = importlib.util.spec_from_file_location("diloco_minimal", ROOT / "examples" / "diloco_minimal.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    from functools import partial

    from isoloco_kernels import IsoLoCo

    t0 = time.perf_counter()
    loss = {
        "DiLoCo": ex.train(partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), 30),
        "IsoLoCo": ex.train(partial(IsoLoCo, lr=1.8, momentum=0.8, nesterov=True), 30),
    }
    return {
        "command": "python examples/diloco_minimal.py (rounds 30, workers 4, inner 20)",
        "held_out_loss": loss,
        "wall_s": round(time.perf_counter() - t0, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-example", action="store_true", help="rerun the example and rewrite its JSON")
    a = ap.parse_args(argv)
    if a.run_example:
        EXAMPLE.write_text(json.dumps(run_example(), indent=1) + "\n")
    for name, (make, src) in SENTENCES.items():
        print(f"{name} ({src.relative_to(ROOT)}):\n  {make()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
