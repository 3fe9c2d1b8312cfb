"""The reference loop's outer schedules (train/optimizers.py OuterSchedule, --outer-schedule): known answers for
the lr and momentum each round's outer step runs at, read from the outer optimizer's param_groups."""

from __future__ import annotations

import math

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.train.config import OUTER_SCHEDULES, TrainConfig
from isoloco_kernels.train.optimizers import OuterSchedule


def _seen(kind: str, rounds: int, lr=2.0, mu=0.8):
    """(lr, μ) of param group 0 at each of `rounds` outer steps."""
    w = torch.nn.Parameter(torch.zeros(4, 3))
    opt = ik.IsoLoCo([w], lr=lr, momentum=mu)
    sched = OuterSchedule(opt, kind, rounds)
    seen = []
    for _ in range(rounds):
        w.grad = torch.randn(4, 3)
        seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        opt.step()
        sched.step()
    return seen


def test_constant_changes_nothing():
    assert _seen("constant", 10) == [(2.0, 0.8)] * 10


def test_warmup_is_linear_over_five_percent_of_the_rounds():
    seen = _seen("warmup", 100)  # W = 5
    assert [s[0] for s in seen[:6]] == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0, 2.0])
    assert all(s == (pytest.approx(2.0), 0.8) for s in seen[5:])


def test_warmup_cosine_ends_at_a_tenth():
    seen = [s[0] for s in _seen("warmup-cosine", 40)]  # W = 2
    assert seen[:3] == pytest.approx([1.0, 2.0, 2.0])
    assert seen[-1] == pytest.approx(0.2)
    mid = 2 + (40 - 2 - 1) / 2
    assert seen[int(mid)] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 2) / 37))))
    assert all(a >= b for a, b in zip(seen[1:], seen[2:])), "the decay is monotone"


def test_momentum_warmup_starts_above_zero_and_reaches_mu():
    seen = _seen("momentum-warmup", 60)  # W = 3
    assert [s[1] for s in seen[:4]] == pytest.approx([0.8 / 3, 1.6 / 3, 0.8, 0.8])
    assert all(s[0] == 2.0 for s in seen)


def test_one_round_is_never_scaled_to_zero():
    assert _seen("warmup", 1) == [(2.0, 0.8)]
    assert [s[0] for s in _seen("warmup-cosine", 2)] == pytest.approx([1.0, 2.0])  # W ≥ 2: a warm-up even at 10 rounds
    assert [s[0] for s in _seen("warmup", 10)][:3] == pytest.approx([1.0, 2.0, 2.0])


def test_an_unknown_schedule_is_refused_before_training():
    assert set(OUTER_SCHEDULES) == {"constant", "warmup", "warmup-cosine", "momentum-warmup"}
    with pytest.raises(ValueError, match="outer_schedule must be one of"):
        TrainConfig(outer_schedule="linear").validate()


def test_the_loop_steps_the_schedule_each_round():
    """A two-worker run with warmup-cosine: the record says so, and it differs from the constant run."""
    from isoloco_kernels.train import Setup, load_corpus, run_mode

    base = TrainConfig(model="tiny", seq_len=16, workers=2, inner_steps=2, rounds=4, batch=2, warmup=1, eval_windows=8)
    corpus = load_corpus(max_bytes=60_000)
    got = {}
    for kind in ("constant", "warmup-cosine"):
        cfg = TrainConfig(**{**base.__dict__, "outer_schedule": kind})
        cfg.validate()
        got[kind] = run_mode("isoloco", Setup(cfg, corpus))
    assert got["warmup-cosine"]["outer_schedule"] == "warmup-cosine" and "outer_schedule" not in got["constant"]
    assert got["warmup-cosine"]["final_loss"] != got["constant"]["final_loss"]


def test_each_outer_step_runs_once_before_training(monkeypatch):
    from isoloco_kernels.train.config import TrainConfig
    from isoloco_kernels.train.optimizers import check_outer_step

    cfg = TrainConfig(workers=1, merge="tsv")
    check_outer_step("isoloco", cfg)  # K = 1 is a merge's value for one worker: it runs
    check_outer_step("ddp", cfg)  # no outer step: nothing to check

    def refuse(self, *a, **k):
        raise ValueError("this merge cannot run here")

    monkeypatch.setattr(ik.MergeLoCo, "step", refuse)
    with pytest.raises(ValueError, match="--mode isoloco with K=1, merge 'tsv': its outer step cannot run: this merge"):
        check_outer_step("isoloco", cfg)
