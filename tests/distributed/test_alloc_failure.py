"""An allocation that fails on one rank fails every rank quickly, with nothing changed.

The DTensor step's gather, owner and Gram routes, `average_`, `ShardedIsoLoCo` and
`sharded_iso_merge_` (also under `IsoLoCo(process_group=...)`) hand buffers to collectives (and
`sharded_iso_merge_` flattens copies aside); each buffer comes from `pipeline.comm_buffer`.
A failure there on one rank (out of memory, as at scale) must reach
the other rank before it waits in a collective: every rank raises DistributedStepError naming the
failing rank within seconds (well inside the process-group timeout), params and momentum as they
were, and the next step works. 2 gloo ranks, a 16 × 16 param sharded on dim 0 (and a vector).
"""

from __future__ import annotations

import re
import time

import pytest
import torch
import torch.distributed as dist

from isoloco_kernels import IsoLoCo
from isoloco_kernels.distributed import DistributedStepError
from isoloco_kernels.distributed import pipeline as C
from tests.spawn import PG_TIMEOUT_S, Checks, groups, params

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

CHECKS = Checks()
#: route → the comm_buffer calls of one step, in order (each a site a failure is injected at)
SITES = {
    "gather": ("gather send", "gather recv"),
    "owner": ("owner out send", "owner out recv", "owner back send", "owner back recv"),
    "gram": ("gram A0 all-reduce", "gram exact-path flags"),
}


def _setup(route: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    gen = torch.Generator().manual_seed(0)
    whole = [torch.randn(16, 16, generator=gen), torch.randn(5, generator=gen)]
    ps = [
        distribute_tensor(whole[0], mesh, [Shard(0)]),
        distribute_tensor(whole[1], mesh, [Replicate()]),
    ]
    opt = IsoLoCo(ps, lr=1.0, momentum=0.9)
    opt.dtensor_route = route

    def grads(step: int) -> None:
        g = torch.Generator().manual_seed(100 + step)
        for p, w in zip(ps, whole):
            full = torch.randn(w.shape, generator=g)
            p.grad = distribute_tensor(full, mesh, list(p.placements))

    grads(0)
    opt.step()  # momentum exists
    return ps, opt, grads


def _snapshot(ps, opt):
    return [p.to_local().clone() for p in ps] + [opt.state[p]["momentum_buffer"].to_local().clone() for p in ps]


def _sites(rank: int, run) -> int:
    """How many comm_buffer calls `run()` makes on rank 1 (each a site a failure is injected at)."""
    real = C.comm_buffer
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    C.comm_buffer = counting
    try:
        run()
    finally:
        C.comm_buffer = real
    sites = [calls[0]]
    dist.broadcast_object_list(sites, src=1)
    return sites[0]


def _fail_each(rank: int, sites, run, snapshot) -> list[int]:
    """`run()` with rank 1's allocation failing at each site in turn (`sites`: their names, or how
    many, named "buffer <i>"): every rank raises DistributedStepError naming it within seconds, and
    `snapshot()` is unchanged. Returns this rank's comm_buffer calls in each run."""
    names = [f"buffer {i}" for i in range(sites)] if isinstance(sites, int) else list(sites)
    real, made = C.comm_buffer, []
    for site, what in enumerate(names):
        before = snapshot()
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if rank == 1 and calls[0] == site + 1:
                raise torch.OutOfMemoryError(f"injected allocation failure at {what}")
            return real(*args, **kwargs)

        C.comm_buffer = failing
        t0 = time.monotonic()
        try:
            with pytest.raises(
                DistributedStepError,
                match=rf"rank 1: OutOfMemoryError: injected allocation failure at {re.escape(what)}\b",
            ):
                run()
        finally:
            C.comm_buffer = real
        took = time.monotonic() - t0
        assert took < PG_TIMEOUT_S / 3, f"{what}: every rank raised only after {took:.1f} s"
        after = snapshot()
        assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{what}: a tensor changed"
        made.append(calls[0])
    return made


def _check(route: str, rank: int) -> None:
    ps, opt, grads = _setup(route)

    def run():
        grads(1)
        opt.step()

    made = _fail_each(rank, SITES[route], run, lambda: _snapshot(ps, opt))
    assert rank == 1 or min(made) >= len(SITES[route]), f"{made}: buffers made on rank 0 per failing site"
    before = _snapshot(ps, opt)
    grads(2)
    opt.step()  # and the optimizer still works
    assert not torch.equal(ps[0].to_local(), before[0])


for _route in SITES:
    CHECKS.add(_route, lambda rank, _r=_route: _check(_r, rank))


@CHECKS
def _check_average(rank: int) -> None:
    """average_'s chunk buffers (three per dtype: float32 and bfloat16 here), each in turn."""
    from isoloco_kernels.distributed import average_

    gen = torch.Generator().manual_seed(rank)
    ts = [torch.randn(300, generator=gen), torch.randn(7, 9, generator=gen).to(torch.bfloat16)]
    _fail_each(rank, 6, lambda: average_(ts, chunk_bytes=256), lambda: [t.clone() for t in ts])
    before = [t.clone() for t in ts]
    average_(ts, chunk_bytes=256)  # and it still averages
    assert not torch.equal(ts[0], before[0])


@CHECKS
def _check_sharded(rank: int) -> None:
    """ShardedIsoLoCo's buffers (reduce-scatter, reduce to the owner of a solo param, all-gather,
    the flat copy a non-contiguous solo param is broadcast through), each in turn: a solo 40 × 40
    param (solo_above=0.3, transposed) beside sharded ones of two dtypes."""
    from isoloco_kernels.distributed import ShardedIsoLoCo

    gen = torch.Generator().manual_seed(0)
    ps = [
        torch.randn(40, 40, generator=gen).mT,
        torch.randn(16, 16, generator=gen),
        torch.randn(5, generator=gen),
        torch.randn(8, 6, generator=gen).to(torch.bfloat16),
    ]
    opt = ShardedIsoLoCo(ps, lr=1.0, momentum=0.9, chunk_bytes=512, solo_above=0.3)
    assert opt.plan.solo, "the test wants a solo param"

    def grads(step: int) -> None:
        g = torch.Generator().manual_seed(10 * step + rank)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    def run():
        grads(1)
        opt.step()

    grads(0)
    sites = _sites(rank, opt.step)
    assert sites >= 7, sites
    _fail_each(
        rank,
        sites,
        run,
        lambda: [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps if p in opt.state],
    )
    before = ps[1].clone()
    grads(2)
    opt.step()  # and it still works
    assert not torch.equal(ps[1], before)


@CHECKS
def _check_sharded_iso_merge(rank: int) -> None:
    """sharded_iso_merge_'s buffers (my segment per dtype, the all-gather's chunks, the copy of the
    solo matrices I own, stand-ins for non-contiguous units and a flat copy for a non-contiguous
    solo one), each in turn: a solo 40 × 40 bucket (transposed) beside batches of two dtypes, one
    of them transposed."""
    from isoloco_kernels import iso_merge_
    from isoloco_kernels.distributed import sharded_iso_merge_

    gen = torch.Generator().manual_seed(0)  # equal on every rank, as averaged buckets are
    bs = [
        torch.randn(40, 40, generator=gen).mT,
        torch.randn(4, 16, 16, generator=gen),
        torch.randn(3, 8, 6, generator=gen).to(torch.bfloat16),
        torch.randn(2, 10, 12, generator=gen).mT,
    ]
    assert not bs[0].is_contiguous() and not bs[3][0].is_contiguous()

    def run():
        sharded_iso_merge_(bs, method="svd", chunk_bytes=512, solo_above=0.3)

    sites = _sites(
        rank, lambda: sharded_iso_merge_([b.clone() for b in bs], method="svd", chunk_bytes=512, solo_above=0.3)
    )
    assert sites >= 10, sites
    _fail_each(rank, sites, run, lambda: [b.clone() for b in bs])
    want = iso_merge_([b.clone() for b in bs], method="svd")
    run()  # and it still merges
    assert all(torch.allclose(a.float(), w.float(), rtol=1e-2, atol=1e-2) for a, w in zip(bs, want))


@CHECKS
def _check_process_group_step(rank: int) -> None:
    """IsoLoCo(process_group=...): the buffers of its sharded_iso_merge_, each in turn."""
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(40, 40, generator=gen), torch.randn(16, 16, generator=gen), torch.randn(5, generator=gen)]
    opt = IsoLoCo(ps, lr=1.0, momentum=0.9, process_group=dist.group.WORLD)

    def grads(step: int) -> None:
        g = torch.Generator().manual_seed(100 + step)  # equal on every rank: already averaged
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)

    grads(0)
    sites = _sites(rank, opt.step)
    assert sites >= 2, sites
    grads(1)
    _fail_each(
        rank, sites, opt.step, lambda: [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps]
    )
    before = ps[0].clone()
    opt.step()  # and it still works
    assert not torch.equal(ps[0], before)


@CHECKS
def _check_agreements_allocate_nothing_in_a_step(rank: int) -> None:
    """The agreements' control tensors are made once (per length, device and thread) and reused:
    an optimizer's constructor makes them, so its steps allocate none and no allocation of an
    agreement can fail on one rank mid-step. Counted at the one place they are made
    (`agree._new_control`), from an empty cache: some while constructing, none while stepping
    (the DTensor step on each route, IsoLoCo(process_group=...), ShardedIsoLoCo) or while
    calling average_ and sharded_iso_merge_ again."""
    from isoloco_kernels.distributed import ShardedIsoLoCo, average_, sharded_iso_merge_
    from isoloco_kernels.distributed import agree as A

    real, calls = A._new_control, [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    A._CONTROL.__dict__.clear()
    A._new_control = counting
    try:
        ps_dt, opt_dt, grads_dt = _setup("gram")  # constructs, then steps once
        gen = torch.Generator().manual_seed(0)  # equal on every rank: already averaged
        ps = [torch.randn(16, 16, generator=gen), torch.randn(5, generator=gen)]
        pg = IsoLoCo([p.clone() for p in ps], lr=1.0, momentum=0.9, process_group=dist.group.WORLD)
        sh = ShardedIsoLoCo([p.clone() for p in ps], lr=1.0, momentum=0.9, chunk_bytes=512)
        ts, bs = [torch.randn(300, generator=gen)], [torch.randn(3, 8, 6, generator=gen)]
        average_(ts)
        sharded_iso_merge_(bs, method="svd")
        made = calls[0]
        assert made >= 2, f"{made} control tensors made while constructing"
        for step in range(2):
            for route in ("gram", "owner", "gather"):
                opt_dt.dtensor_route = route
                grads_dt(10 + step)
                opt_dt.step()
            for opt in (pg, sh):
                g = torch.Generator().manual_seed(20 + step)
                for p in opt.param_groups[0]["params"]:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            average_(ts)
            sharded_iso_merge_(bs, method="svd")
    finally:
        A._new_control = real
    assert calls[0] == made, f"the steps made {calls[0] - made} control tensors"


def _body(rank, world, tmpdir):
    CHECKS.run(tmpdir, rank, rank)


alloc_groups = groups(_body, 2)


@pytest.mark.parametrize("world,name", params({2: CHECKS}))
def test_allocation_failure_on_one_rank_fails_every_rank(alloc_groups, world, name):
    alloc_groups[world].assert_ok(name)
