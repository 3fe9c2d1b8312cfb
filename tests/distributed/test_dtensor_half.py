"""Half precision (bfloat16, float16) on every DTensor and sharded route, against single-process IsoLoCo.

Both sides get the same half-precision params and grads. Iso-C and the momentum are computed in
float32 (the compute dtype) and only the param is rounded to its dtype, once per step, so:
- the float32 momentum buffers agree to the float32 tolerance whatever the route (a route that
  rounded its Iso-C result to the grad's dtype would miss it by ~2^-9, a route that sent no result
  by 100 %);
- the params agree to their dtype's update tolerance (an element whose update differs in its last
  float32 bits may round to the neighbouring half-precision value);
- every 2-D param moved.
gloo on 127.0.0.1 (tests/spawn.py), 2 ranks (1-D mesh, HSDP 1×2, process group); 4 ranks (HSDP
2×2, 1-D mesh) run by default (ISOLOCO_SKIP_4_RANKS=1 skips them). Each check, per dtype, is its
own test.
"""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import IsoLoCo, iso_merge_
from isoloco_kernels.distributed import DistributedStepError, ShardedIsoLoCo, sharded_iso_merge_
from isoloco_kernels.distributed import dtensor as DT
from tests.distributed.test_dtensor import TOL_FP32, TinyLlama, _pseudo_grad
from tests.helpers import TOL, rel_err
from tests.spawn import PG_TIMEOUT_S, Checks, groups, params

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

HALF = (torch.bfloat16, torch.float16)
ROUTES = ("auto", "gram", "owner", "gather")


def _half_fsdp_llama(mesh, dtype):
    """The test llama in `dtype`, FSDP2-sharded per block, and an unsharded copy with the same values."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLlama().to(dtype)
    ref = copy.deepcopy(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref


def _set_half_grads(model, ref, step, dtype):
    """`test_dtensor._set_grads` in `dtype`: whole grads on the reference, their shards on the DTensors."""
    from torch.distributed.tensor import DTensor

    for i, (p, r) in enumerate(zip(model.parameters(), ref.parameters())):
        full = _pseudo_grad(tuple(p.shape), 1000 * step + i).to(dtype)
        r.grad = full.clone()
        loc = _distribute(full, p).to_local()
        p.grad = DTensor.from_local(loc, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _compare_half(params, ref_params, bufs, ref_bufs, starts, dtype, what):
    """params/ref_params: whole tensors after the steps; bufs/ref_bufs: whole momentum buffers
    (None where this rank holds none); starts: the whole params before the first step."""
    for i, (p, r, b, rb, p0) in enumerate(zip(params, ref_params, bufs, ref_bufs, starts)):
        assert p.dtype == r.dtype == dtype, f"{what}: param {i} has dtype {p.dtype}"
        if p.ndim == 2:
            assert not torch.equal(p, p0), f"{what}: param {i} {tuple(p.shape)} did not move"
        e = rel_err(p, r)
        assert e <= TOL[("update", dtype)], f"{what}: param {i} {tuple(p.shape)} differs from single-process by {e:.3g}"
        if b is None:
            continue
        assert b.dtype == rb.dtype == torch.float32, f"{what}: param {i} momentum dtype {b.dtype}, ref {rb.dtype}"
        e = rel_err(b, rb)
        assert e <= TOL_FP32, f"{what}: param {i} {tuple(p.shape)} momentum differs from single-process by {e:.3g}"


def _run_dtensor(model, ref, opt, ref_opt, dtype, what, steps=2):
    starts = [p.full_tensor() for p in model.parameters()]
    for s in range(steps):
        _set_half_grads(model, ref, s, dtype)
        opt.step()
        ref_opt.step()
    _compare_half(
        [p.full_tensor() for p in model.parameters()],
        [r.detach() for r in ref.parameters()],
        [opt.state[p]["momentum_buffer"].full_tensor() for p in model.parameters()],
        [ref_opt.state[r]["momentum_buffer"] for r in ref.parameters()],
        starts,
        dtype,
        what,
    )
    for p in model.parameters():
        buf = opt.state[p]["momentum_buffer"]
        assert buf.placements == p.placements and buf.to_local().shape == p.to_local().shape, what


# ----------------------------------------------------------------------------------------------
# The checks (each rank runs them all)


def _check_fsdp_routes(mesh, dtype):
    """FSDP2 Shard(0) on a 1-D mesh, every route (the owner route used to send no result back)."""
    world = mesh.size()
    for route in ROUTES:
        model, ref = _half_fsdp_llama(mesh, dtype)
        opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8)
        opt.dtensor_route = route
        ref_opt = IsoLoCo(ref.parameters(), lr=1.8, momentum=0.8)
        _run_dtensor(model, ref, opt, ref_opt, dtype, f"FSDP2 {dtype} route {route}")
        shapes = [tuple(p.shape) for p in ref.parameters() if p.ndim == 2]
        routes = [DT.route_for(sh, 0, world, 2, route) for sh in shapes]
        assert (opt.dtensor_stats.owner_elements > 0) == ("owner" in routes), (route, opt.dtensor_stats)
        assert (opt.dtensor_stats.gram_elements > 0) == ("gram" in routes), (route, opt.dtensor_stats)


def _check_tp_routes(mesh, dtype):
    """ColwiseParallel Shard(0), RowwiseParallel Shard(1) (uneven), a Replicate bias."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for route in ROUTES:
        torch.manual_seed(3)
        mlp = nn.Sequential()
        mlp.add_module("w1", nn.Linear(12, 69))
        mlp.add_module("w2", nn.Linear(69, 12))
        mlp.to(dtype)
        ref = copy.deepcopy(mlp)
        parallelize_module(mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        assert mlp.w2.weight.placements[0].dim == 1 and mlp.w2.bias.placements[0].is_replicate()
        opt = IsoLoCo(mlp.parameters(), lr=1.8, momentum=0.8, method="svd")
        opt.dtensor_route = route
        ref_opt = IsoLoCo(ref.parameters(), lr=1.8, momentum=0.8, method="svd")
        _run_dtensor(mlp, ref, opt, ref_opt, dtype, f"TP {dtype} route {route}")


def _check_general_mesh(hsdp, dtype):
    """A mesh with two dimensions (HSDP): the general full_tensor() path."""
    mesh, what = hsdp, "HSDP " + "x".join(map(str, hsdp.shape))
    model, ref = _half_fsdp_llama(mesh, dtype)
    opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8, method="svd")
    ref_opt = IsoLoCo(ref.parameters(), lr=1.8, momentum=0.8, method="svd")
    _run_dtensor(model, ref, opt, ref_opt, dtype, f"{what} {dtype}")
    assert opt.dtensor_stats.full_tensor_elements == sum(p.numel() for p in ref.parameters() if p.ndim == 2)


def _check_overflow(mesh, rank, dtype):
    """An outer update beyond float16's range: refused on every rank, naming the param, nothing
    changed; single-process IsoLoCo refuses it too."""
    from torch.distributed.fsdp import fully_shard

    if dtype != torch.float16:
        return  # bfloat16 has float32's range: the same grads fit
    for route in ("owner", "gram", "gather"):
        torch.manual_seed(2)
        lin = nn.Linear(16, 101, bias=False).to(dtype)
        ref = copy.deepcopy(lin)
        fully_shard(lin, mesh=mesh)
        for p, r in zip(lin.parameters(), ref.parameters()):
            full = _pseudo_grad(tuple(p.shape), 9).to(dtype)
            r.grad = full.clone()
            p.grad = _distribute(full, p)
        opt = IsoLoCo(lin.parameters(), lr=1e9, momentum=0.8)
        opt.dtensor_route = route
        before = lin.weight.to_local().clone()
        t0 = time.monotonic()
        with pytest.raises(
            DistributedStepError,
            match=r"ResultOverflowError: IsoLoCo: param_groups\[0\]\['params'\]\[0\] "
            r"\(shape \(101, 16\)\).*overflows the param's dtype torch.float16",
        ):
            opt.step()
        assert time.monotonic() - t0 < PG_TIMEOUT_S / 3
        assert torch.equal(lin.weight.to_local(), before) and not opt.state, f"overflow, route {route}: changed"
        with pytest.raises(ValueError, match="overflows the param's dtype torch.float16"):
            IsoLoCo(ref.parameters(), lr=1e9, momentum=0.8).step()


def _distribute(full, p):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)


def _plain_params(dtype, seed=0):
    """Whole params (equal on every rank) in `dtype`: a 1-D, a tall, a wide and two square matrices."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(24,), (40, 12), (12, 40), (16, 16), (16, 16)]
    return [nn.Parameter((0.1 * torch.randn(sh, generator=g)).to(dtype)) for sh in shapes]


def _check_sharded_optimizer(rank, world, dtype):
    """ShardedIsoLoCo (each rank its own pseudo-gradients, reduce-scattered to the owners) ==
    single-process IsoLoCo on their mean."""
    params = _plain_params(dtype)
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    starts = [p.detach().clone() for p in params]
    opt = ShardedIsoLoCo(params, lr=1.8, momentum=0.8)
    ref_opt = IsoLoCo(ref, lr=1.8, momentum=0.8)
    for s in range(2):
        grads = [
            [_pseudo_grad(tuple(p.shape), 100 * s + 10 * i + r).to(dtype) for r in range(world)]
            for i, p in enumerate(params)
        ]
        for p, r, gs in zip(params, ref, grads):
            p.grad = gs[rank].clone()
            r.grad = (sum(g.float() for g in gs) / world).to(dtype)  # the mean, rounded once
        opt.step()
        ref_opt.step()
    mine = set(opt.mine)
    _compare_half(
        [p.detach() for p in params],
        [r.detach() for r in ref],
        [opt.state[p]["momentum_buffer"] if i in mine else None for i, p in enumerate(params)],
        [ref_opt.state[r]["momentum_buffer"] for r in ref],
        starts,
        dtype,
        f"ShardedIsoLoCo {dtype}",
    )


def _check_process_group(dtype):
    """IsoLoCo(process_group=) (grads already averaged, the flatten split) == single-process IsoLoCo."""
    params = _plain_params(dtype, seed=1)
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    starts = [p.detach().clone() for p in params]
    opt = IsoLoCo(params, lr=1.8, momentum=0.8, process_group=dist.group.WORLD)
    ref_opt = IsoLoCo(ref, lr=1.8, momentum=0.8)
    for s in range(2):
        for i, (p, r) in enumerate(zip(params, ref)):
            p.grad = _pseudo_grad(tuple(p.shape), 50 * s + i).to(dtype)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    _compare_half(
        [p.detach() for p in params],
        [r.detach() for r in ref],
        [opt.state[p]["momentum_buffer"] for p in params],
        [ref_opt.state[r]["momentum_buffer"] for r in ref],
        starts,
        dtype,
        f"process_group {dtype}",
    )


def _check_sharded_merge(dtype):
    """sharded_iso_merge_ on half-precision buckets == iso_merge_ on the same buckets."""
    g = torch.Generator().manual_seed(4)
    buckets = [_pseudo_grad((40, 12), 7).to(dtype)[None].repeat(3, 1, 1), _pseudo_grad((16, 16), 8).to(dtype)[None]]
    buckets[0][1] *= 3
    buckets[0][2] = (0.01 * torch.randn(40, 12, generator=g)).to(dtype)
    want = [b.clone() for b in buckets]
    iso_merge_(want)
    sharded_iso_merge_(buckets)
    for i, (b, w) in enumerate(zip(buckets, want)):
        assert b.dtype == dtype
        e = rel_err(b, w)
        assert e <= TOL[("update", dtype)], f"sharded_iso_merge_ {dtype}: bucket {i} differs by {e:.3g}"


TWO, FOUR = Checks(), Checks()
for _dtype in HALF:
    _name = str(_dtype).removeprefix("torch.")
    for _fn in (
        _check_fsdp_routes,
        _check_tp_routes,
        _check_general_mesh,
        _check_overflow,
        _check_sharded_optimizer,
        _check_process_group,
        _check_sharded_merge,
    ):
        TWO.add(f"{_fn.__name__.removeprefix('_check_')}-{_name}", functools.partial(_fn, dtype=_dtype))
    for _fn in (_check_general_mesh, _check_fsdp_routes):
        FOUR.add(f"{_fn.__name__.removeprefix('_check_')}-{_name}", functools.partial(_fn, dtype=_dtype))


def _body(rank, world, tmpdir):
    from torch.distributed.device_mesh import init_device_mesh

    hsdp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    mesh = init_device_mesh("cpu", (world,))
    (TWO if world == 2 else FOUR).run(tmpdir, rank, rank=rank, world=world, mesh=mesh, hsdp=hsdp)


half_groups = groups(_body, 2, 4, deadline_s=400)  # one spawned group each of 2 and 4 ranks


@pytest.mark.parametrize("world, name", params({2: TWO, 4: FOUR}))
def test_half_precision(half_groups, world, name):
    half_groups[world].assert_ok(name)
