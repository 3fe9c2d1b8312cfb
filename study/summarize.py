"""Regenerate every summary, plot and table of the study from its questions' run records.

    python study/summarize.py            # or: python -m study.summarize

reads every question's study/<question>/results/*.jsonl (common/records.py `load`), writes each summary and plot
into its question's folder and prints each table, after its `<!-- name -->` marker, for the questions' notes:

    init_scale/   study v2 (v2.py, v2_plots.py): summary_v2.json, study_v2.png, study_v2_gap.png, study_v2_grid.png
    cells/        study v3 (v3.py): summary_v3.json, study_v3.png
    merges/       study v5 part B (v5.py): summary_v5_merges.json, study_v5_merges.png
    horizon/      study v6 parts A and B (v6.py): summary_v6.json (with k_scaling's part C), study_v6_horizon.png
    k_scaling/    study v6 part C (fixed_compute.py): study_v6_fixed_compute.png; study v7 (v7.py, spectra.py):
                  summary_v7.json, study_v7_k_scaling.png
    arrival/      workers as they arrive (arrival.py): summary_arrival.json
    compression/  the compressed exchange (compression.py): summary_compress.json, study_compress.png
    precision/    study v4 (v4.py): summary_v4.json, study_v4.png
    capacity/     study v5 part A's mechanism (v5_mechanism.py, its own records): study_v5_mechanism.png

each where its runs exist. Study v2 records ("study": "v2" in the JSONL) are summarized per (init, vocab, K, H,
rounds) cell, v1 runs joining the v2 cells as GPT-2-init byte-level runs without divergence measurements (v2.py).
Study v1 is frozen into its results: its tables are in cells/notes.md, its numbers in cells/summary.json and its
figure in cells/study.png, all written by the v1 pipeline of this file, which git history keeps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# run as a script (python study/summarize.py) or loaded by path (tests): the study's modules import as study.*
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from study.common.records import load, plain, read_jsonl, run_key
from study.common.stats import paired_bootstrap_ci
from study.init_scale.v2 import markdown_v2, summary_v2
from study.init_scale.v2_plots import plot_grid, plots_v2

#: the results files of the questions after study v6, kept out of the summaries before them
LATER = ("k_scaling/results/v7_*.jsonl", "compression/results/compress_v2.jsonl", "arrival/results/*.jsonl")


def main() -> None:
    # the runs of the questions after v6 (LATER: study v7's, compression v2's, arrival's) are theirs alone: the
    # summaries before them read the runs they made (compression v2 reran the uncompressed base cell on new seeds)
    all_runs = load(HERE)
    later = {run_key(r) for pattern in LATER for f in sorted(HERE.glob(pattern)) for r in read_jsonl(f)}
    every = [r for r in all_runs if run_key(r) not in later]
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
        from study.horizon import v6  # study v6: the horizon (A), outer schedules (B)
        from study.k_scaling import fixed_compute  # study v6 part C: K at fixed compute

        if any(r.get("rounds") == v6.HORIZON[2] for r in v3_recs):
            s6 = v6.summarize_v6(v3_recs)
            s6["schedules"] = v6.summarize_schedules([r for r in every if r.get("study") == "v3"])
            s6["fixed_compute"] = fixed_compute.summarize_fixed_compute(v3_recs)
            (HERE / "horizon" / "summary_v6.json").write_text(json.dumps(s6, indent=1))
            v6.plot_v6(s6, HERE / "horizon" / "study_v6_horizon.png")
            fixed_compute.plot_fixed_compute(s6["fixed_compute"], HERE / "k_scaling" / "study_v6_fixed_compute.png")
            print("\n<!-- v6 horizon -->\n" + v6.markdown_v6(s6))
            print("\n<!-- v6 schedules -->\n" + v6.markdown_schedules(s6["schedules"]))
            print("\n<!-- v6 fixed compute -->\n" + fixed_compute.markdown_fixed_compute(s6["fixed_compute"]))
        from study.compression.compression import markdown_compress, plot_compress, summarize_compress

        comp = summarize_compress([r for r in all_runs if r.get("study") == "v3"])
        if comp:
            (HERE / "compression" / "summary_compress.json").write_text(json.dumps(comp, indent=1))
            plot_compress(comp, HERE / "compression" / "study_compress.png")
            print("\n<!-- compress -->\n" + markdown_compress(comp))
    from study.k_scaling import spectra, v7  # study v7: K at fixed compute against the strongest DiLoCo, and why

    v3_cells = v3 if v3_recs else {}
    rows = v7.summarize_v7(all_runs)
    if rows:
        spectra_rows = spectra.summarize_spectra(read_jsonl(spectra.OUT)) if spectra.OUT.exists() else []
        s7 = {"fixed_compute": rows, "spectra": spectra_rows, "workers_or_rounds": v7.summarize_v7b(all_runs)}
        s7["muon_inner"] = v7.summarize_v7(all_runs, inner="muon")
        (HERE / "k_scaling" / "summary_v7.json").write_text(json.dumps(s7, indent=1))
        v6_path = HERE / "horizon" / "summary_v6.json"  # K 4 × 300 rounds: v6's horizon cell, about the same tokens
        v6_rows = json.loads(v6_path.read_text()).get("fixed_compute", []) if v6_path.exists() else []
        fixed = {r["workers"]: r["gap"] for r in v6_rows if r["workers"] == 4}
        fixed |= {r["workers"]: r["gaps"].get("isoloco - diloco") for r in rows}
        gaps = {  # a K whose picks have run fewer than v7.MIN_SEEDS seeds is left out
            "fixed compute (v6, v7)": {K: g for K, g in fixed.items() if (g or {}).get("seeds", 0) >= v7.MIN_SEEDS},
            "10 rounds (v3)": {
                K: v3_cells.get(f"K {K}, H 30, R 10, batch 4×64, adamw 0.003", {}).get("gap") for K in (4, 16, 32)
            },
        }
        spectra.plot_spectra(spectra_rows, gaps, HERE / "k_scaling" / "study_v7_k_scaling.png")
        v7.plot_curves(all_runs, HERE / "k_scaling" / "study_v7_curves.png")
        print("\n<!-- v7 k scaling -->\n" + v7.markdown_v7(rows))
        if s7["muon_inner"]:
            print("\n<!-- v7 muon inner -->\n" + v7.markdown_v7(s7["muon_inner"]))
        if s7["workers_or_rounds"]:
            print("\n<!-- v7 workers or rounds -->\n" + v7.markdown_v7b(s7["workers_or_rounds"]))
        if spectra_rows:
            print("\n<!-- v7 spectra -->\n" + spectra.markdown_spectra(spectra_rows))
    from study.arrival import arrival  # workers as they really arrive: missed rounds, a faulty worker, the clip

    arr = arrival.summarize_arrival(all_runs)
    if arr:
        (HERE / "arrival" / "summary_arrival.json").write_text(json.dumps(arr, indent=1))
        print("\n<!-- arrival -->\n" + arrival.markdown_arrival(arr))
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
    from study.capacity import v5_mechanism  # study v5 part A's mechanism: records of its own (results/mechanism/)

    if v5_mechanism.OUT.exists():
        v5_mechanism.plot(HERE / "capacity" / "study_v5_mechanism.png")
        print("\n<!-- v5 mechanism -->\n" + v5_mechanism.report())


if __name__ == "__main__":
    main()
