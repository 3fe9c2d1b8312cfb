"""Summarize every question's study/<question>/results/*.jsonl: tables (markdown), summary JSONs and PNGs.

    python study/summarize.py            # or python -m study.summarize: regenerates every summary and plot
                                         # and prints the markdown tables the questions' notes show

This file reads the run records (read_jsonl; run_key, what makes a run that run; results_files, every
question's results files in one order; load, their runs once), holds the paired bootstrap interval the
studies' gaps use (paired_bootstrap_ci), and runs the pipeline (main), each table printed after its
`<!-- name -->` marker and each output written into its question's folder:

    init_scale/   study v2's summary, tables and figures (v2.py, v2_plots.py): summary_v2.json, study_v2*.png
    cells/        study v3's (v3.py): summary_v3.json, study_v3.png
    merges/       study v5 part B's (v5.py): summary_v5_merges.json, study_v5_merges.png
    horizon/      study v6's (v6.py): summary_v6.json (parts A, B and k_scaling's part C), study_v6_horizon.png
    k_scaling/    study v6 part C's plot: study_v6_fixed_compute.png
    compression/  the compressed exchange's (compression.py): summary_compress.json, study_compress.png
    precision/    study v4's (v4.py): summary_v4.json, study_v4.png

where their runs exist. run_study.py imports read_jsonl, results_files and run_key from here.

Study v2 records ("study": "v2" in the JSONL) are summarized per (init, vocab, K, H, rounds) cell,
v1 runs joining the v2 cells as GPT-2-init byte-level runs without divergence measurements (v2.py).
Study v1 is frozen into its results: its tables are in study/cells/notes.md, its numbers in
study/cells/summary.json and its figure in study/cells/study.png, all written by the v1 pipeline of this
file, which git history keeps.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# run as a script (python study/summarize.py) or loaded by path (tests): the study's modules import as study.*
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from study.init_scale.v2 import markdown_v2, summary_v2
from study.init_scale.v2_plots import plot_grid, plots_v2


def read_jsonl(path: Path) -> list[dict]:
    """The run records of one results file. ValueError naming the file and line for a line that is
    not a JSON object (a run cut off while it was written: delete that line and rerun the job)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{i}: not a JSON record ({e.msg}); a run cut off while it was written? "
                "delete the line and run the job again"
            ) from None
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{i}: a {type(r).__name__}, not a run record (a JSON object)")
        out.append(r)
    return out


def run_key(r: dict) -> tuple:
    """What makes a run the run it is: its config (records from before the selection / test split
    lack eval_split: they were scored on 64 windows over the whole held-out text), and study v3's
    regime settings and outer momentum ("v3")."""
    v3 = r.get("v3")
    return (
        r["seed"],
        r["workers"],
        r["inner_steps"],
        r["mode"],
        r["outer_lr"],
        r.get("study", "v1"),
        r.get("init", "gpt2"),
        r.get("vocab", 256),
        r["rounds"],
        r.get("eval_split", "whole"),
        r.get("eval_windows", 64),
        None if v3 is None else tuple(sorted(v3.items())),
    )


def results_files(study: Path = HERE) -> list[Path]:
    """Every run-record file of the study in `study`: each question's results/*.jsonl (and any *.jsonl in
    `study` itself: a scratch study's, run_study.study_folder), in the order of their names. That is the order
    the one results folder listed them in before the study was split by question, and it matters: a run two
    processes both executed is kept as first read. Two files of one name would make the order ambiguous."""
    files = sorted([*study.glob("*/results/*.jsonl"), *study.glob("*.jsonl")], key=lambda f: f.name)
    names = [f.name for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"{study}: two results files share a name: {sorted(n for n in names if names.count(n) > 1)}")
    return files


def load(study: Path = HERE) -> list[dict]:
    """The runs of every results file of the study (results_files), each once (a run two processes both
    executed is kept as first read)."""
    recs, seen = [], set()
    for f in results_files(study):
        for r in read_jsonl(f):
            k = run_key(r)
            if k not in seen:
                seen.add(k)
                recs.append(r)
    return recs


def plain(r: dict) -> bool:
    """A run at a constant outer schedule with an uncompressed exchange: what every study before v6 ran, and all
    that their summaries (v2 to v5) read. Study v6's scheduled runs and the compressed-exchange runs have their own."""
    v3 = r.get("v3") or {}
    return "compress" not in v3 and v3.get("outer_schedule", "constant") == "constant"


def paired_bootstrap_ci(a, b, level: float = 0.95, n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of the paired differences a_i − b_i and its percentile-bootstrap
    interval at `level`. Pair i is one seed of both methods (same init and data), so the pairs are
    resampled together, with replacement, n_boot times, and the interval is the (1 − level)/2 and
    (1 + level)/2 quantiles of the resampled means. Deterministic for a given seed. With fewer than
    two pairs there is no interval: lo and hi are NaN. With few pairs (3 seeds) the percentile
    interval is too narrow (it cannot be wider than the pairs' range); read it with the pairs."""
    import random

    if len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    if not 0 < level < 1 or n_boot < 1:
        raise ValueError(f"level must be in (0, 1) and n_boot ≥ 1, got {level}, {n_boot}")
    d = [x - y for x, y in zip(a, b)]
    if not d:
        raise ValueError("no pairs")
    mean = statistics.fmean(d)
    if len(d) < 2:
        return mean, float("nan"), float("nan")
    rng, n = random.Random(seed), len(d)
    boots = sorted(statistics.fmean(rng.choices(d, k=n)) for _ in range(n_boot))
    q = lambda p: boots[min(n_boot - 1, max(0, round(p * (n_boot - 1))))]
    return mean, q((1 - level) / 2), q((1 + level) / 2)


def main() -> None:
    every = load(HERE)
    recs = [r for r in every if plain(r)]
    v2, v2_recs = summary_v2(recs)
    (HERE / "init_scale" / "summary_v2.json").write_text(json.dumps(v2, indent=1))
    plots_v2(v2, v2_recs, HERE / "init_scale")
    plot_grid(v2, HERE / "init_scale")
    print("<!-- v2 -->\n" + markdown_v2(v2))
    for what, key in (
        ("all cells", "gap_correlations"),
        ("cells of 300 inner steps per worker", "gap_correlations_300_steps"),
    ):
        cor = v2[key]
        print(
            f"\nPearson r over {cor['points']} (cell, seed) points ({what}) between DiLoCo's divergence and "
            f"IsoLoCo − DiLoCo (released configs): shrinkage {cor.get('shrinkage', float('nan')):+.2f}, cosine "
            f"{cor.get('cosine', float('nan')):+.2f}, σ₁/σ̄ of mean Δ (second half of the rounds) "
            f"{cor.get('top_over_mean_late', float('nan')):+.2f}"
        )
    print(
        f"\n{len(v2_recs)} v2 runs, {v2['cpu_s_total'] / 60:.1f} CPU-min; {v2['v1_repeats']['runs']} v2 runs repeat a "
        f"v1 configuration, {v2['v1_repeats']['identical']} of them with a bit-identical final loss"
    )
    v3_recs = [r for r in recs if r.get("study") == "v3"]
    if v3_recs:
        from study.cells.v3 import markdown_by_question, markdown_grids, plot_v3, summarize_v3

        v3 = summarize_v3(v3_recs, paired_bootstrap_ci)
        (HERE / "cells" / "summary_v3.json").write_text(json.dumps(v3, indent=1))
        plot_v3(v3, HERE / "cells" / "study_v3.png")
        print("\n<!-- v3 -->\n" + markdown_by_question(v3) + "\n\n" + markdown_grids(v3))
        print(f"\n{len(v3_recs)} v3 runs, {sum(r.get('cpu_s', 0.0) for r in v3_recs) / 60:.1f} CPU-min")
        from study.merges.v5 import markdown_merges, plot_merges, summarize_merges  # study v5 part B

        merges = summarize_merges(v3, v3_recs, paired_bootstrap_ci)
        if merges:
            (HERE / "merges" / "summary_v5_merges.json").write_text(json.dumps(merges, indent=1))
            plot_merges(merges, HERE / "merges" / "study_v5_merges.png")
            print("\n<!-- v5 merges -->\n" + markdown_merges(merges))
        from study.horizon import v6  # study v6: the horizon (A), outer schedules (B), K at fixed compute (C)

        if any(r.get("rounds") == v6.HORIZON[2] for r in v3_recs):
            s6 = v6.summarize_v6(v3_recs)
            s6["schedules"] = v6.summarize_schedules([r for r in every if r.get("study") == "v3"])
            s6["fixed_compute"] = v6.summarize_fixed_compute(v3_recs)
            (HERE / "horizon" / "summary_v6.json").write_text(json.dumps(s6, indent=1))
            v6.plot_v6(s6, HERE / "horizon" / "study_v6_horizon.png")
            v6.plot_fixed_compute(s6["fixed_compute"], HERE / "k_scaling" / "study_v6_fixed_compute.png")
            print("\n<!-- v6 horizon -->\n" + v6.markdown_v6(s6))
            print("\n<!-- v6 schedules -->\n" + v6.markdown_schedules(s6["schedules"]))
            print("\n<!-- v6 fixed compute -->\n" + v6.markdown_fixed_compute(s6["fixed_compute"]))
        from study.compression.compression import markdown_compress, plot_compress, summarize_compress

        comp = summarize_compress([r for r in every if r.get("study") == "v3"])
        if comp:
            (HERE / "compression" / "summary_compress.json").write_text(json.dumps(comp, indent=1))
            plot_compress(comp, HERE / "compression" / "study_compress.png")
            print("\n<!-- compress -->\n" + markdown_compress(comp))
    v4_recs = [r for r in recs if r.get("study") == "v4"]
    if v4_recs:
        from study.precision.v4 import markdown_v4, markdown_verdict, plot_v4, summarize_v4, verdict

        spectra_file = HERE / "precision" / "results" / "spectra" / "v4_spectra.jsonl"
        spectra = read_jsonl(spectra_file) if spectra_file.exists() else []
        v4 = summarize_v4(recs, spectra)
        v = verdict(v4)
        (HERE / "precision" / "summary_v4.json").write_text(json.dumps({"cells": v4, "verdict": v}, indent=1))
        plot_v4(v4, HERE / "precision" / "study_v4.png")
        print("\n<!-- v4 -->\n" + markdown_v4(v4) + "\n\n" + markdown_verdict(v, v4))
        print(f"\n{len(v4_recs)} v4 runs, {sum(r.get('cpu_s', 0.0) for r in v4_recs) / 60:.1f} CPU-min")


if __name__ == "__main__":
    main()
