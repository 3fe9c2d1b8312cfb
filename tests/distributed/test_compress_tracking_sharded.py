"""Tracking (feedback "ef21") on the sharded route: ShardedIsoLoCo(compress=...) on 2 and 3 gloo ranks bit-equal to
the one-process simulation (MergeLoCo), each rank's estimate worker `rank`'s and each owner's estimate of the mean
the simulation's; the estimates saved and restored bit for bit; a NaN on one rank refused everywhere with nothing
changed (estimates included)."""

from __future__ import annotations

import copy

import pytest
import torch

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import DistributedStepError, MergeLoCo, ShardedIsoLoCo
from tests.helpers import seeded, step_as_rank, step_with_one_process
from tests.spawn import Checks, groups, params

pytestmark = pytest.mark.slow  # spawns gloo ranks

SHAPES = [(12, 8), (5,), (8, 12), (40, 6), ()]
CASES = [
    ("stat2:64:0.9:nearest:ef21", "iso_c", torch.float32),
    ("int2:32:1:stochastic:ef21", "iso_c", torch.bfloat16),
    ("int4:64:0.8:nearest:ef21:skip=vectors", "mean", torch.float16),
]


def _deltas(world, step, dtype):
    return seeded(SHAPES, 900 + step, dtype, k=world)


def _equal_to_one_process(rank, world, spec, merge, dtype):
    ps, ref = seeded(SHAPES, 4, dtype), seeded(SHAPES, 4, dtype)
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, compress=spec, merge=merge)
    one = MergeLoCo(ref, lr=0.9, momentum=0.6, compress=spec, merge=merge)
    step_with_one_process(opt, one, ps, lambda step: _deltas(world, step, dtype), rank)
    for i, (p, q) in enumerate(zip(ps, ref)):
        assert torch.equal(p, q), f"{spec} {merge} {dtype}: param {i} differs from the one-process simulation"
    assert opt._residuals.keys() == one._residuals.keys() and opt._residuals
    for i, r in opt._residuals.items():  # this rank's estimate is worker `rank`'s
        assert torch.equal(r, one._residuals[i][rank])
    assert set(opt._update_residuals) == set(opt.mine) & set(one._update_residuals)
    for i, r in opt._update_residuals.items():  # the owner's estimate of the mean
        assert torch.equal(r, one._update_residuals[i])


def _check_save_and_load(rank, world):
    spec = CASES[0][0]
    a, b = seeded(SHAPES, 4, torch.float32), seeded(SHAPES, 4, torch.float32)
    oa = ShardedIsoLoCo(a, lr=0.9, momentum=0.6, compress=spec)
    step_as_rank(oa, a, _deltas(world, 0, torch.float32), rank)
    saved = copy.deepcopy(oa.state_dict())
    assert set(saved["compress"]["update_residuals"]) == set(oa.mine)
    ob = ShardedIsoLoCo(b, lr=0.9, momentum=0.6, compress=spec)
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    ob.load_state_dict(saved)
    for s in (1, 2):
        step_as_rank(oa, a, _deltas(world, s, torch.float32), rank)
        step_as_rank(ob, b, _deltas(world, s, torch.float32), rank)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def _check_nan_on_one_rank_changes_nothing(rank, world):
    ps = seeded(SHAPES, 4, torch.float32)
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, compress=CASES[0][0])
    step_as_rank(opt, ps, _deltas(world, 0, torch.float32), rank)
    before = copy.deepcopy((ps, opt._residuals, opt._update_residuals, opt.state_dict()["state"]))
    bad = _deltas(world, 1, torch.float32)
    bad[0][1, 2, 3] = float("nan")
    with pytest.raises(DistributedStepError, match="NaN"):
        step_as_rank(opt, ps, bad, rank)
    assert all(torch.equal(p, q) for p, q in zip(ps, before[0])) and opt.merged_steps == 1
    for held, kept in ((opt._residuals, before[1]), (opt._update_residuals, before[2])):
        assert held.keys() == kept.keys() and all(torch.equal(held[i], kept[i]) for i in held)
    step_as_rank(opt, ps, _deltas(world, 1, torch.float32), rank)  # the next step works
    assert opt.merged_steps == 2


TABLES = {2: Checks(), 3: Checks()}
for _table in TABLES.values():
    for _k, (_spec, _merge, _dt) in enumerate(CASES):
        _table.add(
            f"equal-{_k}-{_merge}-{str(_dt)[6:]}",
            lambda rank, world, s=_spec, m=_merge, d=_dt: _equal_to_one_process(rank, world, s, m, d),
        )
    _table.add("save_and_load", _check_save_and_load)
    _table.add("nan_on_one_rank", _check_nan_on_one_rank_changes_nothing)


def _body(rank, world, tmpdir):
    TABLES[world].run(tmpdir, rank, rank=rank, world=world)


ranks = groups(_body, 2, 3, deadline_s=300)


@pytest.mark.parametrize("world,name", params(TABLES))
def test_tracking_on_the_sharded_route(ranks, world, name):
    ranks[world].assert_ok(name)
