"""The compressed-exchange study's table (study/compression/compression.py) on synthetic records whose answer is known."""

from __future__ import annotations

import pytest

from study.common.grids import grids
from study.compression import compression as comp
from study.tests.helpers import study_record

FP32 = 1_000_000.0


def _rec(mode, lr, mu, seed, sel, test, spec=None, sent=None):
    r = study_record(mode, lr, mu, seed, sel, test, batch=4)
    if spec is not None:
        r["v3"]["compress"] = spec
        r.update(bytes_per_worker_per_round=sent, allreduce_fp32_bytes_per_worker_per_round=FP32)
    return r


def _records():
    recs = []
    for s in (0, 1, 2):
        recs += [
            _rec("diloco", 0.7, 0.0, s, 2.50, 2.40 + 0.01 * s),  # the uncompressed picks
            _rec("isoloco", 3.2, 0.8, s, 2.30, 2.20 + 0.01 * s),
            _rec("diloco", 0.7, 0.0, s, 2.52, 2.45 + 0.01 * s, "int2:128:none", 70_000.0),
            _rec("diloco", 0.7, 0.0, s, 2.51, 2.42 + 0.01 * s, "int2:128:0.95", 70_000.0),
            _rec("diloco", 1.0, 0.0, s, 2.60, 9.00, "int2:128:0.95", 70_000.0),  # worse selection: not picked
            _rec("isoloco", 3.2, 0.8, s, 2.40, 2.30 + 0.02 * s, "int2:128:none", 70_000.0),
            _rec("isoloco", 3.2, 0.8, s, 2.45, 2.35 + 0.01 * s, "int2:128:0.95", 70_000.0),
            _rec("isoloco", 2.4, 0.8, s, 2.35, 2.25 + 0.01 * s, "int2:128:0.95", 70_000.0),  # the retuned pick
        ]
    recs.append(_rec("diloco", 0.7, 0.0, 0, 2.0, 1.0, "int8:128:none", 258_000.0) | {"v3": {"compress": "x"}})
    return recs


def test_compressed_runs_never_join_the_v3_grids():
    cells = grids(_records())
    (cell,) = cells
    assert set(cells[cell]["diloco"]) == {(0.7, 0.0)} and set(cells[cell]["isoloco"]) == {(3.2, 0.8)}


def test_the_table_pairs_each_spec_with_its_own_uncompressed_run_and_the_other_method():
    (c,) = comp.summarize_compress(_records()[:-1]).values()
    rows = c["rows"]
    assert c["fp32_bytes_per_round"] == FP32
    assert rows["fp32"]["diloco"]["bytes_per_round"] == FP32  # uncompressed records carry no bytes: the fp32 count
    two = rows["int2:128:0.95"]
    assert (two["diloco"]["lr"], two["isoloco"]["lr"]) == (0.7, 2.4)  # the retune picks on the selection split
    assert two["isoloco"]["edge"]  # 2.4 is the lower end of {2.4, 3.2}
    assert two["diloco_vs_32bit"]["mean"] == pytest.approx(0.02)
    assert two["isoloco_vs_32bit"]["mean"] == pytest.approx(0.05)
    assert two["iso_minus_diloco"]["mean"] == pytest.approx(-0.17)
    off = rows["int2:128:none"]
    # IsoLoCo without feedback: 2.30 + 0.02 s − (2.20 + 0.01 s) = 0.10 + 0.01 s: mean 0.11, a t interval around it
    g = off["isoloco_vs_32bit"]
    assert g["seeds"] == 3 and g["mean"] == pytest.approx(0.11) and g["t_lo"] < 0.11 < g["t_hi"]
    ef = c["ef"]["int2:128 0.95"]
    assert ef["diloco"]["mean"] == pytest.approx(-0.03) and ef["isoloco"]["mean"] == pytest.approx(
        -0.06
    )  # (2.25 + 0.01 s) − (2.30 + 0.02 s)
    assert rows["fp32"]["iso_minus_diloco"]["mean"] == pytest.approx(-0.20)
    table = comp.markdown_compress(comp.summarize_compress(_records()[:-1]))
    assert "| int2:128:0.95 | 0.070 |" in table and "| fp32 | 1.000 |" in table
    assert table.index("| fp32 |") < table.index("| int2:128:none |") < table.index("| int2:128:0.95 |")


def test_a_diverged_pick_and_a_missing_method_leave_gaps_not_errors():
    recs = [_rec("diloco", 0.7, 0.0, s, None, None, "int4:128:none", 133_000.0) for s in (0, 1)]
    (c,) = comp.summarize_compress(recs).values()
    row = c["rows"]["int4:128:none"]
    assert row["diloco"]["test_mean"] is None and row["isoloco"] is None and row["iso_minus_diloco"] is None
    assert "| int4:128:none |" in comp.markdown_compress({"cell": c})


def test_the_pareto_front_keeps_only_points_nothing_beats():
    pts = [(1.0, 2.5), (2.0, 2.6), (3.0, 2.4), (4.0, 2.45), (0.5, 2.9)]
    assert comp.pareto(pts) == [(0.5, 2.9), (1.0, 2.5), (3.0, 2.4)]
    assert comp.pareto([]) == []


def test_the_plot_draws_one_panel_per_cell_in_k_order_with_off_scale_points_counted(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    assert comp._cell_order("K 16, H 30, R 75, batch 4×64") > comp._cell_order("K 4, H 30, R 10, batch 4×64")
    (c,) = comp.summarize_compress(_records()[:-1]).values()
    far = {"test_mean": 9.0, "bytes_per_round": 70_000.0, "rounds": 10}
    # IsoLoCo 0.35 above its own fp32 (2.21) but below DiLoCo's fp32 + 0.3: off the scale by its own method's rule
    near = {"test_mean": 2.56, "bytes_per_round": 70_000.0, "rounds": 10}
    bad = {"rows": {**c["rows"], "int2:128:0.95:stochastic": {"diloco": far, "isoloco": near}}}
    titles = []
    import matplotlib.axes

    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", lambda ax, t, **kw: titles.append(t))
    comp.plot_compress({"K 16, R 75": c, "K 4, R 10": bad}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert titles[0].startswith("Compressed exchange: K 4") and "2 off the scale" in titles[0]
    assert titles[1].startswith("Compressed exchange: K 16") and "off the scale" not in titles[1]
