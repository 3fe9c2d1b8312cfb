"""IsoLoCo, the outer optimizer: against reference.isoloco_step_ref (float64), against
torch.optim.SGD with iso=False, SGD-shaped state dicts, all-or-nothing steps, and a DiLoCo loop."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import isoloco_kernels as ik
from isoloco_kernels.reference import iso_flatten_ref, isoloco_step_ref
from tests.helpers import DTYPES, TOL, rel_err

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
    from isoloco_kernels.outer.core import SGD_KEYS, outer_defaults

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
