"""The control plane's object exchange (`agree.gather_objects`, which carries the error texts and
settings of a failed agreement) needs nothing that can fail on one rank between its collectives:
gloo groups of 2 and 3 spawned ranks.

The exchange runs in blocks made once, before any collective, with the agreements' control tensors
(an agreement makes them, so an optimizer's constructor does); an object longer than a block travels
in pieces, every rank running as many all-gathers as the longest object needs. So a rank that cannot
allocate at that moment (out of memory) leaves no rank waiting in a collective: the exchange
completes on every rank, a failed agreement raises DistributedStepError on every rank within seconds
(well inside the process-group timeout) with every error text whole, and the group still works
afterwards. The failure is injected, as in tests/distributed/test_alloc_failure.py, on rank 1: every tensor
agree.py makes (zeros, empty, full) raises torch.OutOfMemoryError there.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from isoloco_kernels.distributed import DistributedStepError
from isoloco_kernels.distributed import agree as A
from tests.spawn import PG_TIMEOUT_S, Checks, groups, params

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

CHECKS = Checks()
VICTIM = 1  # the rank whose allocations fail
LONG = 20_000  # bytes: far longer than a block
FAST_S = PG_TIMEOUT_S / 3  # every rank must be done within this: nobody waited for the timeout


class _NoAllocations:
    """agree.py's `torch`, except that making a tensor raises out of memory."""

    def __init__(self, what: str):
        self.what = what

    def __getattr__(self, name):
        return getattr(torch, name)

    def _fail(self, *args, **kwargs):
        raise torch.OutOfMemoryError(f"injected allocation failure in {self.what}")

    zeros = empty = full = zeros_like = empty_like = _fail


@contextlib.contextmanager
def _allocations_fail(rank: int, what: str):
    if rank == VICTIM:
        A.torch = _NoAllocations(what)
    try:
        yield
    finally:
        A.torch = torch


def _objects(world: int, kind: str) -> list:
    """What each rank sends: small, long on every rank, long on the last rank only, or None."""
    if kind == "small":
        return [{"rank": r, "text": f"error on {r}"} for r in range(world)]
    if kind == "long":
        return [("x" * LONG + str(r), r) for r in range(world)]
    if kind == "one long":
        return ["y" * LONG if r == world - 1 else r for r in range(world)]
    return [None] * world


def _fails_everywhere_fast(rank: int, run, match: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(DistributedStepError, match=match):
        run()
    took = time.monotonic() - t0
    assert took < FAST_S, f"rank {rank} raised only after {took:.1f} s"


@CHECKS
def _check_normal_path_returns_every_object(rank: int, world: int) -> None:
    for kind in ("small", "long", "one long", "none", "small", "long"):
        want = _objects(world, kind)
        assert A.gather_objects(want[rank], dist.group.WORLD) == want, kind
    for size in [*range(980, 1070, 9), *range(2000, 2070, 9)]:  # around one and two blocks, each rank its own
        want = [b"z" * (size + r) for r in range(world)]
        assert A.gather_objects(want[rank], dist.group.WORLD) == want, size


@CHECKS
def _check_objects_travel_through_the_vote_where_a_rank_has_no_blocks(rank: int, world: int) -> None:
    """small=True (some rank could not make the blocks): the same objects, through the vote's own few
    int64, also where nothing can be allocated."""
    A.agree(None, dist.group.WORLD, "first agreement")
    for kind in ("small", "long", "one long", "none"):
        want = _objects(world, kind)
        with _allocations_fail(rank, "gather_objects"):
            assert A.gather_objects(want[rank], dist.group.WORLD, small=True) == want, kind


@CHECKS
def _check_a_rank_without_blocks_votes_no(rank: int, world: int) -> None:
    """A thread's first agreement where one rank cannot make the object blocks: every rank raises at once,
    naming that rank and its error (the text travels through the vote's tensors), and the next agreement,
    with the blocks made, passes."""
    A._CONTROL.__dict__.clear()
    want = rf"step failed on 1 of {world} ranks, .*rank {VICTIM}: OutOfMemoryError: injected allocation failure"
    with _allocations_fail(rank, "agree") if rank == VICTIM else contextlib.nullcontext():
        if rank == VICTIM:  # the vote's own first (a few bytes), then the blocks fail
            A.torch = torch
            A._vote_tensors(world, torch.device("cpu"))
            A.torch = _NoAllocations("agree")
        _fails_everywhere_fast(rank, lambda: A.agree(None, dist.group.WORLD, "step"), want)
    A.agree(None, dist.group.WORLD, "step")


@CHECKS
def _check_an_exchange_allocates_nothing(rank: int, world: int) -> None:
    """Long and short objects, on every rank or one, travel where nothing can be allocated: every rank
    returns them all, promptly (the blocks were made by the group's first agreement)."""
    A._CONTROL.__dict__.clear()
    A.agree(None, dist.group.WORLD, "first agreement")  # makes the exchange's blocks with its own
    for kind in ("long", "one long", "small", "none", "long"):
        want = _objects(world, kind)
        t0 = time.monotonic()
        with _allocations_fail(rank, "gather_objects"):
            got = A.gather_objects(want[rank], dist.group.WORLD)
        assert got == want, kind
        assert time.monotonic() - t0 < FAST_S, f"{kind}: {time.monotonic() - t0:.1f} s"


@CHECKS
def _check_agreement_with_a_long_error_text(rank: int, world: int) -> None:
    """A failed agreement whose error text is long: it travels whole, also where the victim can allocate
    nothing, and every rank raises at once, naming the rank that failed."""
    failing = world - 1
    text = "E" * LONG if rank == failing else None
    want = rf"^step failed on 1 of {world} ranks, nothing was changed on any rank: rank {failing}: E{{{LONG}}}$"
    with pytest.raises(DistributedStepError, match=want):
        A.agree(text, dist.group.WORLD, "step")
    with _allocations_fail(rank, "agree"):
        _fails_everywhere_fast(rank, lambda: A.agree(text, dist.group.WORLD, "step"), want)
    A.agree(None, dist.group.WORLD, "step")  # and the group still agrees


@CHECKS
def _check_mesh_agreement_with_a_long_error_text(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    failing = world - 1
    text = "M" * LONG if rank == failing else None
    want = rf"^mesh step failed on 1 of {world} ranks, .*: rank {failing}: M{{{LONG}}}$"
    with pytest.raises(DistributedStepError, match=want):
        A.agree_on_mesh(text, mesh, "mesh step")
    with _allocations_fail(rank, "agree_on_mesh"):
        _fails_everywhere_fast(rank, lambda: A.agree_on_mesh(text, mesh, "mesh step"), want)
    A.agree_on_mesh(None, mesh, "mesh step")  # and the mesh still agrees


def _body(rank, world, tmpdir):
    CHECKS.run(tmpdir, rank, rank, world)


control_groups = groups(_body, 2, 3)


@pytest.mark.parametrize("world,name", params({2: CHECKS, 3: CHECKS}))
def test_object_exchange_needs_no_allocation(control_groups, world, name):
    control_groups[world].assert_ok(name)
