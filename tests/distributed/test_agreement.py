"""Ranks that disagree, or fail alone, fail together: gloo groups of 2 and 3 spawned ranks.

Every case sets one thing differently on the last rank (a setting, or an argument that rank
alone refuses) and asserts, on every rank, DistributedStepError naming what differs and which
ranks hold which value, within a few seconds, with no tensor changed. The process group timeout
is short, so a regression (a rank left waiting in a collective) fails fast instead of hanging.

The last part runs every collective of the package under a stand-in for NCCL's rule (tensors
must live on the group's communication device), which gloo does not enforce.
"""

from __future__ import annotations

import re
import sys
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import isoloco_kernels  # noqa: F401  (registers the ops in spawned workers too)
from isoloco_kernels import IsoLoCo
from isoloco_kernels import distributed as D
from isoloco_kernels.distributed import agree as A
from tests.distributed.test_distributed import _model, _pseudo_grads
from tests.spawn import Checks, groups, spawn

pytestmark = [
    pytest.mark.slow,  # spawns gloo ranks
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available"),
]

PG_TIMEOUT_S = 12  # a collective left waiting fails its rank after this
FAST_S = 6  # every rank must raise within this (half the timeout: nobody waited for it)
SHAPES = [(8, 6), (6, 8), (5,), (3, 4)]  # row counts shard over 2 and 3 ranks (DTensor cases)


# ----------------------------------------------------------------------------------------------
# The cases: fn(rank, world, odd) runs on every rank; `odd` is the rank that differs.

CASES = Checks()


def _case(fn):
    return CASES.add(fn.__name__.removeprefix("_case_"), fn)


def _differs(key: str, common: str, other: str, world: int) -> str:
    """The regex of agree's report that `key` is `common` on every rank but the last, `other` there."""
    ranks = ", ".join(str(r) for r in range(world - 1))
    return (
        re.escape(f"{key}: {common} on rank{'s' if world > 2 else ''} {ranks}, {other} on rank {world - 1}") + r"(;|$)"
    )


def _failed_on_last(world: int, text: str) -> str:
    return rf"failed on 1 of {world} ranks.*rank {world - 1}: {text}"


def _refused_on_last(rank, world, odd, fn, text, tensors):
    """A constructor refused on the last rank only: that rank raises its own ValueError (after the
    agreement), every other rank DistributedStepError naming it."""
    if rank == odd:
        _fails_together(fn, text, tensors, kind=ValueError)
    else:
        _fails_together(fn, _failed_on_last(world, "ValueError: " + text), tensors)


def _snapshot(opt, tensors):
    out = [t.detach().clone() for t in tensors]
    if opt is not None:
        from isoloco_kernels._validate import local  # a DTensor's local shard: compared without collectives

        out += [local(st["momentum_buffer"]).detach().clone() for st in opt.state.values() if "momentum_buffer" in st]
    return out


def _fails_together(fn, match: str, tensors=(), opt=None, kind=D.DistributedStepError):
    """fn() raises `kind` matching `match` on this rank within FAST_S seconds, and `tensors` (and
    opt's momentum buffers) are bit-identical afterwards."""
    before = _snapshot(opt, tensors)
    t0 = time.monotonic()
    with pytest.raises(kind) as info:
        fn()
    took = time.monotonic() - t0
    assert took < FAST_S, f"DistributedStepError only after {took:.1f} s"
    assert re.search(match, str(info.value)), f"{match!r} not found in: {info.value}"
    after = _snapshot(opt, tensors)
    assert len(after) == len(before), "the momentum state changed"
    for i, (a, b) in enumerate(zip(after, before)):
        assert torch.equal(a, b), f"tensor {i} changed although the call failed"


def _grads_in(params, rank, step=0):
    for p, g in zip(params, _pseudo_grads([tuple(p.shape) for p in params], params[0].dtype, rank, step)):
        p.grad = g


def _stepped_sharded(rank, **kw):
    """A ShardedIsoLoCo after one good step (momentum held), with fresh grads in place."""
    params = _model(SHAPES, torch.float32)
    opt = D.ShardedIsoLoCo(params, lr=1.8, momentum=0.8, **kw)
    _grads_in(params, rank, 0)
    opt.step()
    _grads_in(params, rank, 1)
    return params, opt


# -- the settings each outer optimizer compares --------------------------------------------------
# The ranks compare the same hyper-parameters at construction and at every step, whatever the
# entry point: name → (the keyword set on the odd rank, the setting's name in the report, its
# value on the other ranks, its value there).
SETTINGS = {
    "lr": ({"lr": 0.7}, "param_groups[0]['lr']", "1.8", "0.7"),
    "momentum": ({"momentum": 0.5}, "param_groups[0]['momentum']", "0.8", "0.5"),
    "iso": ({"iso": False}, "param_groups[0]['iso']", "True", "False"),
    "method": ({"method": "svd"}, "method", "'auto'", "'svd'"),
}


def _changed(kw: dict):
    """The change of a step-time case: the setting of `kw` changed on the optimizer (its group, or the
    optimizer's own attribute for method and the chunk sizes)."""
    ((key, value),) = kw.items()
    return lambda o: o.param_groups[0].update(kw) if key in o.defaults else setattr(o, key, value)


# -- ShardedIsoLoCo: construction ---------------------------------------------------------------


def _sharded_init(odd_kw, key, common, other):
    def case(rank, world, odd):
        params = _model(SHAPES, torch.float32)
        kw = odd_kw if rank == odd else {}
        _fails_together(lambda: D.ShardedIsoLoCo(params, **kw), _differs(key, common, other, world), params)

    return case


@_case
def _case_sharded_init_lr_nan(rank, world, odd):
    params = _model(SHAPES, torch.float32)
    lr = float("nan") if rank == odd else 1.8
    _refused_on_last(rank, world, odd, lambda: D.ShardedIsoLoCo(params, lr=lr), ".*learning rate", params)


@_case
def _case_sharded_init_method_bogus(rank, world, odd):
    params = _model(SHAPES, torch.float32)
    method = "bogus" if rank == odd else "auto"
    _refused_on_last(
        rank,
        world,
        odd,
        lambda: D.ShardedIsoLoCo(params, method=method),
        "ShardedIsoLoCo: method must be one of .*'bogus'",
        params,
    )


# -- ShardedIsoLoCo: a setting changed on one rank between steps ----------------------------------


def _sharded_step(odd_kw, key, common, other):
    def case(rank, world, odd):
        params, opt = _stepped_sharded(rank)
        if rank == odd:
            _changed(odd_kw)(opt)
        _fails_together(opt.step, _differs(key, common, other, world), params + [p.grad for p in params], opt)

    return case


@_case
def _case_sharded_add_param_group(rank, world, odd):
    """A group added after construction is refused (the shard plan is fixed), nothing changed,
    and the optimizer still steps."""
    params, opt = _stepped_sharded(rank)
    extra = torch.randn(4, 4)
    with pytest.raises(ValueError, match="fixed at construction"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


# -- ShardedIsoLoCo: replicas whose params differ ------------------------------------------------------


def _params_differ(how: str, compress=None):
    """The last rank's params are not the others' when step() is called: refused on every rank, naming the
    first param that differs and the ranks holding each version, saying what to do; nothing changed."""

    def case(rank, world, odd):
        params, opt = _stepped_sharded(rank, compress=compress)
        if rank == odd:
            with torch.no_grad():
                if how == "forgot to restore":  # this rank's local weights, after its inner steps
                    params[2].add_(0.01)
                    params[3].mul_(0.5)
                elif how == "one ulp":
                    params[2][1] = torch.nextafter(params[2][1], torch.tensor(float("inf")))
                else:  # another seed: every param
                    for p in params:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(99)))
        first, others = {"forgot to restore": (2, 1), "one ulp": (2, 0), "seed": (0, len(SHAPES) - 1)}[how]
        more = f"; {others} more of the {len(SHAPES)} params differ too" if others else ""
        versions = f"rank{'s' if world > 2 else ''} {', '.join(map(str, range(world - 1)))} hold"
        versions += f"{'' if world > 2 else 's'} one version, rank {world - 1} holds another"
        want = (
            re.escape(
                f"ShardedIsoLoCo.step: the ranks' params differ, nothing was changed on any rank: param {first} "
                f"(shape {SHAPES[first]}) is the first that differs ({versions}){more}. "
            )
            + "ShardedIsoLoCo steps replicas: .*Restore the global weights on every rank before step"
        )
        _fails_together(opt.step, want, params + [p.grad for p in params], opt)
        for p, q in zip(params, _model(SHAPES, torch.float32)):  # the same weights on every rank: it steps
            p.data.copy_(q)
        opt.step()

    return case


for _how in ("forgot to restore", "one ulp", "seed"):
    for _c in (None, "int4"):
        CASES[f"sharded_params_differ_{_how.replace(' ', '_')}{'_int4' if _c else ''}"] = _params_differ(_how, _c)


# -- sharded_iso_merge_ ---------------------------------------------------------------------------


def _buckets():
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 6, 5, generator=g), torch.randn(40, 7, generator=g), torch.randn(3, 3, generator=g)]


def _merge(odd_kw, match):
    def case(rank, world, odd):
        bk = _buckets()
        kw = odd_kw if rank == odd else {}
        _fails_together(lambda: D.sharded_iso_merge_(bk, **kw), match(world), bk)

    return case


CASES["merge_method"] = _merge({"method": "svd"}, lambda w: _differs("method", "'auto'", "'svd'", w))
CASES["merge_chunk_bytes"] = _merge(
    {"chunk_bytes": 64}, lambda w: _differs("chunk_bytes", str(D.collectives.CHUNK_BYTES), "64", w)
)
CASES["merge_solo_above"] = _merge({"solo_above": None}, lambda w: _differs("solo_above", "1.0", "None", w))
CASES["merge_method_bogus"] = _merge(
    {"method": "bogus"}, lambda w: _failed_on_last(w, "ValueError: method must be one of")
)
CASES["merge_chunk_bytes_zero"] = _merge({"chunk_bytes": 0}, lambda w: _failed_on_last(w, "ValueError: .*chunk_bytes"))


# -- IsoLoCo(process_group=...) ---------------------------------------------------------------------


def _pg_init(odd_kw, key=None, common=None, other=None, refused=None):
    def case(rank, world, odd):
        params = _model(SHAPES, torch.float32)
        kw = odd_kw if rank == odd else {}
        make = lambda: IsoLoCo(params, process_group=dist.group.WORLD, **kw)  # noqa: E731
        if refused:
            _refused_on_last(rank, world, odd, make, refused, params)
        else:
            _fails_together(make, _differs(key, common, other, world), params)

    return case


CASES["pg_init_method_bogus"] = _pg_init({"method": "bogus"}, refused="IsoLoCo: method must be one of")
CASES["pg_init_lr_inf"] = _pg_init({"lr": float("inf")}, refused=".*learning rate")


def _pg_step(odd_kw, key, common, other):
    def case(rank, world, odd):
        params = _model(SHAPES, torch.float32)
        opt = IsoLoCo(params, lr=1.8, momentum=0.8, process_group=dist.group.WORLD)
        for step in range(2):  # grads already averaged: equal on every rank
            _grads_in(params, 0, step)
            if step == 1:
                if rank == odd:
                    _changed(odd_kw)(opt)
                _fails_together(opt.step, _differs(key, common, other, world), params + [p.grad for p in params], opt)
            else:
                opt.step()

    return case


# -- average_ ---------------------------------------------------------------------------------------


@_case
def _case_average_chunk_bytes(rank, world, odd):
    xs = [torch.randn(300), torch.randn(20, 7)]
    cb = 64 if rank == odd else 1 << 20
    _fails_together(lambda: D.average_(xs, chunk_bytes=cb), _differs("chunk_bytes", str(1 << 20), "64", world), xs)


# -- the DTensor step (a 1-D mesh of every rank, params sharded by rows) ------------------------


def _mesh(world):
    from torch.distributed.device_mesh import init_device_mesh

    if not hasattr(_mesh, "made"):
        _mesh.made = init_device_mesh("cpu", (world,))
    return _mesh.made


def _dtensor_opt(rank, world, **kw):
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    params = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in _model(SHAPES, torch.float32)]
    for p, g in zip(params, _pseudo_grads(SHAPES, torch.float32, 0, 0)):
        p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
    return params, IsoLoCo(params, **kw)


def _dtensor_watch(params, grads=True):
    from isoloco_kernels._validate import local

    return [local(p) for p in params] + ([local(p.grad) for p in params] if grads else [])


def _dtensor_init(odd_kw, key=None, common=None, other=None, refused=None):
    """IsoLoCo on DTensor params built differently on one rank: the ranks agree over the mesh."""

    def case(rank, world, odd):
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = _mesh(world)
        params = [distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for t in _model(SHAPES, torch.float32)]
        make = lambda: IsoLoCo(params, **(odd_kw if rank == odd else {}))  # noqa: E731
        if refused:
            _refused_on_last(rank, world, odd, make, refused, _dtensor_watch(params, grads=False))
        else:
            _fails_together(make, _differs(key, common, other, world), _dtensor_watch(params, grads=False))

    return case


CASES["dtensor_init_lr_nan"] = _dtensor_init({"lr": float("nan")}, refused=".*learning rate")


def _dtensor_step(odd_kw, key, common, other):
    """A setting changed on one rank after construction: the DTensor step's first agreement."""

    def case(rank, world, odd):
        params, opt = _dtensor_opt(rank, world)
        if rank == odd:
            _changed(odd_kw)(opt)
        _fails_together(opt.step, _differs(key, common, other, world), _dtensor_watch(params), opt)

    return case


# every entry point compares every setting of SETTINGS, at construction and at a step; ShardedIsoLoCo
# its chunk size and solo_above too, the DTensor step its route
for _kind, _init, _step in (
    ("sharded", _sharded_init, _sharded_step),
    ("pg", _pg_init, _pg_step),
    ("dtensor", _dtensor_init, _dtensor_step),
):
    for _name, _setting in SETTINGS.items():
        CASES[f"{_kind}_init_{_name}"] = _init(*_setting)
        CASES[f"{_kind}_step_{_name}"] = _step(*_setting)
_common = str(D.collectives.CHUNK_BYTES)
CASES["sharded_init_chunk_bytes"] = _sharded_init({"chunk_bytes": 4096}, "chunk_bytes", _common, "4096")
CASES["sharded_step_chunk_bytes"] = _sharded_step({"chunk_bytes": 64}, "chunk_bytes", _common, "64")
CASES["sharded_init_solo_above"] = _sharded_init({"solo_above": None}, "solo_above", "1.0", "None")
CASES["dtensor_step_route"] = _dtensor_step({"dtensor_route": "gather"}, "dtensor_route", "'auto'", "'gather'")


@_case
def _case_dtensor_closure_raises(rank, world, odd):
    params, opt = _dtensor_opt(rank, world)

    def closure():
        if rank == odd:
            raise RuntimeError("no loss on this rank")
        return 0.0

    _fails_together(
        lambda: opt.step(closure),
        _failed_on_last(world, "RuntimeError: no loss on this rank"),
        _dtensor_watch(params),
        opt,
    )


# ----------------------------------------------------------------------------------------------
# One spawned group per world size runs every case; each case is reported as its own test.


def _warm_up(rank):
    """First uses (kernels, dispatch, gloo's pairs) cost seconds on a busy machine: pay them
    before the cases are timed."""
    params, opt = _stepped_sharded(rank)
    opt.step()
    D.sharded_iso_merge_(_buckets())
    with pytest.raises(D.DistributedStepError):
        A.agree("warming up" if rank == 0 else None, None, "warm-up")


def _body(rank, world, tmpdir):
    _warm_up(rank)  # and every rank started: the cases time the library, not the spawn
    CASES.run(tmpdir, rank, rank, world, world - 1)


agreement_groups = groups(_body, 2, 3, pg_timeout_s=PG_TIMEOUT_S)  # one spawned group per world size


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in CASES])
@pytest.mark.parametrize("world", [pytest.param(2, id="2ranks"), pytest.param(3, id="3ranks")])
def test_disagreement_fails_every_rank(agreement_groups, world, name):
    """One rank set differently: DistributedStepError on every rank, fast, naming it; nothing changed."""
    agreement_groups[world].assert_ok(name)


# ----------------------------------------------------------------------------------------------
# NCCL's rule without NCCL: every tensor the package hands to a collective lives on the device
# `agree.comm_device(group)` decides (NCCL refuses CPU tensors; gloo takes anything).


def test_comm_device_is_decided_by_the_backend(monkeypatch):
    """NCCL (alone or beside gloo) → this process's CUDA device (the group's bound one first);
    anything else → the CPU. Nothing about the tensors a rank holds enters the decision."""

    class Group:
        bound_device_id = None

    g = Group()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, want in (("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cuda:3"), ("gloo", "cpu"), ("mpi", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert A.comm_device(g) == torch.device(want), backend
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    g.bound_device_id = torch.device("cuda", 1)
    assert A.comm_device(g) == torch.device("cuda", 1)
    # tensors handed over in place must be there: a CPU param on NCCL is refused by name
    with pytest.raises(ValueError, match=r"param 3 is on cpu, but the process group \(nccl\) communicates on cuda:1"):
        A.check_on_comm_device([torch.zeros(2)], ["param 3"], g)


class NcclRule:
    """A stand-in for NCCL's device rule on gloo.

    `comm_device` is replaced by one that answers with one particular device object (`answer`,
    normally `self.device`); the factories the package makes its buffers with (`torch.empty`,
    `torch.zeros`, `torch.tensor`) record the storages made with exactly that object, and
    `check_on_comm_device` records the tensors it accepted (user memory handed over in place). Every
    collective called from inside the package must then get only recorded tensors: a tensor made
    on a device taken from anywhere else (a default CPU tensor, the data's device, "the CPU when
    this rank holds nothing") is a violation, although gloo would carry it. Object collectives
    (which pick their own device) are violations too. The DTensor step's data collectives (the Gram
    all-reduce and its exact path, the owner all-to-alls, the gathers) are held to the same rule.
    `calls` counts the collectives by name, `by_caller` by (calling module.function, name).
    """

    TENSOR_COLLECTIVES = (
        "all_reduce",
        "broadcast",
        "reduce",
        "all_to_all_single",
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "gather",
        "scatter",
    )
    OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")

    def __init__(self):
        self.device = torch.device("cpu")  # the decision: this object, and no equal one
        self.answer = self.device
        self.made: dict[int, weakref.ref] = {}  # storage address → the live tensor made there
        self.calls: dict[str, int] = {}
        self.by_caller: dict[tuple[str, str], int] = {}
        self.violations: list[str] = []

    def _record(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.made[t.untyped_storage().data_ptr()] = weakref.ref(t)

    def _was_made(self, t) -> bool:
        """t's memory belongs to a live tensor made on the decided device (a freed address that an
        unrecorded tensor reuses does not count)."""
        ptr = t.untyped_storage().data_ptr()
        r = self.made.get(ptr)
        return r is not None and r() is not None and r().untyped_storage().data_ptr() == ptr

    def install(self) -> None:
        import isoloco_kernels.distributed.dtensor  # noqa: F401  (its aliases are patched too)

        mods = [m for n, m in sys.modules.items() if n.startswith("isoloco_kernels") and m is not None]
        A._CONTROL.__dict__.clear()  # the agreements' control tensors are made again, under the rule

        def patch_everywhere(original, replacement, extra=()):
            for owner in [*mods, *extra]:
                for k, v in list(vars(owner).items()):
                    if v is original:
                        setattr(owner, k, replacement)

        patch_everywhere(A.comm_device, lambda group=None: self.answer)
        real_check = A.check_on_comm_device

        def check(tensors, names, group):
            tensors = list(tensors)
            real_check(tensors, names, group)
            self._record(tensors)

        patch_everywhere(real_check, check)
        for name in ("empty", "zeros", "tensor"):
            real = getattr(torch, name)

            def factory(*args, _real=real, **kwargs):
                out = _real(*args, **kwargs)
                if kwargs.get("device") is self.device:
                    self._record([out])
                return out

            setattr(torch, name, factory)
        for name in self.TENSOR_COLLECTIVES + self.OBJECT_COLLECTIVES:
            real = getattr(dist, name, None)
            if real is not None:
                patch_everywhere(real, self._wrap(name, real), extra=[dist, dist.distributed_c10d])

    def _wrap(self, name, real):
        def collective(*args, **kwargs):
            frame = sys._getframe(1)
            caller = f"{frame.f_globals.get('__name__', '')}.{frame.f_code.co_name}"
            if caller.startswith("isoloco_kernels"):
                self.calls[name] = self.calls.get(name, 0) + 1
                self.by_caller[caller, name] = self.by_caller.get((caller, name), 0) + 1
                self.check(name, caller, [*args, *kwargs.values()])
            return real(*args, **kwargs)

        return collective

    def check(self, name, caller, args) -> None:
        if name in self.OBJECT_COLLECTIVES:
            self.violations.append(f"{caller}: {name} (an object collective picks its own device)")
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
        for t in tensors:
            where = f"{caller}: {name} got a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
            if t.device != self.device:
                self.violations.append(f"{where}, not on the communication device")
            elif not self._was_made(t):
                self.violations.append(f"{where}, not made on the device comm_device decided")


def _every_collective(rank, world, rule):
    """Every collective path of the package, good and failing, once or more."""
    from torch.distributed.tensor import Shard, distribute_tensor

    nan_on_last = lambda t: t.view(-1)[0].fill_(float("nan")) if rank == world - 1 else None  # noqa: E731
    # agree and agree_on_mesh, agreeing and not (the failure texts travel by gather_objects)
    A.agree(None, None, "agree", settings={"x": "1"})
    with pytest.raises(D.DistributedStepError):
        A.agree(None, None, "agree", settings={"x": str(rank)})
    mesh = _mesh(world)
    A.agree_on_mesh(None, mesh, "agree_on_mesh", fp=5)
    with pytest.raises(D.DistributedStepError):
        A.agree_on_mesh("bad" if rank == 0 else None, mesh, "agree_on_mesh")
    # average_: several buckets, mixed dtypes, a non-contiguous tensor; then a NaN on one rank
    xs = [torch.randn(40, 3).mT, torch.randn(50), torch.randn(7, dtype=torch.float64)]
    D.average_(xs, chunk_bytes=64)
    nan_on_last(xs[1])
    with pytest.raises(D.DistributedStepError):
        D.average_(xs)
    # ShardedIsoLoCo: segments in tiny chunks, solo tensors (one non-contiguous), then a NaN
    params = _model(SHAPES + [(30, 20)], torch.float32)
    params[-1] = params[-1].mT.contiguous().mT
    for solo in (None, 0.2):
        opt = D.ShardedIsoLoCo(params, chunk_bytes=96, solo_above=solo)
        assert solo is None or opt.plan.solo
        for step in range(2):
            _grads_in(params, rank, step)
            opt.step()
    nan_on_last(params[0].grad)
    with pytest.raises(D.DistributedStepError):
        opt.step()
    # sharded_iso_merge_: segments, solo, non-contiguous, then a NaN
    for solo in (None, 0.2):
        bk = _buckets() + [torch.randn(9, 30).mT]
        D.sharded_iso_merge_(bk, solo_above=solo, chunk_bytes=128)
    nan_on_last(bk[0])
    with pytest.raises(D.DistributedStepError):
        D.sharded_iso_merge_(bk)
    # IsoLoCo(process_group=...): a step, then a NaN grad on one rank (that rank holds no entries)
    params = _model(SHAPES, torch.float32)
    opt = IsoLoCo(params, process_group=dist.group.WORLD)
    _grads_in(params, 0)
    opt.step()
    nan_on_last(params[1].grad)
    with pytest.raises(D.DistributedStepError):
        opt.step()
    # the DTensor step on every route, then a NaN grad and a raising closure on one rank
    for route in ("gram", "owner", "gather"):
        ps, opt = _dtensor_opt(rank, world)
        opt.dtensor_route = route
        opt.step()
    # the Gram route's exact path (agreed flags, then an all-gather): a rank-one grad
    ps, opt = _dtensor_opt(rank, world)
    opt.dtensor_route = "gram"
    low = torch.outer(torch.arange(1.0, 9.0), torch.arange(1.0, 7.0))  # 8 × 6
    ps[0].grad = distribute_tensor(low, mesh, [Shard(0)], src_data_rank=None)
    opt.step()
    assert opt.dtensor_stats.gram_exact >= 1, opt.dtensor_stats
    from isoloco_kernels._validate import local

    nan_on_last(local(ps[0].grad))
    with pytest.raises(D.DistributedStepError):
        opt.step()
    for p, g in zip(ps, _pseudo_grads(SHAPES, torch.float32, 0, 0)):
        p.grad = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)

    def closure():
        if rank == world - 1:
            raise RuntimeError("no loss")
        return 0.0

    with pytest.raises(D.DistributedStepError):
        opt.step(closure)
    # constructors that disagree
    with pytest.raises(D.DistributedStepError):
        D.ShardedIsoLoCo(_model(SHAPES, torch.float32), lr=1.0 + rank)
    with pytest.raises(D.DistributedStepError):
        IsoLoCo(_model(SHAPES, torch.float32), lr=1.0 + rank, process_group=dist.group.WORLD)


def _body_nccl_rule(rank, world, tmpdir):
    rule = NcclRule()
    rule.install()
    _every_collective(rank, world, rule)
    assert not rule.violations, "\n".join(rule.violations[:20])
    for name in ("all_reduce", "reduce_scatter", "all_gather", "reduce", "broadcast", "all_to_all_single"):
        assert any(k.startswith(name) for k in rule.calls), f"no {name} ran under the stand-in: {rule.calls}"
    # the DTensor step's data collectives ran under the rule: the Gram all-reduce and the exact
    # path's flags (gram_route.py), the gathers and the owner all-to-alls of shards (collectives.py)
    dtensor_callers = (
        "distributed.gram_route.gram_route",
        "distributed.gram_route.agree_exact",
        "distributed.collectives.all_gather_shards",
        "distributed.collectives.owner_exchange",
    )
    dt: dict[str, int] = {}
    for (caller, name), n in rule.by_caller.items():
        if caller.endswith(dtensor_callers):
            dt[name] = dt.get(name, 0) + n
    assert dt.get("all_reduce", 0) >= 2 and dt.get("all_to_all_single", 0) >= 2, dt
    assert any(name.startswith("all_gather") for name in dt), dt
    # the stand-in refuses what NCCL would: a control tensor made on a device decided elsewhere
    rule.answer = torch.device("cpu")  # equal to the decision, but not the decision
    A._CONTROL.__dict__.clear()  # (control tensors are made once and reused: make them again)
    A.agree(None, None, "stand-in check")
    rule.answer = rule.device
    assert rule.violations and all("not made on the device comm_device decided" in v for v in rule.violations), (
        rule.violations
    )


@pytest.mark.parametrize("world", [pytest.param(2, id="2ranks"), pytest.param(3, id="3ranks")])
def test_every_collective_follows_nccl_device_rule(tmp_path, world):
    """agree, agree_on_mesh, object gathers, average_, ShardedIsoLoCo, sharded_iso_merge_,
    IsoLoCo(process_group=...) and the DTensor step, good and failing, under the stand-in."""
    spawn(_body_nccl_rule, world, tmp_path, pg_timeout_s=PG_TIMEOUT_S)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_a_checksum_is_of_the_bits_not_of_where_they_sit(dtype):
    """Replicas holding equal params at different storage offsets (views into a flat buffer at an odd offset)
    get equal checksums; one flipped bit changes it."""
    from isoloco_kernels.distributed.bits import checksums

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 512 + 7, generator=g).to(dtype)
    buf = torch.zeros(x.numel() + 3, dtype=dtype)
    buf[1:-2] = x
    view = buf[1:-2]  # not 8-byte aligned but for float64
    assert (view.storage_offset() * view.element_size() % 8 == 0) == (dtype == torch.float64)
    assert checksums([view]) == checksums([x.clone()])
    y = x.clone()
    y.view(torch.int8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize])[
        100
    ] ^= 1
    assert checksums([y]) != checksums([x])
