"""IsoLoCo on DTensor params: FSDP2 (`fully_shard`) and tensor parallelism, gloo on 127.0.0.1.

One spawned group of 2 ranks (spawning costs tens of seconds on a busy 2-core machine) runs
every 2-rank check, each reported as its own test: the checks of the step, torchft's DiLoCo end to
end included; the one-rank failures injected between the step's collectives and the
load_state_dict refusals; the Gram route's rank-cut cases. 4 ranks (HSDP 2×2, FSDP × TP 2×2) run
by default (ISOLOCO_SKIP_4_RANKS=1 skips them). The reference is single-process IsoLoCo on the same
whole grads, on an unsharded copy of the same model. Half precision: tests/distributed/test_dtensor_half.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import IsoLoCo, ops
from isoloco_kernels.distributed import DistributedStepError, ShardedIsoLoCo, gram_route
from isoloco_kernels.distributed import dtensor as DT
from isoloco_kernels.distributed import routes as R
from isoloco_kernels.distributed.plan import ShardLayout, plan_shards, shard_sizes
from tests.helpers import TOL, rel_err, spectrum, with_spectrum
from tests.spawn import PG_TIMEOUT_S, Checks, groups, params

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

TOL_FP32 = 1e-5  # whole-model relative error vs single-process IsoLoCo after several outer steps

# The checks, by the test that reports them; each takes the body's context by parameter name
# (mesh, hsdp, dp_tp, rank, world, tmpdir: tests.spawn.Checks.run).
STEP, FAILURES, RANK_CUT, FOUR = Checks(), Checks(), Checks(), Checks()

VOCAB, HIDDEN, FFN, LAYERS, HEADS = 101, 16, 45, 2, 2  # odd vocabulary and ffn: uneven shards


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (f(h).view(b, t, HEADS, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _pseudo_grad(shape, seed):
    """A pseudo-gradient stand-in: geometric spectrum (cond 1e2) for matrices, Gaussian otherwise."""
    g = torch.Generator().manual_seed(seed)
    if len(shape) == 2:
        x = with_spectrum(1, *shape, spectrum("geometric", min(shape), 1e2), g)[0]
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (1e-2 * x).float()


def _set_grads(sharded, ref, step):
    """Whole grads on the reference model; their shards (as torchft writes them) on the DTensors."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for i, ((name, p), (rname, r)) in enumerate(zip(sharded.named_parameters(), ref.named_parameters())):
        assert name == rname
        full = _pseudo_grad(tuple(p.shape), 1000 * step + i)
        if ref is not None:
            r.grad = full.clone()
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _step_both(model, ref, steps: int, method: str, route: str = "auto"):
    """IsoLoCo(lr=1.8, momentum=0.8, method) on the DTensor model (its dtensor_route set) and on the
    single-process reference, `steps` steps on the same grads; (opt, ref_opt)."""
    opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8, method=method)
    opt.dtensor_route = route
    ref_opt = IsoLoCo(ref.parameters(), lr=1.8, momentum=0.8, method=method)
    for s in range(steps):
        _set_grads(model, ref, s)
        opt.step()
        ref_opt.step()
    return opt, ref_opt


def _compare(sharded, ref, opt, ref_opt, what, tol=TOL_FP32):
    for (name, p), r in zip(sharded.named_parameters(), ref.parameters()):
        e = rel_err(p.full_tensor(), r)
        assert e <= tol, f"{what}: {name} {tuple(p.shape)} differs from single-process IsoLoCo by {e:.3g}"
        buf = opt.state[p]["momentum_buffer"]
        assert isinstance(buf, type(p)) and buf.placements == p.placements, f"{what}: {name} momentum"
        assert buf.to_local().shape == p.to_local().shape
        e = rel_err(buf.full_tensor(), ref_opt.state[r]["momentum_buffer"])
        assert e <= tol, f"{what}: {name} momentum differs by {e:.3g}"


def _fsdp_llama(mesh, seed=0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyLlama()
    ref = copy.deepcopy(model)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref


# ----------------------------------------------------------------------------------------------
# The checks (each rank runs them all)


@STEP
def _check_fsdp_matches_single_process(mesh, rank):
    """Several outer steps over DTensor grads == single-process IsoLoCo on the whole grads."""
    # the first step's grads come from a real backward through the FSDP2 model (reduce-scattered)
    model, ref = _fsdp_llama(mesh)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    for m in (model, ref):
        F.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    opt, ref_opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8), IsoLoCo(ref.parameters(), lr=1.8, momentum=0.8)
    opt.step()
    ref_opt.step()
    _compare(model, ref, opt, ref_opt, "after a backward under FSDP2")

    world = mesh.size()
    for method in ("svd", "auto", "gram"):
        for route in ("auto", "gram", "owner", "gather"):
            model, ref = _fsdp_llama(mesh)
            opt, ref_opt = _step_both(model, ref, 3, method, route)
            _compare(model, ref, opt, ref_opt, f"FSDP2 {world} ranks, method {method}, route {route}")
            # what went over the wire, against the routes' rule
            shapes = [tuple(p.shape) for p in ref.parameters() if p.ndim == 2]
            routes = [DT.route_for(sh, 0, world, 4, route) for sh in shapes]
            gram = sum(min(sh) ** 2 for sh, r in zip(shapes, routes) if r == "gram")
            longest = sum(-(-sh[0] // world) * sh[1] for sh, r in zip(shapes, routes) if r == "gather")
            st = opt.dtensor_stats
            assert (st.gram_elements, st.gather_elements) == (gram, world * longest), (route, st)
            # method "gram": the Gram route's matrices ran gram.py's iteration on A₀ (none fell back)
            n_gram = routes.count("gram")
            assert (st.gram_iterated, st.gram_fallbacks) == ((n_gram, 0) if method == "gram" else (0, 0)), (route, st)
            # owner route: each matrix once to its owner and back, all but the owner's own shard
            owned = [sh for sh, r in zip(shapes, routes) if r == "owner"]
            owners = plan_shards(owned, world, solo_above=None).owners
            want = 2 * sum(sh[0] * sh[1] - shard_sizes(sh[0], world)[o][1] * sh[1] for sh, o in zip(owned, owners))
            sent = torch.tensor([st.owner_elements])
            dist.all_reduce(sent)
            assert int(sent) == want, (route, int(sent), want)
            if route == "auto" and world == 2:  # 101 × 16 rides the Gram (ratio 6.3 > 8·W/4), the rest owners
                assert routes.count("gram") == 2 and gram == 2 * HIDDEN**2, routes
                assert routes.count("owner") == len(shapes) - 2, routes


@STEP
def _check_sgd(mesh):
    """iso=False is torch.optim.SGD(nesterov=True) on the same DTensor params and grads."""
    model, ref_plain = _fsdp_llama(mesh, seed=1)
    other, _ = _fsdp_llama(mesh, seed=1)
    opt = IsoLoCo(model.parameters(), lr=0.7, momentum=0.9, iso=False)
    sgd = torch.optim.SGD(other.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for s in range(3):
        _set_grads(model, ref_plain, s)
        _set_grads(other, ref_plain, s)
        opt.step()
        sgd.step()
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert rel_err(a.to_local(), b.to_local()) <= 1e-6, f"iso=False vs SGD: {name}"
        ba, bb = opt.state[a]["momentum_buffer"], sgd.state[b]["momentum_buffer"]
        assert ba.placements == bb.placements and rel_err(ba.to_local(), bb.to_local()) <= 1e-6, name


@STEP
def _check_tp(mesh):
    """ColwiseParallel / RowwiseParallel MLP (Shard(0) and Shard(1) weights, uneven ffn)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for route in ("auto", "owner", "gather"):
        torch.manual_seed(3)
        mlp = nn.Sequential()
        mlp.add_module("w1", nn.Linear(12, 69))  # 69 × 12: Colwise → Shard(0), 35/34 rows
        mlp.add_module("w2", nn.Linear(69, 12))  # 12 × 69: Rowwise → Shard(1), bias replicated
        ref = copy.deepcopy(mlp)
        parallelize_module(mlp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        places = {n: p.placements for n, p in mlp.named_parameters()}
        assert places["w1.weight"][0].dim == 0 and places["w2.weight"][0].dim == 1
        assert places["w2.bias"][0].is_replicate()
        opt, ref_opt = _step_both(mlp, ref, 3, "svd", route)
        _compare(mlp, ref, opt, ref_opt, f"TP, route {route}")
        want = {"auto": (2 * 12 * 12, 0), "owner": (0, 0), "gather": (0, 2 * 35 * 12 * 2)}[route]
        assert (opt.dtensor_stats.gram_elements, opt.dtensor_stats.gather_elements) == want, opt.dtensor_stats
        assert (opt.dtensor_stats.owner_elements > 0) == (route == "owner")


@contextlib.contextmanager
def _replaced(module, attr: str, text: str, active: bool, call_real: bool = False):
    """module.attr raises RuntimeError(text) while the block runs, where `active` (after running
    the real one, with call_real); restored afterwards."""
    real = getattr(module, attr)

    def broken(*args, **kwargs):
        if call_real:
            real(*args, **kwargs)
        raise RuntimeError(text)

    if active:
        setattr(module, attr, broken)
    try:
        yield
    finally:
        setattr(module, attr, real)


def _fails_everywhere_fast(rank, who, name, step, what, head=""):
    """Replace `name` ("module.function" in isoloco_kernels.distributed, where the step looks it up)
    by one that raises on rank `who` only, run `step` on every rank: each must raise
    DistributedStepError naming that rank within a third of the pg timeout."""
    module, attr = name.rsplit(".", 1)
    mod = importlib.import_module(f"isoloco_kernels.distributed.{module}")
    t0 = time.monotonic()
    with _replaced(mod, attr, f"injected failure in {attr}", rank == who):
        with pytest.raises(DistributedStepError, match=rf"{head}rank {who}: RuntimeError: injected failure in {attr}"):
            step()
    assert time.monotonic() - t0 < PG_TIMEOUT_S / 3, f"{what}: took {time.monotonic() - t0:.1f} s"


def _snapshot(model, opt):
    ps = [p.to_local().clone() for p in model.parameters()]
    bs = [opt.state[p]["momentum_buffer"].to_local().clone() for p in model.parameters()]
    return ps, bs


def _assert_unchanged(model, opt, snap, what):
    ps, bs = snap
    for (name, p), a, b in zip(model.named_parameters(), ps, bs):
        assert torch.equal(p.to_local(), a), f"{what}: {name} changed although the step failed"
        assert torch.equal(opt.state[p]["momentum_buffer"].to_local(), b), f"{what}: {name} momentum changed"


def _stepped_once(mesh):
    """The FSDP2 model and its reference, an IsoLoCo that stepped once (so momentum exists), and a
    snapshot of the params and momentum to compare with after a failed step."""
    model, ref = _fsdp_llama(mesh)
    opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8)
    _set_grads(model, ref, 0)
    opt.step()
    return model, ref, opt, _snapshot(model, opt)


@STEP
def _check_all_or_nothing(mesh, rank):
    model, ref, opt, snap = _stepped_once(mesh)
    _set_grads(model, ref, 1)
    if rank == 1:  # a NaN in rank 1's shard of the embedding only
        model.embed.weight.grad.to_local()[3, 2] = float("nan")
    t0 = time.monotonic()
    with pytest.raises(
        DistributedStepError, match=r"1 of 2 ranks.*rank 1: ValueError: .*\(shape \(101, 16\)\) on rank 1 grad.*NaN"
    ):
        opt.step()
    assert time.monotonic() - t0 < PG_TIMEOUT_S / 3
    _assert_unchanged(model, opt, snap, "NaN on rank 1")
    # a missing grad on one rank: told, not hung
    _set_grads(model, ref, 1)
    if rank == 0:
        model.norm.weight.grad = None
    with pytest.raises(DistributedStepError, match="different sets of grads"):
        opt.step()
    _assert_unchanged(model, opt, snap, "missing grad")
    # a flatten that fails on one rank after the collectives
    _set_grads(model, ref, 1)
    with _replaced(gram_route, "_gram_results", "injected Gram failure", rank == 0, call_real=True):
        with pytest.raises(DistributedStepError, match="rank 0: RuntimeError: injected Gram failure"):
            opt.step()
    _assert_unchanged(model, opt, snap, "failed flatten")
    # an owner whose flatten fails (after the first all-to-all, before the second)
    with _replaced(ops, "flatten_chunked_", "injected owner failure", rank == 1):  # behind outer.bucket_flatten's op
        with pytest.raises(DistributedStepError, match="rank 1: RuntimeError: injected owner failure"):
            opt.step()
    _assert_unchanged(model, opt, snap, "failed owner flatten")
    # an update that would overflow one rank's param shard: refused everywhere before any write
    _set_grads(model, ref, 1)
    if rank == 0:
        model.norm.weight.grad.to_local()[0] = 3e38
    with pytest.raises(DistributedStepError, match="rank 0: ResultOverflowError"):
        opt.step()
    _assert_unchanged(model, opt, snap, "overflow")
    _set_grads(model, ref, 1)
    opt.step()  # and it still works
    assert not torch.equal(model.embed.weight.to_local(), snap[0][0])


@STEP
def _check_dcp(mesh, rank, tmpdir):
    """torch.distributed.checkpoint save/load of the DTensor momentum: bit-exact, same trajectory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, ref = _fsdp_llama(mesh)
    opt = IsoLoCo(model.parameters(), lr=1.8, momentum=0.8)
    for s in range(2):
        _set_grads(model, ref, s)
        opt.step()
    sd = opt.state_dict()
    assert all(isinstance(v["momentum_buffer"], type(p)) for p, v in zip(model.parameters(), sd["state"].values()))
    path = os.path.join(tmpdir, "dcp")
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)

    model2, _ = _fsdp_llama(mesh)  # the same params, a fresh optimizer
    with torch.no_grad():
        for p, p2 in zip(model.parameters(), model2.parameters()):
            p2.to_local().copy_(p.to_local())
    opt2 = IsoLoCo(model2.parameters(), lr=1.8, momentum=0.8)
    want = {"optim": get_optimizer_state_dict(model2, opt2)}  # fills state through a zero step
    dcp.load(want, checkpoint_id=path)
    set_optimizer_state_dict(model2, opt2, want["optim"])
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p.to_local(), p2.to_local()), f"DCP: {name} param changed by the zero step"
        b, b2 = opt.state[p]["momentum_buffer"], opt2.state[p2]["momentum_buffer"]
        assert b2.placements == b.placements and torch.equal(b.to_local(), b2.to_local()), f"DCP: {name}"
    _set_grads(model, ref, 2)
    _set_grads(model2, ref, 2)
    opt.step()
    opt2.step()
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p.to_local(), p2.to_local()), f"DCP: {name} differs after resuming"


@STEP
def _check_plain_state_dict(mesh):
    """A plain (single-process) IsoLoCo or SGD state dict loads into the DTensor optimizer, resharded."""
    makers = {
        "IsoLoCo": lambda ps: IsoLoCo(ps, lr=1.8, momentum=0.8),
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True),
    }
    for kind, make in makers.items():
        model, ref = _fsdp_llama(mesh)
        ref_opt = make(ref.parameters())
        for s in range(2):
            _set_grads(model, ref, s)  # the model's grads are unused: it only takes over the state
            ref_opt.step()
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters()):
                p.to_local().copy_(_distribute_like(r, p).to_local())
        opt = (
            IsoLoCo(model.parameters(), lr=0.7, momentum=0.9, iso=False) if kind == "SGD" else make(model.parameters())
        )
        opt.load_state_dict(ref_opt.state_dict())
        _set_grads(model, ref, 2)
        opt.step()
        ref_opt.step()
        _compare(model, ref, opt, ref_opt, f"plain {kind} state dict, resharded")


def _distribute_like(t, p):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t.detach(), p.device_mesh, p.placements, src_data_rank=None)


@STEP
def _check_refusals(mesh):
    from torch.distributed.tensor import DTensor, Partial

    model, _ = _fsdp_llama(mesh)
    with pytest.raises(TypeError, match="plain tensor"):
        IsoLoCo([*model.parameters(), nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="leave process_group=None"):
        IsoLoCo(model.parameters(), process_group=dist.group.WORLD)
    partial = nn.Parameter(DTensor.from_local(torch.zeros(4, 4), mesh, [Partial()]))
    with pytest.raises(ValueError, match="Partial.*not supported"):
        IsoLoCo([partial])
    opt = IsoLoCo(model.parameters())
    with pytest.raises(ValueError, match="not supported"):
        opt.add_param_group({"params": [partial]})
    assert len(opt.param_groups) == 1
    # ShardedIsoLoCo steps whole replicated tensors: DTensor params are refused at construction on
    # every rank, naming the param and the optimizer to use (they used to fail at step() with
    # torch's "got mixed torch.Tensor and DTensor")
    with pytest.raises(TypeError, match=r"ShardedIsoLoCo: param 0 .*DTensor.*Use IsoLoCo\(model.parameters\(\)\)"):
        ShardedIsoLoCo(model.parameters(), lr=1.0, momentum=0.9)


def _check_general_mesh(mesh, what):
    """Meshes with two dimensions take the general full_tensor() path: same result as single-process."""
    model, ref = _fsdp_llama(mesh)
    opt, ref_opt = _step_both(model, ref, 2, "svd")
    assert all(p.device_mesh.ndim == 2 for p in model.parameters())
    _compare(model, ref, opt, ref_opt, what)
    n2d = sum(p.numel() for p in ref.parameters() if p.ndim == 2)
    assert opt.dtensor_stats.full_tensor_elements == n2d, opt.dtensor_stats


def _check_fsdp_tp(mesh):
    """FSDP over TP on a dp × tp mesh: Colwise weights become _StridedShard × Shard(0); a layer that
    is not tensor-parallel lives on the dp sub-mesh alone (two meshes in one optimizer)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(4)
    mlp = nn.Sequential()
    mlp.add_module("w1", nn.Linear(12, 69))
    mlp.add_module("w2", nn.Linear(69, 12))
    mlp.add_module("w3", nn.Linear(12, 53, bias=False))
    ref = copy.deepcopy(mlp)
    parallelize_module(mlp, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(mlp, mesh=mesh["dp"])
    assert type(mlp.w1.weight.placements[0]).__name__ == "_StridedShard", mlp.w1.weight.placements
    assert mlp.w3.weight.device_mesh.ndim == 1
    opt, ref_opt = _step_both(mlp, ref, 2, "svd")
    _compare(mlp, ref, opt, ref_opt, "FSDP x TP 2x2")


STEP.add("general_mesh", lambda hsdp: _check_general_mesh(hsdp, "HSDP 1x2 (general path)"))
FOUR.add("general_mesh", lambda hsdp: _check_general_mesh(hsdp, "HSDP 2x2"))
FOUR.add("fsdp_tp", lambda dp_tp: _check_fsdp_tp(dp_tp))
FOUR.add("fsdp_matches_single_process", _check_fsdp_matches_single_process)


def _torchft_run(mesh, rank, world, make_outer, lighthouse_addr, store_port, sync_every=2, rounds=2):
    """One replica group of `world` FSDP2 ranks trained by torchft's DiLoCo (Manager + lighthouse on
    localhost); returns (model, outer optimizer, [(params, grads, params after) per outer step])."""
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    model, _ = _fsdp_llama(mesh, seed=7)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = make_outer(model.parameters())
    seen = []
    real_step = outer.step

    def recording_step(*a, **k):  # the outer step's inputs and result, as whole tensors
        before = [(p.full_tensor(), p.grad.full_tensor()) for p in model.parameters()]
        out = real_step(*a, **k)
        seen.append((before, [p.full_tensor() for p in model.parameters()]))
        return out

    outer.step = recording_step
    timeout = timedelta(seconds=15)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        use_async_quorum=False,
        load_state_dict=None,
        state_dict=None,
        replica_id="isoloco_ft_0",
        store_addr="127.0.0.1",
        store_port=store_port,
        rank=rank,
        world_size=world,
        lighthouse_addr=lighthouse_addr,
        port=0,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
            for step in range(sync_every * rounds):
                g = torch.Generator().manual_seed(100 * step + rank)  # each FSDP rank its own batch
                tokens = torch.randint(0, VOCAB, (2, 8), generator=g)
                F.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
                inner.step()
                inner.zero_grad()
    finally:
        manager.shutdown(wait=False)
    return model, outer, seen


@STEP
def _check_torchft(mesh, rank, world):
    """torchft's own DiLoCo over an FSDP2 model with IsoLoCo as the outer optimizer: the outer steps
    equal single-process IsoLoCo on the same whole params and pseudo-gradients; IsoLoCo(iso=False)
    gives the run torch.optim.SGD(nesterov=True) gives."""
    from torchft._torchft import LighthouseServer

    if rank == 0:
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
        # one store per run: a new Manager must not find the previous one's address there
        stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(3)]
        info = [lighthouse.address(), [st.port for st in stores]]
    else:
        info = [None, None]
    dist.broadcast_object_list(info, src=0)
    addr, ports = info
    runs = {}
    try:
        for (name, make), port in zip(
            (
                ("isoloco", lambda ps: IsoLoCo(ps, lr=1.8, momentum=0.8)),
                ("iso_off", lambda ps: IsoLoCo(ps, lr=0.7, momentum=0.9, iso=False)),
                ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)),
            ),
            ports,
        ):
            runs[name] = _torchft_run(mesh, rank, world, make, addr, port)
            dist.barrier()
    finally:
        dist.barrier()
        if rank == 0:
            lighthouse.shutdown()
    model, outer, seen = runs["isoloco"]
    assert len(seen) == 2, f"torchft ran {len(seen)} outer steps, expected 2"
    ref = [nn.Parameter(p.clone()) for p, _ in seen[0][0]]
    ref_opt = IsoLoCo(ref, lr=1.8, momentum=0.8)
    for k, (before, after) in enumerate(seen):
        with torch.no_grad():
            for r, (p, g) in zip(ref, before):
                r.copy_(p)
                r.grad = g.clone()
        assert any(g.norm() > 0 for _, g in before), "torchft handed the outer step zero pseudo-gradients"
        ref_opt.step()
        for (name, _), r, a in zip(model.named_parameters(), ref, after):
            e = rel_err(a, r)
            assert e <= TOL_FP32, f"torchft outer step {k}: {name} differs from single-process IsoLoCo by {e:.3g}"
    for p in model.parameters():
        assert outer.state[p]["momentum_buffer"].placements == p.placements
    (m_off, _, _), (m_sgd, _, _) = runs["iso_off"], runs["sgd"]
    for (name, a), b in zip(m_off.named_parameters(), m_sgd.parameters()):
        e = rel_err(a.to_local(), b.to_local())
        assert e <= 1e-6, f"torchft: IsoLoCo(iso=False) vs SGD(nesterov=True): {name} differs by {e:.3g}"


def _body(rank, world, tmpdir):
    from torch.distributed.device_mesh import init_device_mesh

    if world == 2:
        ctx = dict(
            mesh=init_device_mesh("cpu", (world,)),
            hsdp=init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard")),
        )
        tables = (STEP, FAILURES, RANK_CUT)
    else:
        ctx = dict(
            hsdp=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
            dp_tp=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
            mesh=init_device_mesh("cpu", (world,)),
        )
        tables = (FOUR,)
    for table in tables:
        table.run(tmpdir, rank, rank=rank, world=world, tmpdir=tmpdir, **ctx)


# one spawned group of 2 ranks runs every 2-rank check, one of 4 ranks the 4-rank ones
dtensor_groups = groups(_body, 2, 4, deadline_s=400)


@pytest.mark.parametrize("world, name", params({2: STEP, 4: FOUR}))
def test_dtensor_step(dtensor_groups, world, name):
    dtensor_groups[world].assert_ok(name)


def test_routes_and_bytes():
    """The route rule (bytes per rank), no process group needed (the wire-byte counts of bench/dtensor_bytes.py:
    bench/tests/test_dtensor_bytes.py)."""
    assert shard_sizes(101, 2) == [(0, 51), (51, 50)]
    assert shard_sizes(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)]
    # one matrix's layout: every rank's piece, and a rank's piece of the whole matrix
    lay = ShardLayout((7, 5), 1, 3, 2)
    assert lay.sizes == [(0, 2), (2, 2), (4, 1)] and [lay.numel(r) for r in range(3)] == [14, 14, 7]
    assert lay.piece_shape(0) == (7, 2) and lay.piece_shape(2) == (7, 1)
    whole = torch.arange(35.0).view(7, 5)
    assert torch.equal(lay.piece(whole), whole[:, 4:]) and torch.equal(lay.piece(whole, 1), whole[:, 2:4])
    assert DT.route_for((32000, 1024), 0, 8, 4) == "gram"  # vocab × hidden: the Gram
    assert DT.route_for((1024, 1024), 0, 8, 4) == "owner"  # square: d² float64 > the matrix
    assert DT.route_for((1024, 1024), 0, 8, 4, "gram") == "gram"
    assert DT.route_for((1024, 2688), 0, 8, 4, "gram") == "owner"  # short side sharded: never Gram
    assert DT.route_for((1024, 2688), 0, 8, 4, "gather") == "gather"
    # Gram iff long/short > 16·W/(b + r): b bytes out, r = max(b, 4) back (results in the compute dtype)
    assert (
        DT.route_for((16 * 1024 + 64, 1024), 0, 8, 4) == "gram"
        and DT.route_for((16 * 1024 - 64, 1024), 0, 8, 4) == "owner"
    )
    assert DT.route_for((5 * 1024, 1024), 0, 2, 4) == "gram" and DT.route_for((3 * 1024, 1024), 0, 2, 4) == "owner"
    assert DT.route_for((6 * 1024, 1024), 0, 2, 2) == "gram" and DT.route_for((5 * 1024, 1024), 0, 2, 2) == "owner"
    assert R.owner_bytes((1024, 1024), 0, 2, 2) == 1 / 4 * 1024 * 1024 * (2 + 4)
    assert DT.route_for((7, 5), None, 8, 4) == "local" and DT.route_for((7, 5), 0, 1, 4) == "local"
    # the owner route's owners: plan_shards, largest flatten cost first to the least loaded rank
    assert plan_shards([(4, 4), (8, 8), (2, 2), (8, 8)], 2, solo_above=None).owners == (0, 0, 1, 1)


def test_gram_from_a0_matches_flatten_gram_and_falls_back_deterministically():
    """gram.gram_from_a0 (the Gram route's method "gram") on A₀ alone equals flatten_gram_ on X, in
    both orientations; a rank-deficient A₀ misses the check the same way every time it is asked."""
    from isoloco_kernels.flatten import gram

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 24, 150, generator=g)
    x[1, 4] = 0  # a zero short-side line stays exactly zero
    ref = x.clone()
    gram.flatten_gram_(ref)
    a0 = x.double() @ x.double().mT
    y, sbar, _, ok = gram.gram_from_a0(a0, long_side=150, dtype=torch.float32)
    assert bool(ok.all())
    w = y * sbar[:, None, None]
    wide = (w @ x.double()).float()
    tall = (x.mT.double() @ w.mT).float()  # the Gram route's orientation: shards with the long side down
    assert float((wide - ref).norm() / ref.norm()) <= 1e-5
    assert float((tall - ref.mT).norm() / ref.norm()) <= 1e-5
    assert bool((wide[1, 4] == 0).all())
    x[2, 5] = x[2, 6]  # rank deficient beyond zero lines
    a0 = x.double() @ x.double().mT
    oks = [gram.gram_from_a0(a0.clone(), long_side=150, dtype=torch.float32)[3].tolist() for _ in range(2)]
    assert oks[0] == oks[1] == [True, True, False]


@pytest.mark.parametrize(
    "kind, cond, certified",
    [
        pytest.param("geometric", 1e3, True, id="kappa1e3-certified"),
        # 31 directions at 1e-6·σ_1: above the cut, but the bound (loose by r^¼) cannot show it; the
        # residual check alone passed this one (9e-6 ≤ CHECK_TOL)
        pytest.param("lowrank_noise", 1e6, False, id="noise-floor-1e-6-uncertified"),
        pytest.param("lowrank_noise", 4e6, False, id="noise-floor-below-the-rank-cut"),
    ],
)
def test_gram_from_a0_certifies_the_rank_cut_like_flatten_gram(kind, cond, certified):
    """gram_from_a0 applies flatten_gram_'s bound on the smallest kept direction (σ > τ·σ_1,
    reference.rank_tol) besides the residual: a float32 matrix it cannot certify is refused, so
    the DTensor Gram route sends it to the exact path as flatten_gram_ sends it to the SVD."""
    import warnings

    from isoloco_kernels.flatten import gram

    g = torch.Generator().manual_seed(11)
    x = with_spectrum(1, 32, 200, spectrum(kind, 32, cond), g).float()
    a0 = x.double() @ x.double().mT
    ok = gram.gram_from_a0(a0, long_side=200, dtype=torch.float32)[3]
    gram.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gram.GramFallbackWarning)
        gram.flatten_gram_(x.clone())
    single = not gram.last_stats().recomputed
    assert ok.tolist() == [certified] and single == certified, (ok, gram.last_stats())


# ----------------------------------------------------------------------------------------------
# A failure on one rank between two collectives; load_state_dict refusals

# (case id, what raises on one rank, route): each name is library code the step runs between two
# collectives (or before the first agreement); the rank must still join every collective, so every
# rank raises DistributedStepError within seconds and nothing changes.
# route → {case id: what raises on one rank}: each is library code the step runs between two
# collectives (or before the first agreement); the rank must still join every collective, so every
# rank raises DistributedStepError within seconds and nothing changes.
INJECTIONS = {
    "auto": {"plan-before-agreement": "dtensor._Routes", "nesterov": "dtensor._prepare_nesterov"},
    "gram": {"gram-before-allreduce": "gram_route._gram_into", "gram-after-allreduce": "gram_route._gram_results"},
    "gather": {
        "gather-pack": "collectives.gather_pack",
        "gather-unpack": "collectives.gather_unpack",
        "gather-my-shard": "routes._my_shard",
    },
    "owner": {
        "owner-pack": "collectives._owner_pack",
        "owner-collect": "routes.owner_collect",
        "owner-unpack": "routes.owner_unpack",
        "owner-flatten": "routes._flatten_whole",
        "owner-return-between-all-to-alls": "collectives._owner_pack_results",
        "owner-return": "routes.owner_return",
        "owner-receive": "routes.owner_receive",
    },
}


def _stepped_once_shared(mesh):
    """`_stepped_once`, made once per process for every injected failure (each leaves it unchanged)."""
    if not hasattr(_stepped_once_shared, "made"):
        _stepped_once_shared.made = _stepped_once(mesh)
    return _stepped_once_shared.made


def _check_injected_failure(mesh, rank, case: str, name: str, route: str, who: int):
    model, ref, opt, snap = _stepped_once_shared(mesh)
    opt.dtensor_route = route
    _set_grads(model, ref, 1)
    _fails_everywhere_fast(rank, who, name, opt.step, case, head="1 of 2 ranks.*")
    _assert_unchanged(model, opt, snap, case)


for _k, (_case, _name, _route) in enumerate((c, n, r) for r, cs in INJECTIONS.items() for c, n in cs.items()):
    FAILURES.add(_case, functools.partial(_check_injected_failure, case=_case, name=_name, route=_route, who=_k % 2))


@FAILURES
def _check_closure(mesh, rank):
    """A closure that raises on one rank only; then the optimizer still steps."""
    model, ref, opt, snap = _stepped_once_shared(mesh)
    _set_grads(model, ref, 1)

    def closure():
        if rank == 1:
            raise RuntimeError("injected closure failure")
        return 0.0

    t0 = time.monotonic()
    with pytest.raises(DistributedStepError, match="rank 1: RuntimeError: injected closure failure"):
        opt.step(closure)
    assert time.monotonic() - t0 < PG_TIMEOUT_S / 3
    _assert_unchanged(model, opt, snap, "closure")
    opt.dtensor_route = "auto"
    opt.step()  # and it still works
    assert not torch.equal(model.embed.weight.to_local(), snap[0][0])


@FAILURES
def _check_load_refusals(mesh, rank):
    """A DTensor momentum buffer on another mesh or with other placements or shape, or a buffer that
    is a param: refused by load_state_dict, nothing loaded, the next step runs."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate

    model, ref, opt, _ = _stepped_once(mesh)
    params = list(model.parameters())
    q = next(i for i, (n, _) in enumerate(model.named_parameters()) if n.endswith("0.q.weight"))  # 16 × 16
    k = q + 1  # 0.k.weight, 16 × 16 too
    flipped = DeviceMesh("cpu", list(reversed(range(mesh.size()))))
    cases = {
        "replicate-placement": (lambda b, p: b.redistribute(b.device_mesh, [Replicate()]), "placements"),
        "other-mesh": (lambda b, p: _on_mesh(b, flipped), "placements .* on "),
        "other-shape": (lambda b, p: opt.state[params[0]]["momentum_buffer"], "shape"),
        "own-param": (lambda b, p: p.detach(), "shares memory with its own param"),
        "other-param": (lambda b, p: params[k].detach(), f"shares memory with param {k}"),
    }
    for case, (make, pattern) in cases.items():
        snap = _snapshot(model, opt)
        held = [opt.state[p]["momentum_buffer"] for p in params]
        sd = opt.state_dict()
        sd["state"][q] = {"momentum_buffer": make(sd["state"][q]["momentum_buffer"], params[q])}
        with pytest.raises((ValueError, TypeError), match=pattern):
            opt.load_state_dict(sd)
        assert all(opt.state[p]["momentum_buffer"] is b for p, b in zip(params, held)), f"{case}: state replaced"
        _assert_unchanged(model, opt, snap, case)
    _set_grads(model, ref, 1)
    opt.step()  # the refused loads left a working optimizer
    assert not torch.equal(params[q].to_local(), snap[0][q])


def _on_mesh(b, mesh):
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(b.to_local().clone(), mesh, b.placements, shape=b.shape, stride=b.stride())


@pytest.mark.parametrize("name", list(FAILURES))
def test_dtensor_failures_two_ranks(dtensor_groups, name):
    """Every INJECTIONS case, a closure failing on one rank and the load refusals."""
    dtensor_groups[2].assert_ok(name)


@pytest.mark.parametrize(
    "make, pattern",
    [
        pytest.param(lambda ps, st: ps[0].detach(), "param 0 .* shares memory with its own param", id="own-param"),
        pytest.param(lambda ps, st: ps[1].detach(), "param 0 .* shares memory with param 1", id="other-param"),
        pytest.param(lambda ps, st: ps[0].detach()[:], "shares memory with its own param", id="view-of-param"),
        pytest.param(lambda ps, st: st[1], "param 0 .* shares memory with param 2", id="inside-another-param"),
        pytest.param(lambda ps, st: st[3], None, id="beside-a-param-is-fine"),
    ],
)
def test_load_refuses_buffer_sharing_param_memory(make, pattern):
    """A plain optimizer too: a buffer that is (a view of) a param would make every step refuse;
    a buffer in the same storage as a param but on none of its elements loads."""
    stack = torch.randn(4, 4, 5)
    ps = [nn.Parameter(torch.randn(4, 5)) for _ in range(2)] + [nn.Parameter(stack[:2])]  # param 2: stack[0:2]
    assert ps[2].untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    opt = IsoLoCo(ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    held = [opt.state[p]["momentum_buffer"] for p in ps]
    before = [h.clone() for h in held]
    sd = opt.state_dict()
    sd["state"][0] = {"momentum_buffer": make(ps, stack)}
    if pattern is None:
        opt.load_state_dict(sd)
        assert opt.state[ps[0]]["momentum_buffer"].data_ptr() == stack[3].data_ptr()
        opt.step()
        return
    with pytest.raises(ValueError, match=pattern):
        opt.load_state_dict(sd)
    assert all(opt.state[p]["momentum_buffer"] is h and torch.equal(h, b) for p, h, b in zip(ps, held, before))
    opt.step()


# ----------------------------------------------------------------------------------------------
# The Gram route against reference.py where A₀ cannot resolve the spectrum (the rank cut)


# (case id, dtype, spectrum builder): a tall (400×128, Shard(0)) and a wide (128×400, Shard(1))
# matrix per case, both on the Gram route (long side sharded), every method.
def _rank_cut_grads(case):
    g = torch.Generator().manual_seed(21)
    kind, dtype = case.split(":")
    dtype = getattr(torch, dtype)
    out = []
    for m, n in ((400, 128), (128, 400)):
        if kind == "rank-deficient":
            s = spectrum("geometric", 128, 1e2)
            s[64:] = 0  # rank 64, formed in float64 and rounded to the dtype
        else:
            s = spectrum("geometric", 128, float(kind.removeprefix("kappa")))
        out.append(with_spectrum(1, m, n, s, g)[0].to(dtype))
    return out


RANK_CUT_CASES = [
    "kappa1e6:float32",
    "kappa2e6:float32",
    "rank-deficient:float32",
    "kappa1e8:float64",
    "rank-deficient:float64",
]
RANK_CUT_METHODS = ("svd", "eigh", "auto", "gram")


def _check_rank_cut_case(mesh, case):
    """One step on the Gram route: the Iso-C update (the first momentum buffer) == reference.py,
    as single-process IsoLoCo's is, for every method."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from isoloco_kernels.reference import iso_flatten_ref

    grads = _rank_cut_grads(case)
    dtype = grads[0].dtype
    # U_r V_rᵀ moves by ~eps64·κ between two float64 SVDs of one matrix (different LAPACK paths)
    cond = 1e2 if case.startswith("rank-deficient") else float(case.split(":")[0].removeprefix("kappa"))
    tol = TOL[("exact", dtype)] + 64 * torch.finfo(torch.float64).eps * cond
    for method in RANK_CUT_METHODS:
        params, ref = [], []
        for dim, gr in enumerate(grads):
            p = nn.Parameter(distribute_tensor(torch.zeros_like(gr), mesh, [Shard(dim)], src_data_rank=None))
            p.grad = distribute_tensor(gr, mesh, [Shard(dim)], src_data_rank=None)
            params.append(p)
            r = nn.Parameter(torch.zeros_like(gr))
            r.grad = gr.clone()
            ref.append(r)
        opt = IsoLoCo(params, lr=1.0, momentum=0.5, method=method)
        opt.dtensor_route = "gram"
        ref_opt = IsoLoCo(ref, lr=1.0, momentum=0.5, method=method)
        opt.step()
        ref_opt.step()
        st = opt.dtensor_stats
        assert st.gram_elements == 2 * 128**2, (case, method, st)
        for i, (p, r, gr) in enumerate(zip(params, ref, grads)):
            want = iso_flatten_ref(gr)
            single = rel_err(ref_opt.state[r]["momentum_buffer"], want)
            got = rel_err(opt.state[p]["momentum_buffer"].full_tensor(), want)
            what = f"{case}, method {method}, {tuple(gr.shape)} Shard({i})"
            assert single <= tol, f"{what}: single-process IsoLoCo differs from reference.py by {single:.3g}"
            assert got <= tol, (
                f"{what}: the DTensor Gram route differs from reference.py by {got:.3g} "
                f"(single-process: {single:.3g}; {st.gram_exact} exact, {st.gram_iterated} iterated)"
            )
        if case.startswith("rank-deficient") or dtype == torch.float64 or method != "gram":
            # what A₀ cannot resolve went to the exact path (eigh at κ ≥ 1e5, rank deficiency, float64 ≥ 1e3)
            assert st.gram_exact == 2 and st.gram_iterated == 0, (case, method, st)


for _case in RANK_CUT_CASES:
    RANK_CUT.add(_case.replace(":", "-"), functools.partial(_check_rank_cut_case, case=_case))


@RANK_CUT
def _check_exact_path_failures(mesh, rank):
    """A failure on one rank around the Gram route's exact path: that rank flags nothing (its A₀
    results are gone) or packs nothing, yet joins the agreed all-gather; every rank raises
    DistributedStepError within seconds, nothing changed."""
    from torch.distributed.tensor import Shard, distribute_tensor

    grads = _rank_cut_grads("rank-deficient:float32")
    params = [
        nn.Parameter(distribute_tensor(torch.ones_like(gr), mesh, [Shard(d)], src_data_rank=None))
        for d, gr in enumerate(grads)
    ]
    opt = IsoLoCo(params, lr=1.0, momentum=0.5)
    opt.dtensor_route = "gram"
    for k, name in enumerate(
        ("gram_route._gram_results", "collectives.gather_pack", "collectives.gather_unpack", "routes._flatten_whole")
    ):
        who = k % 2
        for d, (p, gr) in enumerate(zip(params, grads)):
            p.grad = distribute_tensor(gr, mesh, [Shard(d)], src_data_rank=None)
        before = [p.to_local().clone() for p in params]
        _fails_everywhere_fast(rank, who, name, opt.step, name)
        assert all(torch.equal(p.to_local(), b) for p, b in zip(params, before)) and not opt.state, name
    opt.step()  # and it still works, through the exact path
    assert opt.dtensor_stats.gram_exact == 2, opt.dtensor_stats


@pytest.mark.parametrize("case", [pytest.param(c, id=c.replace(":", "-")) for c in RANK_CUT_CASES])
def test_gram_route_rank_cut_matches_reference(dtensor_groups, case):
    """Gram-route matrices (2 gloo ranks, both orientations) that A₀ cannot resolve — κ 1e6 and
    2e6 in float32, rank-deficient, float64 at κ 1e8 — give reference.py's result for svd, eigh,
    auto and gram, as single-process IsoLoCo does (the exact path), not an older rank cut's."""
    dtensor_groups[2].assert_ok(case.replace(":", "-"))


def test_gram_route_exact_path_failure_on_one_rank(dtensor_groups):
    """A failure on one rank before or inside the Gram route's exact path fails every rank quickly,
    nothing changed (the failed rank still joins the agreed all-gather)."""
    dtensor_groups[2].assert_ok("exact_path_failures")
