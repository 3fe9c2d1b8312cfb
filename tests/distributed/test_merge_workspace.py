"""`IsoLoCo(process_group=...)` and `sharded_iso_merge_` keep the flatten's scratch within the workspace.

Each rank flattens its share of a bucket in slices of `buckets.chunk_rows` matrices, as the
unsharded step does (`buckets.flatten_chunked_`): with $ISOLOCO_WORKSPACE_BYTES set to two
matrices' modelled scratch, a 64 × 32 × 256 bucket goes to the method two matrices per call on a
group of one rank (32 calls) and of two (16 calls per rank), and the step gives what it gives
without a group. 1 and 2 gloo ranks.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from isoloco_kernels import IsoLoCo
from isoloco_kernels.flatten import registry as buckets
from isoloco_kernels.flatten import registry as flatten
from tests.spawn import Checks, groups, params

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

CHECKS = Checks()
B, M, N = 64, 32, 256


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(M, N, generator=gen) for _ in range(B)]


def _grads(ps, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)  # equal on every rank: already averaged
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)


@CHECKS
def _check_step_flattens_in_slices(rank: int, world: int) -> None:
    per = buckets.method_workspace("svd", M, N, torch.float32)
    real = flatten.METHODS["svd"]
    calls: list[int] = []

    def counting(x3: torch.Tensor) -> None:
        calls.append(x3.shape[0])
        real.run(x3)

    ps, alone = _params(0), _params(0)
    opt = IsoLoCo(ps, lr=1.0, momentum=0.9, method="svd", process_group=dist.group.WORLD)
    ref = IsoLoCo(alone, lr=1.0, momentum=0.9, method="svd")
    saved = os.environ.get(buckets.WORKSPACE_ENV)
    os.environ[buckets.WORKSPACE_ENV] = str(2 * per)
    flatten.METHODS["svd"] = dataclasses.replace(real, run=counting)
    try:
        assert buckets.chunk_rows("svd", torch.empty(B, M, N)) == 2
        for step in range(2):
            _grads(ps, step)
            _grads(alone, step)
            calls.clear()
            opt.step()
            assert calls == [2] * (B // world // 2), calls  # this rank's share, two matrices per call
            ref.step()
    finally:
        flatten.METHODS["svd"] = real
        if saved is None:
            os.environ.pop(buckets.WORKSPACE_ENV)
        else:
            os.environ[buckets.WORKSPACE_ENV] = saved
    for a, b in zip(ps, alone):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _body(rank, world, tmpdir):
    CHECKS.run(tmpdir, rank, rank=rank, world=world)


ws_groups = groups(_body, 1, 2)


@pytest.mark.parametrize("world,name", params({1: CHECKS, 2: CHECKS}))
def test_sharded_flatten_stays_within_the_workspace(ws_groups, world, name):
    ws_groups[world].assert_ok(name)
