"""ShardedIsoLoCo(merge=...): every worker's Δ to its tensor's owner (an all-to-all), merged there,
Nesterov, all-gather — on 2 and 3 gloo ranks, equal to MergeLoCo on the same K = world deltas in one
process; bytes per rank against an all-reduce's; failures on one rank fail every rank, nothing
changed (tests/spawn.py runs the ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import DistributedStepError, MergeLoCo, ShardedIsoLoCo
from isoloco_kernels.distributed.sharded import worker_wire_bytes as wire_bytes
from tests.helpers import seeded, step_as_rank
from tests.spawn import Checks, groups, params

pytestmark = pytest.mark.slow  # spawns gloo ranks

SHAPES = [(12, 8), (5,), (8, 12), (12, 8), (3, 4, 2), (40, 6), ()]
MERGE_CASES = [("tsv", {}), ("iso_cts", {}), ("ties", {"sparsity": 0.2}), ("dare", {"seed": 4}), ("mean", {})]
TABLES = {2: Checks(), 3: Checks()}


def _deltas(world: int, step: int, dtype=torch.float32):
    return seeded(SHAPES, 1000 + step, dtype, k=world)


def _equal_to_one_process(rank, world, merge, opts, dtype, solo_above):
    params = [torch.zeros(s, dtype=dtype) for s in SHAPES]
    ref = [torch.zeros(s, dtype=dtype, requires_grad=False) for s in SHAPES]
    opt = ShardedIsoLoCo(params, lr=0.9, momentum=0.6, merge=merge, merge_options=opts, solo_above=solo_above)
    one = MergeLoCo(ref, lr=0.9, momentum=0.6, merge=merge, merge_options=opts)
    for step in range(2):
        deltas = _deltas(world, step, dtype)
        step_as_rank(opt, params, deltas, rank)
        one.step(deltas=deltas)
    # float32: batched SVDs of other bucket compositions (~1e-6); half params: each step rounds θ to its
    # dtype, so the two may differ by an ulp per element after two steps
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    for i, (p, q) in enumerate(zip(params, ref)):
        err = float((p.double() - q.double()).norm() / q.double().norm().clamp_min(1e-30))
        assert err <= tol, f"{merge} {dtype} solo_above={solo_above}: param {i} differs by {err:.2e}"


for world, table in TABLES.items():
    for merge, opts in MERGE_CASES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for solo in (1.0, 0.2) if merge in ("tsv", "dare") else (1.0,):
                name = f"{merge}-{str(dtype)[6:]}-solo{solo}"
                table.add(
                    name,
                    lambda rank, world, m=merge, o=opts, d=dtype, s=solo: _equal_to_one_process(
                        rank, world, m, o, d, s
                    ),
                )


def _check_bytes_per_rank_are_an_all_reduce(rank, world):
    """The bytes this rank hands to the step's collectives (the all-to-all's outgoing part, the
    segment all-gather's ring share), counted at the calls, ≤ 1.1× an all-reduce's and ≥ 0.9×
    (both collectives were seen)."""
    from isoloco_kernels.distributed import pipeline as collectives  # where the segment all-gather runs

    shapes = [(64, 48)] * 6 + [(48, 64)] * 6 + [(200,)] * 4
    params = [torch.zeros(s) for s in shapes]
    opt = ShardedIsoLoCo(params, lr=1.0, momentum=0.0, merge="tsv")
    sent = {"all_to_all": 0, "all_gather": 0}
    real_a2a, real_ag = dist.all_to_all_single, collectives.all_gather_single

    def a2a(out, inp, *a, **k):
        sent["all_to_all"] += inp.numel() * inp.element_size() * (world - 1) // world
        return real_a2a(out, inp, *a, **k)

    def ag(out, inp, *a, **k):
        sent["all_gather"] += inp.numel() * inp.element_size() * (world - 1)
        return real_ag(out, inp, *a, **k)

    dist.all_to_all_single, collectives.all_gather_single = a2a, ag
    try:
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
    finally:
        dist.all_to_all_single, collectives.all_gather_single = real_a2a, real_ag
    total = sum(p.numel() * 4 for p in params)
    all_reduce = 2 * total * (world - 1) / world
    assert sent["all_to_all"] and sent["all_gather"], sent
    assert 0.9 * all_reduce <= sum(sent.values()) <= 1.1 * all_reduce, (sent, all_reduce)
    assert wire_bytes(opt.plan)["merge"] <= 1.1 * all_reduce


def _check_a_failure_on_one_rank_fails_every_rank(rank, world):
    params = [torch.zeros(s) for s in SHAPES]
    opt = ShardedIsoLoCo(params, lr=1.0, momentum=0.5, merge="ties")
    deltas = _deltas(world, 0)
    for p, d in zip(params, deltas):
        p.grad = d[rank].clone()
    if rank == 1:
        params[3].grad[2, 2] = float("nan")  # one worker's delta holds a NaN
    with pytest.raises((DistributedStepError, ValueError), match="NaN|rank 1"):
        opt.step()
    assert all(float(p.abs().sum()) == 0 for p in params) and not opt.state


def _check_a_rank_configured_differently_is_refused_everywhere(rank, world):
    params = [torch.zeros(s) for s in SHAPES]
    with pytest.raises(DistributedStepError, match="merge"):
        ShardedIsoLoCo(params, merge="tsv" if rank == 0 else "ties")


for table in TABLES.values():
    table.add("bytes_per_rank", _check_bytes_per_rank_are_an_all_reduce)
    table.add("failure_on_one_rank", _check_a_failure_on_one_rank_fails_every_rank)
    table.add("configured_differently", _check_a_rank_configured_differently_is_refused_everywhere)


def _body(rank, world, tmpdir):
    TABLES[world].run(tmpdir, rank, rank, world)


ranks = groups(_body, 2, 3)


@pytest.mark.parametrize("world,name", params(TABLES))
def test_sharded_merge(ranks, world, name):
    ranks[world].assert_ok(name)


def test_the_modelled_bytes_are_an_all_reduce_and_not_an_all_gather():
    from isoloco_kernels.distributed.plan import plan_shards

    plan = plan_shards([(64, 48)] * 8 + [(100,)] * 2, 4, solo_above=None)
    b = wire_bytes(plan)
    assert b["merge"] <= 1.1 * b["allreduce"] and b["allgather_deltas"] >= 1.4 * b["allreduce"]
