"""Study v6 part C's table and plot (study/k_scaling/fixed_compute.py) on synthetic records whose answer is known:
K at fixed compute."""

from __future__ import annotations

import math

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


def _v7(mode, lr, mu, seed, sel, test, K=16, schedule=None, inner_lr=3e-3):
    from study.k_scaling import v7

    r = study_record(mode, lr, mu, seed, sel, test, batch=4, inner_lr=inner_lr, mu=mu)
    r.update(workers=K, rounds=v7.ROUNDS[K], eval_split="halves")
    if schedule:
        r["v3"]["outer_schedule"] = schedule
    return r


def test_v7_the_pick_is_the_best_mean_of_seeds_0_and_1_not_seed_0():
    from study.k_scaling import v7

    recs = [
        _v7("diloco", 0.7, 0.8, 0, 1.50, 1.4),  # best on seed 0, worst on seed 1
        _v7("diloco", 0.7, 0.8, 1, 1.90, 1.8),
        _v7("diloco", 1.0, 0.8, 0, 1.60, 1.5, schedule="warmup-cosine"),
        _v7("diloco", 1.0, 0.8, 1, 1.60, 1.5, schedule="warmup-cosine"),  # the best mean: 1.60
        _v7("diloco", 1.4, 0.5, 0, 1.55, 1.5),
        _v7("diloco", 1.4, 0.5, 1, None, None),  # diverged: +inf
        _v7("diloco", 2.0, 0.0, 0, 1.70, 1.6),  # fourth on seed 0: no seed 1
        _v7("diloco", 0.7, 0.8, 0, 9.0, 9.0, K=32),  # another K's cell
        _v7("diloco", 0.7, 0.8, 0, 0.1, 0.1) | {"rounds": 10},  # v3's 10-round cell: not v7's
    ]
    cfgs = v7.configs(recs, 16)["diloco"]
    assert len(cfgs) == 4
    assert v7.pick(cfgs) == ("diloco", 1.0, 0.8, "warmup-cosine", 3e-3)
    assert v7.ranked(cfgs)[:3] == [("diloco", 0.7, 0.8, "constant", 3e-3), ("diloco", 1.4, 0.5, "constant", 3e-3),
                                   ("diloco", 1.0, 0.8, "warmup-cosine", 3e-3)]  # fmt: skip
    assert v7.jobs(recs, 16, "seed1") == []  # the three best on seed 0 all ran seed 1
    assert v7.jobs(recs, 16, "final") == ["warmup-cosine 0.003 diloco=1@0.8 2,3,4"]
    assert v7.jobs(recs, 32, "seed1") == ["constant 0.003 diloco=0.7@0.8 1"]
    with pytest.raises(ValueError, match="stage"):
        v7.jobs(recs, 16, "seed2")


def test_v7_the_table_pairs_the_picks_over_their_common_seeds_and_ddp_moves_only_its_inner_lr(tmp_path):
    from study.k_scaling import v7

    recs = []
    for seed in range(5):
        recs += [
            _v7("diloco", 0.7, 0.8, seed, 1.7, 1.60 + 0.01 * seed),
            _v7("norm_mean", 1.0, 0.8, seed, 1.6, 1.55),
            _v7("isoloco", 3.2, None, seed, 1.5, 1.40),
            _v7("ddp", None, None, seed, 1.5, 1.45, inner_lr=4.5e-3),
        ]
    recs += [_v7("ddp", None, None, s, 1.6, 1.5) for s in (0, 1)]  # the base inner lr: not the pick
    recs += [_v7("isoloco", 3.2, None, 0, 1.0, 1.0, inner_lr=6e-3)]  # only DDP moves the inner lr
    (row,) = v7.summarize_v7(recs)
    assert row["workers"] == 16 and row["tokens_per_param"] == pytest.approx(16 * 30 * 75 * 256 / 467_584)
    assert row["methods"]["ddp"]["pick"] == "inner lr 0.0045"
    assert row["methods"]["isoloco"]["screen"].keys() == {"3.2 @ default"}
    g = row["gaps"]["isoloco - diloco"]
    assert g["seeds"] == 5 and g["mean"] == pytest.approx(-0.20 - 0.02)
    assert row["gaps"]["norm_mean - diloco"]["mean"] == pytest.approx(-0.05 - 0.02)
    assert row["to_ddp"]["isoloco"]["mean"] == pytest.approx(-0.05)
    table = v7.markdown_v7([row])
    assert "K 16 × 75 rounds" in table and "| isoloco - norm_mean | -0.150" in table


def test_v7_edges_extend_the_seed0_best_one_step_past_its_lr_lines_end():
    from study.k_scaling import v7

    recs = [
        _v7("diloco", 0.5, 0.8, 0, 1.60, 1.5),
        _v7("diloco", 0.7, 0.8, 0, 1.50, 1.4),  # the best, at the top of its line (0.5, 0.7 @ 0.8)
        _v7("diloco", 1.0, 0.5, 0, 1.70, 1.6),  # another μ: another line
        _v7("isoloco", 3.2, None, 0, 1.40, 1.3),  # alone on its line: √2 below and above, on the ladder
        _v7("norm_mean", 0.35, 0.8, 0, 1.40, 1.3),  # the best, at the bottom
        _v7("norm_mean", 0.5, 0.8, 0, 1.45, 1.3),
        _v7("norm_mean", 0.7, 0.8, 0, 1.50, 1.3),
        _v7("ddp", None, None, 0, 1.5, 1.4),  # DDP walks its own grid, × {1, 1.5, 2}: 1.5× next
        _v7("diloco", 9.9, 0.8, 0, 1.0, 1.0, K=32),
    ]
    assert v7.jobs(recs, 16, "edges") == [
        "constant 0.0045 ddp=- 0",
        "constant 0.003 diloco=1@0.8 0",
        "constant 0.003 isoloco=2.4 0",
        "constant 0.003 isoloco=4.2 0",
        "constant 0.003 norm_mean=0.25@0.8 0",
    ]
    recs += [_v7("diloco", 1.0, 0.8, 0, 1.55, 1.4), _v7("isoloco", 2.4, None, 0, 1.45, 1.3)]
    recs += [_v7("ddp", None, None, 0, 1.55, 1.4, inner_lr=4.5e-3)]  # worse than 1×: DDP's walk ends
    recs += [_v7("norm_mean", 0.25, 0.8, 0, 1.30, 1.3)]  # past the edge and better still: the next step
    # IsoLoCo's 3.2 is now the top of (2.4, 3.2): one step of 4/3 up
    assert v7.jobs(recs, 16, "edges") == ["constant 0.003 isoloco=4.2 0", "constant 0.003 norm_mean=0.17@0.8 0"]
    recs += [_v7("isoloco", 4.2, None, 0, 1.45, 1.3), _v7("norm_mean", 0.12, 0.8, 0, 1.20, 1.3)]
    assert v7.jobs(recs, 16, "edges") == []  # the ladder's end
    assert v7.past_edge(v7.configs(recs, 16)["diloco"]) == []
    # DDP's best at the top of what it ran: the next inner lr of its grid, and none past 2×
    ddp = [_v7("ddp", None, None, 0, 1.55, 1.4), _v7("ddp", None, None, 0, 1.53, 1.4, inner_lr=4.5e-3)]
    assert v7.jobs(ddp, 16, "edges") == ["constant 0.006 ddp=- 0"]
    below = math.nextafter(4.5e-3, 0)  # 1.5× as a computed lr may land a bit below: it is 1.5× still, 2× is next
    ddp_product = [ddp[0], _v7("ddp", None, None, 0, 1.53, 1.4, inner_lr=below)]
    assert v7.jobs(ddp_product, 16, "edges") == ["constant 0.006 ddp=- 0"]
    assert v7.jobs(ddp + [_v7("ddp", None, None, 0, 1.52, 1.4, inner_lr=6e-3)], 16, "edges") == []
    assert v7.jobs(ddp + [_v7("ddp", None, None, 0, 1.54, 1.4, inner_lr=6e-3)], 16, "edges") == []


def test_v7_part_d_muon_runs_are_their_own_cell():
    from study.k_scaling import v7

    recs = [_v7("diloco", 1.0, 0.5, s, 1.8, 1.7) for s in (0, 1)]  # AdamW inner
    for r in [_v7("diloco", 1.0, 0.5, s, 1.9 + 0.1 * s, 1.8) for s in (0, 1)] + [
        _v7("isoloco", 2.4, None, 0, 1.6, 1.5)
    ]:
        r["v3"]["inner"] = "muon"
        recs.append(r)
    assert v7.jobs(recs, 16, "seed1", inner="muon") == ["constant 0.003 isoloco=2.4 1"]
    assert v7.jobs(recs, 16, "seed1") == []
    (adamw,), (muon,) = v7.summarize_v7(recs), v7.summarize_v7(recs, inner="muon")
    assert adamw["methods"]["diloco"]["screen"]["1 @ 0.5"]["selection_seeds01"] == pytest.approx(1.8)
    assert muon["methods"]["diloco"]["screen"]["1 @ 0.5"]["selection_seeds01"] == pytest.approx(1.95)
    assert muon["methods"]["isoloco"]["pick"] is None and (adamw["inner"], muon["inner"]) == ("adamw", "muon")
    assert "tokens per parameter, Muon inner), " in v7.markdown_v7([muon])
    assert "Muon" not in v7.markdown_v7([adamw])


def test_v7_a_stage_waits_for_the_cells_runs_in_flight_and_only_for_those(tmp_path, capsys):
    import json

    from study.common.records import run_key
    from study.k_scaling import v7
    from study.run_study import claim_name

    def claim(r, text=None):
        k = run_key(r)
        (tmp_path / ".claims" / claim_name(k)).write_text(repr(k) if text is None else text)
        return claim_name(k)

    (tmp_path / ".claims").mkdir()
    (tmp_path / "q" / "results").mkdir(parents=True)
    done = _v7("diloco", 0.7, 0.8, 1, 1.7, 1.6)
    (tmp_path / "q" / "results" / "r.jsonl").write_text(json.dumps(done) + "\n")
    claim(done)  # finished: its claim stays, and does not count
    seed1 = claim(_v7("isoloco", 3.2, None, 1, 1.5, 1.4))  # a seed-1 run of the cell in flight
    muon = _v7("diloco", 1.0, 0.5, 0, 1.9, 1.8)
    muon["v3"]["inner"] = "muon"
    muon = claim(muon)  # part D's cell
    compressed = _v7("isoloco", 3.2, None, 0, 1.5, 1.4)
    compressed["v3"]["compress"] = "int4"
    claim(compressed)  # compression's runs at K 16 × 75 are not v7's
    claim(_v7("diloco", 0.7, 0.8, 0, 1.7, 1.6, K=32))  # another K
    (tmp_path / ".claims" / "0_16_30_diloco_2.0_v3_old").write_text("")  # a claim without a key: by its name
    busy = v7.in_flight(16, folder=tmp_path)
    assert sorted(busy) == sorted([seed1, "0_16_30_diloco_2.0_v3_old"])
    assert v7.config_of(busy[seed1]) == ("isoloco", 3.2, None, "constant", 3e-3) and busy[seed1]["seed"] == 1
    assert sorted(v7.in_flight(16, "muon", folder=tmp_path)) == sorted([muon, "0_16_30_diloco_2.0_v3_old"])
    assert v7.in_flight(8, folder=tmp_path) == {}
    assert v7.wait_for_stage(8, seeds=(0, 1), limit_s=0.05, poll_s=0.01, folder=tmp_path) == {}
    assert capsys.readouterr().err == ""
    (tmp_path / ".claims" / "0_16_30_diloco_2.0_v3_old").unlink()
    del busy["0_16_30_diloco_2.0_v3_old"]
    # seed1 and edges wait for seed 0's runs (none left), and the seed-1 run in flight is handed back as claimed
    assert v7.wait_for_stage(16, seeds=v7.STAGE_WAITS["seed1"], limit_s=0.05, poll_s=0.01, folder=tmp_path) == busy
    assert capsys.readouterr().err == ""
    v7.wait_for_stage(16, seeds=v7.STAGE_WAITS["final"], limit_s=0.05, poll_s=0.01, folder=tmp_path)
    err = capsys.readouterr().err
    assert "waiting for 1 run(s) of K 16 (adamw), seeds (0, 1), in flight" in err and "gave up waiting" in err


def test_v7_a_stages_runs_another_runner_holds_are_left_out_of_its_jobs():
    from study.k_scaling import v7

    recs = [_v7("diloco", lr, 0.8, 0, sel, 1.4) for lr, sel in ((0.5, 1.6), (0.7, 1.5), (1.0, 1.7), (1.4, 1.8))]
    cfg = lambda lr: ("diloco", lr, 0.8, "constant", 3e-3)  # noqa: E731
    assert v7.jobs(recs, 16, "seed1") == [f"constant 0.003 diloco={x}@0.8 1" for x in ("0.7", "0.5", "1")]
    assert v7.jobs(recs, 16, "seed1", claimed={(cfg(0.7), 1), (cfg(0.5), 0)}) == [
        "constant 0.003 diloco=0.5@0.8 1",
        "constant 0.003 diloco=1@0.8 1",
    ]
    recs += [_v7("diloco", 0.7, 0.8, 1, 1.5, 1.4), _v7("diloco", 0.7, 0.8, 2, 1.5, 1.4)]
    assert v7.jobs(recs, 16, "final", claimed={(cfg(0.7), 3)}) == ["constant 0.003 diloco=0.7@0.8 4"]


def test_v7_next_gives_each_method_its_own_stage_and_holds_back_only_the_method_in_flight():
    from study.k_scaling import v7

    cfg = lambda mode, lr, mu=0.8: (mode, lr, mu, "constant", 3e-3)  # noqa: E731
    recs = [
        _v7("diloco", 0.5, 0.8, 0, 1.60, 1.5),
        _v7("diloco", 0.7, 0.8, 0, 1.50, 1.4),  # top of its line: an edge to run
        _v7("isoloco", 2.4, None, 0, 1.45, 1.3),
        _v7("isoloco", 3.2, None, 0, 1.40, 1.3),  # interior: its three best go to seed 1
        _v7("isoloco", 4.2, None, 0, 1.50, 1.3),
        _v7("ddp", None, None, 0, 1.50, 1.4),
        _v7("ddp", None, None, 1, 1.52, 1.4),  # its best ran seed 1, as did 2× (no edge to walk): its final
        *(_v7("ddp", None, None, seed, 1.60, 1.4, inner_lr=6e-3) for seed in (0, 1)),
    ]
    assert v7.next_jobs(recs, 16) == [
        "constant 0.003 ddp=- 2",
        "constant 0.003 diloco=1@0.8 0",
        "constant 0.003 isoloco=3.2 1",
        "constant 0.003 isoloco=2.4 1",
        "constant 0.003 isoloco=4.2 1",
    ]
    # DiLoCo's edge in flight holds back DiLoCo only; IsoLoCo's 3.2 on seed 1 and DDP's seed 3 are left out
    claimed = {(cfg("diloco", 1.0), 0), (cfg("isoloco", 3.2, None), 1), (cfg("ddp", None, None), 3)}
    assert v7.next_jobs(recs, 16, claimed=claimed) == [
        "constant 0.003 ddp=- 2",
        "constant 0.003 isoloco=2.4 1",
        "constant 0.003 isoloco=4.2 1",
    ]
    # a seed-0 run of DiLoCo's screen in flight: its edge waits for it (the best may move)
    assert "constant 0.003 diloco=1@0.8 0" not in v7.next_jobs(recs, 16, claimed={(cfg("diloco", 1.4, 0.5), 0)})
    # a seed-1 run in flight off the top (here top 1) may still be the pick: no final until it finishes
    ddp45 = ("ddp", None, None, "constant", 4.5e-3)
    recs_ddp = recs + [_v7("ddp", None, None, 0, 1.55, 1.4, inner_lr=4.5e-3)]
    assert v7.next_jobs(recs_ddp, 16, top=1)[0] == "constant 0.003 ddp=- 2"
    assert not any("ddp" in x for x in v7.next_jobs(recs_ddp, 16, top=1, claimed={(ddp45, 1)}))
    recs += [_v7("isoloco", lr, None, 1, sel, 1.3) for lr, sel in ((2.4, 1.40), (4.2, 1.50))]
    # IsoLoCo's last seed-1 run in flight: no final until it finishes (it may be the pick)
    assert v7.next_jobs(recs, 16, claimed={(cfg("isoloco", 3.2, None), 1)}) == [
        "constant 0.003 ddp=- 2",
        "constant 0.003 diloco=1@0.8 0",
    ]
    recs += [_v7("isoloco", 3.2, None, 1, 1.50, 1.3)]  # 3.2: 1.45 over seeds 0–1, 2.4: 1.425, the pick
    assert v7.next_jobs(recs, 16)[-1] == "constant 0.003 isoloco=2.4 2"
    assert v7.next_jobs(recs, 32) == []
    # finals go one seed at a time, the lowest free first: DDP's seed 2 in flight gives its seed 3, then 4
    assert "constant 0.003 ddp=- 3" in v7.next_jobs(recs, 16, claimed={(cfg("ddp", None, None), 2)})
    recs += [_v7("ddp", None, None, s, 1.5, 1.4) for s in (2, 3)]
    assert v7.next_jobs(recs, 16)[0] == "constant 0.003 ddp=- 4"
    assert v7.jobs(recs, 16, "final")[-1] == "constant 0.003 isoloco=2.4 2,3,4"  # a stage on its own: all at once


def test_v7_next_waits_while_nothing_is_free_and_runs_are_in_flight(tmp_path, capsys):
    from study.common.records import run_key
    from study.k_scaling import v7
    from study.run_study import claim_name

    (tmp_path / ".claims").mkdir()
    recs = [_v7("diloco", 0.7, 0.8, 0, 1.50, 1.4), _v7("diloco", 1.0, 0.8, 0, 1.60, 1.5)]
    edge = run_key(_v7("diloco", 0.5, 0.8, 0, 1.5, 1.4))
    (tmp_path / ".claims" / claim_name(edge)).write_text(repr(edge))  # DiLoCo's edge, in flight
    wait = dict(limit_s=0.05, poll_s=0.01, folder=tmp_path, load=lambda: recs)
    with pytest.raises(TimeoutError, match="gave up waiting"):  # a stale claim stops the runner with an error
        v7.wait_for_next(16, **wait)
    assert "no run free for K 16 (adamw) while 1 run(s) are in flight: waiting" in capsys.readouterr().err
    recs.append(_v7("isoloco", 3.2, None, 0, 1.4, 1.3))  # IsoLoCo is free: its runs, at once
    assert v7.wait_for_next(16, **wait) == ["constant 0.003 isoloco=2.4 0", "constant 0.003 isoloco=4.2 0"]
    assert capsys.readouterr().err == ""
    (tmp_path / ".claims" / claim_name(edge)).write_text("")  # a claim without a key may be any method's
    with pytest.raises(TimeoutError):
        v7.wait_for_next(16, **wait)
    assert "no run free" in capsys.readouterr().err
    (tmp_path / ".claims" / claim_name(edge)).unlink()
    (tmp_path / "STOP").touch()
    assert v7.wait_for_next(16, **wait) == []  # stopped: nothing more, even with runs to give
    (tmp_path / "STOP").unlink()
    assert v7.wait_for_next(16, **wait)[0] == "constant 0.003 diloco=0.5@0.8 0"  # nothing in flight: no wait
    assert capsys.readouterr().err == ""


def test_v7_stages_sh_asks_for_the_next_runs_after_each_batch_and_stops_on_a_failed_jobs_call(tmp_path):
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    count = tmp_path / "calls"

    def run(fail_at):
        count.write_text("0")
        script = f"""
python() {{ N=$(( $(cat {count}) + 1 )); echo $N > {count}; echo "jobs $N ${{@: -1}}" >&2
  case $N in {fail_at}) return 3;; 1) echo "constant 0.003 norm_mean=0.25@0.8 0";;
  2) echo "constant 0.003 diloco=0.5@0.9 1"; echo "constant 0.0045 ddp=- 1,2";; esac; }}
R="echo RUN"; C="--cells 16:30"; O=o.jsonl
source study/k_scaling/stages.sh
v7_stages 16 adamw; echo "rc $?" >&2
"""
        out = subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, timeout=60)
        return out.stdout.splitlines(), out.stderr.splitlines()

    runs, log = run(fail_at=99)
    assert [r.split("--seeds ")[1] for r in runs] == [
        "0 --lrs norm_mean=0.25@0.8 --out o.jsonl",
        "1 --lrs diloco=0.5@0.9 --out o.jsonl",
        "1,2 --lrs ddp=- --out o.jsonl",
    ]
    assert "--inner-lr 0.0045" in runs[2] and "--outer-schedule constant" in runs[0]
    assert log == ["jobs 1 next", "jobs 2 next", "jobs 3 next", "rc 0"]  # empty: done
    runs, log = run(fail_at=2)
    assert len(runs) == 1 and log[-1] == "rc 1" and "failed: stopping" in log[-2]


def test_v7b_pairs_isoloco_with_each_diloco_config_and_every_method_with_ddp_at_k4_x_75_rounds(tmp_path):
    from study.k_scaling import v7

    def b(mode, lr, mu, seed, test, **kw):
        return _v7(mode, lr, mu, seed, 1.0, test, **kw) | {"workers": 4, "rounds": 75}

    assert v7.summarize_v7b([_v7("diloco", 0.7, 0.8, 0, 1.7, 1.6)]) is None  # K 16's runs are part A's
    recs = []
    for seed in range(5):
        recs += [
            b("isoloco", 3.2, None, seed, 1.40 + 0.01 * seed),
            b("diloco", 0.5, 0.8, seed, 1.50),
            b("diloco", 0.7, 0.8, seed, 1.45 + 0.02 * seed),
            b("ddp", None, None, seed, 1.42),
        ]
    recs = [
        b("isoloco", 3.2, None, 0, 9.0) | {"rounds": 300},
        b("diloco", 0.5, 0.8, 5, 1.5),
    ] + recs  # another cell; no pair
    out = v7.summarize_v7b(recs)
    assert out["tokens_per_param"] == pytest.approx(4 * 30 * 75 * 256 / 467_584)
    assert sorted(out["test"]) == ["diloco 0.5 @ 0.8", "diloco 0.7 @ 0.8", "inner lr 0.003", "isoloco 3.2 @ default"]
    g = out["gaps"]["isoloco 3.2 @ default - diloco 0.5 @ 0.8"]
    assert g["seeds"] == 5 and g["mean"] == pytest.approx(-0.10 + 0.02)
    assert out["gaps"]["isoloco 3.2 @ default - diloco 0.7 @ 0.8"]["mean"] == pytest.approx(-0.05 - 0.01 * 2)
    assert out["to_ddp"]["diloco 0.5 @ 0.8 - ddp"]["mean"] == pytest.approx(0.08)
    assert len(out["to_ddp"]) == 3
    table = v7.markdown_v7b(out)
    assert "K 4 × 75 rounds (4.9 tokens per parameter)" in table
    assert "| diloco 0.5 @ 0.8 - ddp | +0.080 [+0.080, +0.080] (5 seeds) |" in table


def test_v7_curves_follow_each_methods_pick_over_the_rounds(tmp_path):
    from study.k_scaling import v7

    def curve(r, losses):
        per_round = r["workers"] * 30 * 4 * 64
        return r | {"tokens": [i * per_round for i in range(len(losses))], "test_loss": losses}

    recs = [
        curve(_v7("diloco", 0.7, 0.8, 0, 1.5, 1.4), [5.0, 2.0, 1.4]),
        curve(_v7("diloco", 0.7, 0.8, 1, 1.5, 1.4), [5.0, 3.0, 1.6]),
        curve(_v7("diloco", 1.0, 0.8, 0, 1.9, 1.8), [5.0, 9.0, 9.0]),  # worse on seed 0: not drawn
        curve(_v7("isoloco", 3.2, None, 0, 1.4, 1.3), [5.0, 1.5, 1.3]),
        curve(_v7("isoloco", 3.2, None, 0, 1.4, 1.3) | {"workers": 4}, [5.0, 1.7, 1.5]),  # part B: K 4 × 75
    ]
    c = v7.curves(recs, 16)
    assert c["diloco 0.7 @ 0.8 (2 seeds)"] == ([0.0, 1.0, 2.0], [5.0, 2.5, 1.5])
    assert c["isoloco 3.2 @ default (1 seed)"] == ([0.0, 1.0, 2.0], [5.0, 1.5, 1.3])
    assert list(v7.curves(recs, 4, 75)) == ["isoloco 3.2 @ default (1 seed)"]
    v7.plot_curves(recs, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000
    v7.plot_curves([], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_v7_spectral_stats_know_their_answers():
    import math

    import torch

    from study.k_scaling import spectra

    flat = spectra.spectral_stats(torch.eye(200, 50, dtype=torch.float64) * 3.0)
    assert flat == pytest.approx({"erank_frac": 1.0, "top_over_mean": 1.0, "top1_energy": 1 / 50, "iso_norm": 1.0})
    u, _ = torch.linalg.qr(torch.randn(40, 40, dtype=torch.float64))
    s = torch.tensor([4.0, 2.0] + [0.0] * 38, dtype=torch.float64)
    st = spectra.spectral_stats(u @ torch.diag(s) @ u.T)
    p = torch.tensor([16 / 20, 4 / 20])
    assert st["erank_frac"] == pytest.approx(math.exp(float(-(p * p.log()).sum())) / 40)
    assert st["top_over_mean"] == pytest.approx(4.0 / (6.0 / 40))
    assert st["top1_energy"] == pytest.approx(16 / 20)
    assert st["iso_norm"] == pytest.approx((6 / 40) * math.sqrt(40) / math.sqrt(20))
    assert spectra.spectral_stats(torch.zeros(3, 5))["erank_frac"] is None
