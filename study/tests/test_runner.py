"""study/run_study.py's v3 settings (regime knobs, outer momentum per job, scoring at the end) and the
loop's eval_every that serves them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from isoloco_kernels.train import Setup, TrainConfig, run_mode
from isoloco_kernels.train.data import Corpus
from study.common.records import run_key

STUDY = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # fresh interpreters that train


@pytest.fixture(scope="module")
def run_study():
    from study import run_study

    return run_study


def _corpus() -> Corpus:
    g = torch.Generator().manual_seed(0)
    text = torch.randint(97, 123, (40_000,), generator=g).to(torch.uint8)
    return Corpus(train=text[:32_000], heldout=text[32_000:], source="random letters", n_docs=1, n_heldout_docs=1)


def test_parse_lrs_reads_lr_and_momentum(run_study):
    assert run_study.parse_lrs("diloco=0.7@0.5,isoloco=1.8,ddp=-") == [
        ("diloco", 0.7, 0.5),
        ("isoloco", 1.8, None),
        ("ddp", None, None),
    ]
    assert run_study.parse_lrs("diloco=1.4@0") == [("diloco", 1.4, 0.0)]


def test_best_jobs_wait_for_their_own_cells_grid_jobs_in_flight(run_study, tmp_path):
    def key(seed, K=4, vocab=256, batch=4, mu=None):
        return (seed, K, 30, "diloco", 0.7, "v3", "gpt2", vocab, 10, "halves", 1024, (("batch", batch), ("mu", mu)))

    cell = {run_study.cell_of(key(0))}
    # seed-0 claims of other cells (another K; the same K and H with another vocab or batch), a later seed
    for k in (key(0, K=8), key(0, vocab=8192), key(0, batch=16), key(1)):
        assert run_study.claim(tmp_path, k)
    assert not run_study.claim(tmp_path, key(1))  # claimed once only
    assert run_study.wait_for_grids(tmp_path, cell, limit_s=0, poll_s=0)
    assert run_study.claim(tmp_path, key(0, mu=0.5))  # this cell's grid, at another μ: in flight
    assert not run_study.wait_for_grids(tmp_path, cell, limit_s=0, poll_s=0)
    record = dict(zip(("seed", "workers", "inner_steps", "mode", "outer_lr", "study", "init", "vocab"), key(0)))
    record.update(rounds=10, eval_split="halves", eval_windows=1024, v3={"batch": 4, "mu": 0.5})
    (tmp_path / "v3_x.jsonl").write_text(json.dumps(record) + "\n")  # ... now finished
    assert run_study.wait_for_grids(tmp_path, cell, limit_s=0, poll_s=0)
    (tmp_path / ".claims" / "0_4_30_isoloco_2.4_v3_gpt2_256_10_halves_1024_0123456789abcdef").touch()  # keyless
    assert not run_study.wait_for_grids(tmp_path, cell, limit_s=0, poll_s=0)  # counted by its K and H


def test_best_jobs_under_a_schedule_or_compression_do_not_wait_for_each_other(run_study, tmp_path):
    """A `best:` job with --outer-schedule or --compress picks from the constant, uncompressed grid: a seed-0 run
    of the scheduled (or compressed) job in flight is no grid job of that cell."""
    base = (0, 4, 30, "isoloco", 3.2, "v3", "gpt2", 256, 300, "halves", 1024)
    settings = run_study.grid_settings({"batch": 4, "outer_schedule": "warmup", "compress": "int2:128:none"})
    assert settings == {"batch": 4, "mu": None}
    grid_cell = {run_study.cell_of((*base, tuple(sorted(settings.items()))))}
    for extra in (("outer_schedule", "warmup"), ("compress", "int2:128:none")):
        assert run_study.claim(tmp_path, (*base, (("batch", 4), extra, ("mu", None))))
    assert run_study.wait_for_grids(tmp_path, grid_cell, limit_s=0, poll_s=0)


def test_v3_records_are_told_apart_by_their_settings():
    key = run_key
    base = dict(
        seed=0,
        workers=4,
        inner_steps=30,
        mode="diloco",
        outer_lr=0.7,
        rounds=10,
        study="v3",
        eval_split="halves",
        eval_windows=1024,
    )
    a = key({**base, "v3": {"batch": 16, "mu": None}})
    b = key({**base, "v3": {"batch": 16, "mu": 0.5}})
    c = key({**base, "v3": {"batch": 4, "mu": None}})
    old = key({**base, "study": "v2"})
    assert len({a, b, c, old}) == 4
    assert a == key({**base, "v3": {"mu": None, "batch": 16}})  # order-free


@pytest.mark.parametrize("mode", ["ddp", "isoloco"])
def test_eval_every_scores_every_nth_round_and_the_last(mode):
    cfg = TrainConfig(
        workers=2, inner_steps=2, rounds=5, batch=2, seq_len=16, eval_windows=4, divergence=False, eval_every=2
    )
    setup = Setup(cfg, _corpus())
    out = run_mode(mode, setup)
    per_round = setup.tokens_per_round()
    assert out["tokens"] == [0, 2 * per_round, 4 * per_round, 5 * per_round]
    assert len(out["heldout_loss"]) == len(out["test_loss"]) == 4
    every = run_mode(mode, Setup(TrainConfig(**{**cfg.__dict__, "eval_every": 1}), _corpus()))
    assert len(every["heldout_loss"]) == 6
    # scoring less often changes nothing but which rounds are scored (the loop is deterministic)
    assert out["final_loss"] == every["final_loss"]
    assert out["heldout_loss"][1:] == [every["heldout_loss"][i] for i in (2, 4, 5)]


def test_eval_every_must_be_positive():
    with pytest.raises(ValueError, match="eval_every"):
        TrainConfig(eval_every=0).validate()


def test_v3_run_records_its_settings_and_resumes(tmp_path):
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, str(STUDY / "run_study.py"), "--part", "v3", "--cells", "2:2", "--steps", "4"]
    cmd += ["--eval-windows", "4", "--batch", "2", "--seq-len", "16", "--out", str(out)]
    grid = ["--seeds", "0", "--lrs", "diloco=0.7@0.5,diloco=1.4@0,isoloco=1.8"]
    for _ in range(2):  # the second run finds every job finished
        subprocess.run(cmd + grid, check=True, capture_output=True, cwd=STUDY.parent, timeout=300)
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["mode"], r["outer_lr"], r["outer_momentum"]) for r in recs] == [
        ("diloco", 0.7, 0.5),
        ("diloco", 1.4, 0.0),
        ("isoloco", 1.8, 0.8),
    ]
    # seed 1 of each method's best config on seed 0's selection split
    subprocess.run(
        cmd + ["--seeds", "1", "--lrs", "best:diloco,isoloco"],
        check=True,
        capture_output=True,
        cwd=STUDY.parent,
        timeout=300,
    )
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    best_dl = min((r for r in recs[:2]), key=lambda r: r["final_loss"])
    assert [(r["seed"], r["mode"], r["outer_lr"], r["outer_momentum"], r["v3"]["mu"]) for r in recs[3:]] == [
        (1, "diloco", best_dl["outer_lr"], best_dl["outer_momentum"], best_dl["v3"]["mu"]),
        (1, "isoloco", 1.8, 0.8, None),  # IsoLoCo's default μ is named as the grid named it
    ]
    for r in recs:
        assert r["study"] == "v3" and r["rounds"] == 2 and len(r["heldout_loss"]) == 2
        assert {k: r["v3"][k] for k in ("batch", "seq_len", "inner", "eval_every")} == {
            "batch": 2,
            "seq_len": 16,
            "inner": "adamw",
            "eval_every": 4,
        }


def test_v3_settings_need_part_v3(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(STUDY / "run_study.py"),
            "--seeds",
            "0",
            "--batch",
            "16",
            "--out",
            str(tmp_path / "r.jsonl"),
        ],
        capture_output=True,
        text=True,
        cwd=STUDY.parent,
    )
    assert r.returncode == 2 and "--part v3" in r.stderr
