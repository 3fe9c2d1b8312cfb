"""Study v6 parts A and B on synthetic records whose answer is known: the horizon table and the outer schedules'
table (study/horizon/v6.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from study.common.grids import grids
from study.horizon import v6
from study.tests.helpers import study_record

STUDY = Path(__file__).resolve().parents[1]
TPR = 4 * 30 * 4 * 64


def _rec(mode, lr, mu, seed, sel, curve):
    """A horizon record: 300 rounds, scored every 10, its test loss after round r given by curve(r)."""
    r = study_record(mode, lr, mu, seed, sel, curve(300), batch=4, mu=None, eval_every=10)
    rounds = [0, *range(10, 301, 10)]
    r.update(rounds=300, tokens=[k * TPR for k in rounds], test_loss=[curve(k) for k in rounds], cpu_s=60.0)
    return r


def test_the_horizon_table_picks_at_the_horizon_and_pairs_every_checkpoint():
    recs = []
    for seed in (0, 1, 2):
        base = 0.01 * seed
        recs.append(_rec("diloco", 0.7, 0.0, seed, 1.60 + base, lambda r, b=base: 2.0 - r / 1000 + b))
        recs.append(
            _rec("isoloco", 3.2, 0.8, seed, 1.50 + base, lambda r, b=base, s=seed: 2.1 - r / 900 + b + 0.001 * s)
        )
        recs.append(_rec("ddp", None, None, seed, 1.40, lambda r: 1.9 - r / 1000))
    recs.append(_rec("diloco", 1.0, 0.5, 0, 1.70, lambda r: 2.5))  # worse on the selection split: not picked
    recs.append(_rec("isoloco", 4.2, 0.8, 0, 1.49, lambda r: 3.0))  # better selection at seed 0: the pick
    s = v6.summarize_v6(recs)
    assert s["picks"]["diloco"]["lr"] == 0.7 and s["picks"]["diloco"]["momentum"] == 0.0
    assert s["picks"]["isoloco"]["lr"] == 4.2 and s["picks"]["isoloco"]["edge"]
    assert s["tokens_per_param"] == pytest.approx(300 * TPR / 467_584)
    # the pick 4.2 has seed 0 only: its gap pairs one seed, 3.0 − (2.0 − r/1000) at each checkpoint
    assert [g["round"] for g in s["gap"]] == [10, 30, 100, 300]
    for g in s["gap"]:
        assert g["seeds"] == 1 and g["mean"] == pytest.approx(3.0 - (2.0 - g["round"] / 1000)) and math.isnan(g["t_lo"])
    assert s["to_ddp"]["diloco"]["mean"] == pytest.approx(0.1 + 0.01)  # mean over seeds of (2.0 − 0.3 + b) − 1.6
    table = v6.markdown_v6(s)
    assert "| 300 |" in table and "4.2 @ 0.8" in table and "19.7 tokens per parameter" in table


def test_three_seeds_give_a_t_interval_around_the_mean_gap():
    recs = []
    for seed, d in zip((0, 1, 2), (-0.10, -0.12, -0.11)):
        recs.append(_rec("diloco", 0.7, 0.0, seed, 1.6, lambda r: 2.0))
        recs.append(_rec("isoloco", 3.2, 0.8, seed, 1.5, lambda r, d=d: 2.0 + d))
    g = {x["round"]: x for x in v6.summarize_v6(recs)["gap"]}[300]
    assert g["seeds"] == 3 and g["mean"] == pytest.approx(-0.11)
    half = 4.303 * 0.01 / math.sqrt(3)
    assert (g["t_lo"], g["t_hi"]) == pytest.approx((-0.11 - half, -0.11 + half))


def test_a_run_not_scored_at_a_checkpoint_leaves_that_row_out():
    recs = [_rec("diloco", 0.7, 0.0, 0, 1.6, lambda r: 2.0), _rec("isoloco", 3.2, 0.8, 0, 1.5, lambda r: 1.9)]
    for r in recs:
        r["tokens"], r["test_loss"] = [0, 300 * TPR], [5.0, r["test_loss"][-1]]
    assert [g["round"] for g in v6.summarize_v6(recs)["gap"]] == [300]


def test_runs_with_an_outer_schedule_are_not_grid_points():
    """Part B's runs (an outer schedule at a pick) stay out of the constant-schedule grid the picks come from."""
    plain = _rec("diloco", 0.7, 0.0, 0, 1.6, lambda r: 2.0)
    warm = _rec("diloco", 0.5, 0.0, 0, 1.1, lambda r: 1.5)  # better, but warmed up: not a grid point
    warm["v3"] = {**warm["v3"], "outer_schedule": "warmup"}
    (grid,) = grids([plain, warm]).values()
    assert list(grid["diloco"]) == [(0.7, 0.0)]


def test_the_schedule_table_pairs_each_schedule_with_the_constant_pick_and_the_short_cell_per_round():
    recs = []
    for seed in (0, 1, 2):
        recs.append(_rec("diloco", 0.5, 0.8, seed, 1.55, lambda r: 1.40))
        recs.append(_rec("isoloco", 3.2, 0.8, seed, 1.52, lambda r: 1.39))
        warm = _rec("isoloco", 3.2, 0.8, seed, 1.50, lambda r, s=seed: 1.37 - 0.01 * s)
        warm["v3"]["outer_schedule"] = "warmup"
        dwarm = _rec("diloco", 0.5, 0.8, seed, 1.54, lambda r: 1.38)
        dwarm["v3"]["outer_schedule"] = "warmup"
        recs += [warm, dwarm]
        # the 10-round cell: v3 grid records (scored once) and the per-round runs of part B
        for mode, lr, mu, sel in (("diloco", 0.7, 0.0, 2.48), ("isoloco", 3.2, 0.8, 2.33)):
            recs.append(study_record(mode, lr, mu, seed, sel, 2.3, batch=4, mu=None, eval_every=300))
        for mode, lr, mu, sched, curve in (
            ("diloco", 0.7, 0.0, "constant", lambda r: 3.0 - 0.05 * r),
            ("isoloco", 3.2, 0.8, "constant", lambda r: 4.3 if r == 1 else 3.0 - 0.06 * r),
            ("isoloco", 3.2, 0.8, "warmup", lambda r: 3.0 - 0.06 * r),
        ):
            r = study_record(mode, lr, mu, seed, 2.0, curve(10), batch=4, mu=None, eval_every=1)
            r.update(tokens=[k * TPR for k in range(11)], test_loss=[curve(k) for k in range(11)])
            if sched != "constant":
                r["v3"]["outer_schedule"] = sched
            recs.append(r)
    s = v6.summarize_schedules(recs)
    w = s["horizon"]["warmup"]
    assert w["isoloco"]["vs_constant"]["mean"] == pytest.approx(-0.03) and w["isoloco"]["seeds"] == [0, 1, 2]
    assert w["diloco"]["vs_constant"]["mean"] == pytest.approx(-0.02)
    assert w["iso_minus_diloco"]["mean"] == pytest.approx(-0.02)  # (1.37 − 0.01 s) − 1.38, mean over s
    assert "warmup-cosine" not in s["horizon"]  # no runs: no row
    assert "seed0_selection" not in w  # only the picks ran under the warm-up
    hot = _rec("diloco", 0.7, 0.8, 0, 1.53, lambda r: 1.40)  # a higher peak lr, seed 0 first
    hot["v3"]["outer_schedule"] = "warmup"
    warm = v6.summarize_schedules(recs + [hot])["horizon"]["warmup"]
    assert warm["seed0_selection"] == {"diloco": {"0.5 @ 0.8": 1.54, "0.7 @ 0.8": 1.53}, "isoloco": {"3.2 @ 0.8": 1.50}}
    assert warm["retuned"]["picks"] == {"diloco": "0.7 @ 0.8", "isoloco": "3.2 @ 0.8"}
    one = warm["retuned"]["iso_minus_diloco"]  # one seed of the new pick: a difference, no interval yet
    assert one["seeds"] == 1 and one["mean"] == pytest.approx(1.37 - 1.40) and math.isnan(one["t_lo"])
    hots = [hot] + [_rec("diloco", 0.7, 0.8, sd, 1.6, lambda r: 1.40) for sd in (1, 2)]
    for h in hots[1:]:
        h["v3"]["outer_schedule"] = "warmup"
    s = v6.summarize_schedules(recs + hots)
    assert s["horizon"]["warmup"]["retuned"]["iso_minus_diloco"]["mean"] == pytest.approx(1.36 - 1.40)
    assert s["horizon"]["warmup"]["iso_minus_diloco"]["mean"] == pytest.approx(
        -0.02
    )  # the constant-lr picks, as before
    table = v6.markdown_schedules(s)
    assert "diloco under warmup, seed 0, selection split at the end: 0.5 @ 0.8: 1.5400, 0.7 @ 0.8: 1.5300" in table
    assert "IsoLoCo − DiLoCo at the picks under warmup (diloco 0.7 @ 0.8, isoloco 3.2 @ 0.8): -0.040" in table
    short = s["short"]
    assert short["constant"]["round_1"]["mean"] == pytest.approx(4.3 - 2.95)  # the overshoot after round 1
    assert short["warmup"]["round_1"]["mean"] == pytest.approx(2.94 - 2.95)
    assert short["warmup"]["round_10"]["mean"] == pytest.approx(2.4 - 2.5)
    assert short["warmup_vs_constant"]["round_1"]["mean"] == pytest.approx(2.94 - 4.3)  # paired, IsoLoCo alone
    assert short["warmup_vs_constant"]["round_5"]["mean"] == pytest.approx(0.0)
    table = v6.markdown_schedules(s)
    assert "| warmup |" in table and "| IsoLoCo warmup (DiLoCo constant) |" in table
    assert "| IsoLoCo warmup − IsoLoCo constant | -1.360" in table
