"""A failure at any point between two collectives, on one rank, fails every rank within seconds.

Every piece of library work a collective entry point runs between the ranks' first agreement and
its last collective runs under its `Agreement.attempt` (the rank keeps the failure, still joins
every collective, and the next agreement tells every rank). This test enumerates those points:
it counts rank 1's attempts in a good call, then makes each one fail in turn on rank 1 only, for
every route — the DTensor step's owner, gather and Gram routes, `sharded_iso_merge_`, `average_` and
`IsoLoCo(process_group=...)` (its averaged-grads check included). `ShardedIsoLoCo`'s step has no
attempts: its local phases are plain calls whose failure the step keeps until its one vote; each of them
(and each library function they call) is made to fail in turn instead, for every exchange. Every rank must raise DistributedStepError naming rank 1 well inside the process-group
timeout; where the error says nothing was changed, nothing was; and the next call works.
2 gloo ranks, small tensors (a 16 × 16 matrix sharded on dim 0, a vector).
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from isoloco_kernels import IsoLoCo
from isoloco_kernels.distributed import DistributedStepError
from isoloco_kernels.distributed import agree as A
from tests.spawn import PG_TIMEOUT_S, Checks, groups, params

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

CHECKS = Checks()


def _replacement(owner, attr: str, calls: list, fail_at: int):
    """owner.attr counting its calls in calls[0]; the call numbered `fail_at` raises. For
    `Agreement.attempt` the attempted work raises (inside the attempt); any other function raises
    itself, wherever the library calls it."""
    real = getattr(owner, attr)
    boom = f"injected failure at point {fail_at}"

    def fail(*_, **__):
        raise RuntimeError(boom)

    if owner is A.Agreement and attr == "attempt":

        def attempt(self, fn, *args):
            calls[0] += 1
            return real(self, fail if calls[0] == fail_at else fn, *args)

        return attempt

    def helper(*args, **kwargs):
        calls[0] += 1
        return (fail if calls[0] == fail_at else real)(*args, **kwargs)

    return helper


def _count(run, owner, attr: str) -> int:
    """Rank 1's calls of owner.attr in `run()` (every rank learns the count)."""
    real, calls = getattr(owner, attr), [0]
    setattr(owner, attr, _replacement(owner, attr, calls, 0))
    try:
        run()
    finally:
        setattr(owner, attr, real)
    n = [calls[0]]
    dist.broadcast_object_list(n, src=1)
    return n[0]


def _fail_at_each(rank: int, prepare, run, snapshot, least: int, owner=A.Agreement, attr="attempt") -> None:
    """For each point k of a good `run()` (after `prepare()`): `run()` with rank 1's k-th call of
    owner.attr failing (default: the k-th `Agreement.attempt`): DistributedStepError on every rank
    naming it, fast; nothing changed where it says so."""
    prepare()
    points = _count(run, owner, attr)
    assert points >= least, f"only {points} points"
    real = getattr(owner, attr)
    for k in range(1, points + 1):
        prepare()
        before = snapshot()
        setattr(owner, attr, _replacement(owner, attr, [0], k if rank == 1 else 0))
        t0 = time.monotonic()
        try:
            with pytest.raises(
                DistributedStepError, match=rf"rank 1: RuntimeError: injected failure at point {k}\b"
            ) as e:
                run()
        finally:
            setattr(owner, attr, real)
        took = time.monotonic() - t0
        assert took < PG_TIMEOUT_S / 3, f"point {k}: every rank raised only after {took:.1f} s"
        if "nothing was changed" in str(e.value):
            after = snapshot()
            assert all(torch.equal(a, b) for a, b in zip(after, before)), f"point {k}: a tensor changed: {e.value}"
        else:
            assert re.search("began writing", str(e.value)), str(e.value)
    prepare()
    run()  # and it still works


def _dtensor(route: str, rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(16, 16, generator=gen), torch.randn(16, 6, generator=gen), torch.randn(5, generator=gen)]
    placements = ([Shard(0)], [Shard(0)], [Replicate()])
    ps = [distribute_tensor(w, mesh, pl) for w, pl in zip(whole, placements)]
    opt = IsoLoCo(ps, lr=1.0, momentum=0.9, dtensor_route=route)
    step = [0]

    def prepare():
        step[0] += 1
        g = torch.Generator().manual_seed(100 + step[0])
        for p, w in zip(ps, whole):
            p.grad = distribute_tensor(torch.randn(w.shape, generator=g), mesh, list(p.placements))

    def snapshot():
        return [p.to_local().clone() for p in ps] + [
            opt.state[p]["momentum_buffer"].to_local().clone() for p in ps if p in opt.state
        ]

    prepare()
    opt.step()  # momentum exists
    _fail_at_each(rank, prepare, opt.step, snapshot, least=4)


for _route in ("owner", "gather", "gram"):
    CHECKS.add(f"dtensor_{_route}", lambda rank, _r=_route: _dtensor(_r, rank))


def _sharded_sites(compress, merge, clip=None, weighted=False):
    """Every piece of local work a ShardedIsoLoCo step runs before its vote (each called inside the step's
    try/except, which keeps the failure): (owner, attribute), for the exchange of `compress` and `merge`; with
    `clip` the norms, caps and clipping; `weighted`: the weights' check and resolution (before and after the roll
    call)."""
    from isoloco_kernels.distributed import sharded as S
    from isoloco_kernels.outer import core as O

    opt_sites = [(S.ShardedIsoLoCo, "_checked_grads"), (O, "collect"), (S, "checksums"), (S, "optimizer_settings")]
    opt_sites += [(S, "_own_weight"), (S.ShardedIsoLoCo, "_send_plan"), (S.ShardedIsoLoCo, "_clipped")]
    opt_sites += [(S, "worker_norms_each"), (S, "clip_cap")] if clip is not None else []
    opt_sites += [(S, "resolve_weights")] if weighted else []
    if compress is not None:
        ex = S._CompressedExchange
        return opt_sites + [
            (ex, "pack"),
            (S, "encode_delta"),
            (ex, "inputs"),
            (S, "owner_inputs"),
            (S, "owner_step"),
            (S, "apply_update"),
        ]
    ex = S._MeanExchange if merge in ("iso_c", "mean") else S._WorkerExchange
    sites = opt_sites + [(ex, "pack"), (ex, "inputs"), (S.ShardedIsoLoCo, "_owner_update"), (O, "prepare_nesterov")]
    sites += [(S._Segments, "pack")] if ex is S._MeanExchange else [(S, "merge_groups")]
    return sites + ([(O, "bucket_flatten")] if merge == "iso_c" else [])


def _sharded(rank: int, compress=None, merge="iso_c", clip=None, weighted=False) -> None:
    """ShardedIsoLoCo: each piece of local work before the vote failing in turn on rank 1: a solo param
    (solo_above=0.3) beside sharded ones of two dtypes, a non-contiguous grad, several chunks; with `clip` and
    `weighted` (each rank's own weight) a clipped, weighted round."""
    from isoloco_kernels.distributed import ShardedIsoLoCo

    gen = torch.Generator().manual_seed(0)
    ps = [
        torch.randn(40, 40, generator=gen),
        torch.randn(16, 16, generator=gen),
        torch.randn(5, generator=gen),
        torch.randn(8, 6, generator=gen).to(torch.bfloat16),
    ]
    opt = ShardedIsoLoCo(
        ps, lr=1.0, momentum=0.9, chunk_bytes=2048, solo_above=0.3, compress=compress, merge=merge, clip=clip
    )
    assert opt.plan.solo
    step, start = [0], [p.clone() for p in ps]

    def prepare():
        step[0] += 1
        for p, s in zip(ps, start):
            p.copy_(s)
        g = torch.Generator().manual_seed(10 * step[0] + rank)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        ps[1].grad = ps[1].grad.mT.contiguous().mT

    def snapshot():
        held = [opt.state[p]["momentum_buffer"].clone() for p in ps if p in opt.state]
        return [p.clone() for p in ps] + held + [r.clone() for r in opt._residuals.values()]

    def run():
        opt.step(weight=1.0 + rank if weighted else None)

    for owner, attr in _sharded_sites(compress, merge, clip, weighted):
        _fail_at_each(rank, prepare, run, snapshot, 1, owner, attr)
    run()  # and it steps on: nothing of a refused step was kept


CHECKS.add("sharded", lambda rank: _sharded(rank))
CHECKS.add("sharded_mean", lambda rank: _sharded(rank, merge="mean"))
CHECKS.add("sharded_tsv", lambda rank: _sharded(rank, merge="tsv"))
CHECKS.add("sharded_int4", lambda rank: _sharded(rank, compress="int4:32:0.9:nearest:both"))
CHECKS.add("sharded_int4_ties", lambda rank: _sharded(rank, compress="int4", merge="ties"))
CHECKS.add("sharded_weighted_clip", lambda rank: _sharded(rank, clip="median", weighted=True))
CHECKS.add("sharded_tsv_weighted_clip", lambda rank: _sharded(rank, merge="tsv", clip=2.0, weighted=True))


@CHECKS
def _check_sharded_iso_merge(rank: int) -> None:
    """sharded_iso_merge_: a solo bucket (transposed) beside batches of two dtypes."""
    from isoloco_kernels.distributed import sharded_iso_merge_

    gen = torch.Generator().manual_seed(0)  # equal on every rank, as averaged buckets are
    bs = [
        torch.randn(40, 40, generator=gen).mT,
        torch.randn(4, 16, 16, generator=gen),
        torch.randn(3, 8, 6, generator=gen).to(torch.bfloat16),
    ]
    start = [b.clone() for b in bs]
    _fail_at_each(
        rank,
        lambda: [b.copy_(s) for b, s in zip(bs, start)],
        lambda: sharded_iso_merge_(bs, method="svd", chunk_bytes=1024, solo_above=0.3),
        lambda: [b.clone() for b in bs],
        least=6,
    )


@CHECKS
def _check_average(rank: int) -> None:
    """average_: float32 and bfloat16 tensors, one non-contiguous, several chunks."""
    from isoloco_kernels.distributed import average_

    gen = torch.Generator().manual_seed(rank)
    ts = [torch.randn(300, generator=gen), torch.randn(9, 7, generator=gen).to(torch.bfloat16).mT]
    start = [t.clone() for t in ts]
    _fail_at_each(
        rank,
        lambda: [t.copy_(s) for t, s in zip(ts, start)],  # a failure while averaging leaves them partly averaged
        lambda: average_(ts, chunk_bytes=512),
        lambda: [t.clone() for t in ts],
        least=6,
    )


@CHECKS
def _check_process_group_step(rank: int) -> None:
    """IsoLoCo(process_group=...): its checks (the averaged-grads fingerprint), the packing, its
    sharded_iso_merge_ and the Nesterov preparation, after a load (the momentum check too)."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(40, 40, generator=gen), torch.randn(16, 16, generator=gen), torch.randn(5, generator=gen)]
    opt = IsoLoCo(ps, lr=1.0, momentum=0.9, process_group=dist.group.WORLD)
    step = [0]

    def prepare():
        step[0] += 1
        g = torch.Generator().manual_seed(100 + step[0])  # equal on every rank: already averaged
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.load_state_dict(opt.state_dict())  # every step checks the loaded momentum here

    def snapshot():
        return [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps if p in opt.state]

    _fail_at_each(rank, prepare, opt.step, snapshot, least=6)


# Library helpers that the pipelined collectives call between two collectives (packing and
# unpacking chunks, views of the owned segment): each call of each, failing on rank 1 in turn.
def _helpers(rank: int) -> None:
    from isoloco_kernels.distributed import average_, sharded_iso_merge_
    from isoloco_kernels.distributed import pipeline as C

    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(300, generator=gen), torch.randn(9, 7, generator=gen).mT]
    start = [t.clone() for t in ts]

    def restore():
        for t, s in zip(ts, start):
            t.copy_(s)

    snap = lambda: [t.clone() for t in ts]  # noqa: E731
    _fail_at_each(rank, restore, lambda: average_(ts, chunk_bytes=512), snap, 1, C, "_pieces")
    bs = [torch.randn(4, 16, 16, generator=gen), torch.randn(3, 8, 6, generator=gen)]
    bstart = [b.clone() for b in bs]
    merge = lambda: sharded_iso_merge_(bs, method="svd", chunk_bytes=1024)  # noqa: E731
    _fail_at_each(rank, lambda: [b.copy_(s) for b, s in zip(bs, bstart)], merge, snap, 1, C, "_pieces")


CHECKS.add("helpers_between_collectives", _helpers)


def _body(rank, world, tmpdir):
    CHECKS.run(tmpdir, rank, rank)


point_groups = groups(_body, 2)


@pytest.mark.parametrize("world,name", params({2: CHECKS}))
def test_a_failure_at_any_point_between_collectives_fails_every_rank(point_groups, world, name):
    point_groups[world].assert_ok(name)
