"""Study v6 part C's table and plot (study/k_scaling/fixed_compute.py) on synthetic records whose answer is known:
K at fixed compute."""

from __future__ import annotations

import pytest

from study.k_scaling import fixed_compute
from study.tests.helpers import study_record


def test_the_fixed_compute_table_pairs_each_k_at_its_budget_beside_its_10_round_gap(tmp_path):
    recs = []
    for seed in (0, 1, 2):
        for K, rounds, d_test, i_test in ((16, 75, 1.50, 1.45), (2, 600, 1.40, 1.41)):
            for mode, lr, mu, sel, test in (("diloco", 1.0, 0.0, 1.6, d_test), ("isoloco", 4.2, 0.8, 1.5, i_test)):
                r = study_record(mode, lr, mu, seed, sel, test + 0.01 * seed * (mode == "isoloco"), batch=4)
                r.update(workers=K, rounds=rounds)
                recs.append(r)
        for mode, test in (("diloco", 2.5), ("isoloco", 2.2)):  # K 16 after 10 rounds (v3's fixed-rounds cell)
            r = study_record(mode, 1.0 if mode == "diloco" else 4.2, 0.0 if mode == "diloco" else 0.8, seed, 2.0, test)
            r.update(workers=16, batch=4)
            r["v3"]["batch"] = 4
            recs.append(r)
    recs.append(study_record("isoloco", 5.6, 0.8, 0, 1.7, 1.0, batch=4) | {"workers": 16, "rounds": 75})  # not picked
    rows = {r["workers"]: r for r in fixed_compute.summarize_fixed_compute(recs)}
    assert sorted(rows) == [2, 16]  # K 4 and 8 have no runs: no rows
    k16, k2 = rows[16], rows[2]
    assert k16["picks"]["isoloco"]["lr"] == 4.2 and k16["tokens_per_param"] == pytest.approx(
        16 * 30 * 75 * 256 / 467_584
    )
    assert k16["gap"]["mean"] == pytest.approx(-0.05 + 0.01) and k16["gap"]["seeds"] == 3
    assert k16["gap_10_rounds"]["mean"] == pytest.approx(-0.3)
    assert k2["gap"]["mean"] == pytest.approx(0.01 + 0.01) and k2["gap_10_rounds"] is None
    table = fixed_compute.markdown_fixed_compute(list(rows.values()))
    assert "| 16 | 75 (" in table and "| 2 | 600 (" in table
    fixed_compute.plot_fixed_compute(list(rows.values()), tmp_path / "k.png")
    assert (tmp_path / "k.png").stat().st_size > 1000
    fixed_compute.plot_fixed_compute([], tmp_path / "none.png")  # no K with both picks: no plot
    assert not (tmp_path / "none.png").exists()
