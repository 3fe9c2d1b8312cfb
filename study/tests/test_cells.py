"""Study v3's tables (study/cells/v3.py) on synthetic records whose answer is known: each method tuned on the
selection split, reported on the test split, edges marked, and the ablations against IsoLoCo."""

from __future__ import annotations

import pytest

from study.cells import v3 as v3_module
from study.common.stats import paired_bootstrap_ci
from study.tests.helpers import study_record


@pytest.fixture(scope="module")
def v3():
    return v3_module


def test_v3_tunes_on_selection_reports_test_and_marks_edges(v3):
    recs = [study_record("diloco", 0.35, 0.9, s, 2.50 + s / 100, 2.60) for s in (0, 1, 2)]
    recs += [study_record("diloco", 0.7, 0.9, s, 2.40 + s / 100, 2.70 + s / 100) for s in (0, 1, 2)]
    recs += [study_record("diloco", 1.0, 0.9, 0, None, None)]  # diverged: ranked last
    recs += [study_record("diloco", 0.7, 0.5, 0, 2.45, 2.0)]  # only seed 0: ranked on seed 0 with the rest
    recs += [
        study_record("isoloco", lr, 0.8, s, 2.3 - lr / 10, 2.5 - lr / 10 + s / 1000)
        for lr in (1.2, 1.8)
        for s in (0, 1)
    ]
    recs += [study_record("isoloco", 1.8, 0.8, 0, 9.0, 9.0, batch=4)]  # another cell
    s = v3.summarize_v3(recs, paired_bootstrap_ci)
    assert len(s) == 2
    row = next(r for r in s.values() if r["cell"]["batch"] == 16)
    dl, iso = row["diloco"], row["isoloco"]
    assert (dl["lr"], dl["momentum"], dl["edge"], dl["ranked_on_seeds"]) == (0.7, 0.9, False, [0])
    assert (iso["lr"], iso["edge"]) == (1.8, True)  # best on the grid's upper edge
    assert row["gap"]["seeds"] == [0, 1]
    assert row["gap"]["per_seed"] == pytest.approx([2.32 - 2.70, 2.321 - 2.71])
    assert "0.7 @ 0.9" in v3.markdown_v3(s) and "(edge)" in v3.markdown_v3(s)
    d = row["gap"]["per_seed"]  # the t interval: mean ± 12.706 · sd / √2 for two pairs
    half = 12.706 * abs(d[0] - d[1]) / 2**0.5 / 2**0.5
    assert (row["gap"]["t_lo"], row["gap"]["t_hi"]) == pytest.approx((sum(d) / 2 - half, sum(d) / 2 + half))


def test_v3_reports_an_ablation_against_isoloco_each_tuned(v3):
    recs = [study_record("isoloco", lr, 0.8, s, 2.3 - lr / 10, 2.0 + s / 100) for lr in (1.8, 2.4) for s in (0, 1)]
    # the ablation's best (selection) is its lr 3.2, inside its grid; its test losses are 0.1 and 0.12 worse
    recs += [study_record("isoloco-noemb", lr, 0.8, 0, 2.5 + abs(lr - 3.2), 2.1) for lr in (2.4, 3.2, 4.2)]
    recs += [study_record("isoloco-noemb", 3.2, 0.8, 1, 2.5, 2.13)]
    s = v3.summarize_v3(recs, paired_bootstrap_ci)
    (row,) = s.values()
    assert (row["isoloco-noemb"]["lr"], row["isoloco-noemb"]["edge"]) == (3.2, False)
    g = row["gap_isoloco-noemb"]  # ablation − IsoLoCo, paired per seed
    assert g["seeds"] == [0, 1] and g["per_seed"] == pytest.approx([0.1, 0.12])
    text = v3.markdown_by_question(s)
    assert "`isoloco-noemb`, best lr 3.2) − IsoLoCo, test: +0.110 (+0.100, +0.120)" in text
    assert "isoloco-noemb (lr @ μ" in v3.markdown_grids(s)
