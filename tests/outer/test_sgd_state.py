"""SGD-shaped state (outer/sgd_state.py): a state dict is checked before anything loads — bad fields, content
that would only fail at a later step, meta or expanded buffers, another optimizer's or one rank's sharded
state — and refused with nothing changed; a float64 buffer that fits loads and steps."""

from __future__ import annotations

import copy

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.reference import iso_flatten_ref, nesterov_ref
from tests.helpers import opt_with_state, rel_err, three_params


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _snapshot(ps, opt):
    return [p.clone() for p in ps], {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}


def _unchanged(ps, opt, snap):
    return all(torch.equal(p, q) for p, q in zip(ps, snap[0])) and all(
        torch.equal(s["momentum_buffer"], snap[1][id(p)]) for p, s in opt.state.items()
    )


def test_isoloco_refuses_an_expanded_momentum_buffer_from_a_state_dict():
    ps, opt = opt_with_state()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["momentum_buffer"] = torch.randn(1).expand(5)
    snap = _snapshot(ps, opt)
    with pytest.raises((ValueError, RuntimeError), match=r"momentum_buffer.*overlap|overlap.*momentum_buffer"):
        opt.load_state_dict(sd)
        opt.step()
    assert _unchanged(ps, opt, snap)


@pytest.mark.parametrize(
    "edit,match",
    [
        pytest.param(lambda sd: sd.pop("state"), r"'state'", id="no-state"),
        pytest.param(lambda sd: sd.pop("param_groups"), r"'param_groups'", id="no-param-groups"),
        pytest.param(lambda sd: sd["param_groups"][0].pop("lr"), r"param group 0.*'lr'", id="no-lr"),
        pytest.param(lambda sd: sd["param_groups"][0].update(lr="0.5"), r"param group 0.*lr", id="lr-str"),
        pytest.param(
            lambda sd: sd["param_groups"][0].update(momentum="x"), r"param group 0.*momentum", id="momentum-str"
        ),
        pytest.param(lambda sd: sd["param_groups"][0].update(lr=float("inf")), r"param group 0.*lr", id="lr-inf"),
        pytest.param(
            lambda sd: sd["state"][0].update(momentum_buffer="zeros"), r"param 0.*momentum_buffer", id="buffer-str"
        ),
        pytest.param(
            lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(3)),
            r"param 0.*momentum_buffer",
            id="buffer-shape",
        ),
        pytest.param(
            lambda sd: sd["state"][1].update(momentum_buffer=torch.full((4, 6), float("nan"))),
            r"momentum_buffer",
            id="buffer-nan",
        ),
        pytest.param(
            lambda sd: sd["state"][0].update(momentum_buffer=torch.empty(6, 4, device="meta")),
            r"param 0 .*momentum_buffer is a meta tensor",
            id="buffer-meta",
        ),
    ],
)
def test_load_state_dict_refuses_bad_fields_at_load_with_nothing_changed(edit, match):
    ps, opt = opt_with_state(50)
    sd = copy.deepcopy(opt.state_dict())
    edit(sd)
    snap = _snapshot(ps, opt)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises((ValueError, TypeError), match=match):
        opt.load_state_dict(sd)
    assert _unchanged(ps, opt, snap)
    assert groups == [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    opt.step()  # still usable


# ----------------------------------------------------------------------------------------------
# load_state_dict: content that would only fail at a later step


def _stepped(seed, dtype=torch.float32):
    g = _gen(seed)
    ps = [torch.randn(4, 6, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    opt = ik.IsoLoCo(ps)
    opt.step()
    return ps, opt


def _bufs_and_groups(opt):
    return {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}, [
        dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups
    ]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "dtype, edit, exc, match",
    [
        # a float64 buffer beyond float32: loaded as Inf, then every step refused it
        pytest.param(
            torch.float32,
            lambda sd: sd["state"][0].update(momentum_buffer=torch.full((4, 6), 1e300, dtype=torch.float64)),
            ValueError,
            r"param 0 .*momentum_buffer holds 1e\+300, beyond the torch.float32",
            id="f64-buffer-beyond-f32",
        ),
        pytest.param(
            torch.bfloat16,
            lambda sd: sd["state"][1].update(momentum_buffer=torch.full((5,), -1e39, dtype=torch.float64)),
            ValueError,
            r"param 1 .*momentum_buffer holds 1e\+39, beyond the torch.float32",
            id="f64-buffer-beyond-bf16-param",
        ),
        # a None state entry: torch's loader failed with "'NoneType' object is not subscriptable"
        pytest.param(
            torch.float32,
            lambda sd: sd["state"].update({0: None}),
            TypeError,
            r"state of param 0 must be a dict, got NoneType",
            id="state-entry-none",
        ),
    ],
)
def test_load_state_dict_refuses_content_that_fails_later_with_nothing_changed(dtype, edit, exc, match):
    ps, opt = _stepped(5, dtype)
    sd = opt.state_dict()
    sd = {"state": {k: dict(v) for k, v in sd["state"].items()}, "param_groups": sd["param_groups"]}
    edit(sd)
    bufs, groups = _bufs_and_groups(opt)
    with pytest.raises(exc, match=match):
        opt.load_state_dict(sd)
    bufs2, groups2 = _bufs_and_groups(opt)
    assert groups2 == groups and all(torch.equal(bufs[k], bufs2[k]) for k in bufs)


@pytest.mark.usefixtures("one_thread")
def test_load_state_dict_float64_buffer_that_fits_loads_and_steps():
    # the bound refuses only what does not fit: 1e30 fits float32
    ps, opt = _stepped(6)
    sd = opt.state_dict()
    sd["state"][0] = {"momentum_buffer": torch.full((4, 6), 1e30, dtype=torch.float64)}
    opt.load_state_dict(sd)
    assert opt.state[ps[0]]["momentum_buffer"].dtype == torch.float32
    p0, g0 = ps[0].detach().double().clone(), ps[0].grad.double()
    want, _ = nesterov_ref(p0, torch.full((4, 6), 1e30, dtype=torch.float64), iso_flatten_ref(g0), 1.8, 0.8)
    opt.step()
    assert rel_err(ps[0], want) <= 1e-6


# -- 9. the smaller ones ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [ik.IsoLoCo, ik.MergeLoCo], ids=lambda c: c.__name__)
def test_another_optimizers_state_dict_is_named_as_such(cls):
    params = three_params()
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params)
    adamw.step()
    opt = cls(params)
    with pytest.raises(ValueError, match="not an SGD-shaped state dict.*exp_avg"):
        opt.load_state_dict(adamw.state_dict())
    assert not opt.state


def test_isoloco_refuses_one_ranks_sharded_state():
    params = three_params()
    opt = ik.IsoLoCo(params)
    sd = opt.state_dict()
    sd["sharding"] = {"fingerprint": 1, "rank": 1, "world_size": 2}
    with pytest.raises(ValueError, match="one rank's ShardedIsoLoCo state.*consolidated_state_dict"):
        opt.load_state_dict(sd)
