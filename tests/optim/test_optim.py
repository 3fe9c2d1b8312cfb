"""IsoLoCo, the outer optimizer: against reference.isoloco_step_ref (float64), against
torch.optim.SGD with iso=False, SGD-shaped state dicts, all-or-nothing steps, and a DiLoCo loop."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import isoloco_kernels as ik
from isoloco_kernels._validate import ResultOverflowError
from isoloco_kernels.reference import iso_flatten_ref, isoloco_step_ref, nesterov_ref, sgd_nesterov_ref
from tests.helpers import DTYPES, TOL, opt_with_state, rel_err, three_params

# Matrices (with a transposed twin, 1×n and n×1), vectors, a 3-D tensor and a strided param.
SHAPES = [(6, 9), (9, 6), (6, 9), (1, 7), (7, 1), (5,), (1,), (2, 3, 4), (4, 4)]


def _rand(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _params(dtype, seed, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(_rand(s, dtype, g)) for s in shapes]
    # one non-contiguous param: the transpose of a contiguous tensor
    ps.append(nn.Parameter(_rand((8, 5), dtype, g).t()))
    return ps


def _grads(ps, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return [scale * _rand(p.shape, p.dtype, g) for p in ps]


def _state(opt, ps):
    return [opt.state[p]["momentum_buffer"] if "momentum_buffer" in opt.state[p] else None for p in ps]


def _check_step(opt, groups, grads, dtype, family="exact"):
    """One opt.step() against isoloco_step_ref from the optimizer's own (p, buf) before the step;
    family: the TOL row of the flatten method ("exact" or "polar")."""
    expect = []
    for group, gs in zip(groups, grads):
        ps = group["params"]
        bufs = [torch.zeros_like(p, dtype=torch.float64) if b is None else b for p, b in zip(ps, _state(opt, ps))]
        rp, rb = isoloco_step_ref(ps, bufs, gs, group["lr"], group["momentum"], iso=group["iso"])
        expect.append([(p.detach().to("cpu", copy=True), a, b) for p, a, b in zip(ps, rp, rb)])
        for p, gr in zip(ps, gs):
            p.grad = gr.clone()
    opt.step()
    for group, exp in zip(groups, expect):
        for i, (p, (p0, rp, rb)) in enumerate(zip(group["params"], exp)):
            buf = opt.state[p]["momentum_buffer"]
            assert buf.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            if dtype in (torch.float32, torch.float64):
                # the step itself is compared, so the param's own magnitude cannot hide an error
                err = rel_err(p.detach().to("cpu", torch.float64) - p0.double(), rp - p0.double())
                assert err <= TOL[(family, dtype)], (i, tuple(p.shape), err)
            else:
                assert rel_err(p, rp) <= TOL[("update", dtype)], (i, tuple(p.shape))
            assert rel_err(buf, rb) <= TOL[(family, buf.dtype)], (i, tuple(p.shape))


@pytest.mark.parametrize("method", ["auto", "svd", "eigh", "polar"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference_over_steps(dtype, method):
    ps = _params(dtype, seed=1)
    groups = [
        {"params": ps[:5] + ps[9:], "lr": 0.9, "momentum": 0.8},  # ps[9] is non-contiguous
        {"params": ps[5:8], "lr": 1.8, "momentum": 0.5},
        {"params": ps[8:9], "lr": 0.3, "momentum": 0.9, "iso": False},
    ]
    opt = ik.IsoLoCo(groups, lr=1.8, momentum=0.8, method=method)
    for step in range(3):
        grads = [_grads(g["params"], seed=10 * step + k) for k, g in enumerate(opt.param_groups)]
        _check_step(opt, opt.param_groups, grads, dtype, "polar" if method == "polar" else "exact")


def test_transposed_twin_gets_transposed_update():
    g = torch.Generator().manual_seed(2)
    a = nn.Parameter(torch.zeros(5, 8, dtype=torch.float64))
    b = nn.Parameter(torch.zeros(8, 5, dtype=torch.float64))
    opt = ik.IsoLoCo([a, b], lr=1.0, momentum=0.0)
    d = _rand((5, 8), torch.float64, g)
    a.grad, b.grad = d.clone(), d.t().clone()
    opt.step()
    assert len(opt._plan.buckets) == 1
    # b and a.t() are one matrix flattened twice in one batch (cond ~5): equal to float64 round-off
    assert rel_err(b, a.t()) <= 1e-12 and rel_err(a, -iso_flatten_ref(d)) <= TOL[("exact", torch.float64)]


def test_iso_false_equals_sgd_over_20_steps():
    model_a = _params(torch.float32, seed=3)
    model_b = [nn.Parameter(p.detach().clone()) for p in model_a]

    def groups(ps):
        return [{"params": ps[:4]}, {"params": ps[4:], "lr": 0.3, "momentum": 0.5}]

    sgd = torch.optim.SGD(groups(model_a), lr=0.7, momentum=0.9, nesterov=True)
    iso = ik.IsoLoCo(groups(model_b), lr=0.7, momentum=0.9, iso=False)
    for step in range(20):
        for pa, pb, gr in zip(model_a, model_b, _grads(model_a, seed=100 + step, scale=1.0)):
            pa.grad, pb.grad = gr.clone(), gr.clone()
        sgd.step()
        iso.step()
    for pa, pb in zip(model_a, model_b):
        assert rel_err(pb, pa) <= 1e-6
        assert rel_err(iso.state[pb]["momentum_buffer"], sgd.state[pa]["momentum_buffer"]) <= 1e-6


# ------------------------------------------------------------------------------------------------
# state dicts


def _walk_group_values(sd):
    for g in sd["param_groups"]:
        for k, v in g.items():
            if k != "params":
                yield k, v


def test_state_dict_is_sgd_shaped():
    ps = _params(torch.float32, seed=4)
    opt = ik.IsoLoCo(ps, method="svd")
    for p, gr in zip(ps, _grads(ps, seed=5)):
        p.grad = gr
    opt.step()
    sd = opt.state_dict()
    for k, v in _walk_group_values(sd):
        assert v is None or type(v) in (int, float, bool), (k, v)
    sgd_keys = set(torch.optim.SGD(ps, lr=0.1).state_dict()["param_groups"][0])
    assert sgd_keys <= set(sd["param_groups"][0]), sgd_keys - set(sd["param_groups"][0])
    for s in sd["state"].values():
        assert set(s) == {"momentum_buffer"} and isinstance(s["momentum_buffer"], torch.Tensor)
    assert len(sd["state"]) == len(ps)


def _run(opt, ps, steps, seed):
    for step in range(steps):
        for p, gr in zip(ps, _grads(ps, seed=seed + step, scale=1.0)):
            p.grad = gr
        opt.step()


def test_sgd_checkpoint_loads_into_isoloco_and_back():
    ps_sgd = _params(torch.float32, seed=6)
    sgd = torch.optim.SGD(ps_sgd, lr=0.7, momentum=0.9, nesterov=True)
    _run(sgd, ps_sgd, 3, seed=20)

    ps_iso = [nn.Parameter(p.detach().clone()) for p in ps_sgd]
    iso = ik.IsoLoCo(ps_iso, lr=1.8, momentum=0.8, iso=False)
    # torch's load_state_dict keeps the given tensors when dtype and device match: copy, so the
    # two optimizers do not share momentum buffers
    iso.load_state_dict(copy.deepcopy(sgd.state_dict()))
    assert iso.param_groups[0]["lr"] == 0.7 and iso.param_groups[0]["iso"] is False
    _run(sgd, ps_sgd, 3, seed=30)
    _run(iso, ps_iso, 3, seed=30)
    for a, b in zip(ps_sgd, ps_iso):
        assert rel_err(b, a) <= 1e-6

    back = torch.optim.SGD([nn.Parameter(p.detach().clone()) for p in ps_iso], lr=0.1)
    back.load_state_dict(copy.deepcopy(iso.state_dict()))
    ps_back = back.param_groups[0]["params"]
    assert back.param_groups[0]["nesterov"] is True and back.param_groups[0]["momentum"] == 0.9
    _run(back, ps_back, 3, seed=40)
    _run(iso, ps_iso, 3, seed=40)
    for a, b in zip(ps_back, ps_iso):
        assert rel_err(b, a) <= 1e-6


def test_isoloco_round_trip_restores_trajectory():
    ps = _params(torch.float32, seed=7)
    opt = ik.IsoLoCo([{"params": ps[:3], "iso": False}, {"params": ps[3:], "lr": 0.5}], method="svd")
    _run(opt, ps, 2, seed=50)
    ps2 = [nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = ik.IsoLoCo([{"params": ps2[:3]}, {"params": ps2[3:]}], method="svd")
    with pytest.warns(UserWarning, match="param group 0: the state dict sets iso=False"):
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["iso"] for g in opt2.param_groups] == [False, True] and opt2.param_groups[1]["lr"] == 0.5
    _run(opt, ps, 2, seed=60)
    _run(opt2, ps2, 2, seed=60)
    assert all(torch.equal(a, b) for a, b in zip(ps, ps2))


def test_sgd_checkpoint_without_iso_keeps_the_groups_setting():
    ps = _params(torch.float32, seed=8)
    sgd = torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    opt = ik.IsoLoCo(ps, iso=True)
    opt.load_state_dict(sgd.state_dict())
    assert opt.param_groups[0]["iso"] is True


def test_a_checkpoint_that_switches_iso_warns():
    """iso is the A/B switch: a load that changes it (an iso=False checkpoint into an iso=True
    optimizer, or back) warns, naming the group and how to keep the optimizer's own setting; a
    load that keeps it, or an SGD checkpoint (no iso), does not."""
    import warnings

    ps = _params(torch.float32, seed=8)
    plain = ik.IsoLoCo(ps, iso=False)
    _run(plain, ps, 1, seed=90)
    opt = ik.IsoLoCo(ps, iso=True)
    with pytest.warns(
        UserWarning, match=r"param group 0: the state dict sets iso=False over this optimizer's iso=True"
    ):
        opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["iso"] is False  # torch's rule: a checkpoint restores the group's settings
    with pytest.warns(UserWarning, match=r"sets iso=True over this optimizer's iso=False"):
        plain.load_state_dict(ik.IsoLoCo(ps, iso=True).state_dict())
    sgd = torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    from isoloco_kernels.outer.nd import NDParamWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", NDParamWarning)  # _params holds a 3-D param: said at construction
        ik.IsoLoCo(ps, iso=True).load_state_dict(sgd.state_dict())
        same = ik.IsoLoCo(ps, iso=True)
        same.load_state_dict(ik.IsoLoCo(ps, iso=True).state_dict())


def test_half_params_keep_float32_buffers_through_checkpoints():
    ps = _params(torch.bfloat16, seed=9)
    opt = ik.IsoLoCo(ps, method="svd")
    _run(opt, ps, 2, seed=70)
    sd = opt.state_dict()
    assert all(s["momentum_buffer"].dtype == torch.float32 for s in sd["state"].values())
    opt2 = ik.IsoLoCo([nn.Parameter(p.detach().clone()) for p in ps], method="svd")
    opt2.load_state_dict(sd)
    for p, p2 in zip(ps, opt2.param_groups[0]["params"]):
        assert torch.equal(opt2.state[p2]["momentum_buffer"], opt.state[p]["momentum_buffer"])
    # an SGD checkpoint of bfloat16 params (bfloat16 buffers) is widened exactly
    sgd = torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    _run(sgd, ps, 1, seed=80)
    opt2.load_state_dict(sgd.state_dict())
    for p, p2 in zip(ps, opt2.param_groups[0]["params"]):
        b = opt2.state[p2]["momentum_buffer"]
        assert b.dtype == torch.float32 and torch.equal(b, sgd.state[p]["momentum_buffer"].float())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        pytest.param(dict(nesterov=False), "nesterov=False", id="not-nesterov"),
        pytest.param(dict(nesterov=True, weight_decay=0.1), "weight_decay=0.1", id="weight-decay"),
        pytest.param(dict(nesterov=True, maximize=True), "maximize=True", id="maximize"),
    ],
)
def test_refuses_checkpoints_it_cannot_continue(kwargs, match):
    ps = _params(torch.float32, seed=10)
    sgd = torch.optim.SGD(ps, lr=0.7, momentum=0.9, **kwargs)
    _run(sgd, ps, 1, seed=90)
    opt = ik.IsoLoCo(ps, lr=1.0)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sgd.state_dict())
    assert opt.state_dict() == before


# ------------------------------------------------------------------------------------------------
# the optimizer contract


def test_params_without_grad_are_skipped_and_plan_is_reused_or_rebuilt():
    ps = _params(torch.float32, seed=11)
    opt = ik.IsoLoCo(ps, lr=0.5, momentum=0.5, method="svd")
    grads = _grads(ps, seed=12)
    _check_step(opt, opt.param_groups, [grads], torch.float32)
    plan = opt._plan
    _check_step(opt, opt.param_groups, [_grads(ps, seed=13)], torch.float32)
    assert opt._plan is plan  # same params, shapes and dtypes: buffers reused

    frozen = (0, 5)  # a matrix and a vector
    snap = {i: (ps[i].detach().clone(), opt.state[ps[i]]["momentum_buffer"].clone()) for i in frozen}
    live = [p for i, p in enumerate(ps) if i not in frozen]
    gs = _grads(live, seed=14)
    rp, _ = isoloco_step_ref(live, [opt.state[p]["momentum_buffer"] for p in live], gs, 0.5, 0.5)
    p0 = [p.detach().clone() for p in live]
    for i in frozen:
        ps[i].grad = None
    for p, g in zip(live, gs):
        p.grad = g
    opt.step()
    assert opt._plan is not plan  # the set of matrices changed: re-planned
    for p, r, q in zip(live, rp, p0):
        assert rel_err(p.detach().double() - q.double(), r - q.double()) <= TOL[("exact", torch.float32)]
    for i in frozen:
        assert torch.equal(ps[i], snap[i][0]) and torch.equal(opt.state[ps[i]]["momentum_buffer"], snap[i][1])


def test_no_state_for_params_never_stepped():
    a, b = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4))
    opt = ik.IsoLoCo([a, b])
    a.grad = torch.randn(3, 4)
    opt.step()
    assert "momentum_buffer" in opt.state[a] and b not in opt.state
    assert list(opt.state_dict()["state"]) == [0]


def test_zero_grad_and_closure():
    model = nn.Linear(5, 3)
    opt = ik.IsoLoCo(model.parameters(), lr=0.1, momentum=0.5, method="svd")
    x = torch.randn(8, 5)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    w0 = model.weight.detach().clone()
    loss = opt.step(closure)
    assert len(calls) == 1 and torch.is_tensor(loss) and not torch.equal(model.weight, w0)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    w1 = model.weight.detach().clone()
    opt.step()  # nothing has a grad: nothing moves
    assert torch.equal(model.weight, w1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_grad_raises_and_changes_nothing(bad):
    ps = _params(torch.float32, seed=15)
    opt = ik.IsoLoCo([{"params": ps[:4]}, {"params": ps[4:], "iso": False}], method="svd")
    _run(opt, ps, 1, seed=100)  # existing momentum buffers
    extra = nn.Parameter(torch.randn(3, 3))
    opt.add_param_group({"params": [extra]})  # and one param with no state yet
    snap = copy.deepcopy(opt.state_dict())
    before = [p.detach().clone() for p in ps + [extra]]
    for p, gr in zip(ps + [extra], _grads(ps + [extra], seed=101)):
        p.grad = gr
    ps[6].grad[0] = bad  # group 1, index 2, shape (1,)
    kind = "NaN" if bad != bad else "Inf"
    with pytest.raises(ValueError, match=rf"param_groups\[1\]\['params'\]\[2\] \(shape \(1,\)\).*{kind}"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps + [extra], before))
    after = opt.state_dict()
    assert after["state"].keys() == snap["state"].keys() and extra not in opt.state
    for k in snap["state"]:
        assert torch.equal(after["state"][k]["momentum_buffer"], snap["state"][k]["momentum_buffer"])


def test_huge_finite_grads_are_not_mistaken_for_inf():
    """The finite screen uses norms; a float32 norm overflowing must not reject finite grads."""
    p = nn.Parameter(torch.zeros(6))
    h = nn.Parameter(torch.zeros(300, dtype=torch.float16))
    opt = ik.IsoLoCo([p, h], lr=1e-3, momentum=0.0, iso=False)
    p.grad = torch.full((6,), 1e30)  # ‖g‖² = 6e60 overflows float32
    h.grad = torch.full((300,), 6e4, dtype=torch.float16)  # ‖g‖ ≈ 1e6 overflows float16
    opt.step()
    assert rel_err(p, torch.full((6,), -1e27)) <= 1e-6
    # -lr·g = -60.000003 in float32, rounded once on store: -60 exactly (float16 arithmetic, with lr
    # rounded to 0.0010004, would give -60.03, the next float16 up)
    assert torch.equal(h.detach(), torch.full((300,), -60.0, dtype=torch.float16))


def test_argument_validation():
    p = [nn.Parameter(torch.randn(2, 2))]
    with pytest.raises(ValueError, match="learning rate: -0.1"):
        ik.IsoLoCo(p, lr=-0.1)
    with pytest.raises(ValueError, match="momentum value: -0.5"):
        ik.IsoLoCo(p, momentum=-0.5)
    with pytest.raises(ValueError, match="method must be one of"):
        ik.IsoLoCo(p, method="qr")
    with pytest.raises(ValueError, match="iso must be a bool"):
        ik.IsoLoCo(p, iso="yes")
    with pytest.raises(ValueError, match="param group 1.*learning rate: -1"):
        ik.IsoLoCo([{"params": p}, {"params": [nn.Parameter(torch.randn(3))], "lr": -1}])
    with pytest.raises(ValueError, match="weight_decay=0.01"):
        ik.IsoLoCo([{"params": p, "weight_decay": 0.01}])
    with pytest.raises(TypeError, match="param 0 has dtype torch.complex64"):
        ik.IsoLoCo([nn.Parameter(torch.randn(2, dtype=torch.complex64))])
    opt = ik.IsoLoCo(p)
    p[0].grad = torch.randn(2, 2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


# ------------------------------------------------------------------------------------------------
# Drop-in: a DiLoCo outer loop written the way torchft's DiLoCo and OpenDiLoCo write theirs.


def _diloco(outer_factory, rounds=3, workers=2, inner_steps=3, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    # the global copy, kept on the side
    global_params = [p.detach().clone() for p in model.parameters()]
    outer_opt = outer_factory(model.parameters())
    data = torch.Generator().manual_seed(seed + 1)
    for _ in range(rounds):
        local_sum = [torch.zeros_like(p) for p in global_params]
        for _k in range(workers):
            with torch.no_grad():
                for p, gp in zip(model.parameters(), global_params):
                    p.copy_(gp)
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for _h in range(inner_steps):
                x = torch.randn(32, 6, generator=data)
                y = torch.randn(32, 4, generator=data)
                inner.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                inner.step()
            for s, p in zip(local_sum, model.parameters()):
                s.add_(p.detach())
        # outer step: pseudo-gradient global − local (averaged), params restored to global
        with torch.no_grad():
            for p, gp, s in zip(model.parameters(), global_params, local_sum):
                p.grad = gp - s / workers
                p.copy_(gp)
        outer_opt.step()
        outer_opt.zero_grad()
        with torch.no_grad():
            for p, gp in zip(model.parameters(), global_params):
                gp.copy_(p)
    return global_params


def test_drop_in_diloco_loop():
    sgd = _diloco(lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    iso_off = _diloco(lambda ps: ik.IsoLoCo(ps, lr=0.7, momentum=0.9, iso=False))
    for a, b in zip(sgd, iso_off):
        assert rel_err(b, a) <= 1e-6
    iso_on = _diloco(lambda ps: ik.IsoLoCo(ps, lr=1.8, momentum=0.8))
    assert all(torch.isfinite(p).all() for p in iso_on)
    # the Iso-C flatten is active: the weights (2-D) follow another path than SGD's
    assert rel_err(iso_on[0], sgd[0]) > 1e-3


# ------------------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_matches_reference(dtype):
    ps = [nn.Parameter(p.detach().cuda()) for p in _params(dtype, seed=16)]
    opt = ik.IsoLoCo([{"params": ps[:6]}, {"params": ps[6:], "lr": 0.4, "iso": False}], method="svd")
    for step in range(2):
        grads = [
            [g.cuda() for g in _grads(gr["params"], seed=200 + 10 * step + k)] for k, gr in enumerate(opt.param_groups)
        ]
        _check_step(opt, opt.param_groups, grads, dtype)


@cuda
def test_cpu_and_cuda_params_in_one_optimizer():
    ps = _params(torch.float32, seed=17)
    ps = [p if i % 2 else nn.Parameter(p.detach().cuda()) for i, p in enumerate(ps)]
    opt = ik.IsoLoCo(ps, method="svd")
    for step in range(2):
        grads = [g.to(p.device) for g, p in zip(_grads(ps, seed=300 + step), ps)]
        _check_step(opt, opt.param_groups, [grads], torch.float32)


def test_infinite_lr_and_nonfinite_momentum_are_refused():
    with pytest.raises(ValueError, match="invalid learning rate: inf"):
        ik.IsoLoCo([nn.Parameter(torch.randn(3, 3))], lr=float("inf"))
    w, b = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(4))
    opt = ik.IsoLoCo([w, b], lr=0.5, momentum=0.9)
    w.grad, b.grad = torch.randn(6, 4), torch.randn(4)
    opt.step()
    opt.state[b]["momentum_buffer"][2] = float("nan")  # e.g. a corrupted checkpoint
    before = [t.clone() for t in (w, b, opt.state[w]["momentum_buffer"], opt.state[b]["momentum_buffer"])]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\] \(shape \(4,\)\) momentum_buffer"):
        opt.step()
    after = (w, b, opt.state[w]["momentum_buffer"], opt.state[b]["momentum_buffer"])
    assert all(torch.equal(x.detach().view(torch.int32), y.detach().view(torch.int32)) for x, y in zip(before, after))


def test_bucket_flatten_batches_by_shape_reuses_its_plan_and_names_an_overflow():
    """outer.bucket_flatten, the one bucket-and-flatten of IsoLoCo, ShardedIsoLoCo and the DTensor
    routes: transposed twins share a bucket, each result is iso() of its tensor in its own
    orientation, the plan is kept while the shapes hold, and an overflowing result is named."""
    from isoloco_kernels._validate import ResultOverflowError
    from isoloco_kernels.outer.core import bucket_flatten

    g = torch.Generator().manual_seed(4)
    mats = [torch.randn(5, 3, generator=g), torch.randn(3, 5, generator=g), torch.randn(4, 4, generator=g)]
    plan, views = bucket_flatten(mats, "svd", ["a", "b", "c"])
    assert len(plan.buckets) == 2  # 5×3 and 3×5 together
    for v, m in zip(views, mats):
        assert v.shape == m.shape and rel_err(v, iso_flatten_ref(m)) <= TOL[("exact", torch.float32)]
    again, _ = bucket_flatten([m * 2 for m in mats], "svd", ["a", "b", "c"], plan)
    assert again is plan
    seen = []
    _, views = bucket_flatten(mats, "svd", ["a", "b", "c"], plan, merge=lambda bufs: seen.append(len(bufs)))
    assert seen == [2] and torch.equal(views[2], mats[2])  # the merge given ran instead, on the packed buffers
    assert bucket_flatten([], "svd", [], plan) == (plan, [])

    def overflow(bufs):
        raise ResultOverflowError("bucket 1: matrix 0 does not fit", matrix=0, bucket=1)

    with pytest.raises(ResultOverflowError, match=r"^c: the Iso-C result of its grad does not fit torch.float32"):
        bucket_flatten(mats, "svd", ["a", "b", "c"], merge=overflow)


def test_outer_defaults_checks_in_order_for_both_optimizers():
    """outer.outer_defaults: one constructor check for IsoLoCo and ShardedIsoLoCo (lr, momentum,
    then SGD's keys, then method, then iso)."""
    from isoloco_kernels.outer.sgd_state import SGD_KEYS, outer_defaults

    assert outer_defaults("X", 1.0, 0.5, True, "auto") == dict(lr=1.0, momentum=0.5, iso=True, **SGD_KEYS)
    with pytest.raises(ValueError, match="X: invalid learning rate"):
        outer_defaults("X", -1.0, 0.5, "no", "bogus")
    with pytest.raises(ValueError, match="method must be one of"):
        outer_defaults("X", 1.0, 0.5, "no", "bogus")
    with pytest.raises(ValueError, match="X: iso must be a bool"):
        outer_defaults("X", 1.0, 0.5, "no", "auto")
    with pytest.raises(ValueError, match="nesterov=False"):
        ik.IsoLoCo([nn.Parameter(torch.randn(3, 3))], nesterov=False, method="bogus")
    with pytest.raises(ValueError, match="iso must be a bool"):
        ik.IsoLoCo([nn.Parameter(torch.randn(3, 3))], iso=1)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_isoloco_huge_grad_right_result_or_clear_error():
    # auto picks svd for a square 128×128 on the CPU, which turned every param NaN here
    ps = [torch.randn(128, 128, generator=_gen(6)), torch.randn(32, generator=_gen(7))]
    grads = [torch.ones(128, 128) * 1e37 + torch.eye(128) * 1e36, torch.randn(32, generator=_gen(9)) * 1e37]
    opt = ik.IsoLoCo(ps, lr=1.8, momentum=0.8)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    ref_p, _ = isoloco_step_ref(ps, [torch.zeros_like(p) for p in ps], grads, 1.8, 0.8)
    opt.step()
    for p, r in zip(ps, ref_p):
        assert torch.isfinite(p).all()
        # float64 svd, then the float32 update (measured ≤ 5e-8); a float32 svd would be ~2e-4 off
        assert rel_err(p, r) < TOL[("update", torch.float32)]


def test_isoloco_update_that_overflows_is_refused_with_nothing_changed():
    ps = [torch.randn(8, 8, generator=_gen(10)), torch.randn(8, generator=_gen(11))]
    opt = ik.IsoLoCo(ps, lr=1.8, momentum=0.8)
    ps[0].grad = torch.randn(8, 8, generator=_gen(12))
    ps[1].grad = torch.full((8,), 3e38)  # lr·(1 + μ)·g overflows float32
    before = [p.clone() for p in ps]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*(overflow|not finite)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before))
    assert len(opt.state) == 0


def test_isoloco_refuses_params_that_share_memory():
    base = torch.randn(10, 4)
    before = base.clone()
    opt = ik.IsoLoCo([base[:6], base[4:]], lr=0.5, momentum=0.9)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape)
    with pytest.raises(RuntimeError, match=r"overlap"):
        opt.step()
    assert torch.equal(base, before)


def test_isoloco_refuses_an_inference_param():
    with torch.inference_mode():
        p = torch.randn(4, 4)
    q = torch.randn(4, 4)
    opt = ik.IsoLoCo([q, p], lr=0.5, momentum=0.9)
    q.grad, p.grad = torch.randn(4, 4), torch.randn(4, 4)
    before = q.clone()
    with pytest.raises(RuntimeError, match=r"\[1\].*inference"):
        opt.step()
    assert torch.equal(q, before) and len(opt.state) == 0


# ----------------------------------------------------------------------------------------------
# Optimizer objects: copies and state dicts


def test_isoloco_deepcopy_and_pickle_step_like_the_original():
    ps, opt = opt_with_state(40)
    opt.method = "svd"
    clones = [copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))]
    assert all(c.method == "svd" for c in clones)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=_gen(41))
    results = []
    for c in clones:
        cp = [q for g in c.param_groups for q in g["params"]]
        for q, p in zip(cp, ps):
            q.grad = p.grad.clone()
        c.step()
        results.append(cp)
    opt.step()
    for cp in results:
        for q, p in zip(cp, ps):
            assert torch.equal(q, p)


def test_isoloco_pickled_with_a_process_group_says_so_when_stepped():
    ps, opt = opt_with_state(42)
    opt.process_group = object()  # stands in for a group: not picklable, must not travel
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.process_group is None
    cp = clone.param_groups[0]["params"]
    for q in cp:
        q.grad = torch.randn(q.shape)
    with pytest.raises(RuntimeError, match="process_group"):
        clone.step()
    clone.process_group = None
    clone.step()  # usable again once the caller says there is no group


# ----------------------------------------------------------------------------------------------
# IsoLoCo: a grad sharing memory with a param or momentum buffer the step writes gets the
# reference step (the step reads a copy of it)


def _ref(p, buf, m, lr, mu):
    return nesterov_ref(p, buf if buf is not None else torch.zeros_like(p, dtype=torch.float64), m, lr, mu)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "shape, group_lrs, iso",
    [
        pytest.param((6,), (1.8, 1.8), True, id="1d-one-call"),  # was off by ~1.2
        pytest.param((6,), (1.8, 0.5), True, id="1d-two-lr-groups"),
        pytest.param((4, 6), (1.8, 1.8), False, id="2d-iso-off"),
        pytest.param((4, 6), (1.8, 1.8), True, id="2d-iso"),  # guard: the bucket copy made it right already
    ],
)
def test_isoloco_grad_that_is_another_param_gets_the_reference_step(shape, group_lrs, iso):
    g = _gen(3)
    p, q = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    p.grad = torch.randn(*shape, generator=g)
    q.grad = p.detach()  # q's pseudo-gradient is p's memory, written by the same step
    opt = ik.IsoLoCo([{"params": [p], "lr": group_lrs[0]}, {"params": [q], "lr": group_lrs[1]}], iso=iso)
    p0, q0, gp, gq = (t.detach().double().clone() for t in (p, q, p.grad, q.grad))
    flat = (lambda t: iso_flatten_ref(t)) if (iso and len(shape) == 2) else (lambda t: t)
    want_p, _ = _ref(p0, None, flat(gp), group_lrs[0], 0.8)
    want_q, _ = _ref(q0, None, flat(gq), group_lrs[1], 0.8)
    opt.step()
    assert rel_err(p, want_p) <= TOL[("update", torch.float32)] * 10
    assert rel_err(q, want_q) <= TOL[("update", torch.float32)] * 10


# mu0 was wrong (the buffer was zeroed before it was read); mu0.8 guards the fused CPU kernel's route
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("momentum", [pytest.param(0.0, id="mu0"), pytest.param(0.8, id="mu0.8")])
def test_isoloco_grad_that_is_its_momentum_buffer_gets_the_reference_step(momentum):
    # a loaded buffer may be the very tensor later handed in as the grad
    g = _gen(4)
    p = torch.randn(6, generator=g)
    p.grad = torch.randn(6, generator=g)
    opt = ik.IsoLoCo([p], momentum=0.8)
    opt.step()  # makes the buffer
    opt.param_groups[0]["momentum"] = momentum  # μ 0: SGD's rule, the buffer is read as the grad and left alone
    buf = opt.state[p]["momentum_buffer"]
    p.grad = buf
    p0, b0 = p.detach().double().clone(), buf.double().clone()
    want_p, want_b = sgd_nesterov_ref(p0, b0, b0, 1.8, momentum)
    opt.step()
    assert rel_err(p, want_p) <= 1e-6 and rel_err(opt.state[p]["momentum_buffer"], want_b) <= 1e-6


# ----------------------------------------------------------------------------------------------
# IsoLoCo: the same rule through the optimizer, all-or-nothing


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
@pytest.mark.parametrize("shape", [(16, 4), (4, 16), (7,)], ids=["tall", "wide", "vector"])
def test_isoloco_huge_lr_with_tiny_grads_gives_the_reference_step(shape):
    p = torch.randn(shape, generator=_gen(40))
    g = torch.randn(shape, generator=_gen(41)) * 1e-30
    want, _ = isoloco_step_ref([p], [torch.zeros_like(p)], [g], 1e39, 0.8)
    opt = ik.IsoLoCo([p], lr=1e39, momentum=0.8)
    p.grad = g
    opt.step()
    assert torch.isfinite(p).all() and rel_err(p, want[0]) <= 1e-5


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_isoloco_huge_lr_that_overflows_is_refused_with_nothing_changed():
    # a tall param: the momentum buffers were updated, then a RuntimeError from torch
    ps = [torch.randn(16, 4, generator=_gen(42)), torch.randn(3, generator=_gen(43))]
    opt = ik.IsoLoCo(ps, lr=1e39, momentum=0.8)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=_gen(44))
    before = [p.clone() for p in ps]
    with pytest.raises(ResultOverflowError, match=r"IsoLoCo: param_groups\[0\]\['params'\]\[\d\].*overflows"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ps, before)) and len(opt.state) == 0


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_isoloco_nan_param_is_refused_naming_it():
    ps = [torch.randn(4, 6, generator=_gen(45)), torch.randn(3, generator=_gen(46))]
    ps[1][0] = float("nan")
    opt = ik.IsoLoCo(ps, lr=0.5, momentum=0.9)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=_gen(47))
    before = ps[0].clone()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\].*param.*NaN"):
        opt.step()
    assert torch.equal(ps[0], before) and len(opt.state) == 0


# ----------------------------------------------------------------------------------------------
# Meta and fake tensors


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_isoloco_on_meta_params_says_so():
    p = torch.empty(4, 4, device="meta")
    opt = ik.IsoLoCo([p])
    p.grad = torch.empty(4, 4, device="meta")
    with pytest.raises(RuntimeError, match=r"\['params'\]\[0\].*the param is a meta tensor"):
        opt.step()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_isoloco_with_a_meta_momentum_buffer_says_so_with_nothing_changed():
    p = torch.randn(4, 4, generator=_gen(60))
    opt = ik.IsoLoCo([p])
    p.grad = torch.randn(4, 4, generator=_gen(61))
    opt.state[p]["momentum_buffer"] = torch.empty(4, 4, device="meta")
    before = p.clone()
    with pytest.raises(ValueError, match=r"momentum_buffer is a meta tensor"):
        opt.step()
    assert torch.equal(p, before)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::isoloco_kernels.flatten.iteration_stats.FlattenFallbackWarning")
def test_isoloco_with_a_meta_lr_tensor_says_so():
    with pytest.raises(ValueError, match=r"'lr' is a meta tensor"):
        ik.IsoLoCo([torch.randn(3)], lr=torch.tensor(0.1, device="meta"))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_isoloco_steps_as_the_original(how):
    params = three_params()
    opt = ik.IsoLoCo(params, lr=0.7, momentum=0.8, method="polar")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    params2, opt2 = copy.deepcopy((params, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((params, opt)))
    assert opt2.method == "polar"
    for p, q in zip(params, params2):
        q.grad = p.grad.clone()
    opt.step()
    opt2.step()
    assert all(torch.equal(p, q) for p, q in zip(params, params2))
