"""The statistical formats through today's routes, unchanged: MergeLoCo(compress="stat2:…") keeps each worker's
decayed residual e ← β·(Δ + e − c) with the spec's β, and ShardedIsoLoCo(compress=…) on 2 gloo ranks
(tests/spawn.py) writes the same params as MergeLoCo fed the same deltas, its `wire_bytes` (the centroid tables
included) within the byte targets."""

from __future__ import annotations

import warnings

import pytest
import torch

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import MergeLoCo, ShardedIsoLoCo
from isoloco_kernels.compress import Compression, compress, dequantize, parse
from isoloco_kernels.distributed import sharded
from tests.helpers import seeded, step_with_one_process
from tests.spawn import Checks, groups, params

SHAPES = [(64, 48), (48, 64), (40, 6), (200,), (7,)]


def _deltas(k: int, step: int, dtype=torch.float32):
    return [1e-2 * d for d in seeded(SHAPES, 500 + step, dtype, k=k)]


@pytest.mark.parametrize("spec", ["stat2:64:0.9", "stat4:128:0.5", "stat2:256:0.8:nearest:both"])
def test_merge_loco_keeps_each_workers_decayed_residual_with_the_specs_beta(spec):
    """Two steps of K 3: worker k's residual is β·(Δ_k + e_k − c_k) (c_k its payload decoded), for β 0.9 / 0.5 / 0.8,
    the last with the owner's update residual too; the params move."""
    s = parse(spec)
    ps = seeded(SHAPES, 3)
    opt = MergeLoCo(ps, lr=0.9, momentum=0.6, compress=spec)
    held = {}
    for step in range(2):
        stacks = _deltas(3, step)
        want = {}
        for i, p in enumerate(ps):
            rows = []
            for k in range(3):
                prev = held.get(i)
                packed, _ = compress(
                    stacks[i][k], None if prev is None else prev[k], s.leg("workers"), step=step, tensor_id=i
                )
                v = stacks[i][k] + (0 if prev is None else prev[k])
                rows.append(s.ef_beta * (v.flatten() - dequantize(packed)).view(p.shape))
            want[i] = torch.stack(rows)
        opt.step(deltas=stacks)
        for i in range(len(ps)):
            assert torch.equal(opt._residuals[i], want[i]), (spec, step, i)
        held = {i: r.clone() for i, r in opt._residuals.items()}
    assert bool(opt._update_residuals) == (s.feedback == "both")
    assert not any(torch.equal(p, q) for p, q in zip(ps, seeded(SHAPES, 3)))


TABLES = {2: Checks()}
CASES = [
    ("stat2:64:0.95", "iso_c", torch.float32),
    ("stat4:128:0.9", "mean", torch.bfloat16),
    ("stat2:32:0.9:nearest:both", "tsv", torch.float32),
]


def _equal_to_one_process(rank, world, spec, merge, dtype):
    ps, ref = seeded(SHAPES, 7, dtype), seeded(SHAPES, 7, dtype)
    opt, one = step_with_one_process(ps, ref, rank, lambda step: _deltas(world, step, dtype), spec, merge)
    for i, r in opt._residuals.items():
        assert torch.equal(r, one._residuals[i][rank])


for _k, (_spec, _merge, _dt) in enumerate(CASES):
    TABLES[2].add(
        f"equal-{_k}-{_merge}-{str(_dt)[6:]}",
        lambda rank, world, s=_spec, m=_merge, d=_dt: _equal_to_one_process(rank, world, s, m, d),
    )


@TABLES[2]
def _check_the_route_sends_the_tables(rank, world):
    """stat2 at block 256 and stat4 at block 1024 step on the route, and the bytes it hands its collectives
    (`wire_bytes`: every payload sized by bytes_of, tables included; tests/distributed/test_compress_sharded.py
    counts them at the calls) stay within 0.08 and 0.145 of an fp32 all-reduce's."""
    shapes = [(64, 64)] * 6 + [(256, 32)] * 4
    for spec, limit in ((Compression("stat2", 256), 0.08), (Compression("stat4", 1024), 0.145)):
        ps = [torch.zeros(s) for s in shapes]
        opt = ShardedIsoLoCo(ps, lr=1.0, momentum=0.0, compress=spec)
        for p in ps:
            p.grad = torch.randn(p.shape)
        opt.step()
        model = sharded.wire_bytes(opt.plan, spec)
        assert model["all_to_all"] + model["all_gather"] <= limit * model["allreduce_fp32"], (spec, model)
        assert all(bool(p.abs().sum() > 0) for p in ps)


def _body(rank, world, tmpdir):
    warnings.simplefilter("ignore")
    TABLES[world].run(tmpdir, rank, rank=rank, world=world)


ranks = groups(_body, 2, deadline_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("world,name", params(TABLES))
def test_stat_formats_through_the_sharded_route(ranks, world, name):
    ranks[world].assert_ok(name)
