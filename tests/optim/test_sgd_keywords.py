"""IsoLoCo takes torch.optim.SGD's keywords: the values that mean IsoLoCo's update are accepted (and
reproduce SGD with iso=False), the others are refused with a ValueError naming the fix, and the
param groups and state dicts stay SGD's."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import isoloco_kernels as ik

SHAPES = [(6, 9), (9, 6), (5,), (2, 3, 4), (1, 7)]
# SGD's (and IsoLoCo's) update in float arithmetic: a few roundings per step, over a few steps
EPS = {torch.float32: 1e-6, torch.float64: 1e-14}


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]


def _twins(dtype, seed=0):
    a = _params(dtype, seed)
    return a, [nn.Parameter(p.detach().clone()) for p in a]


def _step_both(a, b, opt_a, opt_b, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for pa, pb in zip(a, b):
            gr = torch.randn(pa.shape, generator=g, dtype=pa.dtype)
            pa.grad, pb.grad = gr.clone(), gr.clone()
        opt_a.step()
        opt_b.step()


def _max_rel(a, b):
    a, b = [x.detach() for x in a], [y.detach() for y in b]
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="plain"),
        pytest.param(dict(dampening=0, weight_decay=0, maximize=False, differentiable=False), id="defaults-spelled"),
        pytest.param(dict(foreach=True), id="foreach"),
        pytest.param(dict(foreach=False), id="for-loop"),
        pytest.param(dict(fused=True), id="fused"),
    ],
)
def test_sgd_partial_reproduces_sgd(dtype, extra):
    """The partial a DiLoCo user writes for SGD, with IsoLoCo's name and iso=False, follows SGD."""
    a, b = _twins(dtype)
    sgd = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True, **extra)(a)
    iso = partial(ik.IsoLoCo, lr=0.7, momentum=0.9, nesterov=True, **extra)(b, iso=False)
    _step_both(a, b, sgd, iso, steps=6)
    if extra.get("fused"):
        # IsoLoCo's CPU update is torch's fused SGD kernel: the same bits
        assert all(torch.equal(x, y) for x, y in zip(b, a))
    else:  # SGD's for-loop / foreach order their roundings differently (an ulp or two)
        assert _max_rel(b, a) <= EPS[dtype]
        assert (
            _max_rel([iso.state[p]["momentum_buffer"] for p in b], [sgd.state[p]["momentum_buffer"] for p in a])
            <= EPS[dtype]
        )
    assert _max_rel(b, _params(dtype)) > 1e-2  # the steps moved the params


def test_sgd_positional_arguments():
    """SGD(params, lr, momentum, dampening, weight_decay, nesterov) in SGD's positions."""
    a, b = _twins(torch.float64)
    sgd = torch.optim.SGD(a, 0.7, 0.9, 0, 0, True, fused=True)
    iso = ik.IsoLoCo(b, 0.7, 0.9, 0, 0, True, iso=False)
    _step_both(a, b, sgd, iso, steps=3)
    assert all(torch.equal(x, y) for x, y in zip(b, a))


REFUSED = [
    pytest.param(dict(nesterov=False), ValueError, "nesterov=True", id="nesterov-false"),
    pytest.param(dict(dampening=0.1), ValueError, "dampening=0", id="dampening"),
    pytest.param(dict(weight_decay=1e-4), ValueError, "weight_decay=0", id="weight-decay"),
    pytest.param(dict(weight_decay=torch.tensor(0.1)), ValueError, "weight_decay=0", id="weight-decay-tensor"),
    pytest.param(dict(maximize=True), ValueError, "maximize=False", id="maximize"),
    pytest.param(dict(differentiable=True), ValueError, "differentiable=False", id="differentiable"),
    pytest.param(dict(foreach=True, fused=True), ValueError, "one of them", id="foreach-and-fused"),
    pytest.param(dict(nesterov="yes"), TypeError, "nesterov must be a bool", id="nesterov-not-bool"),
    pytest.param(dict(foreach=1), TypeError, "foreach must be a bool or None", id="foreach-not-bool"),
    pytest.param(dict(dampening="0"), TypeError, "dampening must be a real number", id="dampening-not-number"),
]


@pytest.mark.parametrize("kwargs, error, fix", REFUSED)
def test_refused_keywords(kwargs, error, fix):
    with pytest.raises(error, match=fix):
        ik.IsoLoCo(_params(torch.float32), lr=0.7, momentum=0.9, **kwargs)


@pytest.mark.parametrize("kwargs, error, fix", REFUSED)
def test_refused_in_a_param_group(kwargs, error, fix):
    """A group setting a refused value is refused by add_param_group, and the optimizer keeps its groups."""
    ps = _params(torch.float32)
    opt = ik.IsoLoCo(ps[:2], lr=0.7, momentum=0.9, nesterov=True)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(error, match=fix):
        opt.add_param_group({"params": ps[2:], **kwargs})
    assert opt.state_dict() == before and len(opt.param_groups) == 1


def test_groups_and_state_dict_are_sgds():
    """The groups hold SGD's keys with SGD's values (plus iso); state dicts go both ways."""
    kw = dict(lr=0.7, momentum=0.9, nesterov=True, foreach=True)
    a, b = _twins(torch.float64)
    sgd, iso = torch.optim.SGD(a, **kw), ik.IsoLoCo(b, iso=False, **kw)
    _step_both(a, b, sgd, iso, steps=2)
    gs, gi = sgd.state_dict()["param_groups"][0], iso.state_dict()["param_groups"][0]
    assert {k: v for k, v in gi.items() if k != "iso"} == gs
    assert all(v is None or type(v) in (int, float, bool) for k, v in gi.items() if k != "params")

    # an SGD(nesterov=True) checkpoint resumes in IsoLoCo, and IsoLoCo's in SGD
    a2, b2 = [nn.Parameter(p.detach().clone()) for p in a], [nn.Parameter(p.detach().clone()) for p in a]
    iso2 = partial(ik.IsoLoCo, **kw)(b2, iso=False)
    iso2.load_state_dict(copy.deepcopy(sgd.state_dict()))
    sgd2 = torch.optim.SGD(a2, lr=0.1)
    sgd2.load_state_dict(copy.deepcopy(iso.state_dict()))
    assert sgd2.param_groups[0]["nesterov"] is True and sgd2.param_groups[0]["momentum"] == 0.9
    _step_both(a2, b2, sgd2, iso2, steps=3, seed=2)
    assert _max_rel(b2, a2) <= EPS[torch.float64]


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        pytest.param(dict(nesterov=True, differentiable=True), "differentiable=False", id="differentiable"),
        pytest.param(dict(nesterov=False), "nesterov=True", id="nesterov-false"),
        pytest.param(dict(dampening=0.5, nesterov=False), "nesterov=True", id="dampened-heavy-ball"),
    ],
)
def test_refuses_sgd_checkpoints_it_cannot_continue(kwargs, fix):
    """An SGD state dict whose settings IsoLoCo cannot honour is refused before anything loads."""
    a, b = _twins(torch.float32)
    sgd = torch.optim.SGD(a, lr=0.7, momentum=0.9, **kwargs)  # its settings are what matters
    iso = ik.IsoLoCo(b, lr=0.7, momentum=0.9, nesterov=True)
    for p in b:
        p.grad = torch.ones_like(p)
    iso.step()
    before = copy.deepcopy(iso.state_dict())
    with pytest.raises(ValueError, match=fix):
        iso.load_state_dict(sgd.state_dict())
    after = iso.state_dict()
    assert after["param_groups"] == before["param_groups"] and after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k]["momentum_buffer"], v["momentum_buffer"])


# -- one SGD-shaped constructor for the three optimizers, written out in each ---------------------

OPTIMIZERS = [ik.IsoLoCo, ik.MergeLoCo, ik.ShardedIsoLoCo]


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_optimizer_has_sgds_signature(cls):
    """SGD's parameters in SGD's positions and kinds, IsoLoCo's defaults, then the optimizer's own keywords."""
    import inspect

    sgd = list(inspect.signature(torch.optim.SGD).parameters.values())
    ours = list(inspect.signature(cls).parameters.values())
    assert [(p.name, p.kind) for p in ours[: len(sgd)]] == [(p.name, p.kind) for p in sgd]
    defaults = {p.name: p.default for p in ours[: len(sgd)]}
    # IsoLoCo's lr and μ; SGD's other keywords at SGD's own defaults, except nesterov (True: DiLoCo's outer step)
    sgd_defaults = {p.name: p.default for p in sgd}
    assert defaults == {**sgd_defaults, "lr": 1.8, "momentum": 0.8, "nesterov": True}
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in ours[len(sgd) :])
    assert {"iso", "method", "process_group"} <= {p.name for p in ours[len(sgd) :]}


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_signature_is_written_in_the_source(cls):
    """What `inspect` shows is what the source says: an undecorated __init__ whose parameters are written
    out, so IDEs and type checkers see them without running anything."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef) and not fn.decorator_list, ast.dump(fn)[:200]
    written = [a.arg for a in fn.args.args[1:] + fn.args.kwonlyargs]
    assert written == [n for n, p in inspect.signature(cls).parameters.items() if p.kind != p.VAR_KEYWORD]
    assert inspect.signature(cls.__init__).parameters["lr"].default == 1.8


_REFUSALS = [  # (args after [w], kwargs, error type, the message after the optimizer's name)
    ((1.0, 0.9, 0.5), {}, ValueError, r"{}: dampening=0.5"),
    ((), {"nesterov": False}, ValueError, r"{}: nesterov=False"),
    ((), {"lr": -1.0}, ValueError, r"{}: invalid learning rate"),
    ((), {"betas": (0.9, 0.99)}, TypeError, r"{}(\.__init__)?\(\) got an unexpected keyword argument 'betas'"),
    ((1.0, 0.9, 0, 0, True, False), {}, TypeError, r"{}\.__init__\(\) takes from 2 to 7 positional arguments but 8"),
]


def _check_refusals(cls) -> None:
    import re

    for args, kwargs, err, msg in _REFUSALS:
        try:
            cls([nn.Parameter(torch.randn(4, 3))], *args, **kwargs)
        except err as e:
            assert re.search(msg.format(cls.__name__), str(e)), (args, kwargs, str(e))
        else:
            raise AssertionError(f"{cls.__name__}{args} {kwargs} was accepted")


@pytest.mark.parametrize("cls", [ik.IsoLoCo, ik.MergeLoCo], ids=lambda c: c.__name__)
def test_every_optimizer_checks_sgds_keywords_alike(cls):
    """The same refusals, positional or by keyword, in each optimizer's own name."""
    _check_refusals(cls)


@pytest.mark.slow
def test_sharded_checks_sgds_keywords_alike():
    """ShardedIsoLoCo needs a process group: one gloo rank in a process of its own."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = (
        "import sys, torch.distributed as dist\n"
        f"sys.path.insert(0, {os.path.join(root, 'tests', 'optim')!r})\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:0')\n"
        "import isoloco_kernels as ik, test_sgd_keywords as t\n"
        "t._check_refusals(ik.ShardedIsoLoCo)\n"
        "dist.destroy_process_group()\nprint('REFUSED ALL')\n"
    )
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "REFUSED ALL" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("cls", [ik.IsoLoCo, ik.MergeLoCo], ids=lambda c: c.__name__)
def test_positional_and_keyword_calls_build_the_same_groups(cls):
    w = nn.Parameter(torch.randn(4, 3))
    a = cls([w], 0.7, 0.5, 0, 0, True, foreach=False, iso=False)
    b = cls([w], lr=0.7, momentum=0.5, foreach=False, iso=False)
    ga, gb = ({k: v for k, v in o.param_groups[0].items() if k != "params"} for o in (a, b))
    assert ga == gb and ga["lr"] == 0.7 and ga["momentum"] == 0.5 and ga["foreach"] is False and ga["iso"] is False
