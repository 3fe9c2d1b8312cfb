"""study/arrival/arrival.py on synthetic records whose answer is known: each condition paired with the same
method's clean run and across methods."""

from __future__ import annotations

import pytest

from study.arrival import arrival
from study.tests.helpers import study_record


def _rec(mode, lr, mu, seed, test, **ragged):
    r = study_record(mode, lr, mu, seed, test, test, batch=4, eval_every=300, mu=mu, **ragged)
    r.update(workers=16, eval_split="halves")
    return r


def test_each_condition_pairs_with_its_clean_run_and_across_methods():
    recs = []
    for seed in range(3):
        recs += [_rec("diloco", 1.0, 0.0, seed, 2.40 + 0.01 * seed), _rec("isoloco", 4.2, None, seed, 2.20)]
        recs += [_rec("diloco", 1.0, 0.0, seed, 2.50 + 0.01 * seed, drop=0.25)]
        recs += [_rec("isoloco", 4.2, None, seed, 2.25, drop=0.25)]
        recs += [_rec("diloco", 1.0, 0.0, seed, 2.90, faulty=10.0), _rec("isoloco", 4.2, None, seed, 2.30, faulty=10.0)]
    recs += [_rec("isoloco", 4.2, None, 0, 9.0, faulty=10.0, merge_clip="median")]  # DiLoCo not run: no row
    recs += [_rec("diloco", 0.7, 0.0, 0, 5.0, drop=0.25)]  # another lr: its own clean run (none here)
    rows = {r["condition"]: r for r in arrival.summarize_arrival(recs)}
    assert set(rows) == {"drop 0.25", "faulty ×10"}
    d = rows["drop 0.25"]
    assert d["config"] == {"diloco": (1.0, 0.0), "isoloco": (4.2, None)}  # the lr-0.7 run (one seed) is not it
    assert d["iso_minus_diloco"]["seeds"] == 3 and d["iso_minus_diloco"]["mean"] == pytest.approx(2.25 - 2.51)
    assert d["cost"]["isoloco"]["mean"] == pytest.approx(0.05) and d["cost"]["isoloco"]["seeds"] == 3
    assert d["cost"]["diloco"]["mean"] == pytest.approx(0.10)
    f = rows["faulty ×10"]
    assert f["iso_minus_diloco"]["mean"] == pytest.approx(2.30 - 2.90)
    assert f["cost"]["diloco"]["mean"] == pytest.approx(2.90 - 2.41)
    table = arrival.markdown_arrival(list(rows.values()))
    assert "| 16 × 10 | faulty ×10 | -0.600" in table
