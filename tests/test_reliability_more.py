"""More hostile inputs, on one process: operands an op reads while it writes another (aliasing),
and state dicts whose content only fails later. Each case gives reference.py's result (float64) or
a clear error with nothing modified.
"""

from __future__ import annotations

import pytest
import torch

import isoloco_kernels as ik
from isoloco_kernels.reference import iso_flatten_ref, nesterov_ref, sgd_nesterov_ref
from tests.helpers import TOL, rel_err

ops = torch.ops.isoloco


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread):
    yield


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# nesterov_outer_: an update (or the scales) sharing memory with a tensor the op writes


def _three(seed):
    g = _gen(seed)
    return [[torch.randn(6, generator=g) for _ in range(2)] for _ in range(3)]


def _shifted(P, B, U):
    base = torch.cat([P[1], torch.ones(1)])
    P[1] = base[:6]
    return [U[0], base[1:]]


@pytest.mark.parametrize(
    "alias, momentum, scales, match",
    [
        # update 1 is param 0: the op wrote param 0 before reading update 1 (error ~1.1)
        pytest.param(
            lambda P, B, U: [U[0], P[0]],
            0.9,
            None,
            r"update 1 shares memory with param 0",
            id="update-is-another-param",
        ),
        # update 0 is its own buffer: with μ = 0 the buffer was zeroed before it was read
        pytest.param(
            lambda P, B, U: [B[0], U[1]], 0.0, None, r"update 0 shares memory with buf 0", id="update-is-its-buffer-mu0"
        ),
        pytest.param(
            lambda P, B, U: [B[0], U[1]],
            0.9,
            torch.tensor([2.0, 1.0]),
            r"update 0 shares memory with buf 0",
            id="update-is-its-buffer-scaled",
        ),
        # update 1 is its own param shifted by one element: read after its neighbour was written
        pytest.param(_shifted, 0.9, None, r"update 1 shares memory with param 1", id="update-overlaps-its-param"),
    ],
)
def test_nesterov_refuses_an_update_that_aliases_a_written_tensor(alias, momentum, scales, match):
    P, B, U = _three(1)
    U = alias(P, B, U)
    before = [t.clone() for t in (*P, *B)]
    with pytest.raises(RuntimeError, match=match + r".*nothing was written"):
        ops.nesterov_outer_(P, B, U, 0.5, momentum, scales)
    assert all(torch.equal(a, b) for a, b in zip(before, (*P, *B)))


def test_nesterov_refuses_scales_that_alias_a_buffer_with_nothing_written():
    # torch's foreach refused it only while writing ("some elements ... refer to a single memory location")
    g = _gen(2)
    P, B, U = [torch.randn(1, generator=g)], [torch.randn(1, generator=g)], [torch.randn(1, generator=g)]
    before = [P[0].clone(), B[0].clone()]
    with pytest.raises(RuntimeError, match=r"scales shares memory with buf 0.*nothing was written"):
        ops.nesterov_outer_(P, B, U, 0.5, 0.9, B[0])
    assert torch.equal(P[0], before[0]) and torch.equal(B[0], before[1])


@pytest.mark.parametrize(
    "make",
    [
        # q = x shifted by a row; the CPU's torch backend reads q aside, the CUDA kernels read q
        # in one block while another writes x: refused on every backend alike
        pytest.param(lambda base: (base[:4], base[1:5]), id="q-is-x-shifted"),
        pytest.param(lambda base: (base[:5, :5], base[:5, :5].mT), id="q-is-x-transposed"),
        pytest.param(lambda base: (base[:4], base[:4]), id="q-is-x"),
    ],
)
def test_iso_scale_refuses_a_q_sharing_memory_with_x_with_nothing_written(make):
    base = torch.randn(6, 6, generator=_gen(7))
    x, q = make(base)
    before = base.clone()
    with pytest.raises(RuntimeError, match=r"iso_scale_: q shares memory with x.*nothing was written"):
        ops.iso_scale_(x, q)
    assert torch.equal(base, before)


def test_nesterov_with_no_tensors_is_a_checked_no_op():
    # was NotImplementedError "There were no tensor arguments to this function"
    ops.nesterov_outer_([], [], [], 0.5, 0.9, None)
    with pytest.raises(ValueError, match=r"lr and momentum must be finite"):
        ops.nesterov_outer_([], [], [], float("nan"), 0.9, None)


# ----------------------------------------------------------------------------------------------
# IsoLoCo: a grad sharing memory with a param or momentum buffer the step writes gets the
# reference step (the step reads a copy of it)


def _ref(p, buf, m, lr, mu):
    return nesterov_ref(p, buf if buf is not None else torch.zeros_like(p, dtype=torch.float64), m, lr, mu)


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
# load_state_dict: content that would only fail at a later step


def _stepped(seed, dtype=torch.float32):
    g = _gen(seed)
    ps = [torch.randn(4, 6, generator=g).to(dtype), torch.randn(5, generator=g).to(dtype)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    opt = ik.IsoLoCo(ps)
    opt.step()
    return ps, opt


def _snapshot(opt):
    return {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}, [
        dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups
    ]


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
    bufs, groups = _snapshot(opt)
    with pytest.raises(exc, match=match):
        opt.load_state_dict(sd)
    bufs2, groups2 = _snapshot(opt)
    assert groups2 == groups and all(torch.equal(bufs[k], bufs2[k]) for k in bufs)


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
