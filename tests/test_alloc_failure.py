"""An allocation that fails on one rank fails every rank quickly, with nothing changed.

The DTensor step's gather and owner routes, `average_` and `ShardedIsoLoCo` hand buffers to
collectives; each buffer comes from `collectives.comm_buffer`. A failure there on one rank (out of memory, as at scale) must reach
the other rank before it waits in a collective: every rank raises DistributedStepError naming the
failing rank within seconds (well inside the process-group timeout), params and momentum as they
were, and the next step works. 2 gloo ranks, a 16 × 16 param sharded on dim 0 (and a vector).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from isoloco_kernels import IsoLoCo
from isoloco_kernels.distributed import DistributedStepError
from isoloco_kernels.distributed import collectives as C
from tests.spawn import PG_TIMEOUT_S, Checks, groups, params

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

CHECKS = Checks()
#: route → the comm_buffer calls of one step, in order (each a site a failure is injected at)
SITES = {
    "gather": ("gather send", "gather recv"),
    "owner": ("owner out send", "owner out recv", "owner back send", "owner back recv"),
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


def _check(route: str, rank: int) -> None:
    ps, opt, grads = _setup(route)
    real = C.comm_buffer
    for site, what in enumerate(SITES[route]):
        grads(1)
        before = _snapshot(ps, opt)
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
                DistributedStepError, match=rf"rank 1: OutOfMemoryError: injected allocation failure at {what}"
            ):
                opt.step()
        finally:
            C.comm_buffer = real
        took = time.monotonic() - t0
        assert took < PG_TIMEOUT_S / 3, f"{what}: every rank raised only after {took:.1f} s"
        after = _snapshot(ps, opt)
        assert all(torch.equal(a, b) for a, b in zip(after, before)), f"{what}: a tensor changed"
        assert calls[0] >= len(SITES[route]) or rank == 1, f"{what}: {calls[0]} buffers made on rank 0"
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
    real = C.comm_buffer
    for site in range(6):
        before = [t.clone() for t in ts]
        calls = [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if rank == 1 and calls[0] == site + 1:
                raise torch.OutOfMemoryError(f"injected allocation failure at buffer {site}")
            return real(*args, **kwargs)

        C.comm_buffer = failing
        t0 = time.monotonic()
        try:
            with pytest.raises(DistributedStepError, match=rf"rank 1: OutOfMemoryError: .* at buffer {site}"):
                average_(ts, chunk_bytes=256)
        finally:
            C.comm_buffer = real
        assert time.monotonic() - t0 < PG_TIMEOUT_S / 3, f"buffer {site}: took {time.monotonic() - t0:.1f} s"
        assert all(torch.equal(a, b) for a, b in zip(ts, before)), f"buffer {site}: a tensor changed"
    average_(ts, chunk_bytes=256)  # and it still averages
    assert not torch.equal(ts[0], before[0])


@CHECKS
def _check_sharded(rank: int) -> None:
    """ShardedIsoLoCo's buffers (reduce-scatter, reduce to the owner of a solo param, all-gather),
    each in turn: a solo 40 × 40 param (solo_above=0.3) beside sharded ones of two dtypes."""
    from isoloco_kernels.distributed import ShardedIsoLoCo

    gen = torch.Generator().manual_seed(0)
    ps = [
        torch.randn(40, 40, generator=gen),
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

    real = C.comm_buffer
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    grads(0)
    C.comm_buffer = counting
    try:
        opt.step()
    finally:
        C.comm_buffer = real
    sites = [calls[0]]
    dist.broadcast_object_list(sites, src=1)  # rank 1's count: the sites a failure is injected at
    assert sites[0] >= 7, sites
    for site in range(sites[0]):
        grads(1)
        before = [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps if p in opt.state]
        calls[0] = 0

        def failing(*args, **kwargs):
            calls[0] += 1
            if rank == 1 and calls[0] == site + 1:
                raise torch.OutOfMemoryError(f"injected allocation failure at buffer {site}")
            return real(*args, **kwargs)

        C.comm_buffer = failing
        t0 = time.monotonic()
        try:
            with pytest.raises(DistributedStepError, match=rf"rank 1: OutOfMemoryError: .* at buffer {site}\b"):
                opt.step()
        finally:
            C.comm_buffer = real
        assert time.monotonic() - t0 < PG_TIMEOUT_S / 3, f"buffer {site}: took {time.monotonic() - t0:.1f} s"
        after = [p for p in ps] + [opt.state[p]["momentum_buffer"] for p in ps if p in opt.state]
        assert all(torch.equal(a, b) for a, b in zip(after, before)), f"buffer {site}: a tensor changed"
    grads(2)
    opt.step()  # and it still works
    assert not torch.equal(ps[1], before[1])


def _body(rank, world, tmpdir):
    CHECKS.run(tmpdir, rank, rank)


alloc_groups = groups(_body, 2)


@pytest.mark.parametrize("world,name", params({2: CHECKS}))
def test_allocation_failure_on_one_rank_fails_every_rank(alloc_groups, world, name):
    alloc_groups[world].assert_ok(name)
