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

import contextlib
import re
import time

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

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


def _fail_each(rank: int, sites, run, snapshot, own: bool = False) -> list[int]:
    """`run()` with rank 1's allocation failing at each site in turn (`sites`: their names, or how
    many, named "buffer <i>"): every rank raises DistributedStepError naming it within seconds, and
    `snapshot()` is unchanged. own: a constructor, where rank 1 raises its own error instead. Returns
    this rank's comm_buffer calls in each run."""
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
            injected = f"injected allocation failure at {re.escape(what)}\\b"
            if own and rank == 1:
                with pytest.raises(torch.OutOfMemoryError, match=injected):
                    run()
            else:
                with pytest.raises(DistributedStepError, match=rf"rank 1: OutOfMemoryError: {injected}"):
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
    """ShardedIsoLoCo makes its exchange's buffers (my segments, the chunks, the owner's copy of a solo
    param) when it is built: each of those failing in turn on rank 1 fails the constructor there (its own
    error) and on every other rank (DistributedStepError naming it). A step then makes only the flat
    stand-in a non-contiguous param is all-gathered through, before the vote: failing there fails every
    rank with nothing changed. A solo 40 × 40 param (solo_above=0.3, transposed) beside sharded ones of two
    dtypes; plain and compressed."""
    from isoloco_kernels.distributed import ShardedIsoLoCo

    for compress in (None, "int4"):
        gen = torch.Generator().manual_seed(0)
        ps = [
            torch.randn(40, 40, generator=gen).mT,
            torch.randn(16, 16, generator=gen),
            torch.randn(5, generator=gen),
            torch.randn(8, 6, generator=gen).to(torch.bfloat16),
        ]

        def build(c=compress):
            return ShardedIsoLoCo(ps, lr=1.0, momentum=0.9, chunk_bytes=512, solo_above=0.3, compress=c)

        sites = _sites(rank, build)
        assert sites >= (4 if compress else 7), sites
        _fail_each(rank, sites, build, lambda: [p.clone() for p in ps], own=True)
        opt = build()
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
        assert sites == (0 if compress else 1), sites  # the stand-in of the transposed param
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


# -- every allocation fails on one rank ----------------------------------------------------------------------
# The broadest injection: while the call runs, every torch allocation of at least 64 elements on rank 1 raises
# out of memory (a dispatch mode that refuses every op result of that size not sharing an input's storage:
# new tensors, not views or in-place results; the collectives themselves pass). Every rank must raise
# DistributedStepError naming rank 1 within seconds, nothing may change on any rank, and the next call works:
# on 2 and 3 ranks, for average_, sharded_iso_merge_ (also the first call of a thread, before any agreement made
# the control plane), ShardedIsoLoCo (plain, compressed, a merge of every worker's Δ; its constructor too),
# IsoLoCo(process_group=...) and the DTensor step on each route.

BROAD = Checks()
SMALL = 64  # elements: what may still be allocated (a vote's few int64)


class NoAllocations(TorchDispatchMode):
    """Every op result of SMALL elements or more that does not share an input's storage raises out of memory."""

    @staticmethod
    def _storages(tree) -> set:
        out = set()
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor):
                t = getattr(t, "_local_tensor", t)  # a DTensor's local shard
                out.add(t.untyped_storage().data_ptr())
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            return out
        inputs = self._storages((args, kwargs))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                local = getattr(t, "_local_tensor", t)
                if local.numel() >= SMALL and local.untyped_storage().data_ptr() not in inputs:
                    raise torch.OutOfMemoryError(f"injected: {func} made {local.numel()} elements")
        return out


def _broad(rank: int, run, snapshot, prepare=lambda: None, own: bool = False) -> None:
    """run() with every allocation of rank 1 failing: every rank raises (DistributedStepError naming rank 1;
    own: rank 1 its own OutOfMemoryError), fast, snapshot() unchanged; then run() works. prepare(): before
    each run, outside the injection (the grads)."""
    prepare()
    before = snapshot()
    t0 = time.monotonic()
    if own and rank == 1:
        with pytest.raises(torch.OutOfMemoryError, match="injected"), NoAllocations():
            run()
    else:
        with pytest.raises(DistributedStepError, match=r"rank 1: OutOfMemoryError: injected") as e:
            with NoAllocations() if rank == 1 else contextlib.nullcontext():
                run()
        assert "nothing was changed on any rank" in str(e.value), str(e.value)
    took = time.monotonic() - t0
    assert took < PG_TIMEOUT_S / 3, f"every rank raised only after {took:.1f} s"
    assert all(torch.equal(a, b) for a, b in zip(snapshot(), before)), "a tensor changed"
    prepare()
    run()


def _cold() -> None:
    """Forget every control tensor of this thread: the next call makes its control plane first."""
    from isoloco_kernels.distributed import agree as A

    A._CONTROL.__dict__.clear()


def _broad_cold_and_warm(rank: int, make, call) -> None:
    """_broad of call(ts) on the tensors make() gives, restored before each run: first as a thread's first
    call (its control plane not made yet), then warm."""
    for cold in (True, False):
        ts = make()
        start = [t.clone() for t in ts]

        def run():
            for t, s0 in zip(ts, start):
                t.copy_(s0)
            if cold:
                _cold()
            call(ts)

        _broad(rank, run, lambda: [t.clone() for t in ts])


@BROAD
def _check_average(rank: int) -> None:
    from isoloco_kernels.distributed import average_

    def make():
        gen = torch.Generator().manual_seed(rank)
        return [torch.randn(300, generator=gen), torch.randn(9, 7, generator=gen).to(torch.bfloat16).mT]

    _broad_cold_and_warm(rank, make, lambda ts: average_(ts, chunk_bytes=256))


@BROAD
def _check_sharded_iso_merge(rank: int) -> None:
    from isoloco_kernels.distributed import sharded_iso_merge_

    def make():
        gen = torch.Generator().manual_seed(0)  # equal on every rank, as averaged buckets are
        return [torch.randn(40, 40, generator=gen).mT, torch.randn(4, 16, 16, generator=gen)]

    _broad_cold_and_warm(rank, make, lambda bs: sharded_iso_merge_(bs, method="svd", chunk_bytes=512, solo_above=0.3))


def _sharded_broad(rank: int, **kw) -> None:
    from isoloco_kernels.distributed import ShardedIsoLoCo

    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(40, 40, generator=gen).mT, torch.randn(16, 16, generator=gen), torch.randn(50, generator=gen)]
    make = lambda: ShardedIsoLoCo(ps, lr=1.0, momentum=0.9, chunk_bytes=512, solo_above=0.3, **kw)  # noqa: E731
    _broad(rank, make, lambda: [p.clone() for p in ps], own=True)  # its buffers, made while it is built
    opt = make()
    step = [0]

    def grads():
        step[0] += 1
        g = torch.Generator().manual_seed(10 * step[0] + rank)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)

    grads()
    opt.step()  # momentum, residuals held

    def snapshot():
        held = [opt.state[p]["momentum_buffer"].clone() for p in ps if p in opt.state]
        return [p.clone() for p in ps] + held + [r.clone() for r in opt._residuals.values()]

    _broad(rank, opt.step, snapshot, grads)
    _broad(rank, lambda: (_cold(), opt.step()), snapshot, grads)  # a thread whose control plane is not made yet
    _broad(rank, opt.consolidated_state_dict, snapshot)  # its buffers, made before its broadcasts


BROAD.add("sharded", lambda rank: _sharded_broad(rank))
BROAD.add("sharded_tsv", lambda rank: _sharded_broad(rank, merge="tsv"))
BROAD.add("sharded_int4", lambda rank: _sharded_broad(rank, compress="int4:32:0.9:nearest:both"))


@BROAD
def _check_process_group_step(rank: int) -> None:
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(40, 40, generator=gen), torch.randn(16, 16, generator=gen), torch.randn(5, generator=gen)]
    opt = IsoLoCo(ps, lr=1.0, momentum=0.9, process_group=dist.group.WORLD)

    def grads():
        g = torch.Generator().manual_seed(100)  # equal on every rank: already averaged
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)

    grads()
    opt.step()
    snapshot = lambda: [p.clone() for p in ps] + [opt.state[p]["momentum_buffer"].clone() for p in ps]  # noqa: E731
    _broad(rank, opt.step, snapshot, grads)


def _dtensor_broad(route: str, rank: int) -> None:
    ps, opt, grads = _setup(route)
    opt.dtensor_route = route

    _broad(rank, opt.step, lambda: _snapshot(ps, opt), lambda: grads(1))


for _route in SITES:
    BROAD.add(f"dtensor_{_route}", lambda rank, _r=_route: _dtensor_broad(_r, rank))


def _broad_body(rank, world, tmpdir):
    BROAD.run(tmpdir, rank, rank)


broad_groups = groups(_broad_body, 2, 3)


@pytest.mark.parametrize("world,name", params({2: BROAD, 3: BROAD}))
def test_every_allocation_failing_on_one_rank_fails_every_rank(broad_groups, world, name):
    broad_groups[world].assert_ok(name)


def _body(rank, world, tmpdir):
    CHECKS.run(tmpdir, rank, rank)


alloc_groups = groups(_body, 2)


@pytest.mark.parametrize("world,name", params({2: CHECKS}))
def test_allocation_failure_on_one_rank_fails_every_rank(alloc_groups, world, name):
    alloc_groups[world].assert_ok(name)
