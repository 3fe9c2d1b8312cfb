"""ShardedIsoLoCo(compress=...) on 2 and 3 gloo ranks (tests/spawn.py): bit-equal to the one-process simulation
(MergeLoCo(compress=...)) in float32, bfloat16 and float16, with error feedback at the default placement
("workers") and on both legs ("both"; in float32 also "owner"); the bytes each rank hands to the collectives, counted at the calls, against an
fp32 all-reduce's; NaN on one rank and an update that does not fit refused everywhere with nothing changed; a
rank with another spec (a feedback placement too) refused everywhere; residuals saved and restored bit for
bit (the default placement and "both"), refused under another spec or rank."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import DistributedStepError, ShardedIsoLoCo
from isoloco_kernels.compress import Compression
from isoloco_kernels.distributed import pipeline, sharded
from tests.helpers import seeded, step_as_rank, step_with_one_process
from tests.spawn import Checks, groups, params

pytestmark = pytest.mark.slow  # spawns gloo ranks

SHAPES = [(12, 8), (5,), (8, 12), (12, 8), (40, 6), ()]
TABLES = {2: Checks(), 3: Checks()}
#: (spec, merge, solo_above): nearest with error feedback at the default placement (each worker's Δ), stochastic
#: with the update sent in full, 2-bit TSV-M with solo tensors and error feedback on both legs, fp8 DiLoCo (the mean)
CASES = [
    ("int4:128:0.95", "iso_c", 1.0),
    (Compression("int8", 64, "stochastic", ef_beta=0.9, update="full", seed=5), "iso_c", 1.0),
    ("int2:32:0.95:stochastic:both", "tsv", 0.2),
    ("fp8:32:none", "mean", 1.0),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the other placements at 2 and 4 bits (float32 only, to keep the runtime small): both legs with Iso-C (the
#: study's setting), and the owner's residual with every Δ sent without one (stochastic, TSV-M stacks)
PLACEMENTS = [
    ("int2:32:0.95:nearest:both", "iso_c", 1.0),
    ("int4:64:0.9:stochastic:owner", "tsv", 1.0),
]


def _deltas(world: int, step: int, dtype=torch.float32):
    return seeded(SHAPES, 1000 + step, dtype, k=world)


def _init(dtype=torch.float32):
    return seeded(SHAPES, 7, dtype)


def _steps(opt, ps, rank, world, steps, dtype=torch.float32):
    for s in steps:
        step_as_rank(opt, ps, _deltas(world, s, dtype), rank)


def _equal_to_one_process(rank, world, spec, merge, solo, dtype):
    """3 steps on the ranks and in one process (MergeLoCo fed all K deltas): every param torch.equal."""
    ps, ref = _init(dtype), _init(dtype)
    opt, one = step_with_one_process(
        ps, ref, rank, lambda step: _deltas(world, step, dtype), spec, merge, solo_above=solo
    )
    assert solo == 1.0 or opt.plan.solo, "the case means to send solo tensors"
    for i, p in enumerate(ps):
        assert not torch.equal(p, _init(dtype)[i]), f"param {i} did not move"
    assert opt._residuals.keys() == one._residuals.keys()  # the legs with feedback, and only those, keep residuals
    assert opt._update_residuals.keys() == set(opt.mine) & one._update_residuals.keys()
    for i in opt.mine:  # the owner's momentum and update residual are the simulation's
        assert torch.equal(opt.state[ps[i]]["momentum_buffer"], one.state[ref[i]]["momentum_buffer"])
        if i in opt._update_residuals:
            assert torch.equal(opt._update_residuals[i], one._update_residuals[i])
    for i, r in opt._residuals.items():  # this rank's residual is worker `rank`'s of the simulation
        assert torch.equal(r, one._residuals[i][rank])


for _world, _table in TABLES.items():
    for _k, (_spec, _merge, _solo) in enumerate(CASES):
        for _dt in DTYPES:
            _table.add(
                f"equal-{_k}-{_merge}-{str(_dt)[6:]}",
                lambda rank, world, s=_spec, m=_merge, o=_solo, d=_dt: _equal_to_one_process(rank, world, s, m, o, d),
            )
    for _k, (_spec, _merge, _solo) in enumerate(PLACEMENTS):
        _table.add(
            f"equal-feedback-{_k}-{_merge}",
            lambda rank, world, s=_spec, m=_merge, o=_solo: _equal_to_one_process(rank, world, s, m, o, torch.float32),
        )


#: The bytes one rank may hand to the collectives, as a fraction of an fp32 ring all-reduce's (the targets: ≤ 0.27 at 8 bits, ≤ 0.14 at 4, ≤ 0.08 at 2).
LIMITS = {"int8": 0.27, "fp8": 0.27, "int4": 0.14, "fp4": 0.14, "int2": 0.08}


class _Wire:
    """The bytes each collective call of the compressed route puts on the wire, counted at the calls, by leg:
    an all-to-all what leaves this rank for the others (its split sizes; equal parts without them), a gather
    a non-root's tensor, a broadcast W − 1 copies of the root's tensor (counted at the root), an all-gather
    W − 1 copies of each rank's part (the ring). Leg 1 is the first all-to-all and the gathers, leg 2 the rest."""

    def __init__(self, world: int):
        self.world, self.me = world, dist.get_rank()
        self.real = (dist.all_to_all_single, dist.gather, dist.broadcast, pipeline.all_gather_single)
        self.legs, self.a2a_calls = [0, 0], 0

    def __enter__(self):
        w, me, (a2a, gather, bcast, ag) = self.world, self.me, self.real

        def all_to_all(out, inp, out_splits=None, in_splits=None, *a, **k):
            n = inp.element_size()
            sent = inp.numel() * n * (w - 1) // w if in_splits is None else (sum(in_splits) - in_splits[me]) * n
            self.legs[min(self.a2a_calls, 1)] += sent
            self.a2a_calls += 1
            return a2a(out, inp, out_splits, in_splits, *a, **k)

        def gathered(t, gather_list=None, dst=0, *a, **k):
            self.legs[0] += 0 if me == dst else t.numel() * t.element_size()
            return gather(t, gather_list, dst, *a, **k)

        def broadcast(t, src, *a, **k):
            self.legs[1] += (w - 1) * t.numel() * t.element_size() if me == src else 0
            return bcast(t, src, *a, **k)

        def all_gather(out, inp, *a, **k):
            self.legs[1] += (w - 1) * inp.numel() * inp.element_size()
            return ag(out, inp, *a, **k)

        dist.all_to_all_single, dist.gather, dist.broadcast, pipeline.all_gather_single = (
            all_to_all,
            gathered,
            broadcast,
            all_gather,
        )
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.gather, dist.broadcast, pipeline.all_gather_single = self.real

    def totals(self) -> list[int]:
        """Every rank's bytes per leg, summed over the ranks (a collective)."""
        t = torch.tensor(self.legs, dtype=torch.int64)
        dist.all_reduce(t)
        return t.tolist()


def _check_bytes_per_rank(rank, world, tmpdir):
    """Every format at the spec's defaults (block 128, the update compressed) and with update="full": the bytes
    on the wire, counted at the route's calls and averaged over the ranks, are exactly what the loop reports per
    worker (`optim.compressed.worker_bytes`: `compress.exchange_bytes` summed, scales included) and
    `wire_bytes`, leg by leg, and within LIMITS of an fp32 all-reduce. Payloads of odd sizes (no padding) and
    a solo tensor, and the params after a step equal to the one-process simulation's."""
    from isoloco_kernels.optim.compressed import worker_bytes

    shapes = [(64, 48)] * 5 + [(48, 64)] * 5 + [(200,)] * 3 + [(37, 29), (5,), (3, 7)]
    report = {}
    for fmt in LIMITS:
        for update in ("compressed", "full"):
            spec = Compression(fmt, update=update)
            ps = [torch.zeros(s) for s in shapes]
            opt = ShardedIsoLoCo(ps, lr=1.0, momentum=0.0, compress=spec)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(rank))
            with _Wire(world) as wire:
                opt.step()
            legs = wire.totals()
            model = sharded.wire_bytes(opt.plan, spec)
            reported = worker_bytes(spec, ps, world)["compressed"]
            assert math.isclose(sum(legs), world * reported, rel_tol=1e-12), (fmt, update, legs, reported)
            assert math.isclose(legs[0], world * model["all_to_all"], rel_tol=1e-12), (legs, model)
            assert math.isclose(legs[1], world * model["all_gather"], rel_tol=1e-12), (legs, model)
            ratio = sum(legs) / world / model["allreduce_fp32"]
            report[f"{fmt}:{update}"] = {"legs": [x / world for x in legs], "of an fp32 all-reduce": ratio}
            if update == "compressed":
                assert ratio <= LIMITS[fmt], f"{fmt}: {ratio:.4f} of an fp32 all-reduce > {LIMITS[fmt]}"
            else:  # the params back in float32: half an all-reduce, plus the compressed Δ
                assert 0.5 < ratio <= 0.5 + LIMITS[fmt], (fmt, ratio)
    with open(os.path.join(tmpdir, f"bytes-{world}-rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)


#: The wire at 4 and 8 ranks (where padding to the longest segment cost up to 1.5× before), and a route with
#: payloads of odd sizes and solo tensors equal to its one-process simulation there.
WIRE = Checks()
WIRE.add("bytes_per_rank", _check_bytes_per_rank)
WIRE.add(
    "equal-int4-iso_c",
    lambda rank, world: _equal_to_one_process(rank, world, "int4:32:0.95:nearest:both", "iso_c", 0.3, torch.float32),
)
WIRE.add(
    "equal-int2-tsv",
    lambda rank, world: _equal_to_one_process(rank, world, "int2:32:0.95", "tsv", 1.0, torch.bfloat16),
)


def _check_nan_on_one_rank_changes_nothing(rank, world):
    """A step with a NaN in rank 1's Δ, after a good step (momentum, residuals, update residuals held):
    DistributedStepError on every rank and no param, momentum, residual or step count changed."""
    ps = _init()
    opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.6, compress="int4:64:0.95:nearest:both")  # update residuals too
    _steps(opt, ps, rank, world, [0])
    before = [p.clone() for p in ps]
    held = {i: opt.state[ps[i]]["momentum_buffer"].clone() for i in opt.mine}
    res, upd = dict(opt._residuals), dict(opt._update_residuals)
    assert res and upd.keys() == set(opt.mine)
    for p, d in zip(ps, _deltas(world, 1)):
        p.grad = d[rank].clone()
    if rank == 1:
        ps[2].grad[3, 4] = float("nan")
    with pytest.raises(DistributedStepError, match="NaN"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, before))
    assert all(torch.equal(opt.state[ps[i]]["momentum_buffer"], b) for i, b in held.items())
    assert opt._residuals.keys() == res.keys() and all(opt._residuals[i] is r for i, r in res.items())
    assert all(opt._update_residuals[i] is r for i, r in upd.items()) and opt.merged_steps == 1


def _check_an_update_that_does_not_fit_changes_nothing(rank, world):
    """float16 params near the top of the range whose step would overflow: refused after the exchange, on
    every rank (each computes the same θ'), with nothing written."""
    ps = [torch.full((8, 8), 6.0e4, dtype=torch.float16), torch.full((4,), 6.0e4, dtype=torch.float16)]
    opt = ShardedIsoLoCo(ps, lr=4.0, momentum=0.0, compress="int8", iso=False)
    for p in ps:
        p.grad = torch.full(p.shape, -2000.0, dtype=torch.float16)
    with pytest.raises(DistributedStepError, match="Inf|after the step"):
        opt.step()
    assert all(bool((p == 6.0e4).all()) for p in ps) and not opt.state and opt.merged_steps == 0


def _check_a_rank_with_another_spec_is_refused_everywhere(rank, world):
    for mine, other in (
        ("int4:128:0.95", "int8:128:0.95"),
        ("int4:128:0.95", "int4:128:0.9"),
        ("int4:128:0.95", "int4:128:0.95:nearest:both"),
        ("int4:128:0.95:nearest:workers", "int4:128:0.95:nearest:owner"),
        ("stat2:256:none", "stat4:256:none"),
        ("stat2:256:none", "stat2:256:1:nearest:ef21"),
        ("stat2:256:none", "stat2:256:none:skip=vectors"),
        ("stat2:256:none:skip=vectors", "stat2:256:none:skip=vectors+vocab=256"),
    ):
        with pytest.raises(DistributedStepError, match="compress"):
            ShardedIsoLoCo(_init(), compress=other if rank == world - 1 else mine)
    opt = ShardedIsoLoCo(_init(), compress="int4")  # changed after construction: refused at the step
    if rank == 0:
        opt.compress = Compression("int4", ef_beta=0.5)
    with pytest.raises(DistributedStepError, match="compress"):
        _steps(opt, opt._params, rank, world, [0])


def _check_residuals_survive_a_save_and_load(rank, world, feedback):
    """2 steps, state_dict, a fresh optimizer loads it, 2 more: bit-equal to 4 uninterrupted steps, every
    residual restored bit for bit (feedback "both": the owner's update residuals too; the default "workers":
    none); another spec's or another rank's state refused, nothing loaded."""
    spec = "int2:64:0.95:stochastic" + (":both" if feedback == "both" else "")
    a = _init(torch.bfloat16)
    oa = ShardedIsoLoCo(a, lr=0.9, momentum=0.8, compress=spec)
    _steps(oa, a, rank, world, range(4), torch.bfloat16)
    b = _init(torch.bfloat16)
    ob = ShardedIsoLoCo(b, lr=0.9, momentum=0.8, compress=spec)
    _steps(ob, b, rank, world, range(2), torch.bfloat16)
    saved = ob.state_dict()
    assert set(saved["compress"]["residuals"]) == set(range(len(SHAPES)))
    assert set(saved["compress"]["update_residuals"]) == (set(ob.mine) if feedback == "both" else set())
    assert saved["compress"]["spec"]["feedback"] == feedback
    c = [p.detach().clone() for p in b]
    oc = ShardedIsoLoCo(c, lr=0.9, momentum=0.8, compress=spec)
    oc.load_state_dict(saved)
    for i, r in ob._residuals.items():
        assert torch.equal(oc._residuals[i], r) and oc._residuals[i] is not r
    assert oc._update_residuals.keys() == ob._update_residuals.keys()
    for i, r in ob._update_residuals.items():
        assert torch.equal(oc._update_residuals[i], r)
    _steps(oc, c, rank, world, range(2, 4), torch.bfloat16)
    assert all(torch.equal(p, q) for p, q in zip(a, c)) and oc.merged_steps == 4
    elsewhere = "owner" if feedback == "both" else "both"
    for other_spec in ("int2:64:0.9:stochastic", f"int2:64:0.95:stochastic:{elsewhere}"):
        other = ShardedIsoLoCo(_init(torch.bfloat16), lr=0.9, momentum=0.8, compress=other_spec)
        with pytest.raises(ValueError, match="compression"):
            other.load_state_dict(saved)
        assert not other._residuals and not other._update_residuals and not other.state
    plain = ShardedIsoLoCo(_init(torch.bfloat16), lr=0.9, momentum=0.8)
    with pytest.raises(ValueError, match="compress=None"):
        plain.load_state_dict(saved)
    every = [None] * world
    dist.all_gather_object(every, saved)
    with pytest.raises(ValueError, match="saved by rank"):
        oc.load_state_dict(every[(rank + 1) % world])
    oc.load_state_dict(
        oc.consolidated_state_dict()
    )  # a whole state holds momentum only: the residuals restart from zero
    assert not oc._residuals and not oc._update_residuals


def _check_a_state_saved_before_sigmas_and_skip_loads(rank, world):
    """A "compress" entry whose spec lacks "sigmas" and "skip" (saved before those fields existed) loads as their
    defaults (None, "none"), and the optimizer that loaded it steps bit for bit as one that loaded the full entry."""
    spec = "int4:64:0.95:stochastic:both"
    a = _init()
    oa = ShardedIsoLoCo(a, lr=0.9, momentum=0.8, compress=spec)
    _steps(oa, a, rank, world, range(2))
    saved = copy.deepcopy(oa.state_dict())  # loads take the tensors: each optimizer gets its own copy
    old = copy.deepcopy(saved)
    del old["compress"]["spec"]["sigmas"], old["compress"]["spec"]["skip"]
    runs = []
    for sd in (saved, old):
        ps = [p.detach().clone() for p in a]
        opt = ShardedIsoLoCo(ps, lr=0.9, momentum=0.8, compress=spec)
        opt.load_state_dict(sd)
        _steps(opt, ps, rank, world, range(2, 4))
        runs.append((ps, opt))
    (full, of), (legacy, ol) = runs
    assert all(torch.equal(p, q) for p, q in zip(full, legacy))
    assert ol.merged_steps == of.merged_steps == 4, (ol.merged_steps, of.merged_steps)
    assert all(torch.equal(ol._residuals[i], r) for i, r in of._residuals.items())
    assert ol._residuals.keys() == of._residuals.keys() and ol._update_residuals.keys() == of._update_residuals.keys()
    assert all(
        torch.equal(ol.state[legacy[i]]["momentum_buffer"], of.state[full[i]]["momentum_buffer"]) for i in ol.mine
    )


def _check_the_loop_under_torchrun_builds_the_compressed_route(rank, world):
    """--outer sharded with --compress: the loop's DistComm builds ShardedIsoLoCo(compress=the parsed spec)."""
    from isoloco_kernels.compress import parse
    from isoloco_kernels.train.config import TrainConfig
    from isoloco_kernels.train.dist import DistComm

    cfg = TrainConfig(workers=world, compress="int4:64:0.9")
    for mode, iso in (("diloco", False), ("isoloco", True)):
        opt = DistComm(world, rank, "sharded").outer_optimizer(mode, _init(), cfg)
        assert isinstance(opt, ShardedIsoLoCo) and opt.compress == parse("int4:64:0.9")
        assert opt.param_groups[0]["iso"] is iso
        _steps(opt, opt._params, rank, world, [0])


for _table in TABLES.values():
    _table.add("loop_under_torchrun", _check_the_loop_under_torchrun_builds_the_compressed_route)
    _table.add("state_before_sigmas_and_skip", _check_a_state_saved_before_sigmas_and_skip_loads)
    _table.add("bytes_per_rank", _check_bytes_per_rank)
    _table.add("nan_on_one_rank", _check_nan_on_one_rank_changes_nothing)
    _table.add("update_overflow", _check_an_update_that_does_not_fit_changes_nothing)
    _table.add("another_spec", _check_a_rank_with_another_spec_is_refused_everywhere)
    _table.add("save_and_load", lambda rank, world: _check_residuals_survive_a_save_and_load(rank, world, "both"))
    _table.add(
        "save_and_load_default", lambda rank, world: _check_residuals_survive_a_save_and_load(rank, world, "workers")
    )


def _body(rank, world, tmpdir):
    warnings.simplefilter("ignore")  # the N-D param warning of a case's shapes
    TABLES[world].run(tmpdir, rank, rank=rank, world=world, tmpdir=tmpdir)


ranks = groups(_body, 2, 3, deadline_s=300)


@pytest.mark.parametrize("world,name", params(TABLES))
def test_compressed_sharded_step(ranks, world, name):
    ranks[world].assert_ok(name)


def _wire_body(rank, world, tmpdir):
    warnings.simplefilter("ignore")
    WIRE.run(tmpdir, rank, rank=rank, world=world, tmpdir=tmpdir)


wide = groups(_wire_body, 4, 8, deadline_s=400)


@pytest.mark.parametrize("world,name", params({4: WIRE, 8: WIRE}))
def test_compressed_route_at_4_and_8_ranks(wide, world, name):
    wide[world].assert_ok(name)
