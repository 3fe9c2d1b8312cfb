"""The registered ops are the one door: `iso_merge_`, `iso_flatten` and every optimizer's step dispatch the
`isoloco::` flatten and Nesterov ops (on the CPU too), and the op behind each door keeps the same
bounded-scratch rule."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import isoloco_kernels as ik
from isoloco_kernels.flatten import registry
from isoloco_kernels.flatten import registry as buckets

FLATTEN_OPS = {"isoloco.iso_merge_.default", "isoloco.iso_flatten_.default"}
NESTEROV_OP = "isoloco.nesterov_outer_.default"


class Ops(TorchDispatchMode):
    """The names of the ops dispatched under this mode."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(str(func))
        return func(*args, **(kwargs or {}))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 6))


def _grads(model) -> None:
    for p in model.parameters():
        p.grad = 1e-2 * torch.randn_like(p)


def test_iso_merge_dispatches_the_op():
    with Ops() as mode:
        ik.iso_merge_([torch.randn(3, 8, 5), torch.randn(6, 6)])
    assert mode.seen & FLATTEN_OPS, sorted(mode.seen)


def test_iso_flatten_dispatches_the_op():
    with Ops() as mode:
        ik.iso_flatten(torch.randn(7, 4))
    assert mode.seen & FLATTEN_OPS, sorted(mode.seen)


@pytest.mark.parametrize("momentum", [0.8, 0.0])
def test_isoloco_step_dispatches_flatten_and_nesterov(momentum):
    model = _model()
    opt = ik.IsoLoCo(model.parameters(), lr=1.8, momentum=momentum)
    _grads(model)
    with Ops() as mode:
        opt.step()
    assert mode.seen & FLATTEN_OPS and NESTEROV_OP in mode.seen, sorted(mode.seen)


def test_diloco_step_dispatches_nesterov():
    model = _model()
    opt = ik.IsoLoCo(model.parameters(), lr=0.7, momentum=0.9, iso=False)
    _grads(model)
    with Ops() as mode:
        opt.step()
    assert NESTEROV_OP in mode.seen and not mode.seen & FLATTEN_OPS, sorted(mode.seen)


@pytest.mark.parametrize("merge", ["iso_c", "mean", "tsv"])
def test_mergeloco_step_dispatches_the_ops(merge):
    model = _model()
    opt = ik.MergeLoCo(model.parameters(), lr=1.0, momentum=0.8, merge=merge)
    deltas = [1e-2 * torch.randn(3, *p.shape) for p in model.parameters()]
    with Ops() as mode:
        opt.step(deltas=deltas)
    assert NESTEROV_OP in mode.seen, sorted(mode.seen)
    if merge != "mean":
        assert mode.seen & FLATTEN_OPS, sorted(mode.seen)


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo process group of one rank in this process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("compress", [None, "int8"])
def test_sharded_step_dispatches_flatten_and_nesterov(one_rank_group, compress):
    model = _model()
    opt = ik.ShardedIsoLoCo(model.parameters(), lr=1.8, momentum=0.8, compress=compress)
    _grads(model)
    with Ops() as mode:
        opt.step()
    assert mode.seen & FLATTEN_OPS and NESTEROV_OP in mode.seen, sorted(mode.seen)


# -- one bounded-scratch rule behind every door -------------------------------------------------


@pytest.fixture
def slices(monkeypatch):
    """The batch size of every slice the flatten methods are handed, with the workspace so small that
    each slice holds one matrix."""
    seen: list[int] = []
    real = registry.iso_flatten_impl

    def spy(x, method):
        seen.append(x.shape[0] if x.ndim == 3 else 1)
        return real(x, method)

    monkeypatch.setattr(registry, "iso_flatten_impl", spy)
    monkeypatch.setenv(buckets.WORKSPACE_ENV, "1")
    return seen


@pytest.mark.parametrize(
    "door",
    [
        lambda x: torch.ops.isoloco.iso_flatten_(x, "svd"),
        lambda x: torch.ops.isoloco.iso_merge_([x], "svd"),
        lambda x: ik.iso_merge_([x], method="svd"),
        lambda x: x.copy_(ik.iso_flatten(x, method="svd")),
    ],
    ids=["op iso_flatten_", "op iso_merge_", "iso_merge_", "iso_flatten"],
)
def test_every_door_flattens_in_bounded_slices(slices, door):
    x = torch.randn(5, 6, 9, dtype=torch.float64)
    want = ik.iso_flatten(x.clone(), method="svd")
    slices.clear()
    door(x)
    assert slices == [1] * 5, slices
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)


def test_the_workspace_rule_is_read_from_the_environment():
    assert buckets.workspace_bytes() == int(os.environ.get(buckets.WORKSPACE_ENV, buckets.WORKSPACE_BYTES))


# -- a step is a short walk: few modules, none re-entered -----------------------------------------


def walk(fn) -> tuple[list[str], list[str]]:
    """The package modules whose code runs during fn(), in first-entry order, and every re-entry: a module
    entered again from a module it called (a callback up the call graph), as "module.function <- caller"."""
    seen: list[str] = []
    back: list[str] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("isoloco_kernels"):
            return
        if mod not in seen:
            seen.append(mod)
        chain, f = [], frame.f_back
        while f is not None:
            m = f.f_globals.get("__name__", "")
            if m.startswith("isoloco_kernels") and (not chain or chain[-1] != m):
                chain.append(m)
            f = f.f_back
        if chain and chain[0] != mod and mod in chain[1:]:
            back.append(f"{mod}.{frame.f_code.co_name} <- {chain[0]}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen, sorted(set(back))


def test_walk_sees_a_callback_up_the_call_graph():
    """The counter can fail: a package function handed to `collect` that calls back into outer/core.py is a
    re-entry (the callback stands in a module of its own, as a method of an optimizer would)."""
    from isoloco_kernels.outer import core

    ns = {"__name__": "isoloco_kernels._probe", "core": core}
    exec("def check(p, g, name):\n    core.check_hyper(1.0, 0.0, name)\n", ns)
    w = torch.randn(4, 3)
    w.grad = torch.randn(4, 3)
    opt = ik.IsoLoCo([w])
    seen, back = walk(lambda: core.collect(opt, "here", check=ns["check"]))
    assert "isoloco_kernels.outer.core" in seen
    assert back == ["isoloco_kernels.outer.core.check_hyper <- isoloco_kernels._probe"], back


def _steps(opt, model, **kw):
    _grads(model)
    opt.step(**kw)  # buffers and plans made
    _grads(model)
    return lambda: opt.step(**kw)


def test_isoloco_step_is_a_short_walk():
    model = _model()
    seen, back = walk(_steps(ik.IsoLoCo(model.parameters(), lr=1.8, momentum=0.8), model))
    assert len(seen) <= 7 and not back, (seen, back)


def test_mergeloco_step_is_a_short_walk():
    model = _model()
    opt = ik.MergeLoCo(model.parameters(), lr=1.8, momentum=0.8)
    deltas = [1e-2 * torch.randn(3, *p.shape) for p in model.parameters()]
    seen, back = walk(_steps(opt, model, deltas=deltas))
    assert len(seen) <= 10 and not back, (seen, back)


def _sharded_walk(compress):
    model = _model()
    opt = ik.ShardedIsoLoCo(model.parameters(), lr=1.8, momentum=0.8, compress=compress)
    return walk(_steps(opt, model))


@pytest.mark.parametrize("compress", [None, "int4"])
def test_sharded_step_is_a_short_walk(one_rank_group, compress):
    """One plain step with one vote: its local phases are plain calls (no callbacks of an agreement), the
    exchange is a method of the optimizer's own module, not a second step (7 modules plain, 10 with int4:
    compress/'s spec, codec and feedback). On one rank there is nothing to vote with (agree.py is not
    entered unless the step fails); on 2 ranks the vote adds agree.py and bits.py (the params' checksum), the
    solo broadcast pipeline.py: 10 and 12 modules, none calling back."""
    seen, back = _sharded_walk(compress)
    assert len(seen) <= 10 and not back, (seen, back)
