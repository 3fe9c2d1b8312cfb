"""The numbers on the README's first screen, generated from the committed result files they come from
(tests/package/test_readme.py checks that the README says exactly these).

    python study/readme_numbers.py                 # prints each README sentence and its source file
    python study/readme_numbers.py --run-example   # reruns examples/diloco_minimal.py at its default
                                                   # size and rewrites examples/diloco_minimal.json

Sources: bench/results/2026-12-04-NVIDIA-H200.json (the flatten on one H200), study/cells/summary_v3.json (the
study's tuned IsoLoCo − DiLoCo gaps), study/horizon/summary_v6.json (the same gap at ~20 tokens per parameter, with
outer schedules and with more workers), examples/diloco_minimal.json (the minimal example's losses) and
study/readme_run/results.json (the main job: the outer step's share of a round).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "bench" / "results" / "2026-12-04-NVIDIA-H200.json"
STUDY = ROOT / "study" / "cells" / "summary_v3.json"
HORIZON = ROOT / "study" / "horizon" / "summary_v6.json"
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
    """Study v6 part A: IsoLoCo − DiLoCo at the end of the long base-cell runs (each method tuned at that
    horizon) and at round 10 of the same runs; the verdict follows the end's interval."""
    s = json.loads(HORIZON.read_text())
    gap = {g["round"]: g for g in s["gap"]}
    end, early = gap[s["rounds"]], gap[10]
    if end["t_hi"] < 0 and -end["mean"] >= GAIN:
        verdict = "the gain holds"
    elif end["t_lo"] > 0:
        verdict = "DiLoCo is ahead"
    else:
        verdict = "the gain is gone"
    # the round where DiLoCo led most, among those whose interval lies above 0 (none: no clause)
    behind = max((g for g in s.get("curve", []) if g["t_lo"] > 0), key=lambda g: g["mean"], default=None)
    middle = f" and {_iv(behind)} at round {behind['round']}, where DiLoCo led most" if behind else ""
    return (
        f"**At ~{s['tokens_per_param']:.0f} tokens per parameter and a constant outer lr {verdict}**: after {s['rounds']} rounds (K 4, H 30, "
        f"each method tuned at that horizon, {end['seeds']} paired seeds) IsoLoCo − DiLoCo is {_iv(end)} at the "
        f"end, {_iv(early)} at round 10 of the same runs{middle}"
    )


def beyond() -> str:
    """Study v6 parts B and C at the same token budget: IsoLoCo − DiLoCo with the outer lr warmed up and
    cosine-decayed (at each method's lr for that schedule when that has 2+ seeds, else at the constant-lr picks),
    and with more workers for fewer rounds (each tuned there)."""
    s = json.loads(HORIZON.read_text())
    row = s["schedules"]["horizon"]["warmup-cosine"]
    cos, re = row["iso_minus_diloco"], (row.get("retuned") or {}).get("iso_minus_diloco")
    if re and re["seeds"] >= 2:
        picks = row["retuned"]["picks"]
        how = f"each method at its lr for that schedule, DiLoCo {picks['diloco']}, IsoLoCo {picks['isoloco']}"
        out = f"{_iv(re)} at round {s['rounds']} ({how}; {_iv(cos)} at the constant-lr picks)"
    else:
        out = f"{_iv(cos)} at round {s['rounds']} (each method at its constant-lr pick)"
    out = f"With the outer lr warmed up and decayed by a cosine to 0.1× it is {out}"
    more = [r for r in s["fixed_compute"] if r["workers"] > 4 and r["gap"] and r["gap"]["seeds"] >= 2]
    for r in more:
        out += f"; with K {r['workers']} for {r['rounds']} rounds, the same tokens, each method tuned there, {_iv(r['gap'])}"
    return out + "."


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
SENTENCES["beyond"] = (beyond, HORIZON)
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
