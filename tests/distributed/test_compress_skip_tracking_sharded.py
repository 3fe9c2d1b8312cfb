"""The compression spec's `skip` rule and tracking (feedback "ef21") on the sharded route, ShardedIsoLoCo(compress=...)
on 2 and 3 gloo ranks, bit-equal to the one-process simulation (MergeLoCo(compress=...)).

skip: a rule that keeps the vectors and the vocabulary-sized matrices in full precision (by shape, and by name from
`model.named_parameters()`); the kept params keep no residual; the bytes counted at the collectives equal what the
loop reports and `wire_bytes`; residuals saved and restored bit for bit.

tracking: each rank's estimate worker `rank`'s and each owner's estimate of the mean the simulation's; the
estimates saved and restored bit for bit; a NaN on one rank refused everywhere with nothing changed (estimates
included)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import DistributedStepError, ShardedIsoLoCo
from isoloco_kernels.compress import Compression
from isoloco_kernels.distributed import sharded
from isoloco_kernels.optim.compressed import worker_bytes
from tests.distributed.test_compress_sharded import _Wire
from tests.helpers import seeded, step_as_rank, step_with_one_process
from tests.spawn import Checks, groups, params

pytestmark = pytest.mark.slow  # spawns gloo ranks

SHAPES = [(12, 8), (5,), (8, 12), (40, 6), (12, 40), ()]
NAMES = ["tok.weight", "norm.weight", "blocks.0.w", "blocks.1.w", "head.weight", "scale"]
#: kept in full precision: params 0, 1, 2, 4, 5 by shape (vectors, a dimension 12); 0, 1, 4, 5 by name
CASES = {
    "shape": (Compression("int4", 32, ef_beta=0.9, skip="vectors+vocab=12"), {0, 1, 2, 4, 5}),
    "name": (Compression("stat2", 64, ef_beta=0.9, feedback="both", skip="vectors+name=tok.+name=head."), {0, 1, 4, 5}),
}
DTYPES = (torch.float32, torch.bfloat16)


def _deltas(world, step, dtype):
    return seeded(SHAPES, 500 + step, dtype, k=world)


def _named(ps):
    return list(zip(NAMES, ps))


def _equal_to_one_process(rank, world, case, merge, dtype):
    spec, kept = CASES[case]
    ps, ref = seeded(SHAPES, 3, dtype), seeded(SHAPES, 3, dtype)
    opt, one = step_with_one_process(ps, ref, rank, lambda step: _deltas(world, step, dtype), spec, merge, names=NAMES)
    assert {i for i, s in enumerate(opt._specs) if s is None} == kept
    for i, p in enumerate(ps):
        assert not torch.equal(p, seeded(SHAPES, 3, dtype)[i]), f"{case}: param {i} did not move"
    assert set(opt._residuals) == set(range(len(SHAPES))) - kept  # a kept param keeps no residual
    assert set(one._residuals) == set(range(len(SHAPES))) - kept
    assert set(opt._update_residuals) == (set(opt.mine) - kept if spec.feedback == "both" else set())
    for i, r in opt._residuals.items():
        assert torch.equal(r, one._residuals[i][rank])


def _check_bytes(rank, world):
    """The bytes on the wire, counted at the calls, are what the loop reports (`worker_bytes` with the names)
    and `wire_bytes`, leg by leg: a kept param in its dtype both ways."""
    for case, (spec, kept) in CASES.items():
        ps = [torch.zeros(s) for s in SHAPES]
        opt = ShardedIsoLoCo(_named(ps), lr=1.0, momentum=0.0, compress=spec)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(rank))
        with _Wire(world) as wire:
            opt.step()
        legs = wire.totals()
        model = sharded.wire_bytes(opt.plan, spec, NAMES)
        reported = worker_bytes(spec, ps, world, NAMES)["compressed"]
        assert math.isclose(sum(legs), world * reported, rel_tol=1e-12), (case, legs, reported)
        assert math.isclose(legs[0], world * model["all_to_all"], rel_tol=1e-12), (case, legs, model)
        assert math.isclose(legs[1], world * model["all_gather"], rel_tol=1e-12), (case, legs, model)
        kept_bytes = sum(4 * math.prod(SHAPES[i]) for i in kept) * (world - 1) / world * 2
        assert reported > kept_bytes  # the kept params travel in full, the rest compressed
        alone = worker_bytes(Compression(spec.format, spec.block), [ps[i] for i in range(6) if i not in kept], world)
        assert math.isclose(reported, kept_bytes + alone["compressed"], rel_tol=1e-12)


def _check_save_and_load(rank, world, spec, shapes, deltas, named, residuals, owner):
    """Saved after a step and loaded into a fresh optimizer: it goes on bit for bit as the one that saved.
    `residuals`: the params whose worker residual (or estimate) the state holds; `owner`: whether it holds the
    owner's (feedback "both", tracking) for this rank's tensors (those the skip rule keeps hold none)."""
    a, b = seeded(shapes, 3, torch.float32), seeded(shapes, 3, torch.float32)
    wrap = _named if named else list
    oa = ShardedIsoLoCo(wrap(a), lr=0.9, momentum=0.6, compress=spec)
    step_as_rank(oa, a, deltas(world, 0, torch.float32), rank)
    sd = copy.deepcopy(oa.state_dict())  # torch's load keeps the saved tensors: the two would share them
    assert set(sd["compress"]["residuals"]) == residuals
    assert set(sd["compress"]["update_residuals"]) == (set(oa.mine) & residuals if owner else set())
    ob = ShardedIsoLoCo(wrap(b), lr=0.9, momentum=0.6, compress=spec)
    with torch.no_grad():
        for p, q in zip(b, a):
            p.copy_(q)
    ob.load_state_dict(sd)
    for s in (1, 2):
        step_as_rank(oa, a, deltas(world, s, torch.float32), rank)
        step_as_rank(ob, b, deltas(world, s, torch.float32), rank)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def _check_a_name_rule_without_names_is_refused(rank, world):
    with pytest.raises(ValueError, match=r"ShardedIsoLoCo: Compression.skip=.*names params.*named_parameters"):
        ShardedIsoLoCo(seeded(SHAPES, 3, torch.float32), compress=CASES["name"][0])


# -- tracking (feedback "ef21") ------------------------------------------------------------------------

TRACK_SHAPES = [(12, 8), (5,), (8, 12), (40, 6), ()]
TRACK_CASES = [
    ("stat2:64:0.9:nearest:ef21", "iso_c", torch.float32),
    ("int2:32:1:stochastic:ef21", "iso_c", torch.bfloat16),
    ("int4:64:0.8:nearest:ef21:skip=vectors", "mean", torch.float16),
]


def _track_deltas(world, step, dtype):
    return seeded(TRACK_SHAPES, 900 + step, dtype, k=world)


def _tracking_equal_to_one_process(rank, world, spec, merge, dtype):
    ps, ref = seeded(TRACK_SHAPES, 4, dtype), seeded(TRACK_SHAPES, 4, dtype)
    opt, one = step_with_one_process(ps, ref, rank, lambda step: _track_deltas(world, step, dtype), spec, merge)
    assert opt._residuals.keys() == one._residuals.keys() and opt._residuals
    for i, r in opt._residuals.items():  # this rank's estimate is worker `rank`'s
        assert torch.equal(r, one._residuals[i][rank])
    assert set(opt._update_residuals) == set(opt.mine) & set(one._update_residuals)
    for i, r in opt._update_residuals.items():  # the owner's estimate of the mean
        assert torch.equal(r, one._update_residuals[i])


def _check_nan_on_one_rank_changes_nothing(rank, world):
    ps = seeded(TRACK_SHAPES, 4, torch.float32)
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, compress=TRACK_CASES[0][0])
    step_as_rank(opt, ps, _track_deltas(world, 0, torch.float32), rank)
    before = copy.deepcopy((ps, opt._residuals, opt._update_residuals, opt.state_dict()["state"]))
    bad = _track_deltas(world, 1, torch.float32)
    bad[0][1, 2, 3] = float("nan")
    with pytest.raises(DistributedStepError, match="NaN"):
        step_as_rank(opt, ps, bad, rank)
    assert all(torch.equal(p, q) for p, q in zip(ps, before[0])) and opt.merged_steps == 1
    for held, kept in ((opt._residuals, before[1]), (opt._update_residuals, before[2])):
        assert held.keys() == kept.keys() and all(torch.equal(held[i], kept[i]) for i in held)
    step_as_rank(opt, ps, _track_deltas(world, 1, torch.float32), rank)  # the next step works
    assert opt.merged_steps == 2


TABLES = {2: Checks(), 3: Checks()}
for _table in TABLES.values():
    for _case in CASES:
        for _merge in ("iso_c", "tsv"):
            for _dt in DTYPES:
                _table.add(
                    f"equal-{_case}-{_merge}-{str(_dt)[6:]}",
                    lambda rank, world, c=_case, m=_merge, d=_dt: _equal_to_one_process(rank, world, c, m, d),
                )
    _table.add("bytes", _check_bytes)
    _table.add(
        "save_and_load",
        lambda rank, world: _check_save_and_load(rank, world, CASES["name"][0], SHAPES, _deltas, True, {2, 3}, True),
    )
    _table.add("name_rule_without_names", _check_a_name_rule_without_names_is_refused)
    for _k, (_spec, _merge, _dt) in enumerate(TRACK_CASES):
        _table.add(
            f"tracking-equal-{_k}-{_merge}-{str(_dt)[6:]}",
            lambda rank, world, s=_spec, m=_merge, d=_dt: _tracking_equal_to_one_process(rank, world, s, m, d),
        )
    _table.add(
        "tracking_save_and_load",
        lambda rank, world: _check_save_and_load(
            rank, world, TRACK_CASES[0][0], TRACK_SHAPES, _track_deltas, False, {0, 1, 2, 3, 4}, True
        ),
    )
    _table.add("tracking_nan_on_one_rank", _check_nan_on_one_rank_changes_nothing)


def _body(rank, world, tmpdir):
    TABLES[world].run(tmpdir, rank, rank=rank, world=world)


ranks = groups(_body, 2, 3, deadline_s=300)


@pytest.mark.parametrize("world,name", params(TABLES))
def test_skip_and_tracking_on_the_sharded_route(ranks, world, name):
    ranks[world].assert_ok(name)
