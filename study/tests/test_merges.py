"""Study v5 part B: the merges as study methods (run_study.VARIANTS) and the merge table (study/merges/v5.py) on
synthetic records whose answer is known."""

from __future__ import annotations

import pytest

from study import run_study as rs
from study.cells import v3
from study.common.stats import paired_bootstrap_ci
from study.merges import v5
from study.tests.helpers import study_record


def test_every_merge_is_a_study_method_on_both_outer_steps():
    from isoloco_kernels.merges import MERGES

    for merge in rs.MERGE_VARIANTS:
        assert merge in MERGES
        assert rs.VARIANTS[merge] == ("isoloco", {"merge": merge})
        assert rs.VARIANTS[f"{merge}-sgd"] == ("isoloco-sgd", {"merge": merge})
    assert set(rs.MERGE_VARIANTS) == set(MERGES) - {"mean", "iso_c"}  # those two are DiLoCo and IsoLoCo


def _rec(mode, lr, mu, seed, sel, test, outer_s=None):
    """A record of the base cell (v1/v2: 4 × 64 bytes), as part B's merges ran it."""
    return study_record(mode, lr, mu, seed, sel, test, outer_s=outer_s, batch=4, mu=None)


def test_the_merge_table_pairs_each_pick_with_tuned_diloco():
    recs = [
        _rec("diloco", 0.7, 0.0, 0, 2.50, 2.40),
        _rec("diloco", 1.0, 0.0, 0, 2.55, 2.45),
        _rec("diloco", 0.7, 0.0, 1, 2.51, 2.41),
        _rec("diloco", 0.7, 0.0, 2, 2.52, 2.42),
        # tsv: the grid's lowest lr wins on seed 0 (an edge); seeds 1 and 2 of it; 0.1 better every seed
        _rec("tsv", 1.8, 0.8, 0, 2.40, 2.30, outer_s=17.0),
        _rec("tsv", 2.4, 0.8, 0, 2.45, 2.35, outer_s=17.0),
        _rec("tsv", 1.8, 0.8, 1, 2.41, 2.31, outer_s=16.0),
        _rec("tsv", 1.8, 0.8, 2, 2.42, 2.32, outer_s=18.0),
    ]
    rows = v5.summarize_merges(v3.summarize_v3(recs, paired_bootstrap_ci), recs, paired_bootstrap_ci)
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"diloco", "tsv"}
    tsv = by_mode["tsv"]
    assert (tsv["lr"], tsv["momentum"], tsv["edge"]) == (1.8, 0.8, True)
    assert tsv["gap"]["per_seed"] == pytest.approx([-0.1, -0.1, -0.1])
    assert tsv["gap"]["mean"] == pytest.approx(-0.1) and tsv["gap"]["t_hi"] == pytest.approx(-0.1)
    assert tsv["outer_s_per_round"] == pytest.approx(1.7)  # (17 + 16 + 18) / 3 seconds over 10 rounds
    assert by_mode["diloco"]["gap"] is None
    table = v5.markdown_merges(rows)
    assert "| TSV-M | Nesterov μ 0.8 | 1.8 @ 0.8 (edge) | 2.310 (3) | **-0.100 [-0.100, -0.100]** | 1.700 |" in table
